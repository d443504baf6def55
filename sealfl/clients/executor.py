"""The partner's own task executor: its long-lived process takes the SuperNode's ClientApp
tasks and answers them in-process with sealfl's installed handlers.

Why: Flower 1.42's SuperNode, in its default ``--isolation subprocess``, starts a SuperExec
that polls the SuperNode every second for a task and starts a fresh ``flwr-clientapp``
process for every message (import Flower, install the run's FAB, import the app, answer,
exit). For a round of the heart task that start-up was ~30x the partner's own work
(``bench/deploy_bench.py``). ``sealfl partner start`` instead runs the SuperNode with
``--isolation process`` -- Flower's mode for an executor "outside of SuperNode" -- and
:class:`PartnerExecutor`, a thread of the partner process that already holds the kit, the
task and the data, is that executor. It speaks Flower's Runtime API with Flower's own
client code (``flwr.supernode.runtime.run_clientapp``: ``push_message``,
``push_task_output``, and :func:`pull_task_input` after its ``pull_task_input``), so the SuperNode, the SuperLink and the ServerApp
see exactly what a ``flwr-clientapp`` process would have sent.

Per task (``AcquireTask`` returned a ClientApp task and its token):

1. pull the message, its Context and the run (``PullTaskInput``, ``PullMessages``);
2. refuse a run whose FAB is not sealfl's app (:func:`check_run`): the partner never executes
   code the SuperLink sends -- the FAB is not installed or imported at all; the handlers
   are the ones installed on this machine (:mod:`sealfl.clients.app`);
3. answer with those handlers, the node config overlaid with the partner process's own
   (``kit-dir``, ``partner-key``, ``data-path``: what the partner started with wins);
4. push the reply (an error reply naming the exception if a handler raised, as Flower's
   ClientApp process does) and the task's status.

While a handler runs, a heartbeat thread tells the SuperNode the task is alive (Flower's
``HeartbeatSender``; a SuperNode that answers "not alive" -- the run was stopped -- marks the
task cancelled: its reply is dropped. Flower's own heartbeat function raises SIGINT in the
ClientApp process instead, which here would stop the partner).

Polling: ``AcquireTask`` is a small HTTP request on loopback. The executor asks every
:attr:`Polling.fast_s` seconds right after a task and slows down linearly with the time
since the last one, up to :attr:`Polling.idle_s` (:func:`poll_interval`): a campaign's next
message is picked up within milliseconds, an idle partner costs a request every half second.

Authentication: the SuperNode's Runtime API accepts ``AcquireTask`` only with an HMAC over the
request keyed by a secret the partner process generated and handed to the SuperNode as a
file (``--superexec-auth-secret-file``, 0600 in a 0700 directory); each task's further calls
carry the one-time token ``AcquireTask`` returned (Flower's design).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import Context, Message

from sealfl.clients.errors import ClientError
from sealfl.common import seconds

log = logging.getLogger(__name__)

__all__ = ["Polling", "poll_interval", "check_run", "pull_task_input", "PartnerExecutor", "ExecutorError", "SEALFL_PUBLISHER",
           "ACQUIRE_METHOD"]

#: ``[tool.flwr.app] publisher`` of sealfl's app (pyproject.toml); a run's FAB id is ``publisher/name``
SEALFL_PUBLISHER = "sealfl"
#: the Runtime API method Flower protects with the SuperExec secret
ACQUIRE_METHOD = "/flwr.proto.Runtime/AcquireTask"


class ExecutorError(ClientError):
    """A task could not be taken or answered (the SuperNode's Runtime API failed, or the
    run is not sealfl's); the message says which."""


@dataclass(frozen=True)
class Polling:
    """How often the executor asks the SuperNode for a task (seconds).

    Attributes:
        fast_s: the interval right after a task (a campaign's next message is near).
        idle_s: the interval once the partner has been idle for ``idle_s / slope`` seconds.
        slope: seconds of interval per second idle (0.05: 0.5 s after 10 s idle).
    """

    fast_s: float = 0.005
    idle_s: float = 0.5
    slope: float = 0.05


def poll_interval(idle_for_s: float, polling: Polling = Polling()) -> float:
    """Seconds to wait before the next ``AcquireTask``, ``idle_for_s`` seconds after the last
    task ended (:func:`sealfl.common.seconds.poll_interval`). Pure."""
    return seconds.poll_interval(idle_for_s, polling.fast_s, polling.idle_s, polling.slope)


def check_run(fab_id: str, publisher: str = SEALFL_PUBLISHER) -> None:
    """Refuse a run whose FAB was not published as sealfl's app.

    Args:
        fab_id: the run's FAB id as the SuperLink gives it (``"<publisher>/<name>"``).
        publisher: the publisher this partner answers for.
    Raises:
        ExecutorError: another publisher's app (the partner runs only sealfl's handlers).
    """
    pub = fab_id.split("/", 1)[0] if isinstance(fab_id, str) else ""
    if pub != publisher:
        raise ExecutorError(f"run of app {fab_id!r}: this partner answers only {publisher}'s app "
                            f"(publisher {publisher!r}); started by another consortium tool?")


Handler = Callable[[Message, Context], Message]

#: tries of each Runtime API call of a task (a SuperNode busy for a moment answers 503), spaced
#: 50 ms, 100 ms ... up to 1 s apart; ``AcquireTask`` is tried once (the loop asks again)
TASK_CALL_TRIES = 6


def retry_invoker(tries: int):
    """Flower's ``RetryInvoker`` for this process's Runtime API calls: transport errors and
    HTTP 502/503/504 retried ``tries`` times in all, 50 ms doubling to 1 s apart; any other
    HTTP error raised at once. Flower's own ``make_simple_http_retry_invoker`` (meant for a
    disposable ClientApp process) retries forever, up to minutes apart, and sends its process
    SIGINT on an HTTP 401 -- here that process is the partner's."""
    import httpx
    from flwr.supercore.retry import RetryInvoker, exponential

    def give_up(exc: Exception) -> bool:
        return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code not in (502, 503, 504)

    return RetryInvoker(lambda: exponential(base_delay=0.05, max_delay=1), (httpx.TransportError, httpx.HTTPStatusError),
                        max_tries=tries, max_time=None, should_giveup=give_up, wait_function=time.sleep)

def pull_task_input(client) -> tuple[Message, Context, Any]:
    """The task's message, Context and run from the SuperNode's Runtime API: Flower's
    ``flwr.supernode.runtime.run_clientapp.pull_task_input`` (same calls, same checks, the
    FAB left unread) with object retries from 5 ms (:mod:`sealfl.common.flwr_retries`: the
    SuperNode offers the task as soon as the message is stored, then pulls its objects).

    Raises:
        ExecutorError: the SuperNode has no message for the task.
        Exception: Flower's own errors (HTTP, an object that never came).
    """
    from flwr.common.serde import context_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    from sealfl.common.flwr_retries import OBJECT_RETRY_CAP_S, OBJECT_RETRY_S

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    context = context_from_proto(res.context)
    run = run_from_proto(res.run)
    msgs = client.PullMessages(PullAppMessagesRequest())
    if not msgs.messages_list:
        raise ExecutorError("the SuperNode offered a task but holds no message for it")
    node = Node(node_id=context.node_id)
    tree = msgs.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, initial_backoff=OBJECT_RETRY_S, backoff_cap=OBJECT_RETRY_CAP_S)
    message.metadata.__dict__["_message_id"] = tree.object_id
    return message, context, run


class PartnerExecutor:
    """Takes the SuperNode's ClientApp tasks and answers them with ``handler``, one at a time,
    in a daemon thread of this process (module docstring).

    Args:
        runtime_address: ``127.0.0.1:PORT`` of the SuperNode's Runtime API (its ``--host/--port``).
        secret: the SuperExec secret the SuperNode was given (bytes, >= 16).
        handler: ``(Message, Context) -> Message``; default: :data:`sealfl.clients.app.app`.
        node_config: the partner's own node config, laid over the one the SuperNode sends.
        polling: the :class:`Polling` intervals.
        on_task: called after each task with ``(message_type, run_id, seconds, error)``
            (``error``: None, or why the task was refused); exceptions in it are logged.

    Attributes:
        served: tasks answered (an error reply counts).
        last_task_s: seconds the last task took from pull to pushed status.
    """

    def __init__(self, runtime_address: str, secret: bytes, handler: Handler | None = None,
                 node_config: Mapping[str, Any] | None = None, polling: Polling = Polling(),
                 on_task: Callable[[str, int | None, float, str | None], None] | None = None):
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ExecutorError("the SuperExec secret must be at least 16 random bytes")
        self.address = runtime_address
        self._secret = secret
        self._handler = handler
        self.node_config = dict(node_config or {})
        self.polling = polling
        self.on_task = on_task
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="partner-executor", daemon=True)
        self.served = 0
        self.last_task_s: float | None = None

    # -- the loop ------------------------------------------------------------------------

    def start(self) -> "PartnerExecutor":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the loop to end after the current task; wait up to ``timeout_s`` seconds."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _client(self, interceptor, tries: int) -> Any:
        from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
        from flwr.supercore.runtime import RuntimeHttpClient

        return RuntimeHttpClient.from_server_address(
            server_address=self.address, insecure=True, root_certificates=None,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"), interceptor],
            retry_invoker=retry_invoker(tries))

    def _loop(self) -> None:
        from flwr.proto.runtime_pb2 import AcquireTaskRequest
        from flwr.supercore.constant import TaskType
        from flwr.supercore.interceptors import SuperExecAuthHttpInterceptor

        client = self._client(SuperExecAuthHttpInterceptor(master_secret=self._secret,
                                                           protected_methods={ACQUIRE_METHOD}), tries=1)
        last = time.monotonic()
        failures = 0
        try:
            while not self._stop.is_set():
                try:
                    res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value],
                                                                agentapp_fab_hashes=[]))
                    failures = 0
                except Exception as exc:  # noqa: BLE001 - the SuperNode starting, restarting or gone
                    failures += 1
                    if failures == 1:  # expected while the SuperNode starts: no warning for that
                        log.info("SuperNode Runtime API at %s not answering yet (%s); retrying", self.address, exc)
                    elif failures == 20 or failures % 600 == 0:  # ~10 s, then every ~10 min
                        log.warning("SuperNode Runtime API at %s not answering (%s); retrying", self.address, exc)
                    self._stop.wait(min(1.0, 0.05 * failures))
                    continue
                if res.HasField("task") and res.token:
                    try:
                        self._task(res.token)
                    except Exception:  # noqa: BLE001 - one task going wrong never stops the partner
                        log.exception("a task of the SuperNode could not be answered")
                    last = time.monotonic()
                    continue
                self._stop.wait(poll_interval(time.monotonic() - last, self.polling))
        finally:
            client.close()

    # -- one task ------------------------------------------------------------------------

    def _task(self, token: str) -> None:
        from flwr.app.error import Error
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supercore.heartbeat import HeartbeatSender
        from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor
        from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

        t0 = time.perf_counter()
        client = self._client(RuntimeTokenHttpInterceptor(token), tries=TASK_CALL_TRIES)
        cancelled = threading.Event()
        beat = HeartbeatSender(self._heartbeat_fn(client, cancelled))
        message = context = reply = None
        status, details = SubStatus.FAILED, "the partner's task failed"
        try:
            beat.start()
            message, context, run = pull_task_input(client)
            check_run(run.fab_id)
            ctx = Context(run_id=context.run_id, node_id=context.node_id,
                          node_config={**context.node_config, **self.node_config}, state=context.state,
                          run_config=context.run_config, series_id=context.series_id)
            reply = self._handle(message, ctx)
            status, details = SubStatus.COMPLETED, ""
        except Exception as exc:  # noqa: BLE001 - the refusal travels back as the reply's error
            reason = f"{type(exc).__name__}: {exc}"
            log.error("%s message refused: %s", getattr(getattr(message, "metadata", None), "message_type", "a"),
                      reason)
            details = reason
            if message is not None:
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message)
        finally:
            if beat.is_running:
                beat.stop()
            try:
                if cancelled.is_set():
                    log.warning("the SuperNode cancelled this task (the run was stopped); its reply is dropped")
                elif reply is not None and context is not None:
                    push_message(client, reply, context)
                push_task_output(client=client, context=context, sub_status=status, details=details)
            except Exception as exc:  # noqa: BLE001 - the SuperNode went away mid-task
                log.error("could not push the reply to the SuperNode: %s", exc)
            finally:
                client.close()
        self.served += 1
        self.last_task_s = time.perf_counter() - t0
        kind = getattr(getattr(message, "metadata", None), "message_type", "a")
        run_id = getattr(context, "run_id", None)
        error = None if status == SubStatus.COMPLETED else details
        log.info("%s message of run %s answered in %.3f s (%s)", kind, run_id, self.last_task_s, error or "ok")
        if self.on_task is not None:
            try:
                self.on_task(kind, run_id, self.last_task_s, error)
            except Exception:  # noqa: BLE001 - a display never stops the partner
                log.exception("on_task callback failed")

    def _handle(self, message: Message, context: Context) -> Message:
        handler = self._handler
        if handler is None:
            from sealfl.clients import app as partner

            handler = partner.app
        return handler(message=message, context=context)

    @staticmethod
    def _heartbeat_fn(client, cancelled: threading.Event) -> Callable[[], bool]:
        """Flower's task heartbeat (``make_task_heartbeat_fn_http``) without its SIGINT: a task
        the SuperNode no longer wants is marked ``cancelled``."""
        import httpx
        from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest

        def fn() -> bool:
            try:
                res = client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
            except (httpx.TransportError, httpx.HTTPStatusError):
                return False
            if not res.success:
                cancelled.set()
            return True

        return fn
