"""Hardware a release declares it needs, and the pure decision whether a device meets it.

A release may carry, in its signed metadata, ``"requirements"``::

    {"cpu_features": ["avx2" | "avx512_vnni" | "avx_vnni" | "asimddp", ...],  # all required
     "min_memory_bytes": int,            # MemTotal
     "min_free_disk_bytes": int,         # free space of the device state directory
     "tpm_sha256_bank": bool,            # a TPM with a SHA-256 PCR bank
     "execution_providers": [str, ...]}  # onnxruntime providers that must be available

Every field is optional; unknown fields are refused (a newer requirement this reader would
ignore could break the device). ``cpu_features`` names are the Linux ``/proc/cpuinfo`` flags
of the integer kernels' instructions: AVX2, AVX-512 VNNI, AVX-VNNI, and Arm's dot product
(``asimddp``, NEON SDOT/UDOT).

:func:`unmet` compares them with a device profile (:mod:`sealfl.enclave.device.doctor`) and returns
every unmet requirement, not only the first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sealfl.attestation.errors import VerificationError
from sealfl.attestation.manifest import MANIFEST_FILE
from sealfl.common.fields import Fields

__all__ = ["CPU_FEATURES", "parse_requirements", "unmet"]

CPU_FEATURES = ("avx2", "avx512_vnni", "avx_vnni", "asimddp")
_KEYS = ("cpu_features", "min_memory_bytes", "min_free_disk_bytes", "tpm_sha256_bank", "execution_providers")


def parse_requirements(raw: Any) -> dict:
    """Check a release's ``requirements`` metadata (None = no requirements).

    Raises:
        VerificationError: ``manifest.json`` check ``requirements``: a field unknown or of the
            wrong type (names it).
    """
    if raw is None:
        return {}
    fields = Fields("metadata.requirements", lambda m: VerificationError(MANIFEST_FILE, "requirements", m))
    fields.object(raw, "")
    fields.only(raw, _KEYS)
    out: dict = {}
    if "cpu_features" in raw:
        feats = fields.get(raw, "cpu_features", "array", max_len=len(CPU_FEATURES))
        out["cpu_features"] = [fields.choice(f, fields.join("cpu_features", i), choices=CPU_FEATURES)
                               for i, f in enumerate(feats)]
    for key in ("min_memory_bytes", "min_free_disk_bytes"):
        if key in raw:
            out[key] = fields.get(raw, key, "integer", hi=2**62)
    if "tpm_sha256_bank" in raw:
        out["tpm_sha256_bank"] = fields.get(raw, "tpm_sha256_bank", "boolean")
    if "execution_providers" in raw:
        eps = fields.get(raw, "execution_providers", "array", max_len=16)
        out["execution_providers"] = [fields.string(e, fields.join("execution_providers", i), max_len=128)
                                      for i, e in enumerate(eps)]
    return out


def unmet(requirements: Mapping[str, Any], profile: Mapping[str, Any]) -> list[str]:
    """Every requirement the device ``profile`` does not meet (empty list = all met). Pure.

    Args:
        requirements: output of :func:`parse_requirements`.
        profile: ``{"cpu_features": set[str], "memory_total_bytes": int, "free_disk_bytes": int,
            "tpm_sha256_bank": bool, "execution_providers": list[str]}`` (missing keys count as
            unknown, i.e. unmet when required).
    """
    out = []
    have = set(profile.get("cpu_features", ()))
    missing = [f for f in requirements.get("cpu_features", ()) if f not in have]
    if missing:
        out.append(f"CPU features {missing} are required but this CPU has {sorted(have & set(CPU_FEATURES))}")
    for key, prof in (("min_memory_bytes", "memory_total_bytes"), ("min_free_disk_bytes", "free_disk_bytes")):
        if key in requirements and profile.get(prof, -1) < requirements[key]:
            out.append(f"{key} = {requirements[key]} but the device has {profile.get(prof, 'unknown')}")
    if requirements.get("tpm_sha256_bank") and not profile.get("tpm_sha256_bank"):
        out.append("a TPM with a SHA-256 PCR bank is required but none was found")
    eps = [e for e in requirements.get("execution_providers", ()) if e not in profile.get("execution_providers", ())]
    if eps:
        out.append(f"onnxruntime execution providers {eps} are required but not available")
    return out
