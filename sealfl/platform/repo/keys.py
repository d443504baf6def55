"""Signing keys of a TUF repository: ECDSA P-256 (securesystemslib ``CryptoSigner``) in
private PEM files (mode 0600, directories 0700).

* the **offline** root keys (:data:`ROOT_KEYS` of them, threshold :data:`ROOT_THRESHOLD`)
  live in a directory of their own, ``root-<keyid16>.pem``, meant to be moved off the
  coordinator's machine after set-up (never committed); ``consortium create`` makes them
  into ``CONSORTIUM/authority/tuf-root/`` (:func:`make_authority_root_keys`) and ``repo init
  -c CONSORTIUM`` uses them;
* the **online** keys of timestamp, snapshot and targets live in ``REPO/keys/<role>.pem``.

A key file is loaded only if it is a private regular file (group and others have no
access), so a key left readable is refused by name instead of used.
"""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.serialization import load_pem_private_key
from securesystemslib.signer import CryptoSigner

from sealfl.common.fsutil import atomic_write, check_private_file, ensure_private_dir
from sealfl.platform.errors import PlatformError

__all__ = ["ROOT_KEYS", "ROOT_THRESHOLD", "ONLINE_ROLES", "RepoError", "new_signer", "write_key", "read_key",
           "write_root_keys", "read_root_keys", "AUTHORITY_ROOT_DIR", "authority_root_keys_dir",
           "make_authority_root_keys"]

ROOT_KEYS = 3
ROOT_THRESHOLD = 2
#: the TUF root keys' directory inside a consortium's ``authority/``
AUTHORITY_ROOT_DIR = "tuf-root"
ONLINE_ROLES = ("timestamp", "snapshot", "targets")
_MAX_KEY_BYTES = 16 << 10


class RepoError(PlatformError):
    """A repository operation was refused or failed; the message names the file and the fix."""


def new_signer() -> CryptoSigner:
    """A fresh ECDSA P-256 signer (``ecdsa-sha2-nistp256``)."""
    return CryptoSigner.generate_ecdsa()


def write_key(path: Path, signer: CryptoSigner) -> None:
    """Write ``signer``'s private key (PKCS#8 PEM) to ``path`` with mode 0600."""
    ensure_private_dir(path.parent)
    atomic_write(path, signer.private_bytes, 0o600)


def read_key(path: Path) -> CryptoSigner:
    """Load a private key file written by :func:`write_key`.

    Raises:
        RepoError: missing, readable by others, too large or not an ECDSA private key.
    """
    try:
        if not check_private_file(path):
            raise RepoError(f"{path}: a private key readable by group or others is refused; chmod 600 it (and "
                            "consider the key exposed)")
        with open(path, "rb") as fh:
            data = fh.read(_MAX_KEY_BYTES + 1)
    except FileNotFoundError:
        raise RepoError(f"{path}: key file missing") from None
    except OSError as exc:
        raise RepoError(f"{path}: cannot read the key: {exc}") from exc
    if len(data) > _MAX_KEY_BYTES:
        raise RepoError(f"{path}: larger than {_MAX_KEY_BYTES} bytes, not a key file")
    try:
        key = load_pem_private_key(data, password=None)
        return CryptoSigner(key)
    except (ValueError, TypeError) as exc:
        raise RepoError(f"{path}: not an unencrypted ECDSA private key in PEM ({exc})") from None


def write_root_keys(directory: Path, signers: list[CryptoSigner]) -> None:
    """Write the offline root keys into ``directory`` (created 0700; must hold no ``root-*.pem``).

    Raises:
        RepoError: the directory already holds root keys (never overwritten).
    """
    directory = Path(directory)
    if directory.is_dir() and any(directory.glob("root-*.pem")):
        raise RepoError(f"{directory} already holds root keys; give an empty or new directory")
    ensure_private_dir(directory)
    for s in signers:
        write_key(directory / f"root-{s.public_key.keyid[:16]}.pem", s)


def authority_root_keys_dir(consortium_dir: str | Path) -> Path:
    """Where ``consortium create`` keeps the TUF root keys: ``CONSORTIUM/authority/tuf-root``
    (beside the consortium CA's key; move the whole authority directory offline)."""
    return Path(consortium_dir) / "authority" / AUTHORITY_ROOT_DIR


def make_authority_root_keys(consortium_dir: str | Path) -> Path:
    """Make the :data:`ROOT_KEYS` TUF root keys into :func:`authority_root_keys_dir` (0700,
    keys 0600) and return that directory.

    Raises:
        RepoError: it already holds root keys (never overwritten).
    """
    out = authority_root_keys_dir(consortium_dir)
    write_root_keys(out, [new_signer() for _ in range(ROOT_KEYS)])
    return out


def read_root_keys(directory: Path) -> dict[str, CryptoSigner]:
    """``{keyid: signer}`` of every ``root-*.pem`` in ``directory``.

    Raises:
        RepoError: the directory is missing or holds no root key; a key file is refused
            (:func:`read_key`).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise RepoError(f"offline keys directory {directory} not found")
    out = {}
    for path in sorted(directory.glob("root-*.pem")):
        s = read_key(path)
        out[s.public_key.keyid] = s
    if not out:
        raise RepoError(f"{directory} holds no root-*.pem key")
    return out

