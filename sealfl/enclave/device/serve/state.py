"""What ``sealfl device serve`` shares between its HTTP thread and its main thread: the
served release, the generation slots, the metrics.

A **slot** is one :class:`~sealfl.enclave.sandbox.llm_runtime.LLMRuntime` (one sandboxed child
with its own KV cache) that serves one request at a time. ``--max-concurrent N`` means N
slots; a request that finds no free slot waits in a bounded FIFO queue (``--queue Q``, at
most ``--queue-timeout`` seconds; :class:`SlotQueue`) or, with
the queue full or ``Q = 0``, is refused at once (HTTP 429): memory is bounded by N
children, N requests in flight and Q waiting bodies.

Runtimes are created on the server's **main thread** only (their children carry
``PR_SET_PDEATHSIG``, which fires when the creating thread exits); a slot whose child died
is handed back to the main thread (:meth:`ServeState.request_restart`), which starts a new
child from the verified bytes it kept, accepts it as boot does (health check and signed
canary) and counts a worker restart.

**Switching releases while serving** (``device serve --repo URL --poll S``,
:meth:`ServeState.swap`): the main thread boots the newer verified release, starts and
warms its slots, then swaps the slot list in one step under the lock. A request that holds
an old slot keeps it (and its model) to the end; the old slot is *retired*: it takes no new
request and its child is closed when its request gives it back (or at once when idle). New
requests get only new slots, so nothing is dropped and no request mixes two models.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sealfl.enclave.device.serve.metrics import ServeMetrics

__all__ = ["Slot", "ServeState", "ReleaseInfo", "SlotQueue", "TabularModel"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TabularModel:
    """A served tabular release: its name, version, root digest, statement digest, the
    model's input name and width (features per row), the parsed signed input spec
    (:class:`~sealfl.enclave.device.inputs.InputSpec`, None if the release states no
    ranges) and the model's output names."""

    name: str
    version: int
    root_digest: str
    statement_digest: str
    input_name: str
    width: int
    spec: Any
    output_names: tuple[str, ...]


@dataclass
class Slot:
    """One generation slot (module docstring)."""

    index: int
    runtime: Any
    busy: bool = False
    broken: bool = False
    retired: bool = False
    release: "ReleaseInfo | None" = None


@dataclass(frozen=True)
class ReleaseInfo:
    """The served release, for ``/health``, ``/v1/models`` and the metrics."""

    name: str
    version: int
    root_digest: str
    variant: str
    statement_digest: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "root_digest": self.root_digest,
                "variant": self.variant, "statement_digest": self.statement_digest}


@dataclass
class ServeState:
    """Shared state of one server.

    Attributes:
        max_concurrent: number of slots.
        metrics: the :class:`ServeMetrics`.
        status: ``"loading"`` until a verified model serves, then ``"ready"``; ``"refused"``
            when boot failed; ``"stopping"`` on shutdown.
        error: why boot failed (``"refused"``).
        release: the served release (None until ready).
        slots: the slots (empty until ready).
        max_context: the release's context limit, tokens.
        state_dir: the device state directory (``GET /attestation`` quotes its TEE).
        queue_size: requests that may wait for a slot (0: none).
        queue_timeout_s: longest wait for a slot, seconds.
        tee: the TEE the served release booted on (``{"backend", "insecure", "ak_keyid"}``),
            shown by ``/health``.
        on_slot_free: called (from any thread) when a slot is given back.
    """

    max_concurrent: int
    metrics: ServeMetrics
    state_dir: str = ""
    status: str = "loading"
    error: str = ""
    release: ReleaseInfo | None = None
    slots: list[Slot] = field(default_factory=list)
    max_context: int = 0
    queue_size: int = 0
    queue_timeout_s: float = 30.0
    tee: dict = field(default_factory=dict)
    on_slot_free: Any = None
    tokenizer_runtime: Any = None
    tabular: "TabularModel | None" = None
    restarts: "queue.Queue" = field(default_factory=queue.Queue)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _cancels: set = field(default_factory=set)
    _retired: list = field(default_factory=list)

    def track(self, cancel: threading.Event, on: bool) -> None:
        """Register (``on``) or forget the cancel event of a running generation; :meth:`close`
        sets every registered one."""
        with self._lock:
            (self._cancels.add if on else self._cancels.discard)(cancel)

    @property
    def model_id(self) -> str:
        """The model id clients send (``/v1/models``): the release name."""
        return self.release.name if self.release else ""

    def ready(self, release: ReleaseInfo, runtimes: list, max_context: int) -> None:
        """Start serving ``runtimes`` (one per slot) of ``release``."""
        with self._lock:
            self.slots = [Slot(i, rt, release=release) for i, rt in enumerate(runtimes)]
            self.tokenizer_runtime = runtimes[0]
            self.max_context = int(max_context)
            self.release = release
            self.status = "ready"
        m = self.metrics
        m.release_info.labels(release.name, str(release.version), release.variant, release.root_digest).set(1)
        m.loaded.set(1)

    def ready_tabular(self, model: "TabularModel", runtime) -> None:
        """Start serving a tabular release's ``runtime`` (one slot; the Open Inference
        Protocol routes, :mod:`sealfl.enclave.device.serve.oip_routes`)."""
        with self._lock:
            self.slots = [Slot(0, runtime)]
            self.tabular = model
            self.release = ReleaseInfo(model.name, model.version, model.root_digest, "tabular",
                                       model.statement_digest)
            self.status = "ready"
        m = self.metrics
        m.release_info.labels(model.name, str(model.version), "tabular", model.root_digest).set(1)
        m.loaded.set(1)
    def swap(self, release: ReleaseInfo, runtimes: list, max_context: int) -> None:
        """Serve ``runtimes`` of ``release`` from now on (module docstring): old slots retire,
        idle ones are closed here, busy ones when their request ends."""
        with self._lock:
            stopping = self.status != "ready"
        if stopping:
            self._close_retired([Slot(-1, rt) for rt in runtimes])
            return
        with self._lock:
            old, old_release = self.slots, self.release
            self.slots = [Slot(i, rt, release=release) for i, rt in enumerate(runtimes)]
            self.tokenizer_runtime = runtimes[0]
            self.max_context = int(max_context)
            self.release = release
            idle = []
            for slot in old:
                slot.retired = True
                (self._retired if slot.busy else idle).append(slot)
        self._close_retired(idle)
        m = self.metrics
        if old_release is not None:
            m.release_info.remove(old_release.name, str(old_release.version), old_release.variant,
                                  old_release.root_digest)
        m.release_info.labels(release.name, str(release.version), release.variant, release.root_digest).set(1)
        m.release_switches.inc()
        if self.on_slot_free is not None:
            self.on_slot_free()

    @staticmethod
    def _close_retired(slots) -> None:
        for slot in slots:
            try:
                slot.runtime.close()
            except Exception:  # noqa: BLE001 -- a retired child: close the others regardless
                log.exception("closing a retired runtime failed")

    def acquire(self) -> Slot | None:
        """A free, working slot marked busy, or None (never waits)."""
        with self._lock:
            if self.status != "ready":
                return None
            for slot in self.slots:
                if not slot.busy and not slot.broken:
                    slot.busy = True
                    self.metrics.running.inc()
                    return slot
        return None

    def release_slot(self, slot: Slot) -> None:
        """Give ``slot`` back (its request finished, failed or was cancelled)."""
        with self._lock:
            if not slot.retired:
                self.metrics.kv_tokens(slot.index, 0)
            if slot.busy:
                slot.busy = False
                self.metrics.running.dec()
            retire = slot.retired
            if retire and slot in self._retired:
                self._retired.remove(slot)
        if retire:
            self._close_retired([slot])
        if self.on_slot_free is not None:
            self.on_slot_free()

    def request_restart(self, slot: Slot) -> None:
        """Mark ``slot`` broken (its child died) and ask the main thread to restart it."""
        with self._lock:
            slot.broken = True
            if slot.retired:
                return  # its release is no longer served: nothing to restart
        self.restarts.put(slot)

    def restarted(self, slot: Slot, runtime) -> None:
        """The main thread replaced ``slot``'s runtime."""
        with self._lock:
            slot.runtime = runtime
            slot.broken = False
        self.metrics.worker_restarts.inc()
        if self.on_slot_free is not None:
            self.on_slot_free()

    def serving(self) -> bool:
        """True while ready with at least one working slot."""
        with self._lock:
            return self.status == "ready" and any(not s.broken for s in self.slots)

    def worker_pids(self) -> list[int]:
        """Pids of the slots' live children."""
        with self._lock:
            return [s.runtime.pid for s in self.slots if s.runtime is not None and s.runtime.alive]

    def close(self) -> None:
        """Stop every slot's child (shutdown)."""
        with self._lock:
            self.status = "stopping"
            runtimes = [s.runtime for s in self.slots] + [s.runtime for s in self._retired]
            self._retired = []
            for cancel in self._cancels:
                cancel.set()
        for rt in runtimes:
            try:
                rt.close()
            except Exception:  # noqa: BLE001 -- shutting down: close the others regardless
                log.exception("closing a runtime failed")


class SlotQueue:
    """Requests waiting for a generation slot, first come first served (runs on the event
    loop; :attr:`ServeState.on_slot_free` wakes it from the worker threads).

    At most ``state.queue_size`` wait, each at most ``state.queue_timeout_s`` seconds, as
    llama.cpp's server and vLLM queue requests beyond their running batch; beyond that the
    caller answers 429. A client that disconnects while waiting leaves the queue.
    """

    def __init__(self, state: ServeState, loop: asyncio.AbstractEventLoop) -> None:
        self.state, self.loop = state, loop
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        state.on_slot_free = self._wake_soon

    def _wake_soon(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: stopping
            pass

    def _wake(self) -> None:
        while self._waiting:
            fut = self._waiting[0]
            if fut.done():
                self._waiting.popleft()
                continue
            slot = self.state.acquire()
            if slot is None:
                break
            self._waiting.popleft()
            fut.set_result(slot)
        self.state.metrics.waiting.set(len(self._waiting))

    async def acquire(self, gone: Callable[[], Awaitable]) -> tuple[Slot | None, str]:
        """A slot, or ``(None, reason)``: ``"busy"`` (queue full or disabled),
        ``"queue_timeout"``, ``"gone"`` (``gone()``, awaited while waiting, returned: the
        client disconnected)."""
        if not self._waiting:
            slot = self.state.acquire()
            if slot is not None:
                return slot, ""
        if len(self._waiting) >= self.state.queue_size:
            return None, "busy"
        fut = self.loop.create_future()
        self._waiting.append(fut)
        self.state.metrics.waiting.set(len(self._waiting))
        gone = asyncio.ensure_future(gone())
        got, why = None, "queue_timeout"
        try:
            done, _ = await asyncio.wait({fut, gone}, timeout=self.state.queue_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                why = "gone"
            elif fut in done and not fut.cancelled():
                got = fut.result()
        finally:
            gone.cancel()
            if got is None:
                if fut.done() and not fut.cancelled():
                    self.state.release_slot(fut.result())  # a slot it will not use: hand it on
                else:
                    fut.cancel()
            if fut in self._waiting:
                self._waiting.remove(fut)
            self.state.metrics.waiting.set(len(self._waiting))
        return (got, "") if got is not None else (None, why)
