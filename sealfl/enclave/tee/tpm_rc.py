"""TPM 2.0 response codes: what a failed tpm2-tools command means and what the operator does.

Pure (no I/O): :func:`decode` turns a ``TSS2_RC`` into a :class:`TpmRc`, :func:`from_stderr`
finds the code tpm2-tools printed (``ERROR: Esys_Load(0x902) - tpm:warn(2.0): ...``).

**Layout** (TPM 2.0 Library Part 2 "Structures", §6.6 ``TPM_RC``, Figures 26-27; TSS 2.0
TCG TSS 2.0 Overview §"Response codes" for the layer byte):

* bits 16-23: the TSS layer (0 = the TPM itself, 10 = TCTI, 11/12 = resource manager; 12
  carries a TPM code from behind a resource manager); a non-TPM layer means the TPM was
  never reached or the TSS refused the call;
* **format-one** (bit 7 set): bits 0-5 the error number (``TPM_RC_FMT1 + E``), bit 6 ``P``
  (bits 8-11 number the *parameter*), else bit 11 says *session* (bits 8-10 its number) or
  *handle* (bits 8-10) -- e.g. ``0x99D`` = ``TPM_RC_POLICY_FAIL`` in session 1, ``0x18B`` =
  ``TPM_RC_HANDLE`` for handle 1;
* **format-zero** (bit 7 clear): bits 0-6 the number, bit 8 ``V`` (TPM 2.0 code), bit 10
  ``T`` (vendor), bit 11 ``S`` (warning) -- e.g. ``0x902`` = ``TPM_RC_OBJECT_MEMORY``, a
  warning: the command was not executed and may succeed later.

**Kinds** (:data:`KINDS`) group the codes by what the operator does; :attr:`TpmRc.transient`
is True for the kinds a caller retries (``resources`` after flushing what it loaded itself,
``busy`` after a pause). Names and numbers: Part 2 Table 16 (``TPM_RC`` constants).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["TpmRc", "KINDS", "decode", "from_stderr", "TRANSIENT_KINDS"]

# -- Part 2 Table 16 ---------------------------------------------------------------------
_FMT0 = {
    0x100: "INITIALIZE", 0x101: "FAILURE", 0x103: "SEQUENCE", 0x10B: "PRIVATE", 0x119: "HMAC",
    0x120: "DISABLED", 0x121: "EXCLUSIVE", 0x124: "AUTH_TYPE", 0x125: "AUTH_MISSING", 0x126: "POLICY",
    0x127: "PCR", 0x128: "PCR_CHANGED", 0x12D: "UPGRADE", 0x12E: "TOO_MANY_CONTEXTS", 0x12F: "AUTH_UNAVAILABLE",
    0x130: "REBOOT", 0x131: "UNBALANCED", 0x142: "COMMAND_SIZE", 0x143: "COMMAND_CODE", 0x144: "AUTHSIZE",
    0x145: "AUTH_CONTEXT", 0x146: "NV_RANGE", 0x147: "NV_SIZE", 0x148: "NV_LOCKED", 0x149: "NV_AUTHORIZATION",
    0x14A: "NV_UNINITIALIZED", 0x14B: "NV_SPACE", 0x14C: "NV_DEFINED", 0x150: "BAD_CONTEXT", 0x151: "CPHASH",
    0x152: "PARENT", 0x153: "NEEDS_TEST", 0x154: "NO_RESULT", 0x155: "SENSITIVE",
    # warnings (TPM_RC_WARN = 0x900)
    0x901: "CONTEXT_GAP", 0x902: "OBJECT_MEMORY", 0x903: "SESSION_MEMORY", 0x904: "MEMORY",
    0x905: "SESSION_HANDLES", 0x906: "OBJECT_HANDLES", 0x907: "LOCALITY", 0x908: "YIELDED", 0x909: "CANCELED",
    0x90A: "TESTING", 0x920: "NV_RATE", 0x921: "LOCKOUT", 0x922: "RETRY", 0x923: "NV_UNAVAILABLE",
    **{0x910 + i: f"REFERENCE_H{i}" for i in range(7)}, **{0x918 + i: f"REFERENCE_S{i}" for i in range(7)},
}
_FMT1 = {
    0x081: "ASYMMETRIC", 0x082: "ATTRIBUTES", 0x083: "HASH", 0x084: "VALUE", 0x085: "HIERARCHY",
    0x087: "KEY_SIZE", 0x088: "MGF", 0x089: "MODE", 0x08A: "TYPE", 0x08B: "HANDLE", 0x08C: "KDF", 0x08D: "RANGE",
    0x08E: "AUTH_FAIL", 0x08F: "NONCE", 0x090: "PP", 0x092: "SCHEME", 0x095: "SIZE", 0x096: "SYMMETRIC",
    0x097: "TAG", 0x098: "SELECTOR", 0x09A: "INSUFFICIENT", 0x09B: "SIGNATURE", 0x09C: "KEY",
    0x09D: "POLICY_FAIL", 0x09F: "INTEGRITY", 0x0A0: "TICKET", 0x0A1: "RESERVED_BITS", 0x0A2: "BAD_AUTH",
    0x0A3: "EXPIRED", 0x0A4: "POLICY_CC", 0x0A5: "BINDING", 0x0A6: "CURVE", 0x0A7: "ECC_POINT",
}

_KIND_OF = {
    **dict.fromkeys(("OBJECT_MEMORY", "SESSION_MEMORY", "MEMORY", "OBJECT_HANDLES", "SESSION_HANDLES",
                     "CONTEXT_GAP", "TOO_MANY_CONTEXTS"), "resources"),
    **dict.fromkeys(("YIELDED", "CANCELED", "TESTING", "RETRY", "NV_RATE", "NV_UNAVAILABLE", "PCR_CHANGED"),
                    "busy"),
    "LOCKOUT": "lockout",
    **dict.fromkeys(("AUTH_FAIL", "BAD_AUTH", "AUTH_MISSING", "AUTH_UNAVAILABLE", "AUTH_TYPE", "AUTH_CONTEXT",
                     "NV_AUTHORIZATION"), "auth"),
    **dict.fromkeys(("HIERARCHY", "DISABLED"), "hierarchy"),
    **dict.fromkeys(("HANDLE",) + tuple(f"REFERENCE_H{i}" for i in range(7))
                    + tuple(f"REFERENCE_S{i}" for i in range(7)), "handle"),
    **dict.fromkeys(("POLICY_FAIL", "POLICY", "POLICY_CC", "EXPIRED", "TICKET", "CPHASH"), "policy"),
    **dict.fromkeys(("INTEGRITY", "BINDING", "PARENT", "BAD_CONTEXT", "SENSITIVE"), "foreign-object"),
    "NV_DEFINED": "nv-defined", "NV_SPACE": "nv-space", "NV_UNINITIALIZED": "nv-uninitialized",
    "NV_LOCKED": "nv-locked",
    **dict.fromkeys(("FAILURE", "NEEDS_TEST", "NO_RESULT"), "failure"),
    "INITIALIZE": "initialize", "REBOOT": "initialize",
    "LOCALITY": "locality",
    **dict.fromkeys(("HASH", "SELECTOR", "CURVE", "SCHEME", "ASYMMETRIC", "KEY_SIZE", "SYMMETRIC", "MODE", "KDF",
                     "COMMAND_CODE"), "unsupported"),
}

#: kind -> (what it means, what the operator does). The operator's part never advises
#: re-provisioning: whether a key is really gone is decided by listing the TPM's handles.
KINDS: dict[str, tuple[str, str]] = {
    "resources": ("the TPM is out of memory for loaded objects or sessions (other software keeps objects loaded "
                  "in it)",
                  "sealfl flushed what it had loaded and retried; run a resource manager (SEALFL_TPM_TCTI="
                  "device:/dev/tpmrm0, or tpm2-abrmd) or flush the stale objects (tpm2_getcap handles-transient; "
                  "tpm2_flushcontext -t) once nothing else needs them. The device's keys are intact: do not "
                  "re-provision"),
    "busy": ("the TPM is busy (self-test, NV write rate, a PCR changed during the command)",
             "retry in a few seconds; sealfl already retried"),
    "lockout": ("the TPM is in dictionary-attack lockout after failed authorizations",
                "wait for the lockout to expire (tpm2_getcap properties-variable: TPM2_PT_LOCKOUT_*) or clear it "
                "with the lockout authorization (tpm2_dictionarylockout --clear-lockout); the keys are intact"),
    "auth": ("the TPM refused the authorization (sealfl uses the owner and endorsement hierarchies with empty "
             "authorization)",
             "the TPM owner set a password on a hierarchy (tpm2_changeauth): sealfl needs empty owner and "
             "endorsement authorization, or a TPM of its own"),
    "hierarchy": ("a TPM hierarchy sealfl uses (owner or endorsement) is disabled",
                  "enable it (firmware TPM settings, or tpm2_hierarchycontrol)"),
    "handle": ("the TPM has no object at that handle", "see the message for whether sealfl's key is there"),
    "policy": ("the TPM's policy is not satisfied: the PCR values differ from those the data was sealed to",
               "the measured code or boot state changed since sealing; re-seal the secret from its source"),
    "foreign-object": ("the TPM refused the object: it was created by another TPM, under another owner seed "
                       "(the TPM was cleared), or was modified",
                       "the sealed data cannot be recovered on this TPM; re-create it"),
    "nv-defined": ("the NV index is already defined", "another program or another sealfl role uses it"),
    "nv-space": ("the TPM's NV memory is full", "undefine NV indices you no longer need (tpm2_getcap "
                 "handles-nv-index; tpm2_nvundefine)"),
    "nv-uninitialized": ("the NV index was defined but never written (an interrupted set-up)",
                         "see the message for what sealfl found in the TPM"),
    "nv-locked": ("the NV index is write- or read-locked", "restart the TPM or the machine"),
    "failure": ("the TPM is in failure mode", "restart the TPM (swtpm) or the machine; check the TPM's firmware"),
    "initialize": ("the TPM was not started (TPM2_Startup missing)",
                   "start it: tpm2_startup -c (swtpm: --flags startup-clear)"),
    "locality": ("the command is not allowed at this locality", "run sealfl where it can use locality 0"),
    "unsupported": ("the TPM does not support an algorithm sealfl needs (ECC P-256, SHA-256)",
                    "use a TPM 2.0 with ECC P-256 and a SHA-256 PCR bank (sealfl device doctor)"),
    "tcti": ("the TPM could not be reached", "check SEALFL_TPM_TCTI (e.g. device:/dev/tpmrm0 or "
             "swtpm:host=127.0.0.1,port=2321), that the TPM or swtpm runs, and that this user may open it"),
    "other": ("the TPM returned an error", "see the tpm2-tools message"),
}

#: kinds a caller retries
TRANSIENT_KINDS = frozenset({"resources", "busy"})
_TCTI_LAYER, _RM_LAYER, _RM_TPM_LAYER = 10, 11, 12


@dataclass(frozen=True)
class TpmRc:
    """A decoded response code.

    Attributes:
        code: the full ``TSS2_RC`` (32 bits).
        name: ``TPM_RC_<NAME>`` without the prefix (``"OBJECT_MEMORY"``), or ``""`` if unknown
            or not from the TPM.
        kind: key of :data:`KINDS`.
        where: ``"handle 1"``, ``"session 1"``, ``"parameter 2"`` or ``""``.
    """

    code: int
    name: str
    kind: str
    where: str = ""

    @property
    def transient(self) -> bool:
        """True when retrying may succeed (``resources``: after flushing; ``busy``: after a pause)."""
        return self.kind in TRANSIENT_KINDS

    @property
    def meaning(self) -> str:
        """What the code means (one clause)."""
        return KINDS[self.kind][0]

    @property
    def advice(self) -> str:
        """What the operator does."""
        return KINDS[self.kind][1]

    def label(self) -> str:
        """``"TPM_RC_OBJECT_MEMORY 0x902"`` (with ``", session 1"`` where it applies)."""
        head = f"TPM_RC_{self.name} {self.code:#x}" if self.name else f"TSS2_RC {self.code:#x}"
        return head + (f", {self.where}" if self.where else "")


def decode(code: int) -> TpmRc:
    """Decode a ``TSS2_RC`` (layout in the module docstring). Pure; never raises for an int.

    Args:
        code: the response code as tpm2-tools prints it (``0x902``, ``0x99d``, ``0xa000a``).

    Returns:
        a :class:`TpmRc` (``kind`` ``"tcti"`` for the TCTI layer, ``"other"`` when unknown).
    """
    code = int(code) & 0xFFFFFFFF
    layer = (code >> 16) & 0xFF
    if layer == _TCTI_LAYER:
        return TpmRc(code, "", "tcti")
    if layer not in (0, _RM_TPM_LAYER):
        return TpmRc(code, "", "other")
    rc = code & 0xFFF
    where = ""
    if rc & 0x080:  # format-one
        base = 0x080 | (rc & 0x03F)
        n = (rc >> 8) & 0xF
        if rc & 0x040:
            where = f"parameter {n}"
        elif n:
            where = f"session {n & 0x7}" if n & 0x8 else f"handle {n & 0x7}"
        name = _FMT1.get(base, "")
    else:
        base = rc
        name = _FMT0.get(base, "")
    return TpmRc(code, name, _KIND_OF.get(name, "other"), where)


_RC_IN_TOOLS = re.compile(r"\b[A-Za-z0-9_]+\((0x[0-9A-Fa-f]{1,8})\)\s*-")
_RC_FALLBACK = re.compile(r"ErrorCode \((0x[0-9A-Fa-f]{1,8})\)")
_TCTI_TEXT = re.compile(r"Could not load tcti|Failed to instantiate TCTI|Cannot connect to swtpm|"
                        r"Failed to open specified TCTI device", re.I)


def from_stderr(stderr: str) -> TpmRc | None:
    """The response code in tpm2-tools' stderr (the last ``Name(0x...) -`` of an ``ERROR:``
    line; else the last ``ErrorCode (0x...)``), or a ``tcti`` code when the tools could not
    load the TCTI (no code is printed then); None if there is neither. Pure."""
    found = _RC_IN_TOOLS.findall(stderr) or _RC_FALLBACK.findall(stderr)
    if found:
        return decode(int(found[-1], 16))
    if _TCTI_TEXT.search(stderr):
        return TpmRc(_TCTI_LAYER << 16, "", "tcti")
    return None
