"""``python -m sealfl.platform.supernode_main ARGS``: Flower's own ``flower-supernode``, with
shorter fixed waits.

``sealfl partner start`` runs the SuperNode through this module: it replaces, in Flower's
module only, the fixed sleeps of the SuperNode's message loop and then calls Flower's
``flower-supernode`` entry point (``flwr.supernode.cli.flower_supernode:flower_supernode``)
with the same arguments. Everything else -- TLS, node authentication, the SuperLink
protocol, the per-message ``flwr-clientapp`` process -- is Flower's, unchanged.

The waits (flwr 1.42.0, ``flwr/supernode/start_client_internal.py``):

- line 263, in ``start_client_internal``: ``time.sleep(3)`` after a pull from the
  SuperLink that returned no message. A message pushed just after an empty pull waited up
  to 3 s before the partner saw it; here :data:`IDLE_PULL_S`;
- lines 470 and 506, in ``_push_messages``: ``time.sleep(0.5)`` between two looks at the
  node's own state for the ClientApp's reply (and for its objects). A reply waited up to
  0.5 s in the SuperNode before it was pushed; here :data:`REPLY_POLL_S`.

How: that module's global ``time`` is replaced by a :class:`Waits` object whose ``sleep``
maps exactly these durations (:data:`FLWR_WAITS`) and passes any other through; every other
attribute is the real :mod:`time`'s. :func:`patch` checks first that the module still has
those sleeps (its source), so a Flower upgrade that moves them fails loudly here (and in
``tests/platform/test_supernode_main.py``) instead of silently keeping Flower's waits.

Cost: an idle SuperNode pulls every :data:`IDLE_PULL_S` seconds instead of every 3 s (one
small HTTPS request to the SuperLink each time).
"""

from __future__ import annotations

import inspect
import logging
import sys
import time as _time
from collections.abc import Callable, Mapping
from types import ModuleType

from sealfl.platform.errors import DeploymentError

__all__ = ["IDLE_PULL_S", "REPLY_POLL_S", "FLWR_WAITS", "Waits", "patch", "main"]

log = logging.getLogger(__name__)

#: seconds between two pulls of an idle SuperNode (Flower 1.42: 3 s); a message waits half of
#: it on average before its partner sees it, and every idle SuperNode costs the SuperLink
#: 1 / IDLE_PULL_S requests a second
IDLE_PULL_S = 0.5
#: seconds between two looks for the ClientApp's reply in the SuperNode (Flower 1.42: 0.5 s)
REPLY_POLL_S = 0.05
#: Flower's sleep (seconds) -> ours, and the function of start_client_internal.py that sleeps it
FLWR_WAITS: Mapping[float, float] = {3: IDLE_PULL_S, 0.5: REPLY_POLL_S}
_WHERE = {3: ("start_client_internal", "time.sleep(3)"), 0.5: ("_push_messages", "time.sleep(0.5)")}


class Waits:
    """Stands in for the :mod:`time` module inside one Flower module: ``sleep(s)`` sleeps
    ``waits[s]`` when ``s`` is one of Flower's fixed waits, else ``s``; every other
    attribute is :mod:`time`'s.

    Args:
        waits: Flower's duration -> ours (seconds).
        sleep: the real sleep (tests pass a recorder).
    """

    def __init__(self, waits: Mapping[float, float], sleep: Callable[[float], None] = _time.sleep):
        self.waits = dict(waits)
        self._sleep = sleep

    def sleep(self, seconds: float) -> None:
        self._sleep(self.waits.get(seconds, seconds))

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
    for seconds, (func, call) in _WHERE.items():
        try:
            source = inspect.getsource(getattr(module, func))
        except (AttributeError, OSError, TypeError) as exc:
            raise DeploymentError(f"{module.__name__}.{func} is gone or unreadable ({exc}); flwr changed: "
                                  "update sealfl.platform.supernode_main") from exc
        if call not in source:
            raise DeploymentError(f"{module.__name__}.{func} no longer calls {call} (flwr changed): update "
                                  "sealfl.platform.supernode_main")
    return module


def patch(module: ModuleType | None = None, waits: Mapping[float, float] = FLWR_WAITS,
          sleep: Callable[[float], None] = _time.sleep) -> Waits:
    """Replace the fixed waits of Flower's SuperNode loop (module docstring); returns the
    :class:`Waits` installed. Raises DeploymentError if Flower no longer has them."""
    module = check_flower(module)
    shim = Waits(waits, sleep)
    module.time = shim
    log.debug("flwr SuperNode waits: %s", dict(waits))
    return shim


def main(argv: list[str] | None = None) -> None:
    """Patch, then run Flower's ``flower-supernode`` with ``argv`` (default: ``sys.argv[1:]``)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        patch()
    except DeploymentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from flwr.supernode.cli.flower_supernode import flower_supernode

    sys.argv = ["flower-supernode", *args]
    flower_supernode()


if __name__ == "__main__":
    main()
