"""A partner's startup kit: who it is and its (wrapped) HE secret context.

Layout of ``<consortium>/partners/<slug>/`` (written by
:mod:`sealfl.platform.consortium`):

- ``kit.json`` -- ``{"partner", "index", "consortium", "he": HE parameter dict (packed BFV
  or CKKS), "context_id": hex, "task"}``
- ``partner_key.pem`` -- the partner's P-256 private key (mode 0600; in a real
  deployment generated at the partner's site, only the public key ever leaves it)
- ``he_secret.wrapped`` -- the HE secret context wrapped to that key
  (:mod:`sealfl.he.kit_wrap`, label :data:`HE_SECRET_LABEL`)

A kit made from a partner's own public key (``sealfl partner keygen`` on the partner's
machine, ``consortium create --partner-key NAME=PUB.pem`` at the coordinator) holds no
``partner_key.pem``: the partner gives its private key (``--key``, or copies it into the
kit), and the SuperNode authentication key comes wrapped to the same key
(``supernode_auth_key.wrapped``, label :data:`SUPERNODE_KEY_LABEL`), unwrapped into the kit
on the partner's machine by :func:`unwrap_supernode_key`.

Kits of sealfl 0.1 are read too, for one release: ``"ckks"`` for ``"he"`` and
``ckks_secret.wrapped`` (wrapped with the label ``b"ckks-secret-context"``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from Crypto.PublicKey import ECC

from sealfl.clients.errors import KitError
from sealfl.common.fields import Fields
from sealfl.common.fsutil import read_capped
from sealfl.he import codecs
from sealfl.he.errors import CiphertextError, KeyWrapError
from sealfl.he.kit_wrap import unwrap

#: key of the HE parameters in kit.json and consortium.json
HE_PARAMS_KEY = "he"
#: the wrapped HE secret context in a kit, and the label authenticated with it
HE_SECRET_FILE = "he_secret.wrapped"
HE_SECRET_LABEL = b"he-secret-context"
#: sealfl 0.1: (file, label) of the wrapped secret and the JSON key of the parameters
_OLD_SECRET = ("ckks_secret.wrapped", b"ckks-secret-context")
#: the partner's P-256 private key, in a kit the coordinator generated (the demo) or where the partner put it
PARTNER_KEY_FILE = "partner_key.pem"
PARTNER_PUB_FILE = "partner_key.pub.pem"
#: the SuperNode authentication key wrapped to the partner's own key, and its label
SUPERNODE_WRAPPED_FILE = "supernode_auth_key.wrapped"
SUPERNODE_KEY_LABEL = b"supernode-auth-key"
_MAX_KEY_FILE = 16 * 1024
_OLD_PARAMS_KEY = "ckks"


def slug(name: str) -> str:
    """Directory-safe form of a partner name: ``"VA Long Beach"`` -> ``"va-long-beach"``; a
    name with letters or digits but none of a-z, 0-9 (``"東京病院"``) -> ``"p-"`` and 12 hex
    digits of its SHA-256; ``""`` for a name with no letter or digit at all."""
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not s and any(c.isalnum() for c in name):
        return "p-" + hashlib.sha256(name.encode("utf-8")).hexdigest()[:12]
    return s


@dataclass(frozen=True)
class PartnerKit:
    """A loaded kit. ``codec`` holds the HE secret key (this partner is a key holder);
    ``signing_key`` is the partner's P-256 private key (it signs the partner's replies,
    :func:`sealfl.clients.app.sign_reply`)."""

    partner: str
    index: int
    consortium: str
    codec: codecs.Codec
    task: str
    signing_key: ECC.EccKey | None = field(default=None, repr=False, compare=False)


def kit_dir(consortium_dir: str | Path, partner: str) -> Path:
    return Path(consortium_dir) / "partners" / slug(partner)


@lru_cache(maxsize=8)
def _check_kit_dir(d: Path) -> None:
    """Say what ``d`` is when it is not a kit at all (before 'incomplete' would mislead)."""
    if not d.exists():
        raise KitError(f"startup kit {d} does not exist; give the partner's kit directory (the coordinator's "
                       "CONSORTIUM/partners/<name>, copied to the partner's machine)")
    if not d.is_dir():
        raise KitError(f"startup kit {d} is a file, not a directory; give the partner's kit directory")
    if (d / "consortium.json").exists():
        names = sorted(p.name for p in (d / "partners").iterdir() if p.is_dir()) if (d / "partners").is_dir() else []
        raise KitError(f"{d} is a consortium directory, not a partner's startup kit; give one of "
                       f"{d}/partners/<name>{' (' + ', '.join(names[:8]) + ')' if names else ''}")


def load_partner_key(path: str | Path) -> ECC.EccKey:
    """The partner's P-256 private key from the PEM file ``path``.

    Raises KitError if it is missing, larger than 16 KiB, not a key, a public key only,
    or not on P-256."""
    return _partner_key(Path(path), _read_key_file(Path(path)))


def _read_key_file(p: Path) -> bytes:
    try:
        return read_capped(p, _MAX_KEY_FILE)
    except OSError as exc:
        raise KitError(f"cannot read the partner key {p}: {exc.strerror or exc}; give the partner_key.pem "
                       "'sealfl partner keygen' wrote on this machine") from exc


def _partner_key(p: Path, data: bytes) -> ECC.EccKey:
    """:func:`load_partner_key` on the bytes ``data`` already read from ``p``."""
    if len(data) > _MAX_KEY_FILE:
        raise KitError(f"{p} is larger than {_MAX_KEY_FILE} bytes; it is not a partner key")
    try:
        key = ECC.import_key(data)
    except (ValueError, IndexError, TypeError) as exc:
        raise KitError(f"{p} is not a PEM key ({exc}); give the partner_key.pem 'sealfl partner keygen' wrote") from exc
    if not key.has_private():
        raise KitError(f"{p} holds a public key only; give the private partner_key.pem (it never leaves this machine)")
    if key.curve not in ("NIST P-256", "p256", "P-256", "secp256r1", "prime256v1"):
        raise KitError(f"{p} is a {key.curve} key; a partner key is P-256 ('sealfl partner keygen')")
    return key


def _key_file(d: Path, key_path: str | Path | None) -> Path:
    """Where the partner's private key is: ``key_path``, else the kit's own ``partner_key.pem``.
    Raises KitError if neither is given nor present."""
    if key_path is not None:
        return Path(key_path)
    if not (d / PARTNER_KEY_FILE).exists():
        raise KitError(f"startup kit {d} holds no {PARTNER_KEY_FILE}: it was made from your public key; give your "
                       f"private key with --key PRIV.pem (what 'sealfl partner keygen' wrote) or copy it into the kit")
    return d / PARTNER_KEY_FILE


def unwrap_supernode_key(path: str | Path, key: ECC.EccKey) -> Path | None:
    """In a kit made from the partner's public key, unwrap ``supernode_auth_key.wrapped``
    with the partner's ``key`` into ``supernode_auth_key`` (0600, beside it) if that file is
    not there yet. Returns the path written, or None if nothing was to do.

    Raises KitError if the wrapped key does not open with ``key`` (another partner's key,
    or a tampered file)."""
    from sealfl.common.fsutil import atomic_write

    d = Path(path)
    target, wrapped = d / "supernode_auth_key", d / SUPERNODE_WRAPPED_FILE
    if target.exists() or not wrapped.exists():
        return None
    try:
        priv = unwrap(wrapped.read_bytes(), key, SUPERNODE_KEY_LABEL)
    except KeyWrapError as exc:
        raise KitError(f"startup kit {d}: {SUPERNODE_WRAPPED_FILE}: {exc}") from exc
    atomic_write(target, priv, 0o600)
    return target


def load_kit(path: str, key_path: str | None = None) -> PartnerKit:
    """Load and unwrap the kit in directory ``path``.

    The partner's private key is ``key_path`` if given, else the kit's own
    ``partner_key.pem``.
    Raises KitError naming the missing/unreadable file, or if the secret does not unwrap
    with the partner's private key.
    """
    return _load_kit(Path(path), key_path, codecs.from_bytes)[0]


def _secret_file(d: Path) -> tuple[str, bytes]:
    """(file name, wrapping label) of the kit's wrapped HE secret (sealfl 0.1's name if only it is there)."""
    if not (d / HE_SECRET_FILE).exists() and (d / _OLD_SECRET[0]).exists():
        return _OLD_SECRET
    return HE_SECRET_FILE, HE_SECRET_LABEL


def _inputs_digest(d: Path, key_file: Path, key_bytes: bytes, meta_bytes: bytes, wrapped: bytes) -> bytes:
    """SHA-256 over everything a loaded kit is made from (:func:`cached_kit`'s key)."""
    h = hashlib.sha256(b"sealfl-kit\0")
    for part in (str(d).encode(), str(key_file).encode(), key_bytes, meta_bytes, wrapped):
        h.update(len(part).to_bytes(8, "big") + part)
    return h.digest()


def _load_kit(d: Path, key_path: str | None, load_codec) -> tuple[PartnerKit, bytes]:
    """:func:`load_kit` with the codec made by ``load_codec(secret, params, context_id)``;
    returns the kit and :func:`_inputs_digest` of the bytes it was made from."""
    _check_kit_dir(d)
    key_file = _key_file(d, key_path)
    key_bytes = _read_key_file(key_file)
    key = _partner_key(key_file, key_bytes)
    try:
        meta_bytes = (d / "kit.json").read_bytes()
        meta = json.loads(meta_bytes)
        secret_file, label = _secret_file(d)
        wrapped = (d / secret_file).read_bytes()
    except FileNotFoundError as exc:
        raise KitError(f"startup kit {d} is incomplete: {exc.filename} is missing; re-issue the kit") from exc
    except OSError as exc:  # a directory or an unreadable file where a kit file belongs
        raise KitError(f"startup kit {d}: cannot read {exc.filename}: {exc.strerror or exc}; re-issue the kit") from exc
    except (ValueError, json.JSONDecodeError) as exc:
        raise KitError(f"startup kit {d} is unreadable: {exc}") from exc
    # the directory's name is the partner's choice (a kit is copied to its machine under any name);
    # what makes a kit this partner's is that its HE secret unwraps with its own key (below), and the
    # aggregator refuses a reply whose signing key is not the named partner's
    try:
        secret = unwrap(wrapped, key, label)
    except KeyWrapError as exc:
        raise KitError(f"startup kit {d}: {exc} (is this partner's own private key the one given?)") from exc
    fields = Fields(f"startup kit {d}: kit.json", lambda msg: KitError(f"{msg}; re-issue the kit"))
    fields.object(meta, "")
    partner = fields.get(meta, "partner", "string", max_len=256)
    index = fields.get(meta, "index", "integer", hi=1_000_000)
    consortium = fields.get(meta, "consortium", "string", max_len=256)
    context_id = fields.get(meta, "context_id", "string", max_len=128)
    task = fields.get(meta, "task", "string", default="heart-logreg", max_len=64)
    try:
        cid = bytes.fromhex(context_id)
    except ValueError:
        raise fields.fail("context_id", "must be hex digits") from None
    try:
        params = meta.get(HE_PARAMS_KEY, meta.get(_OLD_PARAMS_KEY))
        codec = load_codec(secret, codecs.params_from_dict(params), cid)
    except CiphertextError as exc:
        raise KitError(f"startup kit {d}: {exc}") from exc
    if not codec.has_secret_key:
        raise KitError(f"startup kit {d}: the unwrapped HE context holds no secret key")
    kit = PartnerKit(partner, index, consortium, codec, task, key)
    return kit, _inputs_digest(d, key_file, key_bytes, meta_bytes, wrapped)


#: kits loaded by :func:`cached_kit` in this process: digest of their inputs -> kit
_KITS: "OrderedDict[bytes, PartnerKit]" = OrderedDict()
#: at most this many (a kit shares its parsed HE context with the others: tens of KB each)
KIT_CACHE_MAX = 4096


def cached_kit(path: str, key_path: str | None = None) -> PartnerKit:
    """:func:`load_kit`, kept per process (the ClientApp calls this for every message).

    Loading a kit imports the partner's key, unwraps the HE secret (ECDH + AEAD) and parses
    the HE context: ~15 ms on a busy core, which a simulated partner paid on every message.
    Here the kit directory, the key file's path and the exact bytes of the key file,
    ``kit.json`` and the wrapped secret are read on every call (~70 KB: a changed or
    replaced file is noticed at once) and hashed together; a kit made from exactly those
    bytes is returned, else the kit is loaded and kept (at most :data:`KIT_CACHE_MAX`,
    least recently used dropped). A kit is only ever returned for the very bytes it was
    made from: another partner's directory or key is another entry, never a hit. The HE
    context is parsed once per distinct secret (:func:`sealfl.he.codecs.from_bytes_shared`:
    every kit of a consortium wraps the same one). Failures are not kept.

    Raises:
        KitError: as :func:`load_kit`.
    """
    d = Path(path)
    try:
        key_file = _key_file(d, key_path)
        digest = _inputs_digest(d, key_file, read_capped(key_file, _MAX_KEY_FILE), (d / "kit.json").read_bytes(),
                                (d / _secret_file(d)[0]).read_bytes())
    except (OSError, KitError):
        digest = None  # _load_kit below names the problem
    if digest is not None and digest in _KITS:
        _KITS.move_to_end(digest)
        return _KITS[digest]
    kit, digest = _load_kit(d, key_path, codecs.from_bytes_shared)
    _KITS[digest] = kit
    while len(_KITS) > KIT_CACHE_MAX:
        _KITS.popitem(last=False)
    return kit
