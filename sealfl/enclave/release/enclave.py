"""The release enclave: holds the release signing key sealed to its own code measurement.

Boot protocol (:meth:`ReleaseEnclave.open`): load the TEE with PCRs reset (a reboot),
extend :func:`~sealfl.enclave.measurement.measure_release_enclave` into PCR 16, then unseal
the release key, which was sealed to ``{16: PCR value after that extend}``. Changed
enclave code -> different PCR 16 -> :class:`UnsealError`; the key never leaves the TEE
policy in plaintext on disk.

State directory (mode 0700)::

    enclave.json          {"schema": "sealfl.release-enclave/v1", "backend", "measurement_pcr": 16,
                           "release_keyid"}
    tee/                  TEE backend state (see sealfl.enclave.tee.sim)
    release_key.sealed    release private key (PKCS#8 PEM) sealed to PCR 16, mode 0600
    release_key.pub.pem   release public key
    secrets/<name>.sealed further secrets sealed to the same policy (e.g. a CKKS secret context)
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from Crypto.PublicKey import ECC

from sealfl.attestation import keys as _keys
from sealfl.attestation.bundle import assemble_release
from sealfl.attestation.canonical import canonical_json, parse_object
from sealfl.attestation.errors import AttestationError, VerificationError
from sealfl.attestation.quote import CHALLENGE_PURPOSE, RELEASE_PURPOSE
from sealfl.attestation.release import TrustAnchors, verify_release
from sealfl.attestation.trust import DEFAULT_MAX_VERSION_STEP, trust_anchor_files, write_trust_anchors
from sealfl.common.fields import Fields
from sealfl.common.fsutil import atomic_write, ensure_private_dir
from sealfl.enclave import measurement as _measure
from sealfl.enclave.errors import EnclaveError, ReleaseWriteError, SecretNotFoundError, TEEStateError, UnsealError
from sealfl.enclave.tee.backends import BACKENDS, create_tee, load_tee
from sealfl.enclave.tee.interface import TEE

__all__ = ["ReleaseEnclave", "ENCLAVE_SCHEMA"]

log = logging.getLogger(__name__)

ENCLAVE_SCHEMA = "sealfl.release-enclave/v1"
_SECRET_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_PCR = _measure.RELEASE_ENCLAVE_PCR


def _parse_enclave_json(data: bytes, root: Path) -> dict:
    """Parse ``enclave.json``; every field type-checked. Raises TEEStateError naming the field."""
    fields = Fields(str(root / "enclave.json"), TEEStateError)
    meta = parse_object(data, fields, "this is not a release enclave state dir")
    if meta.get("schema") != ENCLAVE_SCHEMA:
        raise fields.fail("schema", f"is {meta.get('schema')!r:.80}, expected {ENCLAVE_SCHEMA!r}")
    fields.only(meta, ("schema", "backend", "measurement_pcr", "release_keyid"))
    fields.get(meta, "backend", "choice", choices=BACKENDS)
    fields.get(meta, "measurement_pcr", "integer", lo=_PCR, hi=_PCR)
    fields.get(meta, "release_keyid", "hex64")
    return meta


class ReleaseEnclave:
    """A booted release enclave (use :meth:`create` or :meth:`open`, not the constructor).

    Attributes:
        state_dir: the enclave's state directory (Path).
        tee: the :class:`~sealfl.enclave.tee.interface.TEE` it runs on.
        backend: TEE backend name.
    """

    def __init__(self, state_dir: Path, tee: TEE, signing_key: ECC.EccKey) -> None:
        """Internal; use :meth:`create` or :meth:`open`."""
        self.state_dir = Path(state_dir)
        self.tee = tee
        self.backend = tee.backend
        self._key = signing_key

    # -- lifecycle ---------------------------------------------------------------------

    @staticmethod
    def _boot(tee: TEE) -> dict[int, bytes]:
        """Extend the enclave code measurement into PCR 16; return the resulting policy."""
        tee.extend(_PCR, _measure.measure_release_enclave())
        return tee.read([_PCR])

    @classmethod
    def create(cls, state_dir: str | os.PathLike, backend: str = "sim") -> "ReleaseEnclave":
        """Provision a new enclave: fresh TEE, fresh ECDSA P-256 release key sealed to PCR 16.

        Args:
            state_dir: a non-existent or empty directory.
            backend: TEE backend (``"sim"``, or ``"tpm"``: the ``release-enclave`` role's AK
                handle, NV index and PCR 16 (:mod:`sealfl.enclave.tee.tpm_alloc`); a TPM that
                serves a device is refused).

        Raises:
            TEEStateError: ``state_dir`` is not empty.
            TEEError: unknown/unavailable backend.
        """
        root = Path(state_dir)
        if root.exists() and any(root.iterdir()):
            raise TEEStateError(f"{root} is not empty; open it with ReleaseEnclave.open or choose a new directory")
        ensure_private_dir(root)
        try:
            tee = create_tee(backend, root / "tee", role="release-enclave")
        except BaseException:
            if not any(root.iterdir()):
                root.rmdir()  # nothing of a half-made enclave stays behind
            raise
        policy = cls._boot(tee)
        key = _keys.generate_key()
        atomic_write(root / "release_key.sealed", tee.seal(_keys.private_key_to_pem(key), policy), 0o600)
        atomic_write(root / "release_key.pub.pem", _keys.public_key_to_pem(key), 0o644)
        meta = {"schema": ENCLAVE_SCHEMA, "backend": backend, "measurement_pcr": _PCR,
                "release_keyid": _keys.keyid(key.public_key())}
        atomic_write(root / "enclave.json", canonical_json(meta) + b"\n", 0o600)
        log.info("created release enclave in %s (backend %s, release keyid %s)", root, backend,
                 meta["release_keyid"])
        return cls(root, tee, key)

    @classmethod
    def open(cls, state_dir: str | os.PathLike) -> "ReleaseEnclave":
        """Boot an existing enclave: reset PCRs, extend the measurement, unseal the release key.

        Raises:
            TEEStateError: the state directory is missing or malformed.
            UnsealError: the enclave code measurement differs from the one the key was
                sealed to (code changed), or the sealed key was tampered with.
        """
        root = Path(state_dir)
        try:
            raw = (root / "enclave.json").read_bytes()
            blob = (root / "release_key.sealed").read_bytes()
        except OSError as exc:
            raise TEEStateError(f"{root} is not a release enclave state dir ({exc}); create one first") from exc
        meta = _parse_enclave_json(raw, root)
        tee = load_tee(meta["backend"], root / "tee", reset_pcrs=True)
        cls._boot(tee)
        try:
            pem = tee.unseal(blob)
        except UnsealError as exc:
            raise UnsealError(
                f"release enclave in {root} cannot unseal its release key: {exc}. The enclave code "
                "measurement changed since provisioning; restore the original code or provision a new "
                "enclave (ReleaseEnclave.create) and re-export trust anchors to devices"
            ) from exc
        key = _keys.load_private_key(pem)
        if _keys.keyid(key.public_key()) != meta["release_keyid"]:
            raise TEEStateError(f"unsealed release key does not match enclave.json keyid in {root}")
        log.info("release enclave %s booted, measurement %s", root, tee.read([_PCR])[_PCR].hex())
        return cls(root, tee, key)

    # -- identity ----------------------------------------------------------------------

    @property
    def release_public_key(self) -> ECC.EccKey:
        """The release public key (ECDSA P-256) devices pin."""
        return self._key.public_key()

    @property
    def measurement(self) -> dict[int, str]:
        """Expected PCRs of this enclave, ``{16: lowercase hex}`` (current PCR 16 value)."""
        return {_PCR: self.tee.read([_PCR])[_PCR].hex()}

    def trust_anchors(self, min_version: int = 0,
                      max_version_step: int = DEFAULT_MAX_VERSION_STEP) -> TrustAnchors:
        """In-memory :class:`TrustAnchors` for this enclave (what :meth:`export_trust` writes)."""
        return TrustAnchors(
            release_public_keys=(self.release_public_key,),
            ak_public_key=self.tee.ak_public_key(),
            expected_pcrs=self.measurement,
            allowed_backends=frozenset({self.backend}),
            allow_insecure_sim=self.tee.insecure,
            min_version=min_version,
            max_version_step=max_version_step,
        )

    def export_trust(self, trust_dir: str | os.PathLike, min_version: int = 0, *,
                     max_version_step: int = DEFAULT_MAX_VERSION_STEP, overwrite: bool = False) -> Path:
        """Write the trust directory a device pins (release key, AK, policy with ``{16: hex}``).

        For the ``sim`` backend the policy allows ``"sim"`` and is marked
        ``allow_insecure_sim: true``.

        Raises:
            TrustAnchorError: trust files exist and ``overwrite`` is False.
        """
        anchors = self.trust_anchors(min_version, max_version_step)
        files = trust_anchor_files(
            release_public_keys=anchors.release_public_keys,
            ak_public_key=anchors.ak_public_key,
            expected_pcrs=anchors.expected_pcrs,
            allowed_backends=anchors.allowed_backends,
            allow_insecure_sim=anchors.allow_insecure_sim,
            min_version=min_version,
            max_version_step=max_version_step,
        )
        return write_trust_anchors(trust_dir, files, overwrite=overwrite)

    def attest(self, nonce: bytes) -> dict:
        """A fresh challenge quote over PCR 16 for ``nonce`` (1..64 bytes; for key brokers and
        remote verifiers). Its purpose is ``"challenge"``: it never verifies as a release
        attestation, whatever ``nonce`` is (see :mod:`sealfl.attestation.quote`).

        Raises:
            TEEError: ``nonce`` is not 1..64 bytes.
        """
        return self.tee.quote(CHALLENGE_PURPOSE, nonce, [_PCR])

    # -- releases ----------------------------------------------------------------------

    def write_release(self, out_dir: str | os.PathLike, payload: Mapping[str, bytes], name: str,
                      version: int, metadata: dict | None = None, provenance: dict | None = None) -> dict:
        """Sign, attest and write a release directory atomically.

        Builds manifest, in-toto statement, DSSE envelope and the release attestation
        (quote over PCR 16 for purpose ``"release"`` over the SHA-256 of the signed
        statement), verifies the result against this
        enclave's own trust anchors, writes it into a temporary sibling directory and
        renames that onto ``out_dir``; a crash leaves no half-written ``out_dir``.

        Args:
            out_dir: target directory; must not exist or be empty.
            payload: ``{flat file name: bytes}``, e.g. ``{"model.int8.onnx": b"..."}``.
            name: release name.
            version: release version (int in ``0..2**31-1``).
            metadata: signed free metadata, e.g. ``{"model_file": "model.int8.onnx"}``.
            provenance: the provenance predicate without ``version`` and ``release_enclave``,
                which the enclave writes itself (its backend and its own PCR 16); signed as
                ``provenance.dsse.json`` (:mod:`sealfl.attestation.provenance`). None = none.

        Returns:
            ``{"name", "version", "root_digest", "files": [names], "dir": str, "backend"}``.

        Raises:
            ReleaseWriteError: ``out_dir`` not empty, invalid payload/name/version/metadata,
                or the written release would not verify.
        """
        out = Path(out_dir)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ReleaseWriteError(f"{out} exists and is not an empty directory; choose a new output directory")
        try:
            if provenance is not None:
                provenance = {**provenance, "version": version,
                              "release_enclave": {"backend": self.backend,
                                                  "measurement": {str(k): v for k, v in self.measurement.items()}}}
            files = assemble_release({k: bytes(v) for k, v in payload.items()}, name, version, metadata,
                                     self._key, lambda data: self.tee.quote(RELEASE_PURPOSE, data, [_PCR]),
                                     provenance=provenance)
            verified = verify_release(files, self.trust_anchors())
        except VerificationError as exc:
            raise ReleaseWriteError(f"refusing to write a release that does not verify: {exc}") from exc
        except (AttestationError, TypeError) as exc:
            raise ReleaseWriteError(f"cannot build release {name!r} v{version}: {exc}") from exc
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            for file_name, data in files.items():
                atomic_write(tmp / file_name, data, 0o644)
            os.chmod(tmp, 0o755)
            os.rename(tmp, out)  # atomically replaces a missing or empty out_dir
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ReleaseWriteError(f"cannot write release to {out}: {exc}") from exc
        log.info("wrote release %s v%d (%s) to %s", name, version, verified.root_digest, out)
        return {
            "name": name,
            "version": version,
            "root_digest": verified.root_digest,
            "files": sorted(files),
            "dir": str(out),
            "backend": self.backend,
        }

    # -- sealed secrets (e.g. the CKKS secret context of the key holder) ----------------

    def sign_delta(self, predicate: dict) -> bytes:
        """The bytes of ``delta.dsse.json``: the delta ``predicate`` (base and result
        releases, the patches: :mod:`sealfl.attestation.delta`) signed with the release key.

        Raises:
            DeltaError: the predicate is not well-formed.
        """
        from sealfl.attestation.delta import build_delta_statement

        return build_delta_statement(predicate, self._key)

    def _secret_path(self, name: str) -> Path:
        if not isinstance(name, str) or not _SECRET_NAME.match(name):
            raise EnclaveError(f"secret name {name!r} must match {_SECRET_NAME.pattern}")
        return self.state_dir / "secrets" / f"{name}.sealed"

    def seal_secret(self, name: str, data: bytes) -> None:
        """Seal ``data`` to this enclave's measurement and store it as ``secrets/<name>.sealed`` (0600).

        Overwrites an existing secret of the same name atomically.

        Raises:
            EnclaveError: invalid name (allowed: ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``).
        """
        path = self._secret_path(name)
        ensure_private_dir(path.parent)
        atomic_write(path, self.tee.seal(bytes(data), self.tee.read([_PCR])), 0o600)

    def unseal_secret(self, name: str) -> bytes:
        """Return the secret stored by :meth:`seal_secret`.

        Raises:
            SecretNotFoundError: no such secret.
            UnsealError: the enclave measurement changed or the blob was tampered with.
        """
        path = self._secret_path(name)
        try:
            blob = path.read_bytes()
        except FileNotFoundError as exc:
            raise SecretNotFoundError(f"no sealed secret {name!r} in {self.state_dir}; seal it first") from exc
        return self.tee.unseal(blob)

    def list_secrets(self) -> list[str]:
        """Names of the stored sealed secrets, sorted."""
        folder = self.state_dir / "secrets"
        if not folder.is_dir():
            return []
        return sorted(p.name[: -len(".sealed")] for p in folder.glob("*.sealed"))
