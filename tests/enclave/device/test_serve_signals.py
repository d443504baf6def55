"""A signal always stops ``device serve``'s loop (sealfl.enclave.device.serve.server): the
first raises in the main thread, and every one is recorded and looked at by the loop at
least every WAKE_S seconds, so a stop whose raised exception was lost still ends it."""

from __future__ import annotations

import queue
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from sealfl.enclave.device.serve import server as srv


def _state(*items):
    q: queue.Queue = queue.Queue()
    for it in items:
        q.put(it)
    return SimpleNamespace(restarts=q)


def test_a_recorded_signal_stops_the_loop_before_anything_else():
    with pytest.raises(srv._Stop) as stop:
        srv._next_restart(_state("slot"), [signal.SIGTERM], None)
    assert stop.value.signum == signal.SIGTERM


def test_the_next_dead_slot_or_none_at_the_poll_time():
    assert srv._next_restart(_state("slot"), [], None) == "slot"
    t0 = time.monotonic()
    assert srv._next_restart(_state(), [], 0.3) is None
    assert 0.25 <= time.monotonic() - t0 < srv.WAKE_S + 0.3


@pytest.mark.timeout(30)
def test_a_signal_whose_exception_was_lost_still_ends_a_wait_without_limit():
    got: list[int] = []
    threading.Timer(0.3, got.append, args=(signal.SIGTERM,)).start()  # recorded, nothing raised
    t0 = time.monotonic()
    with pytest.raises(srv._Stop):
        srv._next_restart(_state(), got, None)  # no dead slot will ever come
    assert time.monotonic() - t0 < 0.3 + srv.WAKE_S + 1.0


def test_the_first_signal_raises_and_later_ones_are_only_recorded():
    with srv._signals_raise() as got:
        with pytest.raises(srv._Stop):
            signal.raise_signal(signal.SIGTERM)
            time.sleep(1)  # the handler runs here at the latest
        signal.raise_signal(signal.SIGTERM)  # during the shutdown: recorded, not raised
        time.sleep(0.01)
    assert got == [signal.SIGTERM, signal.SIGTERM]
