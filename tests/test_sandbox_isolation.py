"""The inference worker has no network (netns, or the seccomp fallback), a 1.2 GB default
address-space limit, and is restarted and reported when it dies or exceeds its limit."""

from __future__ import annotations

import os
import signal
import socket

import numpy as np
import pytest
from conftest import make_onnx_model, sample_inputs
from onnx import TensorProto, helper

from sealfl.common.errors import RuntimeSandboxError
from sealfl.common.sandbox import TABULAR_MEMORY_LIMIT_BYTES, SandboxedRuntime
from sealfl.common.supervised import SupervisedRuntime


@pytest.fixture
def listener():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        yield srv.getsockname()[1]


def test_kind_tcp_connect_from_inside_the_worker_fails(listener):
    model = make_onnx_model()
    with SandboxedRuntime(model, network="inherit") as rt:  # control: the probe itself works
        assert rt.send({"op": "probe", "host": "127.0.0.1", "port": listener})["connected"] is True
    for mode in ("best-effort", "seccomp"):
        with SandboxedRuntime(model, network=mode) as rt:
            assert rt.network in (("netns", "userns+netns", "seccomp") if mode == "best-effort" else ("seccomp",))
            reply = rt.send({"op": "probe", "host": "127.0.0.1", "port": listener})
            assert reply["connected"] is False, (mode, reply)
            if mode == "seccomp":
                assert "Permission denied" in reply["error"]
            # inference still works inside the isolated worker
            assert rt.run({"x": sample_inputs(2)})[0].shape == (2, 1)


def test_kind_default_limit_env_and_fds(tmp_path):
    with SandboxedRuntime(make_onnx_model()) as rt:
        limits = open(f"/proc/{rt.pid}/limits").read()
        line = next(x for x in limits.splitlines() if x.startswith("Max address space"))
        assert str(TABULAR_MEMORY_LIMIT_BYTES) in line and TABULAR_MEMORY_LIMIT_BYTES == 1_200_000_000
        env = open(f"/proc/{rt.pid}/environ", "rb").read().split(b"\0")
        assert sorted(e.split(b"=")[0] for e in env if e) == [b"GLIBC_TUNABLES", b"HOME", b"LC_ALL", b"MKL_NUM_THREADS",
                                                              b"OMP_NUM_THREADS", b"OPENBLAS_NUM_THREADS", b"PATH"]
        # malloc advises transparent huge pages (glibc manual, "Memory Allocation Tunables")
        assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in env
        fds = sorted(int(f) for f in os.listdir(f"/proc/{rt.pid}/fd"))
        # stdin/stdout/stderr (pipes + stderr file) and the protocol dup; nothing inherited beyond
        targets = [os.readlink(f"/proc/{rt.pid}/fd/{f}") for f in fds]
        # only pipes to the parent, the stderr temp file, and files inside its own private dirs
        private = (rt.workdir, rt.homedir)
        assert all(t.startswith(("pipe:", "anon_inode:", "/dev/null", *private)) or t.endswith("(deleted)")
                   for t in targets), targets
        assert not any(t.startswith("socket:") for t in targets), targets
    assert not any(os.path.exists(p) for p in private)  # both removed on close


def _hungry_model() -> bytes:
    """y = sum(ConstantOfShape(n) of float zeros): asks for 4*n bytes."""
    graph = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["n"], ["big"],
                          value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0])),
         helper.make_node("ReduceSum", ["big"], ["y"], keepdims=0)],
        "hungry", [helper.make_tensor_value_info("n", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()


def test_kind_worker_over_memory_limit_is_restarted_and_reported():
    with SupervisedRuntime(_hungry_model(), memory_limit_bytes=TABULAR_MEMORY_LIMIT_BYTES) as sup:
        assert float(np.sum(sup.run({"n": np.array([1000], dtype=np.int64)})[0])) == 0.0
        first = sup.health()["pid"]
        with pytest.raises(RuntimeSandboxError, match="restarted"):
            sup.run({"n": np.array([2_000_000_000], dtype=np.int64)})  # 8 GB > 1.2 GB
        health = sup.health()
        assert health["restarts"] == 1 and health["pid"] != first and health["alive"]
        assert "memory" in health["last_failure"] or "died" in health["last_failure"]
        assert sup.metrics() == {"sealfl_sandbox_restarts_total": 1}
        assert float(np.sum(sup.run({"n": np.array([10], dtype=np.int64)})[0])) == 0.0


def test_kind_killed_worker_is_restarted_and_the_request_fails_clearly():
    with SupervisedRuntime(make_onnx_model(), timeout_s=30) as sup:
        os.kill(sup.health()["pid"], signal.SIGKILL)
        with pytest.raises(RuntimeSandboxError, match="died.*retry"):
            sup.run({"x": sample_inputs(1)})
        assert sup.health()["restarts"] == 1
        assert sup.run({"x": sample_inputs(3)})[0].shape == (3, 1)
