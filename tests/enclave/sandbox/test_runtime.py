"""SandboxedRuntime: same outputs as a direct onnxruntime run, in another process, fails fast."""

from __future__ import annotations

import os
import time

import numpy as np
import onnxruntime as ort
import pytest

from sealfl.enclave.errors import RuntimeSandboxError
from sealfl.enclave.sandbox.runtime import SandboxedRuntime
from tests.support.releases import direct_outputs, make_onnx_model, sample_inputs


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0); look at its state
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_outputs_equal_direct_onnxruntime_and_child_is_separate():
    model = make_onnx_model()
    x = sample_inputs(7)
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    with SandboxedRuntime(model) as rt:
        assert rt.pid != os.getpid()
        assert rt.input_names == ["x"] and rt.output_names == ["y"]
        outputs = rt.run({"x": x})
        assert len(outputs) == len(expected)
        np.testing.assert_array_equal(outputs[0], expected[0])
        assert outputs[0].dtype == np.float32 and outputs[0].shape == (7, 1)
        health = rt.health_check()
        assert health["ok"] and health["pid"] == rt.pid
        pid = rt.pid
    assert not _pid_alive(pid)


def test_child_environment_is_minimal_and_has_no_forbidden_imports():
    with SandboxedRuntime(make_onnx_model()) as rt:
        with open(f"/proc/{rt.pid}/environ", "rb") as fh:
            env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if item)
        assert set(env) <= {b"PATH", b"LC_ALL", b"OMP_NUM_THREADS", b"OPENBLAS_NUM_THREADS", b"MKL_NUM_THREADS", b"HOME",
                            b"GLIBC_TUNABLES"}
        assert env[b"HOME"] == rt.homedir.encode()  # its own private directory, not the user's home
        with open(f"/proc/{rt.pid}/cmdline", "rb") as fh:
            cmdline = fh.read().split(b"\0")
        assert b"-I" in cmdline and not any(b".onnx" in part for part in cmdline)  # bytes, not a path
        with open(f"/proc/{rt.pid}/limits") as fh:
            limits = fh.read()
        assert "Max address space" in limits and "unlimited" not in limits.split("Max address space")[1].split("\n")[0]


def test_corrupt_model_raises_quickly_not_hang():
    model = make_onnx_model()
    start = time.monotonic()
    with pytest.raises(RuntimeSandboxError, match="could not load the model"):
        SandboxedRuntime(model[: len(model) // 2] + b"\xff" * 16, start_timeout_s=30)
    assert time.monotonic() - start < 20


def test_inference_error_comes_back_with_child_message_and_runtime_survives():
    with SandboxedRuntime(make_onnx_model()) as rt:
        with pytest.raises(RuntimeSandboxError, match="(?i)invalid|dimension"):
            rt.run({"x": np.zeros((2, 9), dtype=np.float32)})
        with pytest.raises(RuntimeSandboxError, match="unknown model inputs"):
            rt.run({"nope": np.zeros((1, 4), dtype=np.float32)})
        assert rt.run({"x": sample_inputs(1)})[0].shape == (1, 1)


def test_memory_limit_is_enforced():
    with pytest.raises(RuntimeSandboxError, match="could not load the model"):
        SandboxedRuntime(make_onnx_model(), memory_limit_bytes=32 * 1024**2, start_timeout_s=30)


def test_close_kills_child_and_later_calls_fail():
    rt = SandboxedRuntime(make_onnx_model())
    pid = rt.pid
    rt.close()
    rt.close()  # idempotent
    assert not _pid_alive(pid)
    with pytest.raises(RuntimeSandboxError, match="closed"):
        rt.run({"x": sample_inputs(1)})


def test_crashed_child_reported():
    rt = SandboxedRuntime(make_onnx_model())
    os.kill(rt.pid, 9)
    with pytest.raises(RuntimeSandboxError, match="exit"):
        rt.health_check()
    rt.close()


def test_unresponsive_child_times_out_and_is_killed():
    import signal

    rt = SandboxedRuntime(make_onnx_model(), timeout_s=0.5)
    os.kill(rt.pid, signal.SIGSTOP)  # the child hangs
    start = time.monotonic()
    with pytest.raises(RuntimeSandboxError, match="did not answer"):
        rt.run({"x": sample_inputs(2)})
    assert time.monotonic() - start < 5
    assert not _pid_alive(rt.pid)
    rt.close()


def test_prestarted_child_gets_the_model_only_by_load_and_answers_like_onnxruntime():
    model = make_onnx_model()
    x = sample_inputs(5)
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    rt = SandboxedRuntime.prestart()
    try:
        assert _pid_alive(rt.pid)
        with pytest.raises(RuntimeSandboxError, match="no model loaded"):
            rt.run({"x": x})
        with pytest.raises(RuntimeSandboxError, match="non-empty bytes"):
            rt.load(bytearray(model))  # only immutable, verified bytes
        assert rt.load(model) is rt
        np.testing.assert_array_equal(rt.run({"x": x})[0], expected[0])
        with pytest.raises(RuntimeSandboxError, match="already holds a model"):
            rt.load(model)
    finally:
        rt.close()
    assert not _pid_alive(rt.pid) and not os.path.exists(rt.workdir)


def test_prestarted_child_closed_unused_exits_cleanly():
    rt = SandboxedRuntime.prestart()
    pid, proc = rt.pid, rt._proc
    rt.close()
    assert not _pid_alive(pid) and proc.returncode == 0  # it left on 'shutdown', not by SIGKILL
    assert not os.path.exists(rt.workdir) and not os.path.exists(rt.homedir)
    with pytest.raises(RuntimeSandboxError, match="closed"):
        rt.load(make_onnx_model())


def test_prestarted_child_refusing_a_model_is_stopped():
    model = make_onnx_model()
    rt = SandboxedRuntime.prestart(start_timeout_s=30)
    with pytest.raises(RuntimeSandboxError, match="could not load the model"):
        rt.load(model[: len(model) // 2] + b"\xff" * 16)
    assert not _pid_alive(rt.pid)


# -- hostile or careless callers ---------------------------------------------------------

def test_public_request_cannot_bypass_load_or_close():
    """``init`` and ``shutdown`` go only through load() / close(): a caller of the public
    request() cannot hand the child unverified bytes behind load()'s back."""
    with SandboxedRuntime.prestart() as rt:
        for op in ("init", "shutdown"):
            with pytest.raises(RuntimeSandboxError, match="not allowed"):
                rt.request({"op": op}, [make_onnx_model()])
            with pytest.raises(RuntimeSandboxError, match="not allowed"):
                rt.send({"op": op})
        with pytest.raises(RuntimeSandboxError, match="not allowed"):
            rt.request(["init"])
        rt.load(make_onnx_model())  # untouched: still loads and runs
        assert rt.run({"x": sample_inputs(1)})[0].shape == (1, 1)


@pytest.mark.parametrize("options, what", [
    ({"memory_limit_bytes": -1}, "memory_limit_bytes"),
    ({"memory_limit_bytes": 1.2e9}, "memory_limit_bytes"),
    ({"memory_limit_bytes": True}, "memory_limit_bytes"),
    ({"memory_limit_bytes": 1024}, "memory_limit_bytes"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"start_timeout_s": float("nan")}, "start_timeout_s"),
    ({"intra_op_threads": 0}, "intra_op_threads"),
    ({"intra_op_threads": "2"}, "intra_op_threads"),
])
def test_bad_options_are_refused_before_a_child_or_directory_exists(options, what, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeSandboxError, match=what):
        SandboxedRuntime.prestart(**options)
    assert list(tmp_path.iterdir()) == []


def test_run_after_close_says_closed_whatever_the_inputs():
    rt = SandboxedRuntime(make_onnx_model())
    rt.close()
    for inputs in ({"nope": np.zeros(1)}, {"x": sample_inputs(1)}, "not a mapping"):
        with pytest.raises(RuntimeSandboxError, match="closed"):
            rt.run(inputs)


def test_directories_of_a_killed_parent_are_swept_by_the_next_one(tmp_path):
    """A parent SIGKILLed with a runtime open cannot remove its private directories; the
    sweep removes them (and only them: never a live process's, a symlink, a file or
    another name)."""
    import signal
    import subprocess
    import sys

    from sealfl.enclave.sandbox.setup import sweep_stale_dirs

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    code = ("import sys, time\nfrom sealfl.enclave.sandbox.runtime import SandboxedRuntime\n"
            "rt = SandboxedRuntime.prestart()\nprint(rt.workdir, rt.homedir, flush=True)\ntime.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        left = parent.stdout.readline().split()
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
    assert len(left) == 2 and all(os.path.isdir(d) and os.path.dirname(d) == str(tmp_path) for d in left)
    assert sweep_stale_dirs(str(tmp_path)) == []  # too young: one being created is never swept
    for d in left:
        os.utime(d, (time.time() - 60, time.time() - 60))
    mine = tmp_path / f"sealfl-sandbox-{os.getpid()}-abc"  # this (live) process's
    mine.mkdir()
    os.utime(mine, (time.time() - 60, time.time() - 60))
    target = tmp_path / "victim"
    target.mkdir()
    (tmp_path / f"sealfl-sandbox-{parent.pid}-link").symlink_to(target)
    (tmp_path / f"sealfl-sandbox-{parent.pid}-file").write_text("x")
    other = tmp_path / f"sealfl-sandboxed-{parent.pid}-x"
    other.mkdir()
    removed = sweep_stale_dirs(str(tmp_path))
    assert sorted(removed) == sorted(left) and not any(os.path.exists(d) for d in left)
    assert mine.is_dir() and target.is_dir() and other.is_dir()
    assert (tmp_path / f"sealfl-sandbox-{parent.pid}-link").is_symlink()
    assert (tmp_path / f"sealfl-sandbox-{parent.pid}-file").is_file()


def test_the_pipe_to_the_child_is_widened_where_the_kernel_allows():
    """Boot hands a 100 MB model over this pipe: at the default 64 KiB it takes ~1,600
    writes, at 1 MiB ~100 (bench/verify_bench.py measures the time)."""
    import fcntl

    from sealfl.enclave.sandbox.runtime import PIPE_BYTES

    with open("/proc/sys/fs/pipe-max-size") as fh:
        allowed = int(fh.read())
    with SandboxedRuntime.prestart() as rt:
        size = fcntl.fcntl(rt._proc.stdin.fileno(), getattr(fcntl, "F_GETPIPE_SZ", 1032))
        assert size == (PIPE_BYTES if allowed >= PIPE_BYTES or os.geteuid() == 0 else 65536)
        rt.load(make_onnx_model())
        assert rt.run({"x": sample_inputs(3)})[0].shape == (3, 1)


# -- staging: the bytes are copied to the child's stage file while the parent verifies ---

_OTHER_W = np.array([[1.0], [-1.0], [0.5], [2.0]], dtype=np.float32)


def _stage_then_load(staged: bytes, loaded: bytes, x: np.ndarray) -> tuple[bool, np.ndarray]:
    """Prestart, stage ``staged``, load ``loaded``: (whether the staged copy was used, the
    model's output on ``x``)."""
    with SandboxedRuntime.prestart() as rt:
        rt.stage(staged)
        rt.load(loaded)
        return rt.loaded_from_stage, rt.run({"x": x})[0]


def test_load_of_the_staged_object_sends_no_bytes_and_runs_that_model():
    model, x = make_onnx_model(_OTHER_W), sample_inputs(5)
    from_stage, y = _stage_then_load(model, model, x)
    assert from_stage
    np.testing.assert_array_equal(y, direct_outputs(model, x))


@pytest.mark.parametrize("staged", [make_onnx_model(), b"\x00garbage, never parsed"], ids=["other-model", "garbage"])
def test_load_of_another_object_runs_that_one_not_the_staged_bytes(staged):
    """What load() gets is what runs -- a staged object that is not the one verified (a
    different model, or bytes that would not parse) is dropped unparsed."""
    model, x = make_onnx_model(_OTHER_W), sample_inputs(5)
    from_stage, y = _stage_then_load(staged, bytes(bytearray(model)), x)  # equal content, another object
    assert not from_stage
    np.testing.assert_array_equal(y, direct_outputs(model, x))
    assert not np.array_equal(direct_outputs(model, x), direct_outputs(make_onnx_model(), x))  # the models differ


def test_a_staged_model_that_does_not_parse_fails_at_load_and_stops_the_child():
    rt = SandboxedRuntime.prestart()
    bad = b"\x08\x01not an onnx model" * 1000
    rt.stage(bad)
    with pytest.raises(RuntimeSandboxError, match="could not load the model"):
        rt.load(bad)
    assert not _pid_alive(rt.pid)


def test_close_while_staging_a_large_model_stops_the_child_at_once():
    rt = SandboxedRuntime.prestart()
    pid = rt.pid
    rt.stage(b"\x01" * (200 * 1024**2))  # the copy into the stage file is still going on
    t0 = time.monotonic()
    rt.close()
    assert time.monotonic() - t0 < 5 and not _pid_alive(pid)
    with pytest.raises(RuntimeSandboxError, match="closed"):
        rt.load(make_onnx_model())


def test_stage_is_refused_out_of_order():
    with SandboxedRuntime.prestart() as rt:
        with pytest.raises(RuntimeSandboxError):
            rt.stage(b"")
        rt.stage(make_onnx_model())
        with pytest.raises(RuntimeSandboxError, match="stage"):
            rt.stage(make_onnx_model())  # once
        rt.load(make_onnx_model())
        with pytest.raises(RuntimeSandboxError, match="stage"):
            rt.stage(make_onnx_model())  # not after load
    with SandboxedRuntime(make_onnx_model()) as rt, pytest.raises(RuntimeSandboxError, match="stage"):
        rt.stage(make_onnx_model())



def test_a_locked_directory_is_never_swept_whatever_its_pid_says(tmp_path):
    """A live runtime in another PID namespace (a container sharing /tmp) names its
    directories with a pid that means nothing here; its flock still says it is alive."""
    import fcntl
    import subprocess
    import sys

    from sealfl.enclave.sandbox.setup import sweep_stale_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    d = tmp_path / f"sealfl-sandbox-{dead.pid}-other_ns"
    d.mkdir()
    os.utime(d, (time.time() - 60, time.time() - 60))
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as its (live) owner holds it
        assert sweep_stale_dirs(str(tmp_path)) == [] and d.is_dir()
    finally:
        os.close(fd)  # the owner is gone
    assert sweep_stale_dirs(str(tmp_path)) == [str(d)] and not d.exists()


def test_a_bad_request_leaves_the_stream_in_step():
    """A request refused for its arguments writes nothing: the next request gets its own
    reply, not the refused one's."""
    x = sample_inputs(2)
    with SandboxedRuntime(make_onnx_model()) as rt:
        circular: dict = {"op": "ping"}
        circular["self"] = circular
        for header, blobs, kw in (({"op": "ping"}, ["abcdefgh"], {}), ({"op": "ping"}, b"abc", {}),
                                  (circular, [], {}), ({"op": "ping", "z": b"x"}, [], {}),
                                  ({"op": "ping"}, [], {"timeout": float("nan")}),
                                  ({"op": "ping"}, [], {"timeout": "1"}), ({"op": "ping"}, [], {"timeout": 1e10})):
            with pytest.raises(RuntimeSandboxError):
                rt.request(header, blobs, **kw)
            assert rt.alive
        np.testing.assert_array_equal(rt.run({"x": x})[0], direct_outputs(make_onnx_model(), x))
        with pytest.raises(RuntimeSandboxError, match="strings"):
            rt.run({1: x, "x": x})


@pytest.mark.parametrize("options", [{"timeout_s": 1e10}, {"start_timeout_s": 10 ** 400}, {"timeout_s": "5"}])
def test_timeouts_that_would_overflow_a_deadline_are_refused(options):
    with pytest.raises(RuntimeSandboxError, match="seconds"):
        SandboxedRuntime.prestart(**options)


def test_a_forked_copy_closing_the_runtime_leaves_the_creators_child_and_dirs_alone():
    x = sample_inputs(2)
    with SandboxedRuntime(make_onnx_model()) as rt:
        pid = os.fork()
        if pid == 0:  # the copy: close() (and later __del__) must not touch what the creator owns
            try:
                rt.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.path.isdir(rt.workdir) and os.path.isdir(rt.homedir) and rt.alive
        assert rt.run({"x": x})[0].shape == (2, 1)


def test_closing_during_staging_keeps_no_reference_to_the_staged_bytes():
    """The refused release's bytes must go when the runtime stops, not at the next
    garbage collection (boot may load the last good model right after)."""
    import sys

    data = b"\x01" * (64 * 1024**2)
    base = sys.getrefcount(data)
    rt = SandboxedRuntime.prestart()
    rt.stage(data)
    rt.close()
    assert sys.getrefcount(data) == base


def test_requests_during_a_staged_load_wait_for_it_instead_of_breaking_it():
    import threading

    model = make_onnx_model()
    with SandboxedRuntime.prestart() as rt:
        rt.stage(model + b"")  # another object: load() sends the bytes again, a longer window
        errors = []

        def ping():
            try:
                rt.health_check()
            except RuntimeSandboxError as exc:
                errors.append(str(exc))

        t = threading.Thread(target=ping)
        loader = threading.Thread(target=rt.load, args=(model,))
        loader.start()
        t.start()
        loader.join()
        t.join()
        assert rt.alive and rt.run({"x": sample_inputs(1)})[0].shape == (1, 1)
        assert all("no model loaded yet" in e for e in errors)  # refused, not sent ahead of 'init'


def test_without_flock_the_runtime_still_starts_and_cleans_up(monkeypatch, tmp_path):
    import errno
    import tempfile

    from sealfl.enclave.sandbox import setup as sandbox_setup

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "no locks available")

    monkeypatch.setattr(sandbox_setup.fcntl, "flock", no_flock)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with SandboxedRuntime(make_onnx_model()) as rt:
        assert rt.run({"x": sample_inputs(1)})[0].shape == (1, 1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fault", ["unsealed", "short"])
def test_the_child_takes_a_staged_model_only_from_a_sealed_file_of_the_staged_size(fault):
    """The child's own checks on the stage file (the parent never sends such an init)."""
    import fcntl

    model = make_onnx_model()
    rt = SandboxedRuntime.prestart()
    try:
        fd = rt._stage.fd
        os.pwrite(fd, model, 0)
        if fault == "short":
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        rt._loading = True
        with pytest.raises(RuntimeSandboxError, match="not sealed" if fault == "unsealed" else "holds"):
            rt._request({"op": "init", "staged": len(model) + (1 if fault == "short" else 0)}, [], 30)
        assert not _pid_alive(rt.pid)
    finally:
        rt.close()


def test_without_a_memory_file_staging_does_nothing_and_load_sends_the_bytes(monkeypatch):
    from sealfl.enclave.sandbox import runtime as sandbox

    monkeypatch.setattr(sandbox.MemfdStage, "create", classmethod(lambda cls: None))
    model, x = make_onnx_model(_OTHER_W), sample_inputs(4)
    from_stage, y = _stage_then_load(model, model, x)
    assert not from_stage
    np.testing.assert_array_equal(y, direct_outputs(model, x))


def test_the_stage_file_is_sealed_once_written():
    import fcntl

    model = make_onnx_model()
    with SandboxedRuntime.prestart() as rt:
        rt.stage(model)
        assert rt._stage.holds(model)
        seals = fcntl.fcntl(rt._stage.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.pwrite(rt._stage.fd, b"x", 0)
        rt.load(model)
        assert rt.loaded_from_stage and rt._stage.fd == -1  # closed once the child has the model


def test_a_stage_file_changed_before_its_seal_is_not_used(monkeypatch):
    """Between the write and the seal a process of the same user could write to the file
    through /proc/<pid>/fd: the parent compares it with the bytes after sealing, and sends
    the bytes over the pipe when they differ."""
    import fcntl

    from sealfl.enclave.sandbox import stage as sandbox_stage

    real = fcntl.fcntl

    def tamper_then_seal(fd, cmd, arg=0):
        if cmd == fcntl.F_ADD_SEALS:
            os.pwrite(fd, b"\x00" * 16, 40)  # the writer got in just before the seal
        return real(fd, cmd, arg)

    monkeypatch.setattr(sandbox_stage.fcntl, "fcntl", tamper_then_seal)
    model, x = make_onnx_model(_OTHER_W), sample_inputs(3)
    from_stage, y = _stage_then_load(model, model, x)
    assert not from_stage
    np.testing.assert_array_equal(y, direct_outputs(model, x))


def test_the_stage_file_never_takes_a_standard_descriptor():
    import subprocess
    import sys

    code = ("import os\nos.close(0)\nfrom sealfl.enclave.sandbox.stage import MemfdStage\n"
            "s = MemfdStage.create()\nprint(s.fd if s else 'none')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "none" or int(out.stdout) >= 3


def test_staging_that_cannot_start_a_thread_or_exceeds_the_memory_limit_is_skipped(monkeypatch):
    import threading

    from sealfl.enclave.sandbox.runtime import MIN_MEMORY_LIMIT_BYTES

    with SandboxedRuntime.prestart(memory_limit_bytes=MIN_MEMORY_LIMIT_BYTES * 32) as rt:
        rt.stage(b"\x01" * (MIN_MEMORY_LIMIT_BYTES * 32 + 1))  # more than the child may hold
        assert not rt._stage.started
    real_start = threading.Thread.start

    def no_thread(self):
        if self.name == "sandbox-stage":
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    model = make_onnx_model()
    rt = SandboxedRuntime.prestart()
    rt.stage(model)  # nothing staged, no error
    rt.load(model)
    assert not rt.loaded_from_stage and rt.run({"x": sample_inputs(1)})[0].shape == (1, 1)
    pid = rt.pid
    rt.close()
    assert not _pid_alive(pid)


def test_a_forked_copy_drops_only_its_own_stage_descriptor():
    model = make_onnx_model()
    with SandboxedRuntime.prestart() as rt:
        rt.stage(model)
        assert rt._stage.holds(model)
        pid = os.fork()
        if pid == 0:
            try:
                rt.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        rt.load(model)
        assert rt.loaded_from_stage


def test_the_stage_comparison_finds_any_differing_byte():
    from sealfl.enclave.sandbox.stage import _COMPARE_CHUNK, _same

    data = os.urandom(2 * _COMPARE_CHUNK + 1001)
    fd = os.memfd_create("t")
    try:
        os.write(fd, data)
        assert _same(fd, data)
        for pos in (0, _COMPARE_CHUNK - 1, _COMPARE_CHUNK, len(data) // 2, len(data) - 1):
            other = bytearray(data)
            other[pos] ^= 0x80
            assert not _same(fd, bytes(other)), pos
        assert not _same(fd, data[:-1]) and not _same(fd, data + b"\0")
    finally:
        os.close(fd)


def test_kind_a_childs_terminal_codes_never_reach_a_refusal():
    """onnxruntime colours its warnings (ECMA-48 ``ESC [ 0;93m``) on the child's stderr; a
    refusal that quotes that stderr carries the text, not the codes."""
    import os
    import signal

    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
                              [numpy_helper.from_array(np.ones(3, np.float32), "unused")])  # ORT warns about it
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    rt = SandboxedRuntime(model.SerializeToString())
    os.kill(rt.pid, signal.SIGKILL)
    with pytest.raises(RuntimeSandboxError) as info:
        rt.run({"x": np.zeros((1, 4), np.float32)})
    msg = str(info.value)
    assert "Removing initializer 'unused'" in msg and "\x1b" not in msg and "[0;93m" not in msg
