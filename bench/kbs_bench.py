"""Key broker challenges: the cost of one challenge with 10,000 outstanding against the same
broker with 10 outstanding (issue 20: each challenge used to rebuild the nonce table under the
broker's lock -- 14 s for 10,000). Also the cost of refusing a flooding client (429).

Prints a table; writes ``bench/results/kbs.json`` (summary key ``kbs.challenge_cost_ratio_10000``:
microseconds per challenge at 10,000 outstanding / at 10 outstanding, target <= 2: O(1)).
Run: ``.venv/bin/python bench/kbs_bench.py``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from sealfl.attestation.eventlog import POLICY_SCHEMA, parse_policy
from sealfl.enclave.errors import KeyRequestRefused
from sealfl.enclave.keybroker.broker import ChallengeLimits, KeyBroker

OUT = Path(__file__).parent / "results" / "kbs.json"
_POLICY = {"schema": POLICY_SCHEMA, "backends": ["tpm"], "runtime_code": [], "config": [], "release_root": []}


def _broker() -> KeyBroker:
    limits = ChallengeLimits(ttl_s=3600, per_client=1_000_000, total=1_000_000, rate_per_s=1e9, burst=1_000_000,
                             max_clients=1_000_000)
    return KeyBroker(parse_policy(_POLICY), [], {}, limits=limits)


def _per_challenge_us(outstanding: int, probes: int = 2000, repeats: int = 5) -> float:
    """Median microseconds per challenge issued while ``outstanding`` are already held."""
    runs = []
    for _ in range(repeats):
        broker = _broker()
        for i in range(outstanding):
            broker.challenge(f"c{i % 512}")
        t0 = time.perf_counter()
        for i in range(probes):
            broker.challenge(f"p{i % 512}")
        runs.append((time.perf_counter() - t0) / probes * 1e6)
    return statistics.median(runs)


def _refusal_us(probes: int = 20000) -> float:
    broker = KeyBroker(parse_policy(_POLICY), [], {}, limits=ChallengeLimits())
    t0 = time.perf_counter()
    for _ in range(probes):
        try:
            broker.challenge("flooder")
        except KeyRequestRefused:
            pass
    return (time.perf_counter() - t0) / probes * 1e6


def main() -> None:
    low, high = _per_challenge_us(10), _per_challenge_us(10_000)
    refused = _refusal_us()
    rows = [("challenge, 10 outstanding", f"{low:.1f} us"), ("challenge, 10,000 outstanding", f"{high:.1f} us"),
            ("ratio", f"{high / low:.2f}"), ("refusing a flooding client (429)", f"{refused:.1f} us")]
    for name, value in rows:
        print(f"{name:36} {value:>12}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"us_per_challenge_10": low, "us_per_challenge_10000": high, "us_per_refusal": refused,
                               "summary": {"kbs.challenge_cost_ratio_10000": high / low}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
