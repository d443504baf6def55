"""``sealfl device doctor``: what releases depend on, read from this device.

:func:`profile` reads (I/O only; the decisions are
:func:`sealfl.attestation.requirements.unmet`):

* CPU features used by integer kernels, from ``/proc/cpuinfo`` flags (``avx2``,
  ``avx512_vnni``, ``avx_vnni``; on Arm ``asimddp`` = NEON dot product);
* memory (``/proc/meminfo`` MemTotal, MemAvailable) and free disk of the state directory;
* the TPM: the TCTI the ``tpm`` backend would use (:mod:`sealfl.enclave.tee.tpm`), whether it
  answers, and its allocated PCR banks (``tpm2_getcap pcrs``); a SHA-256 bank is required;
* onnxruntime's available execution providers.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from sealfl.attestation.requirements import CPU_FEATURES

__all__ = ["profile", "parse_pcr_banks", "format_profile"]


def _cpu_features() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return set()
    flags = set()
    for line in text.splitlines():
        if line.lower().startswith(("flags", "features")):
            flags.update(line.split(":", 1)[1].split())
    return flags & set(CPU_FEATURES)


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            m = re.match(r"(MemTotal|MemAvailable):\s+(\d+) kB", line)
            if m:
                out[m.group(1)] = int(m.group(2)) * 1024
    except OSError:
        pass
    return out


def parse_pcr_banks(getcap_output: str) -> dict[str, list[int]]:
    """Parse ``tpm2_getcap pcrs`` (YAML lines ``  - sha256: [ 0, 1, ... ]``) to
    ``{bank: [allocated PCR indices]}``. Pure."""
    banks = {}
    for m in re.finditer(r"-\s*(\w+)\s*:\s*\[([^\]]*)\]", getcap_output):
        banks[m.group(1)] = [int(x) for x in m.group(2).replace(",", " ").split()]
    return banks


def _tpm() -> dict:
    from sealfl.enclave.tee.tpm import DEFAULT_TCTI, TCTI_ENV

    tcti = os.environ.get(TCTI_ENV) or DEFAULT_TCTI
    info = {"tcti": tcti, "present": False, "banks": {}, "error": ""}
    if shutil.which("tpm2_getcap") is None:
        info["error"] = "tpm2-tools not installed (scripts/install-tpm.sh)"
        return info
    try:
        proc = subprocess.run(["tpm2_getcap", "pcrs"], capture_output=True, text=True, timeout=30,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TPM2TOOLS_TCTI": tcti})
    except subprocess.TimeoutExpired:
        info["error"] = "tpm2_getcap timed out"
        return info
    if proc.returncode != 0:
        info["error"] = (proc.stderr.strip().splitlines() or ["no answer"])[-1][:300]
        return info
    info["present"] = True
    info["banks"] = parse_pcr_banks(proc.stdout)
    return info


def profile(state_dir: str | os.PathLike | None = None, *, tpm: bool = True) -> dict:
    """The device profile (keys as :func:`sealfl.attestation.requirements.unmet` reads them,
    plus ``memory_available_bytes`` and ``tpm``)."""
    mem = _meminfo()
    where = Path(state_dir) if state_dir is not None else Path.cwd()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        import onnxruntime as ort

        providers = list(ort.get_available_providers())
    except ImportError:
        providers = []
    out = {"cpu_features": sorted(_cpu_features()), "memory_total_bytes": mem.get("MemTotal", -1),
           "memory_available_bytes": mem.get("MemAvailable", -1),
           "free_disk_bytes": shutil.disk_usage(where).free, "execution_providers": providers}
    if tpm:
        t = _tpm()
        out["tpm"] = t
        out["tpm_sha256_bank"] = bool(t["present"] and t["banks"].get("sha256"))
    return out


def format_profile(p: dict) -> list[str]:
    """Human-readable lines of a profile."""
    gib = 1024**3
    lines = [f"CPU integer-kernel features: {', '.join(p['cpu_features']) or 'none of ' + ', '.join(CPU_FEATURES)}",
             f"memory: {p['memory_total_bytes'] / gib:.1f} GiB total, {p['memory_available_bytes'] / gib:.1f} GiB "
             "available",
             f"free disk (state directory): {p['free_disk_bytes'] / gib:.1f} GiB",
             f"onnxruntime execution providers: {', '.join(p['execution_providers']) or 'none'}"]
    t = p.get("tpm")
    if t is not None:
        if t["present"]:
            banks = ", ".join(f"{b} ({len(v)} PCRs)" for b, v in t["banks"].items() if v) or "none allocated"
            lines.append(f"TPM at {t['tcti']}: present; PCR banks {banks}"
                         + ("" if p["tpm_sha256_bank"] else " -- NO SHA-256 bank: the tpm backend needs one"))
        else:
            lines.append(f"TPM at {t['tcti']}: not available ({t['error']})")
    return lines


def check_release_requirements(metadata: dict, state_dir: str | os.PathLike) -> None:
    """Refuse a release whose signed ``requirements`` this device cannot meet.

    Raises:
        BootError: reason ``"requirements"`` listing every unmet requirement, or
            ``"verification"`` (check ``requirements``) if the field is malformed.
    """
    from sealfl.attestation.errors import VerificationError
    from sealfl.attestation.requirements import parse_requirements, unmet
    from sealfl.enclave.errors import BootError

    raw = metadata.get("requirements")
    if raw is None:
        return
    try:
        reqs = parse_requirements(raw)
    except VerificationError as exc:
        raise BootError(str(exc), reason="verification", file=exc.file, check=exc.check) from exc
    problems = unmet(reqs, profile(state_dir, tpm=bool(reqs.get("tpm_sha256_bank"))))
    if problems:
        raise BootError("this device cannot meet the release's requirements: " + "; ".join(problems)
                        + " (run `sealfl device doctor`)", reason="requirements")
