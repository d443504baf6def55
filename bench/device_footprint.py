"""The device extra's footprint: installed size of its dependency closure and `device boot`'s peak RSS.

    python bench/device_footprint.py [--tree DIR ...] [--runs 3] [--extra PKG ...]

* **Installed size**: the sum of the file sizes in each installed distribution's ``RECORD``
  over the closure of sealfl's base dependencies plus its ``device`` extra, read from this
  venv (nothing is downloaded); ``--extra PKG`` adds candidate packages (e.g.
  ``securesystemslib in-toto-attestation``) to show what they would cost.
* **Peak RSS**: ``/usr/bin/time -v``'s "Maximum resident set size" of ``sealfl device boot
  --tee sim`` on a fresh tabular release (one ONNX model) made by that tree's own release
  enclave, median of ``--runs``; each ``--tree`` is a sealfl source tree (e.g. the main
  worktree for "before" and a branch's for "after"), run with ``PYTHONPATH=TREE``.

Prints a table; writes ``bench/results/device_footprint.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

_MAKE_RELEASE = """
import sys
from sealfl.enclave.release.enclave import ReleaseEnclave
from tests.support.releases import MODEL_FILE, default_payload
out = sys.argv[1]
enclave = ReleaseEnclave.create(out + "/enclave")
enclave.export_trust(out + "/trust")
enclave.write_release(out + "/release", default_payload(), "heart-mlp", 1, {"model_file": MODEL_FILE})
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(requirements: list[str]) -> dict[str, metadata.Distribution]:
    """Installed distributions needed by ``requirements`` (their extras followed)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, _ = todo.pop()
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        key = _norm(req.name) + "[" + ",".join(sorted(req.extras)) + "]"
        if key in seen:
            continue
        seen[key] = dist
        for line in dist.requires or []:
            sub = Requirement(line)
            envs = [{"extra": ""}] + [{"extra": e} for e in req.extras]
            if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
                sub.marker = None
                todo.append((sub, ""))
    out: dict[str, metadata.Distribution] = {}
    for key, dist in seen.items():
        out[_norm(key.split("[")[0])] = dist
    return out


def installed_bytes(dist: metadata.Distribution) -> int:
    total = 0
    for f in dist.files or []:
        try:
            total += f.size if f.size is not None else f.locate().stat().st_size
        except OSError:
            pass
    return total


def device_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"]) + list(project["optional-dependencies"]["device"])


def boot_peak_rss(tree: Path, runs: int) -> list[int]:
    """Peak RSS (KiB) of `device boot` with ``PYTHONPATH=tree``, one value per run."""
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
    out = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="sealfl-footprint-") as tmp:
            subprocess.run([sys.executable, "-c", _MAKE_RELEASE, tmp], env=env, check=True, cwd=tree,
                           capture_output=True, timeout=300)
            done = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "sealfl.platform.cli", "device",
                                   "boot", "-t", f"{tmp}/trust", "-r", f"{tmp}/release", "-s", f"{tmp}/state",
                                   "--tee", "sim"], env=env, cwd=tree, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise SystemExit(f"device boot failed in {tree}: {done.stderr[-2000:]}")
            match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
            out.append(int(match.group(1)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", type=Path, help="sealfl source tree(s) to boot with")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--extra", nargs="*", default=[], help="candidate packages to add to the closure")
    args = parser.parse_args()
    base = device_requirements()
    dists = closure(base)
    size = sum(installed_bytes(d) for d in dists.values())
    result: dict = {"device_closure": {"distributions": len(dists), "installed_bytes": size}}
    print(f"{'device extra closure':46s} {len(dists):3d} distributions {size / 1e6:9.2f} MB")
    if args.extra:
        more = closure(base + args.extra)
        added = sorted(set(more) - set(dists))
        extra_size = sum(installed_bytes(more[n]) for n in added)
        result["with_extra"] = {"packages": args.extra, "added": added, "added_bytes": extra_size,
                                "ratio": (size + extra_size) / size}
        print(f"{'+ ' + ' '.join(args.extra):46s} adds {added} {extra_size / 1e6:.2f} MB "
              f"(x{(size + extra_size) / size:.3f})")
    result["boot_peak_rss_kib"] = {}
    for tree in args.tree or []:
        values = boot_peak_rss(tree.resolve(), args.runs)
        result["boot_peak_rss_kib"][str(tree)] = {"runs": values, "median": statistics.median(values)}
        print(f"{'device boot peak RSS, ' + str(tree):46s} median {statistics.median(values) / 1024:8.1f} MiB "
              f"(runs {values} KiB)")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "device_footprint.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
