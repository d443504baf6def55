"""Signed deltas (issue 21 item 7): patch bytes over full release bytes, and device update
time from a patch over from the full release, for two consecutive releases of one campaign.

Heart (the default task): a consortium, a 2-round encrypted campaign and the same campaign
with one more round (3 rounds, same seeds), released as v1 and v2 by the release enclave;
``sealfl release delta`` from v1 to v2. A real TUF repository (``sealfl repo``'s library)
serves v2 and the delta on loopback; fresh devices booted on v1 update to v2, alternately
with the delta (``prefer_delta``) and without (the full release), REPS times each.

LLM (``--llm llm-out``; the target's own case): ``llm-out/`` from ``make llm-demo`` holds a
3-round SmolLM2 LoRA campaign and its release v1. The same campaign with one more round
(same consortium, seeds and settings, read from the first campaign's ``server_config.json``)
runs into ``llm-out/campaign-next`` (kept: a later run reuses it once finished) and is
released as v2 (``llm-out/release-next``); then the same delta and update measurement. The
heart figures already in ``delta.json`` are kept; the LLM ones go under ``llm``.

Figures (``bench/results/delta.json``, targets of issue 21): ``delta.patch_over_full``
(<= 0.15) and ``delta.update_time_ratio`` (median delta update / median full update,
<= 0.5), both measured in the same run; with ``--llm`` also ``delta.llm_patch_over_full``
and ``delta.llm_update_time_ratio`` (the targets are stated for LLM releases).

Run: ``.venv/bin/python bench/delta_bench.py [--llm llm-out]``.
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
#: the paced link of the LLM run's second measurement (Mbit/s): a typical edge uplink
LINK_MBIT = 100.0


class _Link:
    """A repository server whose file bodies leave at ``mbit`` megabits per second (64 KiB
    chunks, paced against the wall clock): the device's link, for the figures beside the
    loopback ones. Bench-only: wraps :class:`sealfl.platform.repo.server.RepoServer`'s handler."""

    def __init__(self, www: Path, mbit: float):
        import functools

        from sealfl.platform.repo.server import RepoServer, _Handler

        rate = mbit * 1e6 / 8  # bytes per second

        class Paced(_Handler):
            def copyfile(self, source, outputfile):
                t0, sent = time.monotonic(), 0
                while chunk := source.read(1 << 16):
                    outputfile.write(chunk)
                    sent += len(chunk)
                    ahead = sent / rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)

        self.server = RepoServer(www)
        self.server._httpd.RequestHandlerClass = functools.partial(Paced, directory=str(Path(www).resolve()))
        self.url = self.server.url

    def __enter__(self):
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop()


def _make_delta(cons_dir: Path, v1: Path, v2: Path, out: Path) -> tuple[object, float]:
    """``release delta`` v1 -> v2 into ``out`` with the consortium's release enclave; its
    summary and the seconds it took."""
    from sealfl.platform.delta import delta_for_consortium

    t0 = time.perf_counter()
    summary = delta_for_consortium(cons_dir, v1, v2, out)
    return summary, time.perf_counter() - t0


def _measure(cons_dir: Path, v1: Path, v2: Path, delta: Path, summary, make_s: float, work: Path, task: str,
             rounds: list[int], link_mbit: float | None = None) -> dict:
    """v2 and its signed delta from v1 (``delta``, made by :func:`_make_delta`) on a real TUF
    repository served on loopback (at ``link_mbit`` Mbit/s when given, else unpaced); REPS
    fresh devices (sim TEE) booted on v1 update alternately through the delta and the full
    release. Returns the figures (bytes, seconds per update)."""
    from sealfl.attestation.repo_index import TUF_ROOT_FILE
    from sealfl.enclave.device.boot import boot
    from sealfl.enclave.device.delta import delta_files, read_delta_statement
    from sealfl.enclave.device.update import update
    from sealfl.enclave.device.verify import verify_dir
    from sealfl.platform.repo.repository import Repository
    from sealfl.platform.repo.server import RepoServer

    work.mkdir(parents=True, exist_ok=True)
    trust = work / "trust"
    shutil.copytree(cons_dir / "trust", trust)
    repo = Repository.init(work / "repo", work / "offline")
    (trust / TUF_ROOT_FILE).write_bytes(repo.root_bytes(1))
    rel = verify_dir(trust, v2)
    repo.publish(rel.files(), rel.name, rel.version, rel.root_digest)
    st = read_delta_statement(trust, delta)
    repo.publish_delta(delta_files(delta, st), st.name, st.version, st.root_digest, st.base_root_digest)
    times: dict[str, list[float]] = {"delta": [], "full": []}
    with (RepoServer(repo.www) if link_mbit is None else _Link(repo.www, link_mbit)) as server:
        for i in range(REPS):
            for via in ("delta", "full"):
                state = work / f"dev-{via}-{i}"
                boot(trust, v1, state, backend="sim").close()
                t0 = time.perf_counter()
                res = update(trust, server.url, state, prefer_delta=via == "delta")
                times[via].append(time.perf_counter() - t0)
                if (res.action, res.via) != ("installed", via):
                    raise SystemExit(f"update {via}: {res.action} via {res.via} ({res.delta_refused})")
                shutil.rmtree(state, ignore_errors=True)  # an LLM device state holds two releases
    d_med, f_med = statistics.median(times["delta"]), statistics.median(times["full"])
    return {"task": task, "rounds": rounds, "link_mbit": link_mbit, "patch_bytes": summary.patch_bytes, "full_bytes": summary.full_bytes,
            "patched_files": list(summary.patched), "make_delta_s": make_s,
            "files": {f.name: {"bytes": f.length, "patch_bytes": f.patch_length,
                               "patched_from": "base" if f.source else "empty"} for f in st.files},
            "update_s": times, "update_median_s": {"delta": d_med, "full": f_med}}


def heart(work: Path) -> dict:
    """Two heart campaigns of one consortium (ROUNDS and ROUNDS + 1 rounds, same seeds), each
    released (v1, v2), then :func:`_measure`."""
    from sealfl.clients.heart.data import HOSPITALS
    from sealfl.platform.campaign import CampaignSpec, run_campaign
    from sealfl.platform.consortium import create_consortium
    from sealfl.platform.release import provision_release_enclave, release

    cons, codec = create_consortium(work / "c", "heart", list(HOSPITALS))
    provision_release_enclave(cons, codec.secret_context_bytes())
    del codec
    for v, rounds in ((1, ROUNDS), (2, ROUNDS + 1)):
        run_campaign(CampaignSpec(str(cons.dir), str(work / f"camp{v}"), rounds=rounds))
        release(cons.dir, work / f"camp{v}", work / f"v{v}", version=v, max_drop=1.0)
    summary, make_s = _make_delta(cons.dir, work / "v1", work / "v2", work / "delta")
    return _measure(cons.dir, work / "v1", work / "v2", work / "delta", summary, make_s, work, "heart",
                    [ROUNDS, ROUNDS + 1])


def llm(demo: Path, work: Path) -> dict:
    """The LLM demo's campaign with one more round (its own settings: rounds, local steps,
    evaluation blocks, seed), released as v2 beside the demo's v1, then :func:`_measure`.

    Raises:
        SystemExit: ``demo`` holds no finished LLM demo (campaign, release), or v1's version
            is not 1.
    """
    from sealfl.platform.campaign import CampaignSpec, run_campaign
    from sealfl.platform.release import release
    from sealfl.server.bookkeeping import CampaignDir

    first, v1, cons_dir = demo / "campaign", demo / "release", demo / "consortium"
    for need in (first / "status.json", first / "server_config.json", v1 / "manifest.json", cons_dir):
        if not need.exists():
            raise SystemExit(f"{need} is missing: run `make llm-demo` first (it writes {demo}/)")
    done = CampaignDir(first).read_status()
    if done.get("status") != "finished":
        raise SystemExit(f"{first} is not a finished campaign ({done.get('status')}): run `make llm-demo` again")
    cfg = json.loads((first / "server_config.json").read_text())
    train = cfg["train"]
    rounds = int(cfg["num_rounds"])
    nxt, v2 = demo / "campaign-next", demo / "release-next"
    if not (nxt / "status.json").exists() or CampaignDir(nxt).read_status().get("status") != "finished" \
            or int(json.loads((nxt / "server_config.json").read_text())["num_rounds"]) != rounds + 1:
        print(f"campaign: {rounds + 1} rounds into {nxt} (the demo's {rounds} and one more) ...", flush=True)
        run_campaign(CampaignSpec(str(cons_dir), str(nxt), rounds=rounds + 1, local_epochs=int(train["local-steps"]),
                                  lr=float(train["lr"]), batch_size=int(train["batch-size"]), seed=int(train["seed"]),
                                  timeout_s=float(cfg["timeout_s"]), overwrite=True,
                                  extra={"eval-blocks": int(train["eval-blocks"])}))
    if not (v2 / "manifest.json").exists():
        print(f"release: v2 of {nxt} into {v2} ...", flush=True)
        release(cons_dir, nxt, v2, version=2)
    same = [r["train_loss"] for r in CampaignDir(first).rounds()] == \
        [r["train_loss"] for r in CampaignDir(nxt).rounds()][:rounds]
    summary, make_s = _make_delta(cons_dir, v1, v2, work / "delta")  # HDiffPatch over ~300 MB: minutes
    out = _measure(cons_dir, v1, v2, work / "delta", summary, make_s, work / "loopback", "causal-lm",
                   [rounds, rounds + 1])
    out["first_rounds_equal"] = same  # the longer campaign repeats the demo's rounds (same seeds)
    # the same two updates over a device's link: on loopback the download is nearly free and
    # both paths cost the same verification, canary and boot
    out["paced"] = _measure(cons_dir, v1, v2, work / "delta", summary, make_s, work / "paced", "causal-lm",
                            [rounds, rounds + 1], link_mbit=LINK_MBIT)
    return out


def _summary(doc: dict) -> dict:
    """The figures ``bench/run_all.py`` collects, from the heart part (the document itself)
    and the LLM part (``doc["llm"]``, when measured)."""
    out = {}
    for prefix, part in (("delta.", doc), ("delta.llm_", doc.get("llm"))):
        if isinstance(part, dict) and "patch_bytes" in part:
            out[prefix + "patch_over_full"] = part["patch_bytes"] / part["full_bytes"]
            times = part["update_s"]
            out[prefix + "update_time_ratio"] = statistics.median(times["delta"]) / statistics.median(times["full"])
            paced = part.get("paced")
            if isinstance(paced, dict):  # the same over a paced link (no target: loopback is the target's)
                t = paced["update_s"]
                out[f"{prefix}update_time_ratio_{paced['link_mbit']:g}mbit"] = \
                    statistics.median(t["delta"]) / statistics.median(t["full"])
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", type=Path, metavar="DIR",
                    help="measure the LLM demo's releases instead: DIR is `make llm-demo`'s output (llm-out)")
    args = ap.parse_args(argv)
    path = RESULTS / "delta.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    work = Path(tempfile.mkdtemp(prefix="sealfl-delta-bench-"))
    try:
        if args.llm:
            part = llm(args.llm.resolve(), work)
            doc = {**old, "llm": part}
        else:
            part = heart(work)
            doc = {**part, "llm": old.get("llm") if isinstance(old.get("llm"), dict) else
                   "not measured: run `bench/delta_bench.py --llm llm-out` after `make llm-demo`"}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc["summary"] = _summary(doc)
    doc["targets"] = {"delta.patch_over_full": 0.15, "delta.update_time_ratio": 0.5,
                      "delta.llm_patch_over_full": 0.15, "delta.llm_update_time_ratio": 0.5}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'figure':36} {'value':>10} {'target':>8}")
    for k, v in doc["summary"].items():
        print(f"{k:36} {v:10.3f} {doc['targets'].get(k, '-'):>8}")
    med = part["update_median_s"]
    print(f"{part['task']}: patch {part['patch_bytes']:,} B / full {part['full_bytes']:,} B; update median delta "
          f"{med['delta']:.2f} s, full {med['full']:.2f} s over {REPS} runs each (loopback)")
    if isinstance(part.get("paced"), dict):
        med = part["paced"]["update_median_s"]
        print(f"  at {LINK_MBIT:g} Mbit/s: update median delta {med['delta']:.2f} s, full {med['full']:.2f} s")


if __name__ == "__main__":
    sys.exit(main())
