"""A supervisor around :class:`~sealfl.common.sandbox.SandboxedRuntime`: a worker that dies
or hits its memory limit is reported and restarted; the request in flight gets a clear
error (never a hang: every wait is bounded by the runtime's timeouts).

What counts as "hit its memory limit": the child died (e.g. killed, or aborted on an
allocation failure), or it answered with an error naming ``MemoryError``, ``bad_alloc`` or a
failed allocation (onnxruntime's ``Failed to allocate memory``) -- under ``RLIMIT_AS`` an
allocation beyond the cap fails instead of growing.

Reports: :meth:`SupervisedRuntime.health` (pid, alive, restarts, last failure, network
isolation) and :meth:`SupervisedRuntime.metrics` (Prometheus-style counter names).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping

import numpy as np

from .errors import RuntimeSandboxError
from .sandbox import SandboxedRuntime

__all__ = ["SupervisedRuntime", "MEMORY_ERROR"]

log = logging.getLogger(__name__)
#: Child error messages that mean "out of memory under the limit".
MEMORY_ERROR = re.compile(r"MemoryError|bad_alloc|[Ff]ailed to allocate|Cannot allocate memory")


class SupervisedRuntime:
    """Restarting wrapper of :class:`SandboxedRuntime` (same model bytes, same options).

    Args:
        model_bytes: the verified model bytes.
        options: keyword arguments of :class:`SandboxedRuntime` (``memory_limit_bytes``, ...).

    Raises:
        RuntimeSandboxError: the first worker cannot start.
    """

    def __init__(self, model_bytes: bytes, **options) -> None:
        self._model = model_bytes
        self._options = dict(options)
        self._lock = threading.Lock()
        self.restarts = 0
        self.last_failure: str | None = None
        self._rt = SandboxedRuntime(model_bytes, **self._options)

    @property
    def runtime(self) -> SandboxedRuntime:
        """The current worker."""
        return self._rt

    def _restart(self, why: str) -> None:
        old = self._rt.pid
        self._rt.close()
        self.restarts += 1
        self.last_failure = why
        self._rt = SandboxedRuntime(self._model, **self._options)
        log.warning("sandboxed worker pid %d failed (%s); restarted as pid %d (restart #%d)", old, why,
                    self._rt.pid, self.restarts)

    def run(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """:meth:`SandboxedRuntime.run` on the current worker.

        Raises:
            RuntimeSandboxError: the request failed; if the worker died or ran out of memory
                it was restarted before this is raised (the message says so: retry).
        """
        with self._lock:
            try:
                return self._rt.run(inputs)
            except RuntimeSandboxError as exc:
                died = not self._rt.alive
                if not died and not MEMORY_ERROR.search(str(exc)):
                    raise
                why = ("worker died" if died else "worker hit its memory limit") + f": {exc}"
                self._restart(why)
                raise RuntimeSandboxError(f"{why}; the worker was restarted as pid {self._rt.pid}: retry the "
                                          "request") from exc

    def health(self) -> dict:
        """``{"alive", "pid", "restarts", "last_failure", "network"}`` of the current worker."""
        return {"alive": self._rt.alive, "pid": self._rt.pid, "restarts": self.restarts,
                "last_failure": self.last_failure, "network": self._rt.network}

    def metrics(self) -> dict[str, int]:
        """Counters: ``sealfl_sandbox_restarts_total``."""
        return {"sealfl_sandbox_restarts_total": self.restarts}

    def close(self) -> None:
        """Stop the worker."""
        self._rt.close()

    def __enter__(self) -> "SupervisedRuntime":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
