"""Replies handed to the aggregator as they arrive, so checking and adding overlap the
partners still working.

Flower's ``Grid.send_and_receive`` (flwr 1.42: ``InMemoryGrid`` and the deployment grid)
pushes a round's messages, then collects *every* reply in a list before it returns, so
the aggregator starts checking and adding ciphertexts only after the slowest partner
answered, and holds all replies in memory at once. :class:`StreamingGrid` wraps a Grid:
its ``send_and_receive`` pushes the messages at once (``Grid.push_messages``) and
returns a :class:`ReplyStream` that pulls (``Grid.pull_messages``) only while it is
iterated and yields each reply as soon as a pull returns it. :class:`EncryptedFedAvg
<sealfl.server.strategy.EncryptedFedAvg>` screens and adds every reply inside that
iteration (:func:`sealfl.server.intake.screen`), so by the time the last partner answers,
the others' ciphertexts are already checked and added into the running sum.

The stream keeps Flower's semantics: it ends when every pushed message has a reply or
``timeout`` seconds after the push (``None``: no limit), and it pulls at most as often as
the wrapped grid does (``InMemoryGrid.pull_interval``, 0.1 s; the deployment grid's 3 s
otherwise). A grid that is not a Flower ``Grid`` (a test double) is called as
it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

from flwr.serverapp import Grid

log = logging.getLogger(__name__)

#: seconds between pulls for a grid that does not say (flwr 1.42 ``GrpcGrid``/``HttpGrid``
#: sleep 3 s between pulls in their own ``send_and_receive``)
DEFAULT_PULL_INTERVAL_S = 3.0


class ReplyStream:
    """The replies to one round's pushed messages, pulled while iterated (once).

    Attributes:
        waited_s: seconds spent inside iteration waiting for replies (pulls that returned
            nothing new and the sleeps between them), as opposed to time the consumer spent
            on the replies it was given.
        last_arrival: ``time.perf_counter()`` when the last reply was pulled (None before).
        received: replies yielded so far.
        pending: message ids still without a reply.
    """

    def __init__(self, grid: Any, message_ids: Iterable[str], timeout: float | None, interval_s: float):
        self._grid = grid
        self.pending = set(message_ids)
        self._deadline = None if timeout is None else time.monotonic() + float(timeout)
        self._interval = float(interval_s)
        self._started = False
        self.waited_s = 0.0
        self.last_arrival: float | None = None
        self.received = 0

    def __iter__(self) -> Iterator[Any]:
        if self._started:
            raise RuntimeError("a ReplyStream can be iterated only once")
        self._started = True
        return self._pull()

    def _pull(self) -> Iterator[Any]:
        while self.pending:
            t0 = t_pull = time.perf_counter()
            got = list(self._grid.pull_messages(self.pending))
            # every pulled reply is yielded, also one that answers no pending id: the
            # consumer (intake.screen) names and refuses it
            self.pending.difference_update(m.metadata.reply_to_message_id for m in got)
            if got:
                self.last_arrival = time.perf_counter()
            self.waited_s += time.perf_counter() - t0
            for msg in got:
                self.received += 1
                yield msg
            del got
            if not self.pending:
                return
            if self._deadline is not None and time.monotonic() >= self._deadline:
                log.debug("reply stream: %d message(s) unanswered at the timeout", len(self.pending))
                return
            t0 = time.perf_counter()  # pull at most every interval, not interval + the consumer's time
            time.sleep(max(0.0, self._interval - (t0 - t_pull)))
            self.waited_s += time.perf_counter() - t0


class StreamingGrid:
    """A Flower Grid whose ``send_and_receive`` returns a :class:`ReplyStream`; every
    other attribute is the wrapped grid's.

    Args:
        grid: the Grid the ServerApp was given.
        interval_s: seconds between pulls; default: the grid's ``pull_interval`` if it has
            one (``InMemoryGrid``), else :data:`DEFAULT_PULL_INTERVAL_S`.
    """

    def __init__(self, grid: Any, interval_s: float | None = None):
        self.inner = grid
        self.interval_s = float(interval_s if interval_s is not None
                                else getattr(grid, "pull_interval", DEFAULT_PULL_INTERVAL_S))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send_and_receive(self, messages: Iterable[Any], *, timeout: float | None = None) -> Iterable[Any]:
        """Push ``messages`` now; return their replies as a :class:`ReplyStream` (a Flower
        ``Grid``) or as the wrapped object's own ``send_and_receive`` returns them."""
        if not isinstance(self.inner, Grid):
            return self.inner.send_and_receive(messages, timeout=timeout)
        ids = list(self.inner.push_messages(messages))
        del messages
        return ReplyStream(self.inner, ids, timeout, self.interval_s)
