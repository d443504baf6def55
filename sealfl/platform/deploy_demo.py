"""``sealfl deploy-demo`` (``make deploy-demo``): the distributed product on one machine.

A consortium of the 4 hospitals (packed BFV) -> a SuperLink (``sealfl superlink start``: TLS,
SuperNode authentication) and 4 SuperNodes (``sealfl partner start``), each a separate process
on 127.0.0.1 in its own working directory holding only its own kit -> an encrypted campaign
over TLS (``sealfl campaign run --superlink``) -> the release (``sealfl release build``) -> a
device boots it (``sealfl device boot --tee sim``) and scores every hospital's test split ->
a summary table, where each process's log is, and ``OUT/report.json``. Every process is
stopped by its pid at the end, on an error and on Ctrl-C/SIGTERM.

``report.json``: ``tls`` and ``node_auth`` (as the campaign recorded them), ``partners``,
``rounds``, per-partner ciphertext bytes per round, round seconds, and the accuracy figures
``make demo`` reports (pooled test accuracy after the last round, per partner; the release's
fp32 and INT8 pooled accuracy; the device's pooled accuracy on the 4 test splits).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from sealfl.common.fsutil import atomic_write
from sealfl.platform.errors import PlatformError
from sealfl.platform.outdir import prepare_owned_dir

__all__ = ["run_deploy_demo", "OWNED"]

MARKER = ".sealfl-deploy-demo"
OWNED = {MARKER, "coordinator", "partners", "device", "logs", "report.json"}
#: longest wait for a process to come up, seconds
START_S = 180.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Procs:
    """The processes this demo started, each in its own session, stopped by pid."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.running = logs, []

    def start(self, name: str, args: list, cwd: Path | None = None) -> subprocess.Popen:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "sealfl.platform.cli", *map(str, args)], stdout=fh,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
                                    start_new_session=True)
        proc.log_path, proc.label = log, name
        self.running.append(proc)
        return proc

    def run(self, name: str, args: list, cwd: Path | None = None) -> str:
        """Run one command to its end; its output (also in its log). Raises PlatformError."""
        proc = self.start(name, args, cwd)
        code = proc.wait()
        self.running.remove(proc)
        text = proc.log_path.read_text(errors="replace")
        if code != 0:
            raise PlatformError(f"{name} failed (exit {code}); its log {proc.log_path} ends: {text[-1500:]}")
        return text

    def stop(self) -> None:
        for proc in self.running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in self.running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: this demo's process group only
                proc.wait()
        self.running = []


def _wait_for(what: str, ready, procs: list[subprocess.Popen]) -> None:
    end = time.monotonic() + START_S
    while not ready():
        for p in procs:
            if p.poll() is not None:
                raise PlatformError(f"{p.label} exited ({p.returncode}) before {what}; its log {p.log_path} ends: "
                                    f"{p.log_path.read_text(errors='replace')[-1500:]}")
        if time.monotonic() > end:
            raise PlatformError(f"timed out after {START_S:.0f} s waiting for {what}")
        time.sleep(0.5)


def run_deploy_demo(out: Path, *, rounds: int = 3, say=print) -> dict:
    """Run the demo into ``out`` (module docstring); returns the report (also ``out/report.json``).

    Raises:
        PlatformError: ``out`` holds something else than an earlier deploy demo, or a step failed
            (the message names the step and the end of its log).
    """
    from sealfl.clients.heart.data import HOSPITALS, load_partitions
    from sealfl.clients.kit import kit_dir
    from sealfl.enclave.device.boot import boot
    from sealfl.platform import flwr_cli
    from sealfl.platform.consortium import create_consortium
    from sealfl.platform.release import provision_release_enclave, trust_dir

    prepare_owned_dir(out, MARKER, OWNED, "deploy demo")
    coord, logs = out / "coordinator", out / "logs"
    for d in (coord, logs, out / "partners"):
        d.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    say("1/5 consortium: HE keys, startup kits (CA, SuperLink TLS, SuperNode keys), release enclave")
    cons, codec = create_consortium(coord / "consortium", "heart", list(HOSPITALS))
    provision_release_enclave(cons, codec.secret_context_bytes())
    procs, port = _Procs(logs), _port()
    try:
        say(f"2/5 SuperLink on 127.0.0.1:{port} and 4 SuperNodes, each in its own directory with its own kit")
        link = procs.start("superlink", ["superlink", "start", cons.dir / "superlink", "--port", port, "--state",
                                         coord / "superlink-state"])
        _wait_for("the SuperLink listened", lambda: "SuperLink on" in link.log_path.read_text(errors="replace"),
                  [link])
        nodes = []
        for p in HOSPITALS:
            slug = kit_dir(cons.dir, p).name
            home = out / "partners" / f"{slug}-site"  # the partner's machine: its kit (named as issued), its log
            shutil.copytree(kit_dir(cons.dir, p), home / slug)
            nodes.append(procs.start(f"supernode-{slug}", ["partner", "start", home / slug, "--superlink",
                                                          f"127.0.0.1:{port}", "--log", home / "supernode.log"],
                                     cwd=home))
        flwr_home = coord / "superlink-state" / "flwr-home"

        def online() -> bool:
            listed = flwr_cli.flwr_json(["supernode", "ls", flwr_cli.CONNECTION], flwr_home).get("nodes", [])
            return sum(n.get("status") == "online" for n in listed) >= len(HOSPITALS)

        _wait_for("4 SuperNodes came online", online, [link, *nodes])
        say(f"3/5 encrypted campaign over TLS: {rounds} rounds")
        camp = coord / "campaign"
        procs.run("campaign", ["campaign", "run", "-c", cons.dir, "-o", camp, "--rounds", rounds, "--superlink",
                               f"127.0.0.1:{port}"])
    finally:
        procs.stop()
    say("4/5 release: decrypt in the enclave, ONNX, INT8, gate, sign, attest")
    procs.run("release", ["release", "build", "-c", cons.dir, "--campaign", camp, "-o", coord / "release-v1",
                          "--version", 1, "--json"])
    say("5/5 device: measured boot of the release, on-device scoring of the 4 test splits")
    status = json.loads((camp / "status.json").read_text())
    records = [json.loads(line) for line in (camp / "rounds.jsonl").read_text().splitlines() if line.strip()]
    release_meta = json.loads((coord / "release-v1" / "manifest.json").read_text())
    correct = n = 0
    with boot(trust_dir(cons), coord / "release-v1", out / "device" / "state", backend="sim") as dev:
        for part in load_partitions():
            probs = dev.predict(part.x_test).reshape(-1)
            correct += int(((probs >= 0.5).astype(int) == part.y_test).sum())
            n += len(part.y_test)
        verified = {"name": dev.release.name, "version": dev.release.version, "root_digest": dev.release.root_digest}
    last = records[-1]
    deployment = status.get("deployment") or {}
    report = {
        "tls": bool(deployment.get("tls")), "node_auth": bool(deployment.get("node_auth")),
        "superlink": deployment.get("superlink"), "partners": list(cons.partners), "rounds": len(records),
        "per_partner_ciphertext_bytes_per_round": [r["ciphertext_bytes_in"] / max(1, len(r.get("accepted") or []))
                                                   for r in records],
        "round_seconds": [r.get("round_seconds") for r in records],
        "pooled_test_accuracy_per_round": [r.get("pooled_test_accuracy") for r in records],
        "accuracy": {"pooled_test": last.get("pooled_test_accuracy"),
                     "per_partner": {k: v.get("accuracy") for k, v in (last.get("per_partner") or {}).items()},
                     "release_fp32_pooled_test": release_meta.get("metadata", {}).get("accuracy", {})
                     .get("fp32_pooled_test"),
                     "release_int8_pooled_test": release_meta.get("metadata", {}).get("accuracy", {})
                     .get("int8_pooled_test"),
                     "device_pooled_test": correct / n},
        "device": {"release": verified},
        "logs": {p.name[:-4]: str(p) for p in sorted(logs.glob("*.log"))},
        "seconds": time.perf_counter() - t_all,
    }
    atomic_write(out / "report.json", json.dumps(report, indent=2).encode(), 0o644)
    return report
