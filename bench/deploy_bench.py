"""Benchmark: an encrypted heart round on Flower's deployment engine vs the same round in simulation.

One run, on this machine: a consortium of the 4 hospitals (packed BFV), a SuperLink
(``sealfl superlink start``: TLS, SuperNode authentication) and 4 SuperNodes (``sealfl partner
start``, each with its own kit) on 127.0.0.1, ``sealfl campaign run --superlink`` for
``--rounds`` rounds; then the same campaign (same seeds) in Flower's simulation engine
(``sealfl campaign run``). Per runtime: the median ``round_seconds`` over the rounds after the
first, and the ciphertext bytes the aggregator received per partner per round. Against the
deployment run, the bytes Flower's SuperLink counted (``flwr ls`` network traffic: inbound,
i.e. every reply including the statistics round and the last round's evaluation) per partner
per message round (a campaign sends one train message per partner per round, each carrying
the previous round's evaluation, plus one evaluate message after the last round).

Run: ``.venv/bin/python bench/deploy_bench.py [--rounds 4]`` (~3 min here). Prints a table and
writes ``bench/results/deploy.json``. Ratios are of two runtimes in the same run; the
absolute seconds depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "deploy.json"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sealfl(args, out: Path, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    fh = open(out, "wb")
    try:
        return subprocess.Popen([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)], stdout=fh, stderr=fh,
                                stdin=subprocess.DEVNULL, env=env, **kw)
    finally:
        fh.close()


def _rounds(d: Path) -> list[dict]:
    return [json.loads(line) for line in (d / "rounds.jsonl").read_text().splitlines() if line.strip()]


def _median_round(rounds: list[dict]) -> float:
    later = [r["round_seconds"] for r in rounds[1:]] or [r["round_seconds"] for r in rounds]
    return statistics.median(later)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    from sealfl.clients.heart.data import HOSPITALS
    from sealfl.clients.kit import kit_dir
    from sealfl.platform import flwr_cli
    from sealfl.platform.consortium import create_consortium

    work = Path(tempfile.mkdtemp(prefix="sealfl-deploy-bench-"))
    cons, _ = create_consortium(work / "c", "heart", list(HOSPITALS))
    port = _port()
    procs = [_sealfl(["superlink", "start", cons.dir / "superlink", "--port", port, "--state", work / "sl"],
                     work / "superlink.out")]
    try:
        t0 = time.monotonic()
        while "SuperLink on" not in (work / "superlink.out").read_text():
            if procs[0].poll() is not None or time.monotonic() - t0 > 900:  # registering 4 keys took minutes when loaded
                raise SystemExit(f"the SuperLink did not start: {(work / 'superlink.out').read_text()}")
            time.sleep(0.5)
        for p in HOSPITALS:
            procs.append(_sealfl(["partner", "start", kit_dir(cons.dir, p), "--superlink", f"127.0.0.1:{port}", "--log",
                                  work / f"sn-{kit_dir(cons.dir, p).name}.log"], work / f"partner-{p}.out"))
        home = work / "sl" / "flwr-home"
        while sum(n.get("status") == "online"
                  for n in flwr_cli.flwr_json(["supernode", "ls", flwr_cli.CONNECTION], home, timeout_s=300).get("nodes", [])) < 4:
            if time.monotonic() - t0 > 900:  # generous: on a loaded 2-core box importing flwr alone took ~1 min
                raise SystemExit("4 SuperNodes did not come online")
            time.sleep(1)
        dep = _sealfl(["campaign", "run", "-c", cons.dir, "--out", work / "deployed", "--rounds", args.rounds,
                       "--superlink", f"127.0.0.1:{port}"], work / "deployed.out")
        if dep.wait() != 0:
            raise SystemExit((work / "deployed.out").read_text())
        run_id = json.loads((work / "deployed" / "status.json").read_text())["deployment"]["run_id"]
        traffic = flwr_cli.flwr_json(["ls", flwr_cli.CONNECTION, "--run-id", str(run_id)], home, timeout_s=300)["runs"][0]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait()
    sim = _sealfl(["campaign", "run", "-c", cons.dir, "--out", work / "simulated", "--rounds", args.rounds],
                  work / "simulated.out")
    if sim.wait() != 0:
        raise SystemExit((work / "simulated.out").read_text())
    d_rounds, s_rounds = _rounds(work / "deployed"), _rounds(work / "simulated")
    d_med, s_med = _median_round(d_rounds), _median_round(s_rounds)
    ct_in = statistics.median(r["ciphertext_bytes_in"] for r in d_rounds) / len(HOSPITALS)
    # message rounds: statistics + one train per round (each with the previous round's evaluation) + the last evaluate
    flower_in = traffic["network-traffic"]["inbound-bytes"] / len(HOSPITALS) / (1 + args.rounds + 1)
    res = {
        "rounds": args.rounds, "partners": len(HOSPITALS), "he": "bfv", "task": "heart",
        "deployment_round_s": d_med, "simulation_round_s": s_med, "deployment_over_simulation": d_med / s_med,
        "same_model": [r["pooled_test_accuracy"] for r in d_rounds] == [r["pooled_test_accuracy"] for r in s_rounds],
        "ciphertext_bytes_per_partner_round": ct_in, "flower_inbound_bytes_per_partner_message_round": flower_in,
        "flower_traffic": traffic["network-traffic"], "work_dir": str(work),
    }
    t = Table(title=f"encrypted heart round, 4 partners, {args.rounds} rounds (median of rounds 2..)")
    for col in ("runtime", "round s", "vs simulation"):
        t.add_column(col, justify="right")
    t.add_row("simulation (Ray)", f"{s_med:.2f}", "1.00")
    t.add_row("deployment (TLS SuperNodes)", f"{d_med:.2f}", f"{d_med / s_med:.2f}")
    Console().print(t)
    Console().print(f"same pooled accuracy every round: {res['same_model']}; ciphertext in per partner per round "
                    f"{ct_in:,.0f} B; Flower inbound per partner per message round {flower_in:,.0f} B")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
