"""``sealfl llm-demo`` (``make llm-demo``): federated LoRA of SmolLM2-135M-Instruct on four
manuals of the Python documentation, end to end, in stages with a progress display each:

1. consortium with ``task = causal-lm`` (CKKS key ceremony, 4 partner kits, release enclave);
2. encrypted campaign on Ray: ``rounds`` rounds; each partner trains LoRA adapters for
   ``local_steps`` steps of 4 blocks of 128 tokens and sends E(n * adapters); the
   aggregator adds ciphertexts (``EncryptedFedAvg``);
3. release: decrypt in the release enclave, merge, ONNX with KV cache, INT4 + INT8, the
   partners score base / fp32 / INT4 / INT8 on their held-out text, gate, canary, sign;
4. device: ``sealfl device generate`` in a separate process (verify, boot the sandboxed
   runtime, canary, answer a question); its peak RSS (process tree, sampled every 50 ms)
   and first-token time are recorded; then ``sealfl device serve`` on a free loopback port
   answers ``CHAT_QUESTION`` through ``POST /v1/chat/completions`` (report ``chat``) and
   is stopped with SIGTERM.

Defaults (3 rounds x 6 steps at lr 4e-3, 128-token blocks, 8 held-out blocks per partner) are chosen
to finish within 25 minutes on 2 cores; ``report.json`` records what ran and how long
each stage took.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from sealfl.common.fsutil import atomic_write
from sealfl.platform import supervisor
from sealfl.platform.campaign import CampaignSpec
from sealfl.platform.consortium import create_consortium
from sealfl.platform.errors import PlatformError
from sealfl.platform.outdir import prepare_owned_dir
from sealfl.platform.progress import run_campaign_with_progress
from sealfl.platform.release import provision_release_enclave, release, trust_dir

__all__ = ["run_llm_demo", "SAMPLE_PROMPT"]

MARKER = ".sealfl-llm-demo"
OWNED = {MARKER, "consortium", "campaign", "release", "device-state", "report.json", "device.log", "serve.log",
         "serve.port"}
SAMPLE_PROMPT = "How do I open a file and read it line by line in Python?"
CHAT_QUESTION = "What is the difference between a list and a tuple in Python?"


def _prepare(out: Path) -> None:
    """Empty ``out`` of an earlier LLM demo's files; refuse to touch anything else."""
    prepare_owned_dir(out, MARKER, OWNED, "LLM demo")


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (Linux /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except (OSError, ValueError):
            continue
    return total


def run_device(trust: Path, release_dir: Path, state: Path, prompt: str, log_path: Path,
               timeout_s: float = 600.0) -> dict:
    """``sealfl device generate`` in a child process; returns the answer, its stderr
    summary, exit code, wall time and the sampled peak RSS of the process tree."""
    cmd = [sys.executable, "-m", "sealfl.platform.cli", "device", "generate", "--trust", str(trust), "--release",
           str(release_dir), "--state", str(state), "--prompt", prompt, "--max-tokens", "96", "--tee", "sim"]
    t0 = time.perf_counter()
    with open(log_path, "wb") as errf:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf)
        peak = 0
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            peak = max(peak, _tree_rss(proc.pid))
            if time.monotonic() > deadline:
                proc.kill()
                break
            time.sleep(0.05)
        answer = proc.stdout.read().decode("utf-8", "replace").strip()
        proc.wait()
    return {"answer": answer, "exit_code": proc.returncode, "seconds": time.perf_counter() - t0,
            "peak_rss_bytes": peak, "log": log_path.read_text(errors="replace").strip()[-2000:]}


def _http_json(url: str, body: dict | None = None, timeout: float = 300.0) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def run_serve_chat(trust: Path, release_dir: Path, state: Path, question: str, out: Path,
                   timeout_s: float = 600.0) -> dict:
    """``sealfl device serve`` in a child process on a free loopback port: wait for
    ``/health`` 200, ask ``question`` through ``POST /v1/chat/completions`` (greedy, 96
    tokens), stop the server with SIGTERM (by its pid) and return the question, answer,
    usage, finish reason, wall time of the request and the server's exit code.

    Raises:
        PlatformError: the server exited, never became healthy or did not answer.
    """
    import signal
    import urllib.error

    port_file, log_path = out / "serve.port", out / "serve.log"
    port_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "sealfl.platform.cli", "device", "serve", "--trust", str(trust), "--release",
           str(release_dir), "--state", str(state), "--port", "0", "--port-file", str(port_file), "--tee", "sim"]
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=logf)
        try:
            deadline = time.monotonic() + timeout_s
            status = 0
            while status != 200:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise PlatformError(f"device serve exited {proc.returncode} or never became healthy; see "
                                        f"{log_path}")
                if port_file.exists() and port_file.read_text().strip():
                    url = f"http://127.0.0.1:{int(port_file.read_text())}"
                    try:
                        status, _ = _http_json(url + "/health", timeout=10)
                    except (urllib.error.URLError, OSError, ValueError):
                        status = 0
                time.sleep(0.2)
            t0 = time.perf_counter()
            code, body = _http_json(url + "/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": question}], "max_tokens": 96,
                                     "temperature": 0, "seed": 0}, timeout=timeout_s)
            seconds = time.perf_counter() - t0
            if code != 200:
                raise PlatformError(f"/v1/chat/completions answered {code}: {body}")
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                exit_code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                exit_code = proc.wait()
    choice = body["choices"][0]
    return {"question": question, "answer": choice["message"]["content"], "finish_reason": choice["finish_reason"],
            "usage": body["usage"], "seconds": seconds, "server_exit_code": exit_code}


def run_llm_demo(out: Path, *, rounds: int = 3, local_steps: int = 6, ray_address: str | None = None,
                 console: Console | None = None, eval_blocks: int = 8, lr: float | None = None) -> dict:
    """Run the LLM demo into ``out``; returns the report (also ``out/report.json``).
    ``eval_blocks``: held-out blocks of 128 tokens each partner scores (evaluation and gate).
    ``lr``: partners' AdamW learning rate (None: the task's default,
    :meth:`CausalLMTask.train_defaults`).

    Raises:
        PlatformError: ``out`` holds something other than an earlier LLM demo, or the
            device did not answer; any campaign / release error with its own message;
            Interrupted on SIGINT/SIGTERM.
    """
    console = console or Console()
    out = Path(out)
    _prepare(out)
    times: dict[str, float] = {}
    t_all = time.perf_counter()

    console.rule("[bold]1. consortium (task causal-lm): CKKS key ceremony, 4 partner kits, release enclave")
    t0 = time.perf_counter()
    from sealfl.clients.plugins import get_task

    task = get_task("causal-lm")
    cons, codec = create_consortium(out / "consortium", "python-docs", list(task.partners), task="causal-lm")
    provision_release_enclave(cons, codec.secret_context_bytes())
    del codec
    times["consortium"] = time.perf_counter() - t0
    console.print(f"partners: {', '.join(cons.partners)}  ({times['consortium']:.1f} s)")
    supervisor.check()

    console.rule(f"[bold]2. encrypted campaign: {rounds} rounds of LoRA + CKKS FedAvg on Ray "
                 f"({task.n_params:,} adapter values per partner)")
    t0 = time.perf_counter()
    camp = run_campaign_with_progress(
        CampaignSpec(str(cons.dir), str(out / "campaign"), rounds=rounds, local_epochs=local_steps,
                     ray_address=ray_address, timeout_s=1800.0, extra={"eval-blocks": int(eval_blocks),
                                                              **({"lr": float(lr)} if lr is not None else {})}), console)
    times["campaign"] = time.perf_counter() - t0
    history = [{"round": r["round"], "next_token_accuracy": r.get("pooled_test_accuracy"),
                "seconds": r.get("round_seconds")} for r in camp.rounds]

    console.rule("[bold]3. release: decrypt in the enclave, merge, ONNX + KV cache, INT4/INT8, partners' gate, sign")
    t0 = time.perf_counter()
    stages: list[str] = []
    with console.status("release build…") as status:
        def on_stage(name: str) -> None:
            stages.append(name)
            status.update(f"release build: {name}…")

        rel = release(cons.dir, out / "campaign", out / "release", version=1, ray_address=ray_address,
                      on_stage=on_stage)
    times["release"] = time.perf_counter() - t0
    rep = rel.accuracy
    console.print(f"root digest {rel.summary['root_digest']}  ({times['release']:.1f} s); " + "; ".join(
        f"{v}: agreement {g['top1_agreement']:.3f}, perplexity {g['perplexity']:.2f} vs fp32 {g['perplexity_fp32']:.2f}"
        for v, g in rep["gate"].items()))
    supervisor.check()

    console.rule("[bold]4. device: verify, boot the sandboxed runtime, canary, generate")
    t0 = time.perf_counter()
    with console.status("sealfl device generate…"):
        dev = run_device(trust_dir(cons), out / "release", out / "device-state", SAMPLE_PROMPT, out / "device.log")
    times["device"] = time.perf_counter() - t0
    if dev["exit_code"] != 0 or not dev["answer"]:
        raise PlatformError(f"the device did not answer (exit code {dev['exit_code']}): {dev['log']}")
    console.print(f"[bold]Q:[/] {SAMPLE_PROMPT}\n[bold]A:[/] {dev['answer']}")
    supervisor.check()
    with console.status("sealfl device serve: POST /v1/chat/completions…"):
        chat = run_serve_chat(trust_dir(cons), out / "release", out / "device-state", CHAT_QUESTION, out)
    times["serve"] = time.perf_counter() - t0 - times["device"]
    console.print(f"[bold]chat Q:[/] {CHAT_QUESTION}\n[bold]chat A:[/] {chat['answer']}")
    times["total"] = time.perf_counter() - t_all

    per = rep["per_partner"]
    report = {
        "task": "causal-lm",
        "partners": cons.partners,
        "rounds": len(camp.rounds),
        "settings": {**task.train_defaults(), "local-steps": local_steps, "eval-blocks": int(eval_blocks),
                     **({"lr": float(lr)} if lr is not None else {}),
                     "lora": task.spec.to_dict(), "adapter_values": task.n_params},
        "perplexity_before": rep["perplexity"]["before"],
        "perplexity_after": rep["perplexity"]["after"],
        "perplexity_ratio": rep["perplexity"]["after"] / rep["perplexity"]["before"],
        "per_partner": per,
        "history": history,
        "release": {"dir": str(out / "release"), "root_digest": rel.summary["root_digest"],
                    "int4_bytes": rep["sizes"]["int4_bytes"], "int8_bytes": rep["sizes"]["int8_bytes"],
                    "bytes": rep["sizes"]["release_bytes"], "files": rel.summary["files"]},
        "trust": {"dir": str(trust_dir(cons))},
        "gate": rep["gate"],
        "sample": {"prompt": SAMPLE_PROMPT, "answer": dev["answer"]},
        "chat": chat,
        "device": {"peak_rss_bytes": dev["peak_rss_bytes"], "seconds": dev["seconds"], "summary": dev["log"]},
        "server_has_secret_key": bool(camp.status.get("server_has_secret_key")),
        "time": {**times, **{k: v for k, v in rep["seconds"].items()}},
    }
    from sealfl.platform.report import campaign_report

    report["report_html"] = str(campaign_report(out / "campaign")[0].html)
    atomic_write(out / "report.json", json.dumps(report, indent=2).encode(), 0o644)
    console.print(f"perplexity before {report['perplexity_before']:.2f} -> after {report['perplexity_after']:.2f} "
                  f"(ratio {report['perplexity_ratio']:.3f}); INT4 {report['release']['int4_bytes'] / 1e6:.1f} MB; "
                  f"device peak RSS {dev['peak_rss_bytes'] / 2**20:.0f} MiB; total {times['total'] / 60:.1f} min; "
                  f"report in {out / 'report.json'}, plots in {report['report_html']}")
    return report
