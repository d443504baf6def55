"""The partner's own task executor (sealfl.clients.executor): what it decides without a
SuperNode. Its work against real SuperNodes is tested in tests/platform/test_deployment.py
and test_deployed_faults.py (every deployed campaign runs through it)."""

from __future__ import annotations

import pytest

from sealfl.clients.executor import (
    ExecutorError,
    PartnerExecutor,
    Polling,
    check_run,
    poll_interval,
)
from sealfl.common.seconds import poll_interval as generic_interval


def test_only_runs_of_sealfls_app_are_answered():
    check_run("sealfl/sealfl")
    check_run("sealfl/heart-campaign")  # any app name of the publisher
    for other in ("flwrlabs/quickstart", "sealflx/app", "", "/sealfl", None, 42, "evil/sealfl"):
        with pytest.raises(ExecutorError, match="answers only sealfl's app"):
            check_run(other)


def test_polls_are_fast_right_after_a_task_and_slow_when_idle():
    p = Polling(fast_s=0.01, idle_s=0.5, slope=0.05)
    assert poll_interval(0.0, p) == 0.01           # a campaign's next message is near
    assert poll_interval(2.0, p) == pytest.approx(0.1)
    assert poll_interval(3600.0, p) == 0.5          # an idle partner: twice a second
    assert poll_interval(-5.0, p) == 0.01           # a clock that went back: still the fast interval
    assert generic_interval(4.0, 0.02, 1.0, 0.5) == 1.0 and generic_interval(0.01, 0.02, 1.0, 0.5) == 0.02


def test_the_superexec_secret_must_be_long_random_bytes():
    for bad in (b"", b"short", "a string of 32 characters.......", None):
        with pytest.raises(ExecutorError, match="at least 16 random bytes"):
            PartnerExecutor("127.0.0.1:9", bad)


def test_the_executor_keeps_asking_a_supernode_that_is_not_up_yet_and_stops_when_told():
    """Nothing listens on the port (a SuperNode still starting): no crash, retries, a clean stop,
    and no warning (every 'partner start' begins so)."""
    import logging
    import socket
    import time

    levels: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda r: levels.append(r.levelname) if "not answering" in r.getMessage() else None
    logger = logging.getLogger("sealfl.clients.executor")
    old_level, old_disabled = logger.level, logger.disabled
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.disabled = False

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing answers there
    ex = PartnerExecutor(f"127.0.0.1:{port}", b"k" * 32).start()
    time.sleep(0.5)
    deadline = time.monotonic() + 20
    while not levels and time.monotonic() < deadline:  # the first try (flwr's imports first) can take a while
        time.sleep(0.05)
    assert ex._thread.is_alive() and ex.served == 0
    ex.stop(timeout_s=10)
    logger.removeHandler(handler)
    logger.setLevel(old_level)
    logger.disabled = old_disabled
    assert not ex._thread.is_alive()
    assert levels == ["INFO"]


def _status_error(code: int):
    import httpx

    req = httpx.Request("POST", "http://127.0.0.1:9/v1/runtime/pull-task-input")
    return httpx.HTTPStatusError(f"HTTP {code}", request=req, response=httpx.Response(code, request=req))


def test_task_calls_retry_a_busy_supernode_a_few_times_and_never_signal_the_partner(monkeypatch):
    """Flower's own invoker sends its process SIGINT on HTTP 401 and retries forever; the
    partner process must do neither."""
    import os
    import signal

    from sealfl.clients.executor import TASK_CALL_TRIES, retry_invoker

    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    calls = []

    def unauthorized():
        calls.append(401)
        raise _status_error(401)

    with pytest.raises(Exception, match="HTTP 401"):
        retry_invoker(TASK_CALL_TRIES).invoke(unauthorized)
    assert calls == [401] and not killed  # given up at once, no SIGINT
    busy = []

    def unavailable():
        busy.append(503)
        raise _status_error(503)

    with pytest.raises(Exception, match="HTTP 503"):
        retry_invoker(3).invoke(unavailable)
    assert busy == [503] * 3 and not killed and signal.SIGINT not in [s for _, s in killed]

