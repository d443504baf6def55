"""``TpmTEE``: the TEE interface on a TPM 2.0 (``/dev/tpmrm0`` or ``swtpm``), via tpm2-tools.

**Why the tpm2-tools CLI, not tpm2-pytss.** PyPI ``tpm2-pytss`` is a source build that needs
``libtss2-dev`` and ``pkg-config`` (a C tool chain on every device); the Debian package
``tpm2-tools`` (5.x) is a prebuilt binary with a stable command line, and the few
operations sealfl needs (extend, read, quote, seal/unseal, NV, create EK/AK) are one
command each. Each command runs with a timeout (:mod:`sealfl.enclave.tee.tpm_tools`); a
failure's response code is decoded into what it means and what to do
(:mod:`sealfl.enclave.tee.tpm_rc`), transient ones are retried, and what sealfl loaded is
flushed after use -- only that: without a resource manager (``tpm2-abrmd``, or the kernel's
``/dev/tpmrm0``) other software's objects share the TPM's few slots (``0x902``).

**Which TPM.** The TCTI string (tpm2-tools' ``TPM2TOOLS_TCTI``) comes from the environment
variable :data:`TCTI_ENV` (``SEALFL_TPM_TCTI``), else from ``tee.json``, else
``device:/dev/tpmrm0``. Tests use ``swtpm:host=127.0.0.1,port=P``.

**Roles and allocation** (:mod:`sealfl.enclave.tee.tpm_alloc`; same table in the README):
a ``device`` uses AK handle 0x81010010, floor NV index 0x01500010 and SHA-256 PCRs 16
(runtime code, then configuration) and 23 (release root digest); a ``release-enclave`` AK
0x81010020, NV 0x01500020 and PCR 16. A TPM serves one role and one state at a time:
provisioning refuses a TPM that holds another role's AK, or (without ``replace``) another
state's AK of the same role; provisioning and every :meth:`TpmTEE.load` refuse a TPM whose
SHA-256 bank lacks the role's PCRs.

Why resettable PCRs: ``sealfl device boot`` is a user-space process that (re)boots a release
without an OS reboot, and PCRs 16 and 23 are the only ones software may reset at locality 0
(TCG PC Client Platform Firmware Profile, PCR usage); 0-15 belong to firmware/boot loader/OS
and stay until a TPM restart, 17-22 to DRTM (locality 4). So each boot resets the role's
PCRs (:meth:`TpmTEE.load` with ``reset_pcrs=True``) and extends them from zero. The price: any
process with TPM access at locality 0 (root, or the ``tss`` group on ``/dev/tpmrm0``) can
reset them and replay good values, so a quote proves the sealfl state only as far as the OS
is trusted. A production image that measures sealfl from its boot chain (IMA into PCR 10,
or a unified kernel image into 11) should add those PCRs to the verifier's policy.

**Provisioning** (:meth:`TpmTEE.create`): an ECC P-256 EK (``tpm2_createek``) and, under the
endorsement hierarchy, an ECDSA/SHA-256 restricted signing AK (``tpm2_createak``), made
persistent at the role's AK handle; its public part is exported as ``ak.pem`` for the
verifier. The anti-rollback floor lives in the role's NV index
(:mod:`sealfl.attestation.tee_floor` record, owner read/write); provisioning keeps an existing
floor (re-bound to the new AK), so wiping the file-system state never lowers it. A failed
provisioning leaves no state directory behind.

**Whether a key is gone** is decided by listing the TPM's persistent handles and NV indices
(``tpm2_getcap``), never from a failed read: a read fails for many reasons (object memory
full, lockout, ...), and advising re-provisioning then would destroy a good identity.

**Sealing** (:mod:`sealfl.enclave.tee.tpm_seal`): a fresh AES-256 key sealed as a TPM
keyed-hash object under the owner's primary key with a ``PolicyPCR`` policy; the data
AES-256-GCM encrypted under it.

State directory (mode 0700, files 0600): ``tee.json`` ``{"backend": "tpm", "format": 1,
"tcti": str, "role": str}`` (``role`` absent: ``device``, as written by sealfl 0.2) and
``ak.pem`` (AK public key). No secret is on disk.
"""

from __future__ import annotations

import base64
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from sealfl.attestation import keys as _keys
from sealfl.attestation.canonical import canonical_json, parse_object
from sealfl.attestation.errors import AttestationError
from sealfl.attestation.quote import DIGEST_SIZE, PCR_BANK, pcr_digest, qualifying_data
from sealfl.attestation.tee_floor import FLOOR_RECORD_SIZE, FloorRecord
from sealfl.attestation.tpm_attest import parse_quote_attest
from sealfl.common.fields import Fields
from sealfl.common.fsutil import atomic_write, check_private_file, ensure_private_dir
from sealfl.enclave.errors import TEEError, TEEStateError
from sealfl.enclave.tee import tpm_seal
from sealfl.enclave.tee.interface import TEE, check_floor_write
from sealfl.enclave.tee.interface import check_pcr_digest as _check_digest
from sealfl.enclave.tee.interface import check_pcr_index as _check_index
from sealfl.enclave.tee.tpm_alloc import DEFAULT_ROLE, ROLES, Role, check_free, probe, role_of
from sealfl.enclave.tee.tpm_tools import DEFAULT_TCTI, TCTI_ENV, Tools, tcti_of

__all__ = ["TpmTEE", "TEE_CLASS", "TCTI_ENV", "DEFAULT_TCTI", "AK_HANDLE", "FLOOR_NV_INDEX", "RESET_PCRS", "ROLES"]

log = logging.getLogger(__name__)

#: The device role's AK handle, floor NV index and PCRs (:data:`ROLES` has every role's).
AK_HANDLE = f"{ROLES['device'].ak_handle:#x}"
FLOOR_NV_INDEX = f"{ROLES['device'].floor_nv:#010x}"
RESET_PCRS = ROLES["device"].pcrs
_FORMAT = 1


def _parse_tee_json(data: bytes, root: Path) -> tuple[str, Role]:
    fields = Fields(str(root / "tee.json"), TEEStateError)
    meta = parse_object(data, fields)
    fields.only(meta, ("backend", "format", "tcti", "role"))
    if fields.get(meta, "backend", "string") != "tpm":
        raise fields.fail("backend", f"is {meta['backend']!r:.40}, not 'tpm'")
    fields.get(meta, "format", "integer", lo=_FORMAT, hi=_FORMAT)
    role = fields.get(meta, "role", "choice", choices=tuple(ROLES), default=DEFAULT_ROLE)
    return fields.get(meta, "tcti", "string", max_len=512), ROLES[role]


class TpmTEE(TEE):
    """TPM 2.0 TEE (see module docstring). Use :meth:`create` / :meth:`load`."""

    backend = "tpm"
    insecure = False

    def __init__(self, state_dir: Path, tools: Tools, ak_pem: bytes, role: Role = ROLES[DEFAULT_ROLE]) -> None:
        """Internal; use :meth:`create` or :meth:`load`."""
        self._dir = Path(state_dir)
        self._tools = tools
        self._ak_pem = ak_pem
        self.role = role

    @property
    def state_dir(self) -> Path:
        """The state directory of this TEE."""
        return self._dir

    @property
    def tcti(self) -> str:
        """The TCTI this TEE talks to."""
        return self._tools.tcti

    # -- lifecycle ---------------------------------------------------------------------

    @classmethod
    def create(cls, state_dir: str | os.PathLike, *, role: str = DEFAULT_ROLE, replace: bool = False) -> "TpmTEE":
        """Provision ``role`` on the TPM: EK, AK under the endorsement hierarchy made
        persistent at the role's handle, ``ak.pem`` exported, floor record (re-)bound to
        the new AK, keeping an existing floor. The TPM is checked first (it answers, has
        the SHA-256 bank for the role's PCRs, serves no other role, and holds no other
        state's AK unless ``replace``); on any failure ``state_dir`` is left as it was.

        Raises:
            TEEStateError: ``state_dir`` already holds TEE state; the TPM serves another
                role, or (without ``replace``) holds another state's AK of this role.
            TPMError: the TPM does not answer or a command failed (what it means, what to do).
            TEEError: the TPM lacks the SHA-256 bank for the role's PCRs; unknown role.
        """
        root = Path(state_dir)
        r = role_of(role)
        if (root / "tee.json").exists() or (root / "ak.pem").exists():
            raise TEEStateError(f"{root} already holds TEE state; use TpmTEE.load or pick an empty directory")
        tools = Tools(tcti_of(None))
        probe(tools, r)
        taken = check_free(tools, r, replace=replace)
        old = cls._old_floor(tools, r)
        made = not root.exists()
        ensure_private_dir(root)
        persisted = False
        try:
            ak_pem = cls._make_ak(tools, r, taken)
            persisted = True
            atomic_write(root / "ak.pem", ak_pem, 0o600)
            tee = cls(root, tools, ak_pem, r)
            if old is False:
                tools.run("tpm2_nvdefine", f"{r.floor_nv:#010x}", "-C", "o", "-s", str(FLOOR_RECORD_SIZE),
                          "-a", "ownerread|ownerwrite")
            if isinstance(old, FloorRecord):
                log.warning("TPM %s keeps its rollback floor %s across re-provisioning", tools.tcti, old.version)
                tee._nv_write(old.rebound(tee.ak_keyid()))
            else:
                tee._nv_write(FloorRecord(tee.ak_keyid()))
            atomic_write(root / "tee.json", canonical_json({"backend": "tpm", "format": _FORMAT, "tcti": tools.tcti,
                                                            "role": r.name}), 0o600)
        except BaseException:
            if persisted:  # best effort: no key of a state that does not exist stays in the TPM
                tools.run("tpm2_evictcontrol", "-C", "o", "-c", f"{r.ak_handle:#x}", check=False)
            if made:
                shutil.rmtree(root, ignore_errors=True)
            else:
                (root / "ak.pem").unlink(missing_ok=True)
            raise
        return tee

    @staticmethod
    def _old_floor(tools: Tools, r: Role):
        """The floor record already in the role's NV index; ``None`` if the index is defined
        but unwritten or unreadable as a record (it is overwritten), ``False`` if undefined."""
        if r.floor_nv not in tools.handles("nv-index"):
            return False
        tee = TpmTEE(Path("."), tools, b"", r)
        try:
            return tee.read_floor()
        except TEEStateError as exc:
            log.warning("TPM %s: the rollback floor at NV %#010x is not readable (%s); writing a new one",
                        tools.tcti, r.floor_nv, exc)
            return None

    @staticmethod
    def _make_ak(tools: Tools, r: Role, taken: bool) -> bytes:
        handle = f"{r.ak_handle:#x}"
        with tempfile.TemporaryDirectory(prefix="sealfl-tpm-") as tmp, tools.scope():
            ek, ak = os.path.join(tmp, "ek.ctx"), os.path.join(tmp, "ak.ctx")
            pem = os.path.join(tmp, "ak.pem")
            tools.run("tpm2_createek", "-c", ek, "-G", "ecc", "-u", os.path.join(tmp, "ek.pub"))
            tools.run("tpm2_createak", "-C", ek, "-c", ak, "-G", "ecc", "-g", "sha256", "-s", "ecdsa",
                      "-u", pem, "-f", "pem", "-n", os.path.join(tmp, "ak.name"))
            tools.flush()
            if taken:
                log.warning("replacing the persistent %s AK at %s on TPM %s (--force)", r.what, handle, tools.tcti)
                tools.run("tpm2_evictcontrol", "-C", "o", "-c", handle)
            tools.run("tpm2_evictcontrol", "-C", "o", "-c", ak, handle)
            return Path(pem).read_bytes()

    @classmethod
    def load(cls, state_dir: str | os.PathLike, *, reset_pcrs: bool = True) -> "TpmTEE":
        """Open the provisioned TPM; ``reset_pcrs=True`` (a new boot) resets the role's PCRs.

        Raises:
            TEEStateError: state files missing, malformed or group/other-accessible, or the
                TPM's persistent AK is really absent (not listed among its persistent
                handles: TPM cleared, or another TPM) or differs from ``ak.pem`` (another
                state took the TPM over): re-provision on purpose.
            TPMError: the TPM does not answer or a command failed -- e.g. its object memory
                is full (the key is intact: the message says so and what to do).
            TEEError: the TPM lacks the SHA-256 bank for the role's PCRs.
        """
        root = Path(state_dir)
        try:
            for name in ("tee.json", "ak.pem"):
                if not check_private_file(root / name):
                    raise TEEStateError(f"{root / name} is accessible by group/others; chmod 600 it")
            tcti, r = _parse_tee_json((root / "tee.json").read_bytes(), root)
            ak_pem = (root / "ak.pem").read_bytes()
        except OSError as exc:
            raise TEEStateError(f"cannot load TPM TEE state from {root}: {exc}") from exc
        tools = Tools(tcti_of(tcti))
        probe(tools, r)
        handle = f"{r.ak_handle:#x}"
        with tempfile.TemporaryDirectory(prefix="sealfl-tpm-") as tmp:
            out = os.path.join(tmp, "ak.pem")
            proc = tools.run("tpm2_readpublic", "-c", handle, "-f", "pem", "-o", out, check=False)
            if proc.returncode != 0:
                if r.ak_handle not in tools.handles("persistent"):
                    raise TEEStateError(f"TPM {tools.tcti} has no attestation key at {handle} (the TPM was cleared, "
                                        "or this is another TPM): re-provision the device on purpose "
                                        "(sealfl device provision --force)")
                raise tools.error("tpm2_readpublic", proc, f"reading the attestation key at {handle}")
            in_tpm = Path(out).read_bytes()
        try:
            same = _keys.keyid(_keys.load_public_key(in_tpm)) == _keys.keyid(_keys.load_public_key(ak_pem))
        except AttestationError as exc:
            raise TEEStateError(f"{root / 'ak.pem'}: {exc}") from exc
        if not same:
            raise TEEStateError(f"the AK in TPM {tools.tcti} at {handle} is not the one in {root / 'ak.pem'}: the "
                                "TEE state belongs to another key; re-provision the device on purpose "
                                "(sealfl device provision --force)")
        tee = cls(root, tools, ak_pem, r)
        if reset_pcrs:
            tools.run("tpm2_pcrreset", *map(str, r.pcrs))
        return tee

    # -- TEE interface ---------------------------------------------------------------

    def extend(self, pcr: int, digest: bytes) -> None:
        """See :meth:`TEE.extend` (``tpm2_pcrextend``)."""
        index = _check_index(pcr)
        self._tools.run("tpm2_pcrextend", f"{index}:sha256={_check_digest(digest, 'extend digest').hex()}")

    def read(self, pcrs: Sequence[int]) -> dict[int, bytes]:
        """See :meth:`TEE.read` (``tpm2_pcrread``).

        Raises:
            TEEError: bad index, or the TPM returned no SHA-256 value (bank not allocated).
        """
        indices = sorted({_check_index(i) for i in pcrs})
        if not indices:
            return {}
        with tempfile.TemporaryDirectory(prefix="sealfl-tpm-") as tmp:
            out = os.path.join(tmp, "pcrs.bin")
            self._tools.run("tpm2_pcrread", f"sha256:{','.join(map(str, indices))}", "-o", out)
            raw = Path(out).read_bytes()
        if len(raw) != DIGEST_SIZE * len(indices):
            raise TEEError(f"TPM {self.tcti} returned {len(raw)} bytes for {len(indices)} SHA-256 PCRs {indices}: its "
                           "SHA-256 bank is not allocated for them (sealfl device doctor shows the banks)")
        return {i: raw[k * DIGEST_SIZE:(k + 1) * DIGEST_SIZE] for k, i in enumerate(indices)}

    def quote(self, purpose: str, data: bytes, pcrs: Sequence[int]) -> dict:
        """See :meth:`TEE.quote`: ``TPM2_Quote`` by the AK; the dict carries ``attest``
        (format in :mod:`sealfl.attestation.quote`). The TPM's signature is stored in its
        canonical low-S DER form (:func:`sealfl.attestation.keys.canonical_signature`)."""
        indices = sorted({_check_index(i) for i in pcrs})
        if not indices:
            raise TEEError("a quote needs at least one PCR")
        try:
            nonce = qualifying_data(purpose, data)
        except AttestationError as exc:
            raise TEEError(f"cannot produce quote: {exc}") from exc
        with tempfile.TemporaryDirectory(prefix="sealfl-tpm-") as tmp:  # a quote leaves nothing loaded
            msg, sig, pcr_out = (os.path.join(tmp, n) for n in ("msg", "sig", "pcrs"))
            self._tools.run("tpm2_quote", "-c", f"{self.role.ak_handle:#x}", "-l",
                            f"sha256:{','.join(map(str, indices))}", "-q", nonce.hex(), "-m", msg, "-s", sig,
                            "-o", pcr_out, "-g", "sha256", "-f", "plain")
            attest, signature = Path(msg).read_bytes(), Path(sig).read_bytes()
        try:
            signature = _keys.canonical_signature(signature)
        except AttestationError as exc:
            raise TEEError(f"TPM {self.tcti} returned a quote signature that is not DER ECDSA: {exc}") from exc
        info = parse_quote_attest(attest)
        values = self.read(indices)
        if info.pcr_digest.hex() != pcr_digest(values):
            raise TEEError("a PCR changed while quoting (pcrDigest differs from the values read); quote again")
        return {"backend": "tpm", "pcr_bank": PCR_BANK, "pcrs": {str(i): values[i].hex() for i in indices},
                "pcr_digest": info.pcr_digest.hex(), "purpose": purpose, "nonce": info.extra_data.hex(),
                "attest": base64.b64encode(attest).decode("ascii"),
                "signature": base64.b64encode(signature).decode("ascii")}

    def public_key(self) -> bytes:
        """See :meth:`TEE.public_key`."""
        return self._ak_pem

    def seal(self, data: bytes, policy: Mapping[int, bytes] | None = None) -> bytes:
        """See :meth:`TEE.seal`; blob format in :mod:`sealfl.enclave.tee.tpm_seal`."""
        pol = {_check_index(i): _check_digest(v, f"policy value of PCR {i}") for i, v in (policy or {}).items()}
        return tpm_seal.seal(self._tools, data, pol)

    def unseal(self, blob: bytes) -> bytes:
        """See :meth:`TEE.unseal` (:func:`sealfl.enclave.tee.tpm_seal.unseal`)."""
        return tpm_seal.unseal(self._tools, blob)

    def read_floor(self) -> FloorRecord:
        """See :meth:`TEE.read_floor` (``tpm2_nvread`` of the role's NV index).

        Raises:
            TEEStateError: the index is really absent (not listed by the TPM), defined but
                never written, or holds no floor record: re-provision on purpose.
            TPMError: the read failed for another reason (what it means, what to do).
        """
        index = f"{self.role.floor_nv:#010x}"
        with tempfile.TemporaryDirectory(prefix="sealfl-tpm-") as tmp:
            out = os.path.join(tmp, "nv")
            proc = self._tools.run("tpm2_nvread", index, "-C", "o", "-s", str(FLOOR_RECORD_SIZE), "-o", out,
                                   check=False)
            if proc.returncode != 0:
                rc = getattr(proc, "rc", None)
                if rc is not None and rc.kind == "nv-uninitialized":
                    raise TEEStateError(f"TPM {self.tcti}: the rollback floor NV index {index} was defined but never "
                                        "written (provisioning was interrupted): re-provision the device on purpose "
                                        "(sealfl device provision --force)")
                if self.role.floor_nv not in self._tools.handles("nv-index"):
                    raise TEEStateError(f"TPM {self.tcti} holds no rollback floor at NV index {index}: re-provision "
                                        "the device on purpose (sealfl device provision --force)")
                raise self._tools.error("tpm2_nvread", proc, f"reading the rollback floor at NV index {index}")
            data = Path(out).read_bytes()
        try:
            return FloorRecord.from_bytes(data)
        except AttestationError as exc:
            raise TEEStateError(f"TPM NV index {index}: {exc}") from exc

    def write_floor(self, record: FloorRecord) -> None:
        """See :meth:`TEE.write_floor` (``tpm2_nvwrite``)."""
        check_floor_write(self.read_floor(), record)
        self._nv_write(record)

    # -- helpers ----------------------------------------------------------------------

    def _nv_write(self, record: FloorRecord) -> None:
        with tempfile.TemporaryDirectory(prefix="sealfl-tpm-") as tmp:
            path = os.path.join(tmp, "nv")
            Path(path).write_bytes(record.to_bytes())
            self._tools.run("tpm2_nvwrite", f"{self.role.floor_nv:#010x}", "-C", "o", "-i", path)


#: Backend registry hook used by :func:`sealfl.enclave.tee.interface.backend_class`.
TEE_CLASS = TpmTEE
