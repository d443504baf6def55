"""sealfl.common.procs.memory_status / reset_peak_rss: the coordinator RSS figures of
bench/scale.py are read this way (VmRSS, VmHWM of /proc/PID/status; clear_refs 5)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from sealfl.common.procs import memory_status, reset_peak_rss

MiB = 1 << 20


def test_the_peak_is_reset_to_the_current_rss_after_a_large_allocation_is_freed():
    block = np.ones(200 * MiB // 8)  # touched: 200 MiB resident
    peak = memory_status()["VmHWM"]
    del block
    now = memory_status()
    assert peak - now["VmRSS"] > 150 * MiB  # the block was returned to the OS, the peak remembers it
    assert reset_peak_rss() is True
    after = memory_status()
    assert after["VmHWM"] < peak - 150 * MiB and after["VmHWM"] >= after["VmRSS"]


def test_another_process_is_read_by_pid_and_a_gone_one_gives_nothing():
    p = subprocess.Popen([sys.executable, "-c", "import sys, time; b = bytearray(64 << 20); sys.stdout.write('x');"
                          "sys.stdout.flush(); time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        assert p.stdout.read(1) == b"x"
        st = memory_status(p.pid)
        assert st["VmHWM"] >= st["VmRSS"] > 60 * MiB
    finally:
        p.kill()
        p.wait()
    assert memory_status(p.pid) == {}
    assert reset_peak_rss(p.pid) is False
