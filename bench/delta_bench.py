"""Signed deltas (issue 21 item 7): patch bytes over full release bytes, and device update
time from a patch over from the full release, for two consecutive releases of one campaign.

Heart (the default task): a consortium, a 2-round encrypted campaign and the same campaign
with one more round (3 rounds, same seeds), released as v1 and v2 by the release enclave;
``sealfl release delta`` from v1 to v2. A real TUF repository (``sealfl repo``'s library)
serves v2 and the delta on loopback; fresh devices booted on v1 update to v2, alternately
with the delta (``prefer_delta``) and without (the full release), REPS times each.

LLM releases are not measured here: they need ``llm-out/`` from ``make llm-demo`` (a
SmolLM2 LoRA campaign and its release, far longer than this script's budget); the
result's ``llm`` says so.

Figures (``bench/results/delta.json``, targets of issue 21): ``delta.patch_over_full``
(<= 0.15) and ``delta.update_time_ratio`` (median delta update / median full update,
<= 0.5), both measured in the same run.

Run: ``.venv/bin/python bench/delta_bench.py``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
REPS = 3
ROUNDS = 2


def main() -> None:
    from sealfl.attestation.repo_index import TUF_ROOT_FILE
    from sealfl.clients.heart.data import HOSPITALS
    from sealfl.enclave.device.boot import boot
    from sealfl.enclave.device.delta import delta_files, read_delta_statement
    from sealfl.enclave.device.update import update
    from sealfl.enclave.device.verify import verify_dir
    from sealfl.platform.campaign import CampaignSpec, run_campaign
    from sealfl.platform.consortium import create_consortium
    from sealfl.platform.delta import delta_for_consortium
    from sealfl.platform.release import provision_release_enclave, release, trust_dir
    from sealfl.platform.repo.repository import Repository
    from sealfl.platform.repo.server import RepoServer

    work = Path(tempfile.mkdtemp(prefix="sealfl-delta-bench-"))
    try:
        cons, codec = create_consortium(work / "c", "heart", list(HOSPITALS))
        provision_release_enclave(cons, codec.secret_context_bytes())
        del codec
        for v, rounds in ((1, ROUNDS), (2, ROUNDS + 1)):
            run_campaign(CampaignSpec(str(cons.dir), str(work / f"camp{v}"), rounds=rounds))
            release(cons.dir, work / f"camp{v}", work / f"v{v}", version=v, max_drop=1.0)
        t0 = time.perf_counter()
        summary = delta_for_consortium(cons.dir, work / "v1", work / "v2", work / "delta")
        make_s = time.perf_counter() - t0
        trust = work / "trust"
        shutil.copytree(trust_dir(cons), trust)
        repo = Repository.init(work / "repo", work / "offline")
        (trust / TUF_ROOT_FILE).write_bytes(repo.root_bytes(1))
        v2 = verify_dir(trust, work / "v2")
        repo.publish(v2.files(), v2.name, v2.version, v2.root_digest)
        st = read_delta_statement(trust, work / "delta")
        repo.publish_delta(delta_files(work / "delta", st), st.name, st.version, st.root_digest, st.base_root_digest)
        times: dict[str, list[float]] = {"delta": [], "full": []}
        with RepoServer(repo.www) as server:
            for i in range(REPS):
                for via in ("delta", "full"):
                    state = work / f"dev-{via}-{i}"
                    boot(trust, work / "v1", state, backend="sim").close()
                    t0 = time.perf_counter()
                    res = update(trust, server.url, state, prefer_delta=via == "delta")
                    times[via].append(time.perf_counter() - t0)
                    if (res.action, res.via) != ("installed", via):
                        raise SystemExit(f"update {via}: {res.action} via {res.via} ({res.delta_refused})")
        d_med, f_med = statistics.median(times["delta"]), statistics.median(times["full"])
        out = {"task": "heart", "rounds": [ROUNDS, ROUNDS + 1], "patch_bytes": summary.patch_bytes,
               "full_bytes": summary.full_bytes, "patched_files": list(summary.patched), "make_delta_s": make_s,
               "files": {f.name: {"bytes": f.length, "patch_bytes": f.patch_length,
                                  "patched_from": "base" if f.source else "empty"} for f in st.files},
               "update_s": times, "llm": "not measured: no llm-out/ here (needs `make llm-demo`)",
               "summary": {"delta.patch_over_full": summary.patch_bytes / summary.full_bytes,
                           "delta.update_time_ratio": d_med / f_med},
               "targets": {"delta.patch_over_full": 0.15, "delta.update_time_ratio": 0.5}}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "delta.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'figure':28} {'value':>10} {'target':>8}")
    for k, v in out["summary"].items():
        print(f"{k:28} {v:10.3f} {out['targets'][k]:>8}")
    print(f"patch {summary.patch_bytes} B / full {summary.full_bytes} B; update median delta {d_med:.2f} s, "
          f"full {f_med:.2f} s over {REPS} runs each")


if __name__ == "__main__":
    sys.exit(main())
