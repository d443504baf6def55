"""``sealfl device doctor``: what releases depend on, read from this device.

:func:`profile` reads (I/O only; the decisions are
:func:`sealfl.attestation.requirements.unmet`):

* CPU features used by integer kernels, from ``/proc/cpuinfo`` flags (``avx2``,
  ``avx512_vnni``, ``avx_vnni``; on Arm ``asimddp`` = NEON dot product);
* memory (``/proc/meminfo`` MemTotal, MemAvailable) and free disk of the state directory;
* the TPM: the TCTI the ``tpm`` backend would use (:mod:`sealfl.enclave.tee.tpm`), whether it
  answers, its allocated PCR banks (``tpm2_getcap pcrs``; a SHA-256 bank is required), which
  sealfl roles hold an attestation key in it (``handles-persistent`` against
  :data:`sealfl.enclave.tee.tpm_alloc.ROLES`) and how many transient objects are loaded;
* with a state directory, the TEE the device runs on (:func:`~sealfl.enclave.device.provision.describe_tee`:
  ``tpm``, or ``sim`` -- flagged INSECURE -- or not provisioned);
* onnxruntime's available execution providers.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from sealfl.attestation.requirements import CPU_FEATURES
from sealfl.enclave.tee.tpm_tools import parse_handles, parse_pcr_banks

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


def _tpm() -> dict:
    from sealfl.enclave.tee.tpm_alloc import ROLES
    from sealfl.enclave.tee.tpm_tools import DEFAULT_TCTI, TCTI_ENV

    tcti = os.environ.get(TCTI_ENV) or DEFAULT_TCTI
    info = {"tcti": tcti, "present": False, "banks": {}, "error": "", "roles": {}, "transient_loaded": None}
    if shutil.which("tpm2_getcap") is None:
        info["error"] = "tpm2-tools not installed (scripts/install-tpm.sh)"
        return info
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TPM2TOOLS_TCTI": tcti}

    def getcap(what: str):
        try:
            return subprocess.run(["tpm2_getcap", what], capture_output=True, text=True, timeout=30, env=env)
        except subprocess.TimeoutExpired:
            return None

    proc = getcap("pcrs")
    if proc is None or proc.returncode != 0:
        from sealfl.enclave.tee.tpm_rc import from_stderr

        rc = from_stderr(proc.stderr) if proc is not None else None
        info["error"] = ("tpm2_getcap timed out" if proc is None else
                         f"{rc.meaning}: {rc.advice}" if rc is not None else
                         (proc.stderr.strip().splitlines() or ["no answer"])[-1][:300])
        return info
    info["present"] = True
    info["banks"] = parse_pcr_banks(proc.stdout)
    persistent = getcap("handles-persistent")
    if persistent is not None and persistent.returncode == 0:
        held = set(parse_handles(persistent.stdout))
        info["roles"] = {name: {"ak_handle": f"{r.ak_handle:#x}", "provisioned": r.ak_handle in held}
                         for name, r in ROLES.items()}
    transient = getcap("handles-transient")
    if transient is not None and transient.returncode == 0:
        info["transient_loaded"] = len(parse_handles(transient.stdout))
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
    if state_dir is not None:
        from sealfl.enclave.device.provision import describe_tee

        out["device_tee"] = describe_tee(state_dir)
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
            held = [name for name, r in t.get("roles", {}).items() if r["provisioned"]]
            lines.append("TPM keys of sealfl roles: " + (", ".join(
                f"{name} AK at {t['roles'][name]['ak_handle']}" for name in held) or "none"))
            if t.get("transient_loaded") is not None:
                lines.append(f"TPM transient objects loaded now: {t['transient_loaded']}"
                             + (" (other software keeps objects loaded: run a resource manager)"
                                if t["transient_loaded"] else ""))
        else:
            lines.append(f"TPM at {t['tcti']}: not available ({t['error']})")
    d = p.get("device_tee")
    if d is not None:
        if d["backend"] is None:
            lines.append("device TEE: not provisioned" + (f" ({d['error']})" if d["error"] else
                                                          " (sealfl device provision)"))
        else:
            what = "INSECURE simulation, for tests and demos only" if d["insecure"] else f"TPM 2.0 at {d['tcti']}"
            lines.append(f"device TEE: {d['backend']} ({what}); AK keyid {d['ak_keyid'] or '?'}"
                         + (f" -- {d['error']}" if d["error"] else ""))
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
