"""The inference worker has no network (netns, or the seccomp fallback), a 1.2 GB default
address-space limit, and is restarted and reported when it dies or exceeds its limit."""

from __future__ import annotations

import os
import socket

import pytest

from sealfl.enclave.sandbox.runtime import TABULAR_MEMORY_LIMIT_BYTES, SandboxedRuntime
from tests.support.releases import make_onnx_model, sample_inputs


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
