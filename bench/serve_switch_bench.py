"""``device serve --repo --poll``: switching releases under 4 streaming clients (issue 21).

A real repository (``sealfl repo``'s library, served on loopback), ``sealfl device serve``
in a child process with the tiny causal LM of the tests (``tests/support/llm_tiny.py``: the
same runtime, sandbox and verification as SmolLM2, seconds to build), 2 slots and a queue
of 8, four clients streaming chat completions back to back. After a steady phase, version
2 is published; the server verifies it, runs its canary, starts and warms its slots and
switches. Figures (``bench/results/serve_switch.json``):

* ``serve.switch_failed_requests``: requests that failed at any time (target 0);
* ``serve.switch_ttft_p99_ratio``: p99 time to first token of requests that started while
  the switch was under way (publish -> the first answer from v2, + 1 s) over the p99 of the
  steady phase before it, in the same run (target <= 2). On 2 cores the new release's
  verification, canary and warm-up compete with generation for the CPU.

Run: ``.venv/bin/python bench/serve_switch_bench.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tiny model lives with the tests' helpers

STEADY_S = 8.0
AFTER_S = 4.0
CLIENTS = 4


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]


def main() -> int:
    import httpx
    import openai

    from sealfl.platform.repo.server import RepoServer
    from tests.support.llm_tiny import write_tiny_release
    from tests.support.tufrepo import make_repo, provision_trust, publish_verified

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        root = tmp / "llm"
        enclave, payload, metadata = write_tiny_release(root)
        repo = make_repo(tmp)
        provision_trust(root / "trust", repo)
        publish_verified(repo, root / "trust", root / "release")
        with RepoServer(repo.www) as mirror:
            port_file = tmp / "port"
            log = open(tmp / "serve.log", "wb")
            proc = subprocess.Popen([sys.executable, "-m", "sealfl.platform.cli", "device", "serve", "--trust",
                                     str(root / "trust"), "--release", str(root / "release"), "--state",
                                     str(tmp / "state"), "--port", "0", "--port-file", str(port_file), "--tee", "sim",
                                     "--max-concurrent", "2", "--queue", "8", "--repo", mirror.url, "--poll", "0.5"],
                                    stdout=log, stderr=log, env={**os.environ, "PYTHONPATH": str(ROOT)})
            try:
                while not (port_file.exists() and port_file.read_text().strip()):
                    time.sleep(0.05)
                url = f"http://127.0.0.1:{int(port_file.read_text())}"
                while True:
                    try:
                        if httpx.get(url + "/health", timeout=30).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.1)
                client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
                records: list[dict] = []
                stop = threading.Event()

                def run(i: int) -> None:
                    n = 0
                    while not stop.is_set():
                        t0 = time.perf_counter()
                        rec = {"start": t0, "ttft": None, "fp": None, "error": None}
                        try:
                            for chunk in client.chat.completions.create(
                                    model="tiny-llm", messages=[{"role": "user", "content": "What is a list?"}],
                                    max_tokens=24, seed=i * 1000 + n, stream=True):
                                if chunk.choices and chunk.choices[0].delta.content and rec["ttft"] is None:
                                    rec["ttft"] = time.perf_counter() - t0
                                rec["fp"] = chunk.system_fingerprint
                        except Exception as exc:  # noqa: BLE001 -- counted
                            rec["error"] = repr(exc)[:300]
                        rec["end"] = time.perf_counter()
                        records.append(rec)
                        n += 1

                threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
                for t in threads:
                    t.start()
                time.sleep(STEADY_S)
                enclave.write_release(root / "release-v2", payload, "tiny-llm", 2, metadata)
                t_publish = time.perf_counter()
                publish_verified(repo, root / "trust", root / "release-v2")
                while not any((r["fp"] or "").startswith("v2-") for r in list(records)):
                    time.sleep(0.05)
                t_switched = min(r["start"] for r in records if (r["fp"] or "").startswith("v2-"))
                time.sleep(AFTER_S)
                stop.set()
                for t in threads:
                    t.join(timeout=120)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
                log.close()
    failed = [r for r in records if r["error"]]  # an answer without text (EOS first) is not a failure
    t_start = min(r["start"] for r in records)
    before = [r["ttft"] for r in records if r["ttft"] is not None and t_start + 2.0 <= r["start"] < t_publish]
    during = [r["ttft"] for r in records if r["ttft"] is not None and t_publish <= r["start"] <= t_switched + 1.0]
    out = {"clients": CLIENTS, "slots": 2, "queue": 8, "requests": len(records), "failed": len(failed),
           "empty_answers": sum(1 for r in records if not r["error"] and r["ttft"] is None),
           "failures": [r["error"] for r in failed][:5], "switch_seconds": t_switched - t_publish,
           "ttft_p99_before_s": _p99(before), "ttft_p99_during_s": _p99(during) if during else None,
           "n_before": len(before), "n_during": len(during)}
    ratio = out["ttft_p99_during_s"] / out["ttft_p99_before_s"] if during else None
    out["summary"] = {"serve.switch_failed_requests": len(failed), "serve.switch_ttft_p99_ratio": ratio}
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "serve_switch.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'requests':28} {len(records)}\n{'failed':28} {len(failed)}\n"
          f"{'switch (publish -> v2) s':28} {out['switch_seconds']:.2f}\n"
          f"{'TTFT p99 before s':28} {out['ttft_p99_before_s']:.4f} (n={len(before)})\n"
          f"{'TTFT p99 during switch s':28} {out['ttft_p99_during_s'] or float('nan'):.4f} (n={len(during)})\n"
          f"{'ratio (target <= 2)':28} {ratio if ratio is not None else float('nan'):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
