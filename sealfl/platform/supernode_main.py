"""``python -m sealfl.platform.supernode_main [--heartbeat-interval S] ARGS``: Flower's own
``flower-supernode``, with shorter fixed waits and, optionally, another heartbeat interval.

``sealfl partner start`` runs the SuperNode through this module: it replaces, in Flower's
module only, the fixed sleeps of the SuperNode's message loop and then calls Flower's
``flower-supernode`` entry point (``flwr.supernode.cli.flower_supernode:flower_supernode``)
with the same arguments. Everything else -- TLS, node authentication, the SuperLink
protocol, the Runtime API the partner's executor takes its tasks from -- is Flower's,
unchanged.

The waits (flwr 1.42.0, ``flwr/supernode/start_client_internal.py``):

- line 263, in ``start_client_internal``: ``time.sleep(3)`` after a pull from the
  SuperLink that returned no message. A message pushed just after an empty pull waited up
  to 3 s before the partner saw it. Here the wait follows the node's activity
  (:func:`pull_interval`): :data:`PULL_FAST_S` right after a message (a campaign's next
  round is near), growing by :data:`PULL_SLOPE` seconds per second without one, up to
  :data:`PULL_IDLE_S`. The time of the last message is noted by wrapping that module's
  ``_pull_and_store_message`` (it returns the message's run id, or None);
- lines 470 and 506, in ``_push_messages``: ``time.sleep(0.5)`` between two looks at the
  node's own in-memory state for the ClientApp's reply (and for its objects). A reply waited
  up to 0.5 s in the SuperNode before it was pushed; here :data:`REPLY_POLL_S` right after a
  message, slowing with the time since it (:func:`reply_interval`) to Flower's 0.5 s. (The
  thread that runs ``_push_messages`` looks all the time, busy or idle: at a fixed 5 ms that
  was 200 wake-ups a second per SuperNode through every partner's training);
- ``pull_objects``'s first retry of a message object the SuperLink does not hold yet: 1 s,
  here 5 ms (:mod:`sealfl.common.flwr_retries`).

How: that module's global ``time`` is replaced by a :class:`Waits` object whose ``sleep``
maps exactly these durations and passes any other through; every other attribute is the
real :mod:`time`'s. :func:`patch` checks first that the module still has those sleeps and
that function (its source), so a Flower upgrade that moves them fails loudly here (and in
``tests/platform/test_supernode_main.py``) instead of silently keeping Flower's waits.

Cost: while a campaign runs, a SuperNode pulls every :data:`PULL_FAST_S` s at first (one
small HTTPS request to the SuperLink each time); an idle one every :data:`PULL_IDLE_S` s
(Flower: 3 s).

Heartbeat (``--heartbeat-interval S``, taken off the arguments before Flower sees them; Flower
1.42 has no flag for it): the SuperNode declares ``HEARTBEAT_DEFAULT_INTERVAL`` (30 s) to the
SuperLink when it activates and in each heartbeat, and sends one every ``(interval - 5 s) x
0.7..0.9``; the SuperLink lists the node offline ``HEARTBEAT_PATIENCE`` (2) intervals after
the last one (``flwr/common/constant.py``, ``flwr/supercore/heartbeat.py``,
``flwr/supernode/fleet_http_connection.py``, ``sql_linkstate.py``). :func:`set_heartbeat`
replaces that constant in the two SuperNode-side modules only (the SuperLink's bounds
``HEARTBEAT_MIN_INTERVAL``..``HEARTBEAT_MAX_INTERVAL``, 10..1800 s, are checked first), so with
``S`` = 10 a SuperNode that dies is offline after at most 20 s instead of 60 s -- and until then
a restarted SuperNode with the same key is refused. Cost: one small heartbeat request every
~4 s instead of every ~20 s.
"""

from __future__ import annotations

import inspect
import logging
import sys
import time as _time
from collections.abc import Callable
from types import ModuleType

from sealfl.common import seconds
from sealfl.common.flwr_retries import shorten_object_retries
from sealfl.platform.errors import DeploymentError

__all__ = ["PULL_FAST_S", "PULL_IDLE_S", "PULL_SLOPE", "REPLY_POLL_S", "REPLY_SLOPE", "REPLY_IDLE_S", "HEARTBEAT_ARG",
           "Waits", "pull_interval", "reply_interval", "patch",
           "heartbeat_bounds",
           "set_heartbeat", "split_heartbeat", "main"]

log = logging.getLogger(__name__)

#: seconds between two pulls right after a message (Flower 1.42: 3 s always)
PULL_FAST_S = 0.05
#: seconds between two pulls of a SuperNode idle for ``PULL_IDLE_S / PULL_SLOPE`` s or more;
#: a message pushed then waits half of it on average before its partner sees it
PULL_IDLE_S = 1.0
#: seconds of pull interval per second without a message (0.05: 0.5 s after 10 s)
PULL_SLOPE = 0.05
#: seconds between two looks for the ClientApp's reply in the SuperNode right after a message
#: (Flower 1.42: 0.5 s always); the look then slows by :data:`REPLY_SLOPE` seconds per second
#: since the message, up to :data:`REPLY_IDLE_S`: a reply waits at most ~1 % of the time its
#: partner took (a LoRA round's 140 s: 0.5 s at most, 2 looks a second instead of 200)
REPLY_POLL_S = 0.005
REPLY_SLOPE = 0.01
REPLY_IDLE_S = 0.5
#: Flower's fixed sleeps (seconds), and the function of start_client_internal.py that sleeps each
IDLE_WAIT, REPLY_WAIT = 3, 0.5
_WHERE = {IDLE_WAIT: ("start_client_internal", "time.sleep(3)"), REPLY_WAIT: ("_push_messages", "time.sleep(0.5)")}
#: the function whose result says a message came (its run id) or none (None)
_PULL_FN = "_pull_and_store_message"
#: the launcher's own option (seconds); removed from the arguments before Flower parses them
HEARTBEAT_ARG = "--heartbeat-interval"
#: module -> what its source must contain for the heartbeat constant to be the one it uses
_HEARTBEAT_USES = {"flwr.supernode.fleet_http_connection": "heartbeat_interval=HEARTBEAT_DEFAULT_INTERVAL",
                   "flwr.supercore.heartbeat": "HEARTBEAT_DEFAULT_INTERVAL - HEARTBEAT_CALL_TIMEOUT"}


def pull_interval(idle_for_s: float, fast_s: float = PULL_FAST_S, idle_s: float = PULL_IDLE_S,
                  slope: float = PULL_SLOPE) -> float:
    """Seconds before the next pull from the SuperLink, ``idle_for_s`` seconds after the last
    message: ``clamp(idle_for_s * slope, fast_s, idle_s)`` (:func:`sealfl.common.seconds.poll_interval`). Pure."""
    return seconds.poll_interval(idle_for_s, fast_s, idle_s, slope)


def reply_interval(since_message_s: float, fast_s: float = REPLY_POLL_S, idle_s: float = REPLY_IDLE_S,
                   slope: float = REPLY_SLOPE) -> float:
    """Seconds before the next look for the ClientApp's reply, ``since_message_s`` seconds after
    the node last pulled a message: ``clamp(since_message_s * slope, fast_s, idle_s)``. A reply
    that took the partner t seconds is pushed within ``max(fast_s, slope * t)`` of it; an idle
    node (its reply thread looks all the time) looks every ``idle_s``. Pure."""
    return seconds.poll_interval(since_message_s, fast_s, idle_s, slope)


class Waits:
    """Stands in for the :mod:`time` module inside Flower's SuperNode module: ``sleep(3)`` (an
    empty pull) sleeps :func:`pull_interval` of the time since :meth:`note_message` was last
    called, ``sleep(0.5)`` (the reply poll) sleeps :func:`reply_interval` of that time from
    ``reply_s`` on, any other duration is slept as asked; every other attribute is :mod:`time`'s.

    Args:
        reply_s: the reply poll (seconds).
        interval: ``idle_for_s -> seconds`` for the idle pull (default :func:`pull_interval`).
        sleep: the real sleep (tests pass a recorder); clock: the monotonic clock (tests pass one).
    """

    def __init__(self, reply_s: float = REPLY_POLL_S, interval: Callable[[float], float] = pull_interval,
                 sleep: Callable[[float], None] = _time.sleep, clock: Callable[[], float] = _time.monotonic):
        self.reply_s = reply_s
        self._interval = interval
        self._sleep = sleep
        self._clock = clock
        self._last_message = clock()

    def note_message(self) -> None:
        """A message came from the SuperLink just now."""
        self._last_message = self._clock()

    def sleep(self, seconds: float) -> None:
        if seconds == IDLE_WAIT:
            seconds = self._interval(self._clock() - self._last_message)
        elif seconds == REPLY_WAIT:
            seconds = reply_interval(self._clock() - self._last_message, self.reply_s)
        self._sleep(seconds)

    def __getattr__(self, name: str):
        return getattr(_time, name)


def _flower_module() -> ModuleType:
    from flwr.supernode import start_client_internal

    return start_client_internal


def check_flower(module: ModuleType | None = None) -> ModuleType:
    """The Flower module whose waits :func:`patch` replaces, after checking it still
    sleeps them: its global ``time`` is the :mod:`time` module (or already a :class:`Waits`)
    and each function of :data:`_WHERE` calls its ``time.sleep(...)``.

    Raises:
        DeploymentError: Flower changed (names the function and the call not found).
    """
    module = module or _flower_module()
    t = getattr(module, "time", None)
    if t is not _time and not isinstance(t, Waits):
        raise DeploymentError(f"{module.__name__} no longer imports time as a module global (flwr changed); "
                              "sealfl.platform.supernode_main cannot shorten its waits")
    for func, call in _WHERE.values():
        try:
            source = inspect.getsource(getattr(module, func))
        except (AttributeError, OSError, TypeError) as exc:
            raise DeploymentError(f"{module.__name__}.{func} is gone or unreadable ({exc}); flwr changed: "
                                  "update sealfl.platform.supernode_main") from exc
        if call not in source:
            raise DeploymentError(f"{module.__name__}.{func} no longer calls {call} (flwr changed): update "
                                  "sealfl.platform.supernode_main")
    if not callable(getattr(module, _PULL_FN, None)) or f"{_PULL_FN}(" not in inspect.getsource(
            module.start_client_internal):
        raise DeploymentError(f"{module.__name__}.{_PULL_FN} is gone or no longer called by start_client_internal "
                              "(flwr changed): update sealfl.platform.supernode_main")
    return module


def patch(module: ModuleType | None = None, sleep: Callable[[float], None] = _time.sleep,
          clock: Callable[[], float] = _time.monotonic) -> Waits:
    """Replace the fixed waits of Flower's SuperNode loop (module docstring) and note each
    message its pull function returns; returns the :class:`Waits` installed. Raises
    DeploymentError if Flower no longer has them."""
    module = check_flower(module)
    shim = Waits(sleep=sleep, clock=clock)
    pull = getattr(module, _PULL_FN)
    pull = getattr(pull, "__wrapped__", pull)

    def pull_and_note(*args, **kwargs):
        run_id = pull(*args, **kwargs)
        if run_id is not None:
            shim.note_message()
        return run_id

    pull_and_note.__wrapped__ = pull
    setattr(module, _PULL_FN, pull_and_note)
    module.time = shim
    try:
        shorten_object_retries(module)
    except AttributeError as exc:
        raise DeploymentError(f"{exc}: update sealfl.platform.supernode_main") from None
    log.debug("flwr SuperNode waits: pull %g..%g s, reply poll %g s", PULL_FAST_S, PULL_IDLE_S, REPLY_POLL_S)
    return shim


def heartbeat_bounds() -> tuple[float, float]:
    """The heartbeat intervals (seconds) Flower's SuperLink accepts: ``HEARTBEAT_MIN_INTERVAL``,
    ``HEARTBEAT_MAX_INTERVAL`` (flwr 1.42: 10, 1800; ``fleet_handlers._validate_heartbeat_interval``)."""
    from flwr.common import constant

    return float(constant.HEARTBEAT_MIN_INTERVAL), float(constant.HEARTBEAT_MAX_INTERVAL)


def set_heartbeat(interval_s: float, modules: dict[str, ModuleType] | None = None) -> None:
    """Make this process's SuperNode declare and keep ``interval_s`` seconds as its heartbeat
    interval (module docstring). ``modules``: the modules to patch by name (tests pass copies).

    Raises:
        DeploymentError: ``interval_s`` outside :func:`heartbeat_bounds`, or Flower no longer
            uses the constant where this expects it (nothing is patched then).
    """
    import importlib

    low, high = heartbeat_bounds()
    if not low <= float(interval_s) <= high:
        raise DeploymentError(f"{HEARTBEAT_ARG} {interval_s:g}: the SuperLink accepts {low:g} to {high:g} seconds")
    mods = modules or {name: importlib.import_module(name) for name in _HEARTBEAT_USES}
    for name, use in _HEARTBEAT_USES.items():
        mod = mods[name]
        try:
            source = inspect.getsource(mod)
        except (OSError, TypeError) as exc:
            raise DeploymentError(f"{name} is unreadable ({exc}); update sealfl.platform.supernode_main") from exc
        if not isinstance(getattr(mod, "HEARTBEAT_DEFAULT_INTERVAL", None), (int, float)) or use not in source:
            raise DeploymentError(f"{name} no longer uses HEARTBEAT_DEFAULT_INTERVAL as '{use}' (flwr changed): "
                                  "update sealfl.platform.supernode_main")
    for name in _HEARTBEAT_USES:
        mods[name].HEARTBEAT_DEFAULT_INTERVAL = float(interval_s)
    log.debug("flwr SuperNode heartbeat interval: %g s", interval_s)


def split_heartbeat(args: list[str]) -> tuple[float | None, list[str]]:
    """``[..., "--heartbeat-interval", "10", ...]`` -> ``(10.0, the other arguments)``;
    ``(None, args)`` without it. Raises DeploymentError for a missing or non-numeric value."""
    rest, value = [], None
    it = iter(args)
    for a in it:
        if a == HEARTBEAT_ARG or a.startswith(HEARTBEAT_ARG + "="):
            text = a.partition("=")[2] if "=" in a else next(it, "")
            try:
                value = float(text)
            except ValueError:
                raise DeploymentError(f"{HEARTBEAT_ARG} {text!r}: expected seconds") from None
        else:
            rest.append(a)
    return value, rest


def main(argv: list[str] | None = None) -> None:
    """Patch (and set the heartbeat interval if given), then run Flower's ``flower-supernode``
    with the other arguments of ``argv`` (default: ``sys.argv[1:]``); its log lines carry their
    time and no terminal colour codes."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        heartbeat, args = split_heartbeat(args)
        patch()
        if heartbeat is not None:
            set_heartbeat(heartbeat)
    except DeploymentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from flwr.supercore.logger import update_console_handler
    from flwr.supernode.cli.flower_supernode import flower_supernode

    update_console_handler(timestamps=True, colored=False)  # the log is a file: times, no ANSI colours
    sys.argv = ["flower-supernode", *args]
    flower_supernode()


if __name__ == "__main__":
    main()
