"""One check for durations that come from settings or callers (timeouts, intervals)."""

from __future__ import annotations

import math
import numbers
from typing import Any

#: the longest duration sealfl accepts anywhere (seconds; ~11.6 days)
MAX_SECONDS = 1e6


def is_seconds(t: Any, *, zero_ok: bool = False, hi: float = MAX_SECONDS) -> bool:
    """True if ``t`` is a real number (numpy's too, not a bool) that is finite, > 0 (>= 0
    with ``zero_ok``) and <= ``hi`` seconds."""
    if isinstance(t, bool) or not isinstance(t, numbers.Real):
        return False
    try:
        t = float(t)
    except (OverflowError, ValueError):  # an int too large for a float
        return False
    return math.isfinite(t) and (t >= 0 if zero_ok else t > 0) and t <= hi


def poll_interval(quiet_for_s: float, fast_s: float, slow_s: float, slope: float) -> float:
    """Seconds to wait before the next poll of something that answers "nothing yet", when the
    last event (a message, a reply, a task) was ``quiet_for_s`` seconds ago:
    ``clamp(quiet_for_s * slope, fast_s, slow_s)``. Right after an event the next one is likely
    near (a campaign's next round), so the poll is fast; a quiet peer is polled ever less often,
    ``slow_s`` at the least. Pure; all arguments in seconds (``slope``: seconds per second)."""
    return min(slow_s, max(fast_s, quiet_for_s * slope))
