"""How many onnxruntime threads a sandboxed LLM child gets: the cores that are really free.

onnxruntime splits each operator of a decode step over its intra-op threads and waits for
the slowest: one thread preempted by another process stalls the whole step. Measured on
SmolLM2 INT4 (``bench/llm_step_profile.py``, 2 cores, both kept busy by other work, threads
alternating, medians): at load ~4, 14.3 ms per decode step on one thread vs 15.0 on two
(prefill of 128 tokens 0.37 vs 0.24 s); at load 3.4-5.9 with heavier neighbours, 21.6 vs
29.5 ms (prefill 0.50 vs 0.65 s). On a quiet box two threads are faster. So the default is
chosen from what is free when a runtime starts, never more than this process may use:

* **usable** cores: the process's CPU affinity (``sched_getaffinity``), capped by a cgroup
  v2 CPU quota (``/sys/fs/cgroup/cpu.max``: ``quota period`` -> ceil(quota / period));
* **busy** cores: the non-idle share of those CPUs over a short sample
  (:data:`SAMPLE_S`) of ``/proc/stat``'s per-CPU counters (``user nice system idle iowait
  irq softirq steal``; idle + iowait count as free), i.e. what everything else on the
  machine uses while this process waits;
* threads per runtime = ``max(1, min(usable // slots, round(usable - busy) // slots))``.

Spinning stays off (``session.intra_op.allow_spinning = 0`` in the child): a spinning
thread burns a core another process -- or another slot -- needs.

The choice is made once per runtime (an onnxruntime session cannot change its pool); an
explicit thread count (``LLMRuntime(intra_op_threads=...)``, ``device serve --threads``, the
environment variable :data:`THREADS_ENV`) overrides it. Thread count does not change outputs
(same kernels, same per-row reductions; checked by ``tests/enclave/sandbox/test_threads.py``).
"""

from __future__ import annotations

import logging
import math
import os
import time

__all__ = ["SAMPLE_S", "THREADS_ENV", "usable_cpus", "busy_cpus", "choose_threads"]

log = logging.getLogger(__name__)

#: seconds of /proc/stat sampling to estimate what other processes use
SAMPLE_S = 0.25
#: environment variable with a fixed thread count per runtime (overrides the policy)
THREADS_ENV = "SEALFL_LLM_THREADS"
_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def usable_cpus(cpu_max_path: str = _CPU_MAX) -> int:
    """CPUs this process may use: its affinity, capped by the cgroup v2 quota (>= 1)."""
    n = len(_affinity()) or 1
    try:
        with open(cpu_max_path) as fh:
            quota, period = fh.read().split()[:2]
        if quota != "max" and int(period) > 0:
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def _cpu_times(cpus: set[int], stat_path: str) -> tuple[int, int] | None:
    """(busy, total) jiffies summed over ``cpus`` from ``/proc/stat``, or None."""
    busy = total = 0
    seen = 0
    try:
        with open(stat_path) as fh:
            for line in fh:
                head, _, rest = line.partition(" ")
                if not head.startswith("cpu") or head == "cpu" or int(head[3:]) not in cpus:
                    continue
                v = [int(x) for x in rest.split()[:8]]
                idle = v[3] + v[4]
                total += sum(v)
                busy += sum(v) - idle
                seen += 1
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if seen else None


def busy_cpus(sample_s: float = SAMPLE_S, stat_path: str = "/proc/stat") -> float | None:
    """Cores of this process's affinity that other work kept busy over ``sample_s`` seconds
    (0.0 .. len(affinity)); None where ``/proc/stat`` cannot be read."""
    cpus = _affinity()
    a = _cpu_times(cpus, stat_path)
    time.sleep(sample_s)
    b = _cpu_times(cpus, stat_path)
    if a is None or b is None or b[1] <= a[1]:
        return None
    return len(cpus) * (b[0] - a[0]) / (b[1] - a[1])


def choose_threads(slots: int = 1, requested: int | None = None, *, busy: float | None = None,
                   usable: int | None = None) -> int:
    """Intra-op threads for one of ``slots`` runtimes (module docstring).

    Args:
        slots: runtimes that will decode at the same time (``device serve --max-concurrent``).
        requested: an explicit count (returned as is); else :data:`THREADS_ENV` if set to a
            positive integer; else the policy.
        busy, usable: the measured figures (tests; default: :func:`busy_cpus`,
            :func:`usable_cpus`).

    Returns:
        a thread count >= 1.
    """
    if requested:
        return int(requested)
    env = os.environ.get(THREADS_ENV, "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    slots = max(1, int(slots))
    usable = usable_cpus() if usable is None else usable
    busy = busy_cpus() if busy is None else busy
    per_slot = max(1, usable // slots)
    if busy is None:
        return per_slot
    free = max(0, round(usable - busy))
    n = max(1, min(per_slot, free // slots))
    log.info("onnxruntime threads per runtime: %d (%d usable cores, %.2f busy with other work, %d slot(s))",
             n, usable, busy, slots)
    return n
