"""Measure ``device boot`` wall time with the ``tpm`` backend (a swtpm started here on a free
loopback port, stopped by its pid) vs ``sim``, on a release directory (the demo's heart
release). Each repetition is a full boot of the recorded release (``boot_last_good``:
TEE open + PCR reset, measurement, event log, verification, sandbox start, health check,
canary, floor check/raise) after one recording boot.

    python bench/device_boot_tee.py --trust demo-out/consortium/trust --release demo-out/release-v1 [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.support.swtpm


def _time_boots(trust: Path, release: Path, state: Path, backend: str, reps: int) -> list[float]:
    from sealfl.enclave.device.boot import boot, boot_last_good
    from sealfl.enclave.device.provision import provision

    provision(state, backend)
    t0 = time.perf_counter()
    boot(trust, release, state).close()
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        with boot_last_good(trust, state):
            pass
        times.append(time.perf_counter() - t0)
    return [first] + times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trust", type=Path, required=True)
    ap.add_argument("--release", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from sealfl.enclave.tee.tpm import TCTI_ENV
    from tests.support.swtpm import SwTPM

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sim = _time_boots(args.trust, args.release, tmp / "sim", "sim", args.reps)
        tpm_proc = SwTPM(tmp / "swtpm")
        try:
            os.environ[TCTI_ENV] = tpm_proc.tcti
            tpm = _time_boots(args.trust, args.release, tmp / "tpm", "tpm", args.reps)
        finally:
            tpm_proc.stop()
    for name, t in (("sim", sim), ("tpm", tpm)):
        print(f"{name}: first boot (records) {t[0]:.3f} s; re-boot median {statistics.median(t[1:]):.3f} s "
              f"(min {min(t[1:]):.3f}, max {max(t[1:]):.3f}, n={len(t) - 1})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
