"""``sealfl device serve``: verify, boot and serve a release on loopback -- a causal-LM
release over an OpenAI-compatible HTTP API, a tabular one over the Open Inference Protocol
(KServe v2 REST, :mod:`sealfl.enclave.device.serve.oip_routes`).

Threads and order (:func:`run_server`):

1. the listening socket is bound first (``127.0.0.1`` by default; port 0 picks a free
   one, reported on stderr and in ``--port-file``), and uvicorn serves the app
   (:mod:`sealfl.enclave.device.serve.app`) on a daemon thread: ``/health`` answers 503
   ``loading`` while the release is verified;
2. the **main thread** boots exactly as ``sealfl device boot`` does
   (:func:`sealfl.enclave.device.boot.boot`: trust anchors, device state, TEE measurement,
   verification of every byte, canary, crash-consistent record; a refused release
   falls back to the last good one, and with none the server exits 2 without ever
   answering 200), then starts one more runtime per extra slot from the same verified
   bytes (each accepted by its health check and the signed canary). Only the files the
   chosen variant needs stay in memory (the other variant's bytes are dropped);
3. the main thread then waits for slot restarts (a child that died) and signals; with
   ``--repo URL --poll S`` it also checks the TUF repository every ``S`` seconds
   (:func:`sealfl.enclave.device.update.update`: the same refresh, download, verification,
   canary and slot switch as ``device update``) and, when a newer release was installed,
   starts and warms its slots and switches to them while serving
   (:meth:`~sealfl.enclave.device.serve.state.ServeState.swap`: requests in flight finish on
   the old model, new ones get the new one). A refused or failed check changes nothing
   (counted in ``sealfl_llm_update_checks_total{result}``; ``update.json`` says why).

Stopping: SIGINT/SIGTERM raise :class:`~sealfl.common.errors.Interrupted` in the main
thread wherever it is (boot included); every slot's child is closed, and the children
carry ``PR_SET_PDEATHSIG`` as well, so none outlives the server even when it is
SIGKILLed. The CLI prints one line and exits 128 + signal (130 / 143).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sealfl.common.fsutil import atomic_write
from sealfl.common.testpoints import check_environment, testpoint
from sealfl.enclave.device.at_rest import KeySource
from sealfl.enclave.device.llm_boot import boot_llm
from sealfl.enclave.device.serve.metrics import ServeMetrics
from sealfl.enclave.device.serve.openai_api import DEFAULT_LIMITS, APILimits
from sealfl.enclave.device.serve.state import ReleaseInfo, ServeState
from sealfl.enclave.errors import BootError, ServeOptionsError
from sealfl.enclave.sandbox.child import trim_heap
from sealfl.enclave.sandbox.threads import choose_threads

__all__ = ["ServeOptions", "run_server", "EXIT_REFUSED"]

log = logging.getLogger(__name__)

#: Exit status when the release is refused and no last good release can be served.
EXIT_REFUSED = 2
#: Prompt length of the warm-up generation each slot runs before the server reports ready.
WARM_UP_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """How to serve.

    Attributes:
        host: address to bind (default loopback).
        port: TCP port (0: a free one).
        max_concurrent: generation slots (1..16); each is one sandboxed child holding the model.
        variant: model variant (default: the release's default).
        port_file: where to write the bound port (atomically), or None.
        limits: request caps (:class:`~sealfl.enclave.device.serve.openai_api.APILimits`).
        threads: onnxruntime intra-op threads per slot (None: the cores really free, split over
            the slots: :func:`sealfl.enclave.sandbox.threads.choose_threads`).
        timeout_s: longest wait for one token from a child, seconds.
        key_source: key source for a release encrypted at rest
            (:func:`sealfl.enclave.device.kbs_client.broker_key_source`), or None.
        backend: the TEE backend asked for (``--tee``), or None for the provisioned one.
        queue_size: requests that may wait for a free slot (0: none; 429 at once).
        queue_timeout_s: longest wait in that queue, seconds (then 429).
        repo: TUF repository URL to poll for newer releases (None: no polling).
        poll_s: seconds between two update checks of ``repo``.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_concurrent: int = 1
    variant: str | None = None
    port_file: Path | None = None
    limits: APILimits = DEFAULT_LIMITS
    threads: int | None = None
    timeout_s: float = 120.0
    key_source: KeySource | None = None
    backend: str | None = None
    queue_size: int = 0
    queue_timeout_s: float = 30.0
    repo: str | None = None
    poll_s: float = 300.0


class _Stop(BaseException):
    """A signal arrived (raised in the main thread by the handler)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


#: longest the serving loop waits before it looks at the signals received again (seconds)
WAKE_S = 1.0


@contextlib.contextmanager
def _signals_raise() -> Iterator[list[int]]:
    """SIGINT/SIGTERM raise :class:`_Stop` in the main thread (the first one; later ones do
    not interrupt the shutdown), and every one is appended to the yielded list, which the
    serving loop checks at least every :data:`WAKE_S` seconds (:func:`_next_restart`). So a
    stop is never lost: an exception raised by a signal handler is dropped when the handler
    happens to run inside a finalizer or a C callback, and a server that had ignored its
    later signals then ran on (seen once under load after a release switch)."""
    got: list[int] = []

    def handler(signum, frame):  # noqa: ARG001 - the signal module's signature
        first = not got
        got.append(signum)
        if first:
            raise _Stop(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _next_restart(state: ServeState, got: list[int], timeout_s: float | None):
    """The next slot whose child died (``state.restarts``), or None after ``timeout_s``
    seconds (None: no limit). Raises :class:`_Stop` as soon as ``got`` holds a signal,
    looking at it at least every :data:`WAKE_S` seconds."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if got:
            raise _Stop(got[0])
        wait = WAKE_S if deadline is None else min(WAKE_S, deadline - time.monotonic())
        if wait <= 0:
            return None
        try:
            return state.restarts.get(timeout=wait)
        except queue.Empty:
            continue


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def _trimmed(release, spec):
    """``release`` keeping only the payload files the chosen variant needs."""
    keep = {f: release.payload[f] for f in [spec.model_file, *spec.files.values()]}
    return dataclasses.replace(release, payload=keep)


def _runtime_options(opts: ServeOptions) -> dict[str, Any]:
    return {"die_with_parent": True, "timeout_s": opts.timeout_s,
            "intra_op_threads": choose_threads(opts.max_concurrent, opts.threads)}


def _boot(trust: Path, release_dir: Path, state_dir: Path, opts: ServeOptions, state: ServeState,
          say: Callable[[str], None]):
    from sealfl.enclave.device.policy import boot_or_last_good

    runtime_options = _runtime_options(opts)

    def refused(exc: BootError) -> None:
        state.metrics.verification_failures.inc()
        say(f"refused: {exc}")

    try:
        outcome = boot_or_last_good(trust, release_dir, state_dir, backend=opts.backend, key_source=opts.key_source,
                                    variant=opts.variant, runtime_options=runtime_options, on_refused=refused)
    except BootError as exc:
        state.status, state.error = "refused", str(exc)
        raise
    dev = outcome.device
    if outcome.kept_last_good:
        say(f"kept the last good release v{dev.release.version}")
    state.tee = {"backend": dev.tee.backend, "insecure": bool(dev.tee.insecure), "ak_keyid": dev.tee.ak_keyid()}
    if not dev.is_llm:
        return dev
    release, spec, runtimes = _trimmed(dev.release, dev.llm_spec), dev.llm_spec, [dev.runtime]
    del dev  # the other variant's bytes (read for verification) go with it, before more slots load
    trim_heap()
    _more_slots(runtimes, release, spec, opts.max_concurrent, runtime_options)
    return release, spec, runtimes, runtime_options


def _more_slots(runtimes: list, release, spec, slots: int, runtime_options: dict[str, Any]) -> None:
    """Start runtimes from the verified ``release`` until there are ``slots``, warm each up;
    on any failure close them all (the first included) and re-raise."""
    try:
        for _ in range(slots - len(runtimes)):
            rt, _, _ = boot_llm(release.payload, release.metadata, spec.variant, runtime_options)
            runtimes.append(rt)
        for rt in runtimes:
            _warm_up(rt)
    except BaseException:
        for rt in runtimes:
            rt.close()
        raise


def _warm_up(runtime) -> None:
    """One prefill of up to :data:`WARM_UP_TOKENS` tokens and one decode step, so the
    first client does not pay onnxruntime's first-run costs (measured on SmolLM2 INT4,
    2 threads: the first 128-token prefill of a session took 2.9 s, the next ones 1.0 s)."""
    from sealfl.enclave.sandbox.decode import SamplingParams

    text = "The device verified every byte of this release before it loaded the model. " * 16
    ids = runtime.encode(text)[:max(1, min(WARM_UP_TOKENS, runtime.max_context - 3))]
    runtime.generate(ids, SamplingParams(max_tokens=2))


def run_server(trust: Path, release_dir: Path, state_dir: Path, opts: ServeOptions,
               say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> None:
    """Serve until a signal (module docstring). Runs on the main thread.

    Args:
        trust, release_dir, state_dir: as for ``sealfl device boot``.
        opts: :class:`ServeOptions`.
        say: one line for the operator (stderr).

    Raises:
        Interrupted: SIGINT/SIGTERM; every child is gone.
        BootError: nothing is served (``/health`` never answered 200): the release was
            refused and no last good release could be booted
            (:class:`~sealfl.enclave.device.policy.NothingRuns`), the TEE state needs
            re-provisioning (reason ``tee-state``), or the directories overlap.
        OSError: the address cannot be bound.
        TestpointError: malformed test pause-point variables.
    """
    import uvicorn

    from sealfl.common.errors import Interrupted
    from sealfl.enclave.device.serve.app import create_app

    if threading.current_thread() is not threading.main_thread():
        raise ServeOptionsError("run_server must run on the main thread (signals, PR_SET_PDEATHSIG)")
    check_environment()
    if not 1 <= opts.max_concurrent <= 16:
        raise ServeOptionsError(f"max_concurrent must lie in [1, 16], got {opts.max_concurrent}")
    state: ServeState
    metrics = ServeMetrics(opts.max_concurrent, worker_pids=lambda: state.worker_pids())
    state = ServeState(opts.max_concurrent, metrics, state_dir=str(state_dir), queue_size=opts.queue_size,
                       queue_timeout_s=opts.queue_timeout_s)
    try:
        sock = _bind(opts.host, opts.port)
    except OSError as exc:
        raise ServeOptionsError(f"cannot listen on {opts.host}:{opts.port}: {exc.strerror or exc}; choose another "
                                "--port (0 picks a free one) or stop what holds it") from exc
    port = sock.getsockname()[1]
    app = create_app(state, opts.limits)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                           timeout_graceful_shutdown=1))
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="sealfl-http", daemon=True)
    with _signals_raise() as got:
        try:
            http.start()
            if opts.port_file is not None:
                atomic_write(Path(opts.port_file), f"{port}\n".encode(), 0o644)
            say(f"listening on http://{opts.host}:{port} (health 503 until the release is verified and loaded)")
            testpoint("serve-boot")
            booted = _boot(trust, release_dir, state_dir, opts, state, say)
            if not isinstance(booted, tuple):
                _serve_tabular(state, booted, opts, port, say, got)
                return
            release, spec, runtimes, runtime_options = booted
            metrics.set_context(spec.generation["max_context"])
            state.ready(ReleaseInfo(release.name, release.version, release.root_digest, spec.variant,
                                    release.statement_digest), runtimes, spec.generation["max_context"])
            say(f"serving {release.name} v{release.version} ({spec.variant}, root digest {release.root_digest}) "
                f"with {opts.max_concurrent} slot(s) on http://{opts.host}:{port}/v1")
            while True:
                slot = _next_restart(state, got, opts.poll_s if opts.repo else None)
                if slot is None:
                    polled = _poll(trust, state_dir, opts, state, runtime_options, say)
                    if polled is not None:
                        release, spec = polled
                    continue
                if not slot.retired:
                    _restart(state, slot, release, spec, runtime_options)
        except _Stop as stop:
            raise Interrupted(stop.signum) from None
        finally:
            state.close()
            server.should_exit = True
            sock.close()


def _serve_tabular(state: ServeState, dev, opts: ServeOptions, port: int, say: Callable[[str], None],
                   got: list[int]) -> None:
    """Serve a booted tabular release over the Open Inference Protocol until a signal (``got``,
    from :func:`_signals_raise`); a child that died is restarted from the verified bytes
    ``dev`` keeps.

    Raises:
        BootError: (reason ``"model"``) the model is not one float input ``[N, d]``; (reason
            ``"runtime"``) the child of a release encrypted at rest died (its key is not kept).
    """
    from sealfl.enclave.device.tabular_boot import start_tabular

    rel, rt = dev.release, dev.runtime
    try:
        model = _tabular_model(dev)
    except BootError:
        dev.close()
        raise
    state.ready_tabular(model, rt)
    say(f"serving {rel.name} v{rel.version} (tabular, root digest {rel.root_digest}) over the Open Inference "
        f"Protocol on http://{opts.host}:{port}/v2/models/{rel.name}/infer")
    if opts.repo:
        say("--repo: switching releases while serving is for causal-LM releases; a tabular device updates with "
            "'sealfl device update' and a restart of 'device serve'")
    while True:
        slot = _next_restart(state, got, None)
        if rel.metadata.get("at_rest"):  # its decrypted bytes were never kept: a new boot fetches the key again
            raise BootError("the model's sandboxed child died and the release is encrypted at rest; restart "
                            "'device serve' (its service manager does)", reason="runtime")
        try:
            slot.runtime.close()
            new = start_tabular(rel, dev.model_file, _runtime_options(opts), rel.payload)
        except BootError as exc:
            log.error("the model's child could not be restarted: %s", exc)
            continue
        state.restarted(slot, new)
        log.warning("the model's child restarted (pid %d)", new.pid)


def _tabular_model(dev):
    """The served model's description from a booted tabular device (its child's input)."""
    from sealfl.enclave.device.serve.state import TabularModel

    rel, rt = dev.release, dev.runtime
    first = rt.inputs[0] if len(rt.inputs) == 1 and isinstance(rt.inputs[0], dict) else {"name": "?", "shape": "?"}
    shape = first.get("shape")
    width = shape[1] if isinstance(shape, list) and len(shape) == 2 else None
    if (first.get("type") != "tensor(float)" or type(width) is not int or width < 1
            or (dev.input_spec is not None and len(dev.input_spec.features) != width)):
        raise BootError(f"release {rel.name} v{rel.version}: its model's input {str(first.get('name'))[:80]!r} has "
                        f"shape {str(shape)[:80]}; serving rows needs one float input [N, d] with d fixed (and "
                        "equal to the signed input spec's features)", reason="model")
    return TabularModel(rel.name, rel.version, rel.root_digest, rel.statement_digest, first["name"], width,
                        dev.input_spec, tuple(rt.output_names))
def _poll(trust: Path, state_dir: Path, opts: ServeOptions, state: ServeState, runtime_options: dict[str, Any],
          say: Callable[[str], None]):
    """One update check of ``opts.repo``; on a newly installed release, its slots are started
    and warmed, then swapped in. Returns ``(release, spec)`` now served, or None."""
    from sealfl.common.errors import SealflError
    from sealfl.enclave.device.update import update

    try:
        res = update(trust, opts.repo, state_dir, backend=opts.backend, key_source=opts.key_source,
                     variant=opts.variant, runtime_options=runtime_options, require_llm=True, keep_device=True,
                     on_refused=lambda exc: state.metrics.verification_failures.inc())
    except (SealflError, OSError) as exc:
        state.metrics.update_checks.labels("refused").inc()
        say(f"update check refused: {exc}; still serving {state.release.name} v{state.release.version}")
        return None
    state.metrics.update_checks.labels(res.action).inc()
    if res.action != "installed":
        if res.action == "kept":
            say(f"update to v{res.version} refused on the device; still serving v{state.release.version}")
        return None
    dev = res.outcome.device
    release, spec = _trimmed(dev.release, dev.llm_spec), dev.llm_spec
    runtimes = [dev.runtime]
    del dev
    trim_heap()
    _more_slots(runtimes, release, spec, opts.max_concurrent, runtime_options)
    state.swap(ReleaseInfo(release.name, release.version, release.root_digest, spec.variant,
                           release.statement_digest), runtimes, spec.generation["max_context"])
    state.metrics.set_context(spec.generation["max_context"])
    say(f"switched to {release.name} v{release.version} ({spec.variant}, root digest {release.root_digest}) "
        "while serving")
    return release, spec


def _restart(state: ServeState, slot, release, spec, runtime_options: dict[str, Any]) -> None:
    """Replace a dead slot's child with a new one from the kept verified bytes."""
    try:
        slot.runtime.close()
        rt, _, _ = boot_llm(release.payload, release.metadata, spec.variant, runtime_options)
    except BootError as exc:
        log.error("slot %d could not be restarted: %s", slot.index, exc)
        return
    state.restarted(slot, rt)
    log.warning("slot %d restarted (child pid %d)", slot.index, rt.pid)
