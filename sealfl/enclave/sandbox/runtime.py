"""Sandboxed onnxruntime inference in a child process (privilege separation).

:class:`SandboxedRuntime` starts ``python -I sandbox_child.py`` (see
:mod:`sealfl.enclave.sandbox.child`) with an empty-ish environment, its working directory a
fresh, empty, private (0700) directory removed when the runtime closes, a new session, an address-space limit (``RLIMIT_AS``) and -- where the kernel allows -- an empty
network namespace. The child receives ONLY the verified model bytes over a pipe (never a
path), builds ``onnxruntime.InferenceSession(model_bytes)`` and serves requests. Replies are
parsed without pickle, so a compromised child cannot attack the parent through the protocol.
Every wait on the child is bounded by a timeout; on timeout or crash the child is killed by
its pid and :class:`RuntimeSandboxError` is raised.

``HOME`` is a second fresh private directory, removed with the first (both are named
after the parent's pid: a later runtime removes those of a parent that died without
closing them, :mod:`sealfl.enclave.sandbox.setup`). Without it onnxruntime
opens a cache database under the user's real home
(``~/.cache/Microsoft/DeveloperTools/.onnxruntime/onnxruntime.db``, seen with onnxruntime
1.2x), a file outside the sandbox the child could write.

Why the empty working directory: onnxruntime resolves a tensor's external-data path for a
model loaded from bytes relative to the working directory. Verification already refuses
models with external data (:mod:`sealfl.attestation.onnx_check`); as a second line of
defence, the child's working directory holds nothing it could read.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time

from sealfl.enclave.errors import RuntimeSandboxError
from sealfl.enclave.sandbox import child as _child
from sealfl.enclave.sandbox.channel import ChildChannel
from sealfl.enclave.sandbox.pipe import PIPE_BYTES, widen_pipe
from sealfl.enclave.sandbox.setup import (
    MIN_MEMORY_LIMIT_BYTES,
    check_options,
    private_dir,
    remove_private_dir,
    sweep_stale_dirs,
)
from sealfl.enclave.sandbox.stage import MemfdStage

__all__ = ["SandboxedRuntime", "DEFAULT_MEMORY_LIMIT_BYTES", "TABULAR_MEMORY_LIMIT_BYTES", "MIN_MEMORY_LIMIT_BYTES",
           "PIPE_BYTES", "sweep_stale_dirs"]

log = logging.getLogger(__name__)

#: Address-space cap for large models (the causal-LM runtime): 4 GiB.
DEFAULT_MEMORY_LIMIT_BYTES = 4 * 1024**3
#: Default cap of the tabular runtime: 1.2 GB (python + onnxruntime need ~250 MiB virtual,
#: the rest is for the model and activations).
TABULAR_MEMORY_LIMIT_BYTES = 1_200_000_000


#: glibc malloc tunable for the child (glibc manual, "Memory Allocation Tunables":
#: ``glibc.malloc.hugetlb=1``, glibc >= 2.35, makes malloc ``madvise(MADV_HUGEPAGE)`` its
#: mappings). Building a session copies the model three or four times into fresh memory;
#: with 4 KiB pages that is one page fault per 4 KiB, with transparent huge pages one per
#: 2 MiB: a 100 MB session builds in ~0.12 s instead of ~0.27 s here. Where THP is
#: "never" or glibc is older, ld.so ignores it. Same as the parent's own large reads
#: (:func:`sealfl.attestation.bigread.read_new_bytes`).
CHILD_GLIBC_TUNABLES = "glibc.malloc.hugetlb=1"


def _minimal_env() -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "GLIBC_TUNABLES": CHILD_GLIBC_TUNABLES,
    }


def _check_model_bytes(model_bytes) -> None:
    if not isinstance(model_bytes, bytes) or not model_bytes:
        raise RuntimeSandboxError("model_bytes must be non-empty bytes (the verified model)")


class SandboxedRuntime(ChildChannel):
    """An onnxruntime session living in a sandboxed child process.

    Args:
        model_bytes: the verified ONNX model bytes (``bytes``, non-empty), or ``None`` to
            start the child without a model (:meth:`prestart`): it sets up its sandbox and
            imports onnxruntime while the caller is still verifying, and gets the model
            by :meth:`load` -- only ever after verification.
        memory_limit_bytes: child ``RLIMIT_AS`` in bytes (default 1.2 GB; 0 = no limit;
            otherwise at least :data:`MIN_MEMORY_LIMIT_BYTES`).
        timeout_s: max seconds to wait for one ``run``/``health_check`` reply.
        start_timeout_s: max seconds for the child to start and load the model.
        intra_op_threads: onnxruntime intra-op thread count in the child.
        network: ``"best-effort"`` (default: an empty network namespace, else a seccomp
            filter denying ``socket()``, else continue without), ``"isolate"`` (fail if
            neither works), ``"seccomp"`` (the filter only) or ``"inherit"``.
        die_with_parent: the child sets ``PR_SET_PDEATHSIG`` (SIGKILL) and so dies when the
            thread that created this runtime exits, however this process ends (a server
            creates its runtimes on its main thread). Off by default: a runtime created on
            a short-lived thread would lose its child with that thread.

    Attributes:
        pid: the child's process id.
        workdir: the child's working directory (empty, mode 0700; removed by :meth:`close`).
        homedir: the child's ``HOME`` (fresh, mode 0700; removed by :meth:`close`).
        network: how the child's network was isolated (``"netns"``, ``"userns+netns"``,
            ``"seccomp"``, ``"unavailable: ..."`` or ``"inherited"``).

    Raises:
        RuntimeSandboxError: the child could not start, reported an error (e.g. a corrupt
            model; its message is included), crashed or timed out.
    """

    #: prestarted children of this class take a staged model from a memory file
    #: (``--stage-fd``; subclasses that run another child script set False)
    STAGE_FD = True

    def __init__(self, model_bytes: bytes | None, *, memory_limit_bytes: int = TABULAR_MEMORY_LIMIT_BYTES,
                 timeout_s: float = 30.0, start_timeout_s: float = 120.0, intra_op_threads: int = 1,
                 network: str = "best-effort", die_with_parent: bool = False) -> None:
        self._die_with_parent = bool(die_with_parent)
        self._loaded = self._loading = False
        self._stage: MemfdStage | None = None
        self.loaded_from_stage = False
        self.network, self.inputs, self.outputs = "not known before load", [], []
        if model_bytes is not None:
            _check_model_bytes(model_bytes)
        check_options(memory_limit_bytes, timeout_s, start_timeout_s, intra_op_threads)
        if network not in ("isolate", "best-effort", "seccomp", "inherit"):
            raise RuntimeSandboxError(f"network must be isolate/best-effort/seccomp/inherit, got {network!r}")
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._closed = False
        self._max_reply = memory_limit_bytes or (1 << 40)
        self._owner_pid = os.getpid()  # a fork()ed copy must neither stop the child nor remove its dirs
        self.workdir = self.homedir = None
        try:
            self._stderr = tempfile.TemporaryFile()
            self.workdir = private_dir()  # mode 0700, empty
            self.homedir = private_dir("home-")  # mode 0700, the child's HOME
        except OSError as exc:
            for d in (self.workdir, self.homedir):
                if d is not None:
                    remove_private_dir(d)
            raise RuntimeSandboxError(f"cannot create the sandbox child's private directories: {exc}") from exc
        cmd = self._command(memory_limit_bytes, intra_op_threads, network)
        # prestarted children of the base class get a memory file to stage the model in
        self._stage = MemfdStage.create() if model_bytes is None and self.STAGE_FD else None
        if self._stage is not None:
            cmd += ["--stage-fd", str(self._stage.fd)]
        try:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=self._stderr, env={**_minimal_env(), "HOME": self.homedir}, cwd=self.workdir,
                                          close_fds=True, start_new_session=True, pass_fds=self._pass_fds())
        except OSError as exc:
            if self._stage is not None:
                self._stage.close()
            self._stderr.close()
            remove_private_dir(self.workdir)
            remove_private_dir(self.homedir)
            raise RuntimeSandboxError(f"cannot start the sandbox child: {exc}") from exc
        self.pid = self._proc.pid
        self._memory_limit = int(memory_limit_bytes)
        self._start_timeout_s = float(start_timeout_s)
        os.set_blocking(self._proc.stdin.fileno(), False)
        widen_pipe(self._proc.stdin.fileno())
        if model_bytes is not None:
            self.load(model_bytes)

    @classmethod
    def prestart(cls, **options) -> "SandboxedRuntime":
        """Start the child with no model (same keyword options as the constructor): the
        sandbox set-up and onnxruntime's import overlap whatever the caller does next
        (device boot: verification). Give it the verified bytes with :meth:`load`, or
        :meth:`close` it. Raises RuntimeSandboxError if the child cannot be started."""
        return cls(None, **options)

    def stage(self, model_bytes: bytes) -> None:
        """Copy ``model_bytes`` ahead of :meth:`load` into the memory file a
        :meth:`prestart`-ed child inherited (:mod:`sealfl.enclave.sandbox.stage`), in a
        background thread, while the caller is still verifying them (device boot: while
        the payload's hash and ONNX checks run). The child is told to read them only by
        :meth:`load` of the *same object* (bytes are immutable: the object staged is the
        object verified); any other object crosses the pipe instead and the staged copy is
        dropped, as it is by :meth:`close` after a refused release. Best effort: where no
        memory file exists, or the copy fails, nothing is staged and load() sends the bytes.

        Raises:
            RuntimeSandboxError: not non-empty bytes, or the runtime is loaded, closed or
                already staged.
        """
        _check_model_bytes(model_bytes)
        if self._loaded or self._loading or self._closed or (self._stage is not None and self._stage.started):
            raise RuntimeSandboxError("stage() needs a prestarted runtime with no model, staged or loaded")
        if self._stage is None or (self._memory_limit and len(model_bytes) > self._memory_limit):
            return  # nothing to stage in, or the child could not hold it: load() sends (and fails) as usual
        try:
            self._stage.start(model_bytes)
        except RuntimeError as exc:  # no thread could be started
            log.debug("not staging the model: %s", exc)

    def load(self, model_bytes: bytes) -> "SandboxedRuntime":
        """Hand the verified model bytes to a :meth:`prestart`-ed child and wait (at most
        ``start_timeout_s``) until its session is built; returns ``self``. If exactly this
        object was :meth:`stage`-d, the child uses the copy it already holds.

        Raises:
            RuntimeSandboxError: not bytes or empty, a model was already loaded, the runtime
                is closed, or the child refused the model / crashed / timed out (the child
                is then stopped).
        """
        _check_model_bytes(model_bytes)
        if self._loaded or self._loading or self._closed:
            raise RuntimeSandboxError("this sandboxed runtime already holds a model or is closed")
        self._loading = True  # other requests stay refused ("no model loaded yet") until 'init' is answered
        staged = self._stage is not None and self._stage.holds(model_bytes)
        try:
            reply = self._send_model(model_bytes, staged)
        except BaseException:
            self.close()
            raise
        finally:
            if self._stage is not None:  # the child has read its copy (or is gone)
                self._stage.close()
        self.loaded_from_stage = staged
        self._loaded = True
        if reply.get("forbidden_modules"):
            self.close()
            raise RuntimeSandboxError(f"sandbox child loaded forbidden modules {reply['forbidden_modules']}")
        self.network = str(reply.get("network"))
        self.inputs: list[dict] = reply.get("inputs", [])
        self.outputs: list[dict] = reply.get("outputs", [])
        log.log(logging.WARNING if self.network.startswith("unavailable") else logging.INFO,
                "sandboxed runtime pid %d up (network isolation: %s, memory limit %d bytes, inputs %s)",
                self.pid, self.network, self._memory_limit, self.input_names)
        return self

    def _pass_fds(self) -> tuple[int, ...]:
        """Descriptors the child inherits (the stage file of a prestarted child; subclasses
        add their own)."""
        return (self._stage.fd,) if self._stage is not None else ()

    def _send_model(self, model_bytes: bytes, staged: bool) -> dict:
        """The ``init`` exchange: the staged copy, or the bytes as the request's blob; returns
        the reply header (raises as :meth:`_request`)."""
        if staged:
            return self._request({"op": "init", "staged": len(model_bytes)}, [], self._start_timeout_s)[0]
        return self._request({"op": "init"}, [model_bytes], self._start_timeout_s)[0]

    def _command(self, memory_limit_bytes: int, intra_op_threads: int, network: str) -> list[str]:
        """The child's command line (subclasses run another child script)."""
        return [sys.executable, "-I", os.path.abspath(_child.__file__),
                "--memory-limit", str(int(memory_limit_bytes)), "--threads", str(int(intra_op_threads)),
                "--network", network] + self._parent_args()

    def _parent_args(self) -> list[str]:
        """``--parent-pid PID`` when the child must die with this process (``die_with_parent``)."""
        return ["--parent-pid", str(os.getpid())] if self._die_with_parent else []

    # -- introspection ---------------------------------------------------------------

    @property
    def input_names(self) -> list[str]:
        """Model input names, in graph order."""
        return [i["name"] for i in self.inputs]

    @property
    def output_names(self) -> list[str]:
        """Model output names, in graph order."""
        return [o["name"] for o in self.outputs]

    @property
    def alive(self) -> bool:
        """True while the child process is running and not closed."""
        return not self._closed and self._proc.poll() is None

    def close(self) -> None:
        """Stop the child (polite shutdown, then SIGKILL by pid) and drop a :meth:`stage`-d
        copy the child never opened. Idempotent."""
        proc = getattr(self, "_proc", None)
        if getattr(self, "_owner_pid", os.getpid()) != os.getpid():
            self._closed = True  # a fork()ed copy: the child and its directories are the creator's
            if getattr(self, "_stage", None) is not None:
                self._stage.close(forked=True)  # only this copy's descriptor of the stage file
            return
        stage = getattr(self, "_stage", None)
        if stage is not None:
            stage.close()  # drops the staged bytes; the child never read them
        if proc is not None and proc.poll() is None:
            if not self._closed:
                try:
                    with self._lock:
                        self._write_all(_child.encode_message({"op": "shutdown"}), time.monotonic() + 0.5)
                except (OSError, TimeoutError):
                    pass
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._closed = True
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        stderr = getattr(self, "_stderr", None)
        if stderr is not None and not stderr.closed:
            stderr.close()
        for private in (getattr(self, "workdir", None), getattr(self, "homedir", None)):
            if private is not None and (proc is None or proc.poll() is not None):
                remove_private_dir(private)

    def __enter__(self) -> "SandboxedRuntime":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- never raise from a finaliser
            pass
