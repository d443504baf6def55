"""Which TPM handles, NV indices and PCRs each sealfl role uses, and the checks that keep
roles (and two device states) from taking each other's over.

===================  ==========  ==============  =========================================
role                 AK handle   floor NV index  PCRs (SHA-256 bank; reset at each boot)
===================  ==========  ==============  =========================================
``device``           0x81010010  0x01500010      16 runtime code + configuration, 23 release root
``release-enclave``  0x81010020  0x01500020      16 enclave code measurement
===================  ==========  ==============  =========================================

Handles are in the owner's persistent range (0x81000000-0x817FFFFF), NV indices in the
owner-defined range (0x01000000-0x01BFFFFF; TCG "Registry of Reserved TPM 2.0 Handles and
Localities"), so the roles never overwrite each other's key or floor.

**One role per TPM.** Only PCRs 16 (debug) and 23 (application) may be reset by software
at locality 0 (TCG PC Client Platform TPM Profile, PCR attributes); every role resets PCR 16
at each boot, so two roles -- or two device states -- on one TPM would reset each other's
measurement. Hence provisioning (:func:`check_free`) refuses a TPM that holds another role's
AK (always: remove that role on purpose first) or another state's AK of the same role
(unless ``replace``, i.e. ``sealfl device provision --force``).

**Banks.** A role measures into the SHA-256 bank; a TPM without it allocated for the role's
PCRs (:func:`check_banks`) would accept extends into nothing (tpm2-tools returns success
and an empty read), so provisioning and every boot refuse it, naming the missing bank.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sealfl.attestation import keys as _keys
from sealfl.attestation.errors import AttestationError
from sealfl.enclave.errors import TEEError, TEEStateError, TPMError
from sealfl.enclave.tee.tpm_tools import Tools, parse_pcr_banks

__all__ = ["Role", "ROLES", "DEFAULT_ROLE", "BANK", "role_of", "check_banks", "check_free", "ak_keyid_at", "probe"]

BANK = "sha256"


@dataclass(frozen=True)
class Role:
    """One role's TPM allocation (module docstring).

    Attributes:
        name: ``"device"`` or ``"release-enclave"``.
        ak_handle: persistent handle of its attestation key.
        floor_nv: NV index of its rollback floor record.
        pcrs: SHA-256 PCRs it resets at each boot and extends.
        what: words for messages.
    """

    name: str
    ak_handle: int
    floor_nv: int
    pcrs: tuple[int, ...]
    what: str


ROLES: dict[str, Role] = {
    "device": Role("device", 0x81010010, 0x01500010, (16, 23), "device"),
    "release-enclave": Role("release-enclave", 0x81010020, 0x01500020, (16,), "release enclave"),
}
DEFAULT_ROLE = "device"


def role_of(name: str) -> Role:
    """The :class:`Role` named ``name``.

    Raises:
        TEEError: unknown role.
    """
    try:
        return ROLES[name]
    except (KeyError, TypeError):
        raise TEEError(f"unknown TPM role {name!r:.40}; choose one of {sorted(ROLES)}") from None


def check_banks(tools: Tools, role: Role) -> None:
    """Refuse a TPM whose SHA-256 bank lacks one of ``role.pcrs`` (module docstring).

    Raises:
        TPMError: the TPM does not answer (``tpm2_getcap pcrs``), with what the failure means.
        TEEError: the bank is missing; the message names the allocated banks and the fix.
    """
    proc = tools.run("tpm2_getcap", "pcrs", check=False)
    if proc.returncode != 0:
        raise tools.error("tpm2_getcap", proc, "reading the TPM's PCR banks")
    banks = parse_pcr_banks(proc.stdout.decode("ascii", "replace"))
    have = set(banks.get(BANK, ()))
    missing = [i for i in role.pcrs if i not in have]
    if missing:
        allocated = ", ".join(f"{b} ({len(v)} PCRs)" for b, v in banks.items() if v) or "none"
        raise TEEError(
            f"TPM {tools.tcti} cannot hold the {role.what}'s measurements: its {BANK.upper()} PCR bank is not "
            f"allocated for PCR(s) {missing} (allocated banks: {allocated}); sealfl measures into {BANK.upper()} "
            f"PCRs {list(role.pcrs)}. Allocate the bank (tpm2_pcrallocate {BANK}:all+sha1:all, effective after "
            "a TPM restart; swtpm_setup --pcr-banks sha256) or use a TPM that has it")


def ak_keyid_at(tools: Tools, handle: int) -> str | None:
    """Keyid (:func:`sealfl.attestation.keys.keyid`) of the public key at persistent
    ``handle``, or None if the TPM cannot read it out or it is not a P-256 key."""
    with tempfile.TemporaryDirectory(prefix="sealfl-tpm-") as tmp:
        out = os.path.join(tmp, "ak.pem")
        proc = tools.run("tpm2_readpublic", "-c", f"{handle:#x}", "-f", "pem", "-o", out, check=False)
        if proc.returncode != 0:
            return None
        try:
            return _keys.keyid(_keys.load_public_key(Path(out).read_bytes()))
        except (OSError, AttestationError):
            return None


def check_free(tools: Tools, role: Role, *, replace: bool) -> bool:
    """Refuse to provision ``role`` on a TPM that serves another role or another state.

    Returns:
        True if ``role``'s AK handle is taken (and ``replace`` allows replacing it).

    Raises:
        TEEStateError: another role's AK is on this TPM; or this role's AK handle holds a
            key (another state's) and ``replace`` is False -- the message names the key and
            what to do.
        TPMError: the TPM could not list its persistent handles.
    """
    persistent = set(tools.handles("persistent"))
    for other in ROLES.values():
        if other is not role and other.ak_handle in persistent:
            raise TEEStateError(
                f"TPM {tools.tcti} already serves a sealfl {other.what} (its attestation key is at "
                f"{other.ak_handle:#x}); a TPM serves one sealfl role, because both reset PCR 16 at each boot. "
                f"Give the {role.what} its own TPM, or retire the {other.what} from this TPM on purpose "
                f"(tpm2_evictcontrol -C o -c {other.ak_handle:#x}; tpm2_nvundefine {other.floor_nv:#010x} -C o)")
    taken = role.ak_handle in persistent
    if taken and not replace:
        kid = ak_keyid_at(tools, role.ak_handle)
        raise TEEStateError(
            f"TPM {tools.tcti} already holds a sealfl {role.what} attestation key at {role.ak_handle:#x}"
            + (f" (keyid {kid[:16]}…)" if kid else "")
            + f", provisioned for another {role.what} state: provisioning here would replace it, and that state "
            "would stop booting (exit 4). Point SEALFL_TPM_TCTI at another TPM, or replace the key on purpose "
            "with --force (its verifier and key broker then need the new AK)")
    return taken


def probe(tools: Tools, role: Role) -> None:
    """The TPM answers and has the role's bank (:func:`check_banks`); raises as it does."""
    try:
        check_banks(tools, role)
    except TPMError as exc:
        if exc.kind == "tcti":
            raise TPMError(f"no TPM answers at {tools.tcti}: {exc.rc.advice if exc.rc else exc}", command=exc.command,
                           rc=exc.rc) from None
        raise
