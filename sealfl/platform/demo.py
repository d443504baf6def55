"""``sealfl demo``: the spine end to end on the real four-hospital data.

consortium (fresh keys) -> encrypted campaign on Ray -> release (INT8, gated, signed,
attested, with provenance) -> device boot from that release -> on-device inference on all 4
test splits -> the device attests and the chain is audited from public material only
(:mod:`sealfl.attestation.audit`; the files a third party needs go to ``out/audit/``) ->
table + ``report.json``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from sealfl.clients.heart.data import HOSPITALS, load_partitions
from sealfl.common.fsutil import atomic_write
from sealfl.he import codecs
from sealfl.platform import supervisor
from sealfl.platform.campaign import CampaignSpec
from sealfl.platform.consortium import Consortium, create_consortium
from sealfl.platform.outdir import prepare_owned_dir
from sealfl.platform.progress import run_campaign_with_progress
from sealfl.platform.release import provision_release_enclave, release, trust_dir

log = logging.getLogger(__name__)
MARKER = ".sealfl-demo"
# Published pooled-test accuracies (FLamby, du Terrail et al. 2022, Fed-Heart-Disease):
FLAMBY_POOLED = 0.776
FLAMBY_FEDAVG = 0.654


OWNED = {MARKER, "consortium", "campaign", "release", "device-state", "audit", "report.json"}


def _prepare(out: Path) -> None:
    """Empty ``out`` of an earlier demo's files; refuse to touch anything else."""
    prepare_owned_dir(out, MARKER, OWNED, "demo")


def _measured_server_secret(cons: Consortium) -> bool:
    """Load the aggregator's context file exactly as the aggregator does and ask TenSEAL."""
    codec = codecs.from_bytes(cons.public_context.read_bytes(), cons.he_params, bytes.fromhex(cons.context_id))
    return codec.has_secret_key


def _audit(cons: Consortium, out: Path, console: Console) -> dict:
    """The device attests to a fresh nonce; the chain is checked from public files only, which
    are written to ``out/audit/`` with the ``sealfl audit`` command that checks them again."""
    import os

    from sealfl.attestation.audit import DeviceEvidence, all_hold, audit_chain
    from sealfl.attestation.canonical import canonical_json
    from sealfl.attestation.keys import load_public_key
    from sealfl.attestation.release import load_trust_anchors, read_release_dir
    from sealfl.enclave.device.evidence import attest_device, device_public_key, measure_config
    from sealfl.enclave.measurement import measure_device_runtime

    nonce = os.urandom(16)
    evidence = attest_device(out / "device-state", nonce)
    ak = device_public_key(out / "device-state")
    folder = out / "audit"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "evidence.json", canonical_json(evidence) + b"\n", 0o644)
    atomic_write(folder / "device-ak.pem", ak, 0o644)
    trust, rounds = trust_dir(cons), out / "campaign" / "rounds.jsonl"
    links = audit_chain(trust=load_trust_anchors(trust), round_log=rounds.read_bytes(),
                        release_files=read_release_dir(out / "release"),
                        device=DeviceEvidence(evidence, load_public_key(ak), nonce, frozenset({"sim"}),
                                              frozenset({measure_device_runtime().hex()}),
                                              frozenset({measure_config(trust).hex()})))
    for link in links:
        console.print(f"{'PASS' if link.ok else 'FAIL'}  {link.name:20s} {link.detail}", markup=False, highlight=False)
    command = (f"sealfl audit --trust {trust} --rounds {rounds} --release {out / 'release'} --evidence "
               f"{folder / 'evidence.json'} --device-ak {folder / 'device-ak.pem'} --nonce {nonce.hex()} --allow-sim")
    return {"ok": all_hold(links), "links": {link.name: link.ok for link in links}, "command": command}


def run_demo(out: Path, *, rounds: int = 10, ray_address: str | None = None, console: Console | None = None) -> dict:
    """Run the demo into ``out``; returns the report dict (also written to ``out/report.json``).

    Raises PlatformError if ``out`` holds something other than an earlier demo, any
    campaign/release/boot error with its own message, and
    :class:`~sealfl.common.errors.Interrupted` on SIGINT/SIGTERM (inside
    :func:`~sealfl.platform.supervisor.interruptible`; acted on between steps, and at once
    while Ray runs). ``report.json`` is written last, atomically: it exists only for a
    demo that ran to its end.
    """
    from sealfl.enclave.device.boot import boot

    console = console or Console()
    out = Path(out)
    _prepare(out)
    t_all = time.perf_counter()

    console.rule("[bold]1. consortium: HE key ceremony, 4 partner kits, release enclave")
    t0 = time.perf_counter()
    cons, codec = create_consortium(out / "consortium", "heart", list(HOSPITALS))
    provision_release_enclave(cons, codec.secret_context_bytes())
    del codec
    console.print(f"partners: {', '.join(cons.partners)}  ({time.perf_counter() - t0:.1f} s)")
    supervisor.check()

    console.rule(f"[bold]2. encrypted campaign: {rounds} rounds of {cons.he_params.to_dict()['scheme']} FedAvg on Ray")
    camp = run_campaign_with_progress(
        CampaignSpec(str(cons.dir), str(out / "campaign"), rounds=rounds, ray_address=ray_address), console)
    last = camp.rounds[-1]

    console.rule("[bold]3. release: decrypt in the enclave, ONNX, INT8, gate, sign, attest")
    with console.status("decrypting in the release enclave; partners score the fp32 and INT8 candidates on Ray…"):
        rel = release(cons.dir, out / "campaign", out / "release", version=1, ray_address=ray_address)
    console.print(f"root digest {rel.summary['root_digest']}  ({rel.seconds:.1f} s)")

    supervisor.check()
    console.rule("[bold]4. device: verify, measure, boot the sandboxed runtime, infer")
    t0 = time.perf_counter()
    per_device: dict[str, dict] = {}
    # the demo's device runs the INSECURE sim TEE, asked for by name (a device never falls back to it)
    with boot(trust_dir(cons), out / "release", out / "device-state", backend="sim") as dev:
        boot_s = time.perf_counter() - t0
        for part in load_partitions():
            p = np.asarray(dev.predict(part.x_test)).reshape(-1)
            correct = int(np.sum((p >= 0.5) == (part.y_test >= 0.5)))
            per_device[part.name] = {"correct": correct, "n": int(len(p)), "accuracy": correct / len(p)}
        verified = {"name": dev.release.name, "version": dev.release.version, "root_digest": dev.release.root_digest}
    supervisor.check()
    console.rule("[bold]5. audit: round digests -> decrypted aggregate -> provenance -> release -> device quote")
    audit = _audit(cons, out, console)
    n_dev = sum(v["n"] for v in per_device.values())
    dev_pooled = sum(v["correct"] for v in per_device.values()) / n_dev

    he_bytes = sum(r["ciphertext_bytes_in"] for r in camp.rounds) / len(camp.rounds)
    fp32_bytes = last["fp32_bytes_per_update"] * len(last["accepted"])
    report = {
        "encrypted": True,
        "server_has_secret_key": bool(_measured_server_secret(cons)) or bool(camp.status.get("server_has_secret_key")),
        "partners": cons.partners,
        "rounds": len(camp.rounds),
        "accuracy": {
            "pooled_test": last["pooled_test_accuracy"],
            "per_partner": {k: last["per_partner"][k]["accuracy"] for k in cons.partners if k in last["per_partner"]},
            "history": [r["pooled_test_accuracy"] for r in camp.rounds],
            "release_fp32_pooled_test": rel.accuracy["fp32"]["pooled"],
            "release_int8_pooled_test": rel.accuracy["int8"]["pooled"],
            "flamby_published": {"pooled_training": FLAMBY_POOLED, "fedavg": FLAMBY_FEDAVG},
        },
        "device": {
            "verified": True,
            "release": verified,
            "pooled_test_accuracy": dev_pooled,
            "per_partner": {k: v["accuracy"] for k, v in per_device.items()},
            "boot_seconds": boot_s,
            "state_dir": str(out / "device-state"),
        },
        "release": {"dir": str(out / "release"), "root_digest": rel.summary["root_digest"],
                    "version": rel.summary["version"], "files": rel.summary["files"], **rel.sizes},
        "trust": {"dir": str(trust_dir(cons))},
        "audit": audit,
        "ray": camp.ray,
        "he": {
            **cons.he_params.to_dict(),
            "bytes_per_round": he_bytes,
            "aggregate_bytes": last["aggregate_bytes"],
            "expansion": he_bytes / fp32_bytes,
            "rejected_updates": sum(len(r.get("rejected") or {}) for r in camp.rounds),
        },
        "time": {
            "encrypted_round_seconds": float(np.mean([r["round_seconds"] for r in camp.rounds])),
            "campaign_seconds": camp.seconds,
            "statistics_round_seconds": camp.status.get("stats_seconds"),
            "release_seconds": rel.seconds,
            "total_seconds": time.perf_counter() - t_all,
        },
    }
    from sealfl.platform.report import campaign_report

    report["report_html"] = str(campaign_report(out / "campaign")[0].html)
    supervisor.check()
    atomic_write(out / "report.json", json.dumps(report, indent=2).encode(), 0o644)
    _print_table(console, report, rel.accuracy, per_device)
    return report


def _print_table(console: Console, report: dict, rel_acc: dict, per_device: dict) -> None:
    t = Table(title="sealfl demo: pooled and per-hospital test accuracy")
    t.add_column("hospital")
    t.add_column("test rows", justify="right")
    t.add_column("fp32 global", justify="right")
    t.add_column("INT8 device", justify="right")
    t.add_column("FLamby pooled", justify="right")
    t.add_column("FLamby FedAvg", justify="right")
    for name, acc in report["accuracy"]["per_partner"].items():
        t.add_row(name, str(per_device[name]["n"]), f"{acc:.3f}", f"{per_device[name]['accuracy']:.3f}", "", "")
    t.add_row("[bold]pooled", str(sum(v["n"] for v in per_device.values())),
              f"[bold]{report['accuracy']['pooled_test']:.3f}", f"[bold]{report['device']['pooled_test_accuracy']:.3f}",
              f"{FLAMBY_POOLED:.3f}", f"{FLAMBY_FEDAVG:.3f}")
    console.print(t)
    he, tm = report["he"], report["time"]
    console.print(
        f"rounds {report['rounds']} | ciphertext per round {he['bytes_per_round'] / 1e6:.2f} MB "
        f"({he['expansion']:.0f}x the fp32 update) | encrypted round {tm['encrypted_round_seconds']:.2f} s | "
        f"campaign {tm['campaign_seconds']:.1f} s | total {tm['total_seconds']:.1f} s\n"
        f"aggregator held a secret key: {report['server_has_secret_key']} | device verified release v"
        f"{report['device']['release']['version']} root digest {report['release']['root_digest'][:16]}… | "
        f"report: {Path(report['release']['dir']).parent / 'report.json'}; plots: {report['report_html']}")
