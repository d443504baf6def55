"""Replies handed to the aggregator as they arrive, so checking and adding overlap the
partners still working.

Flower's ``Grid.send_and_receive`` (flwr 1.42: ``InMemoryGrid`` and the deployment grid)
pushes a round's messages, then collects *every* reply in a list before it returns, so
the aggregator starts checking and adding ciphertexts only after the slowest partner
answered. :class:`StreamingGrid` wraps a Grid:
its ``send_and_receive`` pushes the messages at once (``Grid.push_messages``) and
returns a :class:`ReplyStream` that pulls (``Grid.pull_messages``) only while it is
iterated and yields each reply as soon as a pull returns it. :class:`EncryptedFedAvg
<sealfl.server.strategy.EncryptedFedAvg>` screens and adds every reply inside that
iteration (:func:`sealfl.server.intake.screen`), so by the time the last partner answers,
the others' ciphertexts are already checked and added into the running sum.

The stream keeps Flower's semantics: it ends when every pushed message has a reply or
``timeout`` seconds after the push (``None``: no limit; at 0 it still pulls once, where
Flower's loop does not pull at all), and between the end of one pull and the next it
waits :data:`PULL_FAST_S` right after the push or a reply, then longer the longer no reply
came (and past the interval below, :data:`PULL_LONG_FRACTION` of the quiet time, at most
:data:`PULL_LONG_MAX_S`), up to the wrapped grid's interval (``InMemoryGrid.pull_interval``, 0.1 s) or, for a
grid that has none (flwr 1.42's deployment grid, ``HttpGrid``, which sleeps a fixed 3 s
between pulls in its own ``send_and_receive``: ``flwr/superlink/grid/http_grid.py`` line
412), :data:`DEFAULT_PULL_INTERVAL_S`, counting the aggregator's own work on the replies
towards it, and never sleeps past the deadline. The wrapped grid needs Flower's ``push_messages`` and
``pull_messages`` (every ``flwr.serverapp.Grid`` has them; so does the tests' FakeGrid).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

from sealfl.common.seconds import MAX_SECONDS, is_seconds, poll_interval
from sealfl.server.errors import ReplyStreamError

log = logging.getLogger(__name__)

#: the longest wait between pulls for a grid that does not say (the deployment grid). Flower's
#: own loop waits 3 s (:data:`FLOWER_PULL_INTERVAL_S`), which a reply arriving just after a
#: pull waited in full; a pull is one small request to the SuperLink, so 0.2 s
DEFAULT_PULL_INTERVAL_S = 0.2
#: the first wait after the push or a reply (seconds); the wait then grows by
#: :data:`PULL_SLOPE` seconds per second without a reply, up to the grid's interval
#: (:func:`sealfl.common.seconds.poll_interval`): replies that come close together are
#: picked up within milliseconds, a long round costs a pull every interval
PULL_FAST_S = 0.02
PULL_SLOPE = 0.1
#: past the grid's interval, a stream quiet for long waits this fraction of the quiet time, up
#: to :data:`PULL_LONG_MAX_S`: a reply after t quiet seconds is picked up within ~1 % of t (a
#: LoRA round's 140-s training: ~320 pulls of the SuperLink instead of ~710, each one request
#: and its SQL there)
PULL_LONG_FRACTION = 0.01
PULL_LONG_MAX_S = 2.0
#: flwr 1.42 ``HttpGrid.send_and_receive``'s fixed sleep between pulls
FLOWER_PULL_INTERVAL_S = 3.0


def pull_wait(quiet_s: float, interval_s: float) -> float:
    """Seconds between the end of one pull and the next, ``quiet_s`` seconds after the push or
    the last reply, for a grid whose interval is ``interval_s``: from :data:`PULL_FAST_S` (or the
    interval, if shorter) up by :data:`PULL_SLOPE` per second to the interval
    (:func:`sealfl.common.seconds.poll_interval`), and past it :data:`PULL_LONG_FRACTION` of
    the quiet time, at most :data:`PULL_LONG_MAX_S`. Pure."""
    return max(poll_interval(quiet_s, min(PULL_FAST_S, interval_s), interval_s, PULL_SLOPE),
               min(quiet_s * PULL_LONG_FRACTION, PULL_LONG_MAX_S))


def check_times(timeout: Any, interval_s: Any) -> None:
    """Raises ValueError unless ``timeout`` is None or a number of seconds in [0, 1e6]
    and ``interval_s`` one in (0, 1e6] (:func:`sealfl.common.seconds.is_seconds`)."""
    if timeout is not None and not is_seconds(timeout, zero_ok=True):
        raise ReplyStreamError(f"timeout must be None or a number of seconds in [0, {MAX_SECONDS:g}], got {timeout!r}")
    if not is_seconds(interval_s):
        raise ReplyStreamError(f"the pull interval must be a number of seconds in (0, {MAX_SECONDS:g}], got {interval_s!r}")


class ReplyStream:
    """The replies to one round's pushed messages, pulled while iterated (once).

    A reply that reaches the SuperLink before the deadline is returned even when the
    consumer was busy past it: the deadline is looked at before each pull, and once it
    passed there is one last pull, without a sleep.

    Attributes:
        waited_s: seconds spent inside iteration waiting for replies (pulls and the sleeps
            between them), as opposed to time the consumer spent on the replies it was given.
        waited_after_last_s: the part of ``waited_s`` after the last reply arrived (e.g.
            waiting for a partner that never answers).
        last_arrival: ``time.perf_counter()`` when the last reply was pulled (None before).
        received: replies yielded so far.
        pending: message ids still without a reply.
    Raises:
        ValueError: a ``timeout`` or ``interval_s`` that :func:`check_times` refuses.
    """

    def __init__(self, grid: Any, message_ids: Iterable[str], timeout: float | None, interval_s: float):
        check_times(timeout, interval_s)
        self._grid = grid
        self.pending = set(message_ids)
        self._deadline = None if timeout is None else time.monotonic() + float(timeout)
        self._interval = float(interval_s)
        self._event = time.monotonic()  # the push, then each reply
        self._started = False
        self.waited_s = 0.0
        self.waited_after_last_s = 0.0
        self.last_arrival: float | None = None
        self.received = 0

    def __iter__(self) -> Iterator[Any]:
        if self._started:
            raise ReplyStreamError("a ReplyStream can be iterated only once")
        self._started = True
        return self._pull()

    def _wait(self, seconds: float) -> None:
        self.waited_s += seconds
        self.waited_after_last_s += seconds

    def _pull(self) -> Iterator[Any]:
        while self.pending:
            last_pull = self._deadline is not None and time.monotonic() >= self._deadline
            t0 = time.perf_counter()
            got = list(self._grid.pull_messages(self.pending))
            # every pulled reply is yielded, also one that answers no pending id: the
            # consumer (intake.screen) names and refuses it
            self.pending.difference_update(m.metadata.reply_to_message_id for m in got)
            pulled = time.perf_counter()
            self._wait(pulled - t0)
            if got:
                self.last_arrival = pulled
                self.waited_after_last_s = 0.0
                self._event = time.monotonic()
            for msg in got:
                self.received += 1
                yield msg
            got = []
            if not self.pending:
                return
            if last_pull:
                log.debug("reply stream: %d message(s) unanswered at the timeout", len(self.pending))
                return
            if self._deadline is not None and time.monotonic() >= self._deadline:
                continue  # the consumer's work reached the deadline: one last pull, now
            # an interval between the end of one pull and the next (the consumer's time counts
            # towards it), and no sleep past the deadline: the last pull comes right at it
            t0 = time.perf_counter()
            wait = pull_wait(time.monotonic() - self._event, self._interval)
            pause = wait - (t0 - pulled)
            if self._deadline is not None:
                pause = min(pause, self._deadline - time.monotonic())
            time.sleep(max(0.0, pause))
            self._wait(time.perf_counter() - t0)


class StreamingGrid:
    """A Flower Grid whose ``send_and_receive`` returns a :class:`ReplyStream`; every
    other attribute is the wrapped grid's. The objects of a reply that races them are
    retried after milliseconds, not Flower's 1 s (:mod:`sealfl.common.flwr_retries`, on the
    wrapped grid's module: flwr 1.42's deployment grid, ``http_grid``).

    Args:
        grid: the Grid the ServerApp was given.
        interval_s: seconds between pulls; default: the grid's ``pull_interval`` if it has
            one (``InMemoryGrid``), else :data:`DEFAULT_PULL_INTERVAL_S`.
    """

    def __init__(self, grid: Any, interval_s: float | None = None):
        import sys

        from sealfl.common.flwr_retries import shorten_object_retries

        module = sys.modules.get(type(grid).__module__)
        if module is not None and hasattr(module, "pull_objects"):  # the deployment grid pulls reply objects
            shorten_object_retries(module)
        self.inner = grid
        self.interval_s = float(interval_s if interval_s is not None
                                else getattr(grid, "pull_interval", DEFAULT_PULL_INTERVAL_S))

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy/pickle build the object without __init__)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def send_and_receive(self, messages: Iterable[Any], *, timeout: float | None = None) -> Iterable[Any]:
        """Push ``messages`` now; return their replies as a :class:`ReplyStream`.
        Raises ValueError (nothing pushed) for a timeout :func:`check_times` refuses."""
        check_times(timeout, self.interval_s)  # before anything is pushed
        ids = list(self.inner.push_messages(messages))
        del messages
        return ReplyStream(self.inner, ids, timeout, self.interval_s)


def aggregate_timing(replies: Iterable, t0: float) -> dict[str, float]:
    """Seconds of a round's aggregation begun at ``time.perf_counter()`` = ``t0``, for the
    round log: ``aggregate_seconds`` (checking and adding, without the waits for replies
    of a :class:`~sealfl.server.streaming.ReplyStream`) and ``aggregate_after_last_reply_seconds``
    (from the last reply's arrival -- or ``t0``, for replies that all came at once -- to now,
    without waits for partners that never answered: the part no partner's work overlaps)."""
    now = time.perf_counter()
    waited = float(getattr(replies, "waited_s", 0.0))
    last = getattr(replies, "last_arrival", None)
    if last is None or last <= t0:  # nothing arrived in the stream, or a list: all came at once
        last, waited_after = t0, waited
    else:
        waited_after = float(getattr(replies, "waited_after_last_s", 0.0))
    # never below 0 (a stream partly read before t0 would count waits that t0 does not span)
    return {"aggregate_seconds": max(0.0, now - t0 - waited),
            "aggregate_after_last_reply_seconds": max(0.0, now - last - waited_after)}
