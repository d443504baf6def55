"""StreamingGrid / ReplyStream: a round's replies reach the aggregator while later ones are
still outstanding, with Flower's end conditions (all answered, or the timeout).

The grid here is a real subclass of flwr's ``Grid`` ABC whose replies become available on
a script (the i-th pull releases what the script says), so each test knows exactly what a
pull can return; the real InMemoryGrid path runs in every Ray campaign test."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest

from sealfl.server import streaming
from sealfl.server.errors import ReplyStreamError
from sealfl.server.streaming import DEFAULT_PULL_INTERVAL_S, StreamingGrid, aggregate_timing
from tests.support.fakegrid import StubGrid


def _reply(msg_id: str, tag: str):
    return SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=msg_id), tag=tag)


class ScriptedGrid(StubGrid):
    """``release[k]``: the message ids whose replies become available at the k-th pull
    (counted from 0); each reply is returned once, as flwr's grids delete what they return."""

    def __init__(self, release: dict[int, list[str]], pull_interval: float | None = None):
        self.release = release
        self.pulls = 0
        self.events: list[str] = []
        self.pushed: list = []
        self._ready: dict[str, object] = {}
        if pull_interval is not None:
            self.pull_interval = pull_interval

    def get_node_ids(self):
        return [1, 2, 3]

    def send_and_receive(self, messages, *, timeout=None):  # pragma: no cover - the wrapper must not call it
        raise AssertionError("StreamingGrid called the wrapped send_and_receive")

    def push_messages(self, messages):
        self.pushed = list(messages)
        self.events.append("push")
        return [m for m in self.pushed]

    def pull_messages(self, message_ids):
        wanted = set(message_ids)
        for mid in self.release.get(self.pulls, []):
            self._ready[mid] = _reply(mid, f"reply-{mid}")
        self.events.append(f"pull{self.pulls}")
        self.pulls += 1
        out = [self._ready.pop(m) for m in list(self._ready) if m in wanted]
        return out


def test_kind_each_reply_reaches_the_consumer_before_later_ones_exist():
    grid = ScriptedGrid({0: ["a"], 2: ["b"], 4: ["c"]}, pull_interval=0.001)
    stream = StreamingGrid(grid).send_and_receive(["a", "b", "c"], timeout=10)
    assert grid.events == ["push"]  # pushed at once, nothing pulled before iteration
    for reply in stream:
        grid.events.append(f"got {reply.tag}")
    assert grid.events == ["push", "pull0", "got reply-a", "pull1", "pull2", "got reply-b", "pull3", "pull4",
                           "got reply-c"]  # and no pull after the last reply
    assert stream.received == 3 and not stream.pending


def test_kind_the_stream_ends_at_the_timeout_with_what_came():
    grid = ScriptedGrid({0: ["a"]}, pull_interval=0.01)
    t0 = time.monotonic()
    stream = StreamingGrid(grid).send_and_receive(["a", "b"], timeout=0.3)
    got = [r.tag for r in stream]
    took = time.monotonic() - t0
    assert got == ["reply-a"] and stream.pending == {"b"}
    assert 0.3 <= took < 5.0
    # never more often than the grid's interval allows (here 0.01 s, below PULL_FAST_S: the interval wins)
    assert 2 <= grid.pulls <= 0.3 / min(streaming.PULL_FAST_S, 0.01) + 2


def test_kind_pulls_are_fast_right_after_the_push_and_slow_down_to_the_interval():
    """The wait before a pull is clamp(time since the push or the last reply x PULL_SLOPE,
    PULL_FAST_S, interval): a reply that comes soon after the push is picked up within
    milliseconds, a quiet stream costs one pull per interval."""
    grid = ScriptedGrid({}, pull_interval=0.2)
    stream = StreamingGrid(grid).send_and_receive(["a"], timeout=3.0)
    t0 = time.monotonic()
    assert [r for r in stream] == []
    took = time.monotonic() - t0
    first_s = 0.2 / streaming.PULL_SLOPE  # the waits reach the interval after 2 s quiet
    # the first 2 s: ~ (1/PULL_SLOPE) ln(2 s / 0.05 s) + 10 fast pulls; then one per 0.2 s
    fast = 10 + (1 / streaming.PULL_SLOPE) * math.log(first_s / (streaming.PULL_FAST_S / streaming.PULL_SLOPE))
    assert took >= 3.0
    assert grid.pulls >= 3.0 / 0.2 + 10  # fast at first (a fixed 0.2 s would make 15)
    assert grid.pulls <= fast + (took - first_s) / 0.2 + 3  # ... and no faster than the schedule


def test_kind_waits_are_counted_apart_from_the_consumers_time():
    grid = ScriptedGrid({0: ["a"], 5: ["b"]}, pull_interval=0.02)
    stream = StreamingGrid(grid).send_and_receive(["a", "b"], timeout=10)
    t0 = time.perf_counter()
    for _ in stream:
        time.sleep(0.2)  # the consumer's own work
    total = time.perf_counter() - t0
    # 5 pulls after the first: at least ~4 intervals waited; the consumer's 0.4 s is not a wait
    assert stream.waited_s >= 4 * 0.02 * 0.5
    assert stream.waited_s <= total - 0.4 + 0.01
    # ... and a pull follows the consumer's time without a further full interval
    assert stream.last_arrival is not None and stream.last_arrival > t0
    timing = aggregate_timing(stream, t0)
    assert timing["aggregate_seconds"] == pytest.approx(total - stream.waited_s, abs=0.05)
    assert timing["aggregate_after_last_reply_seconds"] >= 0.2 - 0.01  # the consumer's work on the last reply


def test_kind_a_list_of_replies_counts_all_its_time_as_aggregation():
    t0 = time.perf_counter()
    time.sleep(0.05)
    timing = aggregate_timing([_reply("a", "x")], t0)
    assert timing["aggregate_seconds"] >= 0.05 and timing["aggregate_after_last_reply_seconds"] >= 0.05


def test_kind_a_stream_is_iterated_once():
    grid = ScriptedGrid({0: ["a"]}, pull_interval=0.001)
    stream = StreamingGrid(grid).send_and_receive(["a"], timeout=1)
    list(stream)
    with pytest.raises(ReplyStreamError, match="only once"):
        iter(stream)


def test_kind_pull_cadence_follows_the_wrapped_grid():
    assert StreamingGrid(ScriptedGrid({}, pull_interval=0.25)).interval_s == 0.25
    # a grid without pull_interval (flwr's deployment grid): sealfl's cadence, not Flower's fixed 3 s
    assert StreamingGrid(ScriptedGrid({})).interval_s == DEFAULT_PULL_INTERVAL_S == 0.2
    assert StreamingGrid(ScriptedGrid({}), interval_s=0.5).interval_s == 0.5


def test_everything_but_send_and_receive_is_the_wrapped_grids():
    inner = ScriptedGrid({}, pull_interval=0.5)
    g = StreamingGrid(inner)
    assert g.get_node_ids() == [1, 2, 3] and g.pull_interval == 0.5 and g.inner is inner


class SlowConsumerGrid(ScriptedGrid):
    """Replies become available at fixed times after the push (seconds), whatever the pulls."""

    def __init__(self, at: dict[str, float], pull_interval: float):
        super().__init__({}, pull_interval)
        self.at = at
        self.done: set[str] = set()

    def push_messages(self, messages):
        self.t_push = time.monotonic()
        return super().push_messages(messages)

    def pull_messages(self, message_ids):
        now = time.monotonic() - self.t_push
        for mid, t in self.at.items():
            if t <= now and mid not in self._ready and mid not in self.done:
                self._ready[mid] = _reply(mid, f"reply-{mid}")
        self.pulls += 1
        out = [self._ready.pop(m) for m in list(self._ready) if m in set(message_ids)]
        self.done.update(r.metadata.reply_to_message_id for r in out)
        return out


def test_kind_replies_that_came_in_time_are_taken_though_the_consumer_was_busy_past_the_deadline():
    """Flower's send_and_receive keeps pulling until the deadline; the stream's consumer may be
    busy across it. Replies that reached the grid before the deadline are still returned."""
    grid = SlowConsumerGrid({"a": 0.0, "b": 0.1, "c": 0.2}, pull_interval=0.02)
    stream = StreamingGrid(grid).send_and_receive(["a", "b", "c"], timeout=0.5)
    got = []
    for r in stream:
        got.append(r.tag)
        if r.tag == "reply-a":
            time.sleep(0.7)  # past the deadline; b and c arrived meanwhile
    assert sorted(got) == ["reply-a", "reply-b", "reply-c"] and not stream.pending


def test_kind_a_partner_that_never_answers_is_not_counted_as_aggregation():
    grid = ScriptedGrid({0: ["a", "b"]}, pull_interval=0.01)
    t0 = time.perf_counter()
    stream = StreamingGrid(grid).send_and_receive(["a", "b", "never"], timeout=0.3)
    for _ in stream:
        time.sleep(0.02)
    timing = aggregate_timing(stream, t0)
    assert stream.pending == {"never"} and stream.waited_after_last_s >= 0.2
    # the consumer spent ~0.04 s; the 0.3 s timeout is waiting, not aggregation
    assert timing["aggregate_seconds"] < 0.15 and timing["aggregate_after_last_reply_seconds"] < 0.15


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, "5"])
def test_kind_a_timeout_that_is_not_a_finite_number_of_seconds_is_refused(timeout):
    grid = ScriptedGrid({}, pull_interval=0.01)
    with pytest.raises(ValueError, match="timeout"):
        StreamingGrid(grid).send_and_receive(["a"], timeout=timeout)
    assert grid.events == []  # refused before anything was pushed


def test_kind_a_wrapper_can_be_copied():
    import copy
    import pickle

    g = StreamingGrid(ScriptedGrid({}, pull_interval=0.5))
    assert copy.copy(g).interval_s == 0.5 and copy.deepcopy(g).get_node_ids() == [1, 2, 3]
    assert pickle.loads(pickle.dumps(g)).interval_s == 0.5


class SlowPullGrid(ScriptedGrid):
    """Each pull takes ``pull_s`` seconds (a deployment grid downloading replies); records
    when each pull starts and ends."""

    def __init__(self, pull_s: float, pull_interval: float):
        super().__init__({}, pull_interval)
        self.pull_s, self.spans = pull_s, []

    def pull_messages(self, message_ids):
        t0 = time.monotonic()
        time.sleep(self.pull_s)
        self.spans.append((t0, time.monotonic()))
        return super().pull_messages(message_ids)


def test_kind_a_slow_pull_is_still_followed_by_a_full_interval():
    grid = SlowPullGrid(pull_s=0.06, pull_interval=0.05)
    list(StreamingGrid(grid).send_and_receive(["never"], timeout=1.0))
    pushed = grid.spans[0][0]  # ~ the push: the first pull comes at once
    gaps = [(b[0] - a[1], a[1] - pushed) for a, b in zip(grid.spans, grid.spans[1:-1])]  # the last may be at the deadline
    # after each slow pull a whole wait of the schedule, however long the pull took
    assert gaps and all(gap >= 0.9 * min(0.05, max(streaming.PULL_FAST_S, since * streaming.PULL_SLOPE))
                        for gap, since in gaps)
    assert max(g for g, _ in gaps) >= 0.05 * 0.9  # the schedule reaches the grid's interval


def test_kind_the_stream_does_not_sleep_past_the_deadline():
    grid = ScriptedGrid({}, pull_interval=3.0)  # flwr's deployment cadence
    t0 = time.monotonic()
    stream = StreamingGrid(grid).send_and_receive(["never"], timeout=0.2)
    assert list(stream) == [] and stream.pending == {"never"}
    assert time.monotonic() - t0 < 2.0  # not the 3 s interval
    # fast pulls at first (the schedule), the last one at the deadline, none after it
    assert 2 <= grid.pulls <= 0.2 / streaming.PULL_FAST_S + 2


def test_numpy_numbers_are_timeouts_too():
    import numpy as np

    for t in (np.int64(1), np.float32(0.5), np.float64(0.5)):
        list(StreamingGrid(ScriptedGrid({0: ["a"]}, pull_interval=0.01)).send_and_receive(["a"], timeout=t))


def test_kind_a_long_quiet_stream_waits_a_hundredth_of_its_quiet_time_between_pulls():
    """A LoRA round's partners train for minutes: the deployment grid (0.2 s) is then pulled
    every ~1 % of the quiet time (at most 2 s), not every 0.2 s; short rounds are unchanged."""
    from sealfl.server.streaming import pull_wait

    assert pull_wait(0.0, 0.2) == streaming.PULL_FAST_S
    assert pull_wait(1.0, 0.2) == pytest.approx(0.1) and pull_wait(5.0, 0.2) == 0.2  # heart: as before
    assert pull_wait(20.0, 0.2) == pytest.approx(0.2) and pull_wait(140.0, 0.2) == pytest.approx(1.4)
    assert pull_wait(1e5, 0.2) == streaming.PULL_LONG_MAX_S
    assert pull_wait(0.0, 0.001) == 0.001 and pull_wait(1e3, 5.0) == 5.0  # a grid's own interval still bounds
    before = sum(1 for _ in _walk(140.0, lambda t: streaming.poll_interval(t, streaming.PULL_FAST_S, 0.2,
                                                                           streaming.PULL_SLOPE)))
    now = sum(1 for _ in _walk(140.0, lambda t: pull_wait(t, 0.2)))
    assert before > 680 and now < before / 2, (before, now)  # a 140-s quiet stream: ~320 pulls, not ~710


def _walk(total_s: float, wait):
    t = 0.0
    while t < total_s:
        t += wait(t)
        yield t
