"""A partner's startup kit: who it is and its (wrapped) HE secret context.

Layout of ``<consortium>/partners/<slug>/`` (written by
:mod:`sealfl.platform.consortium`):

- ``kit.json`` -- ``{"partner", "index", "consortium", "he": HE parameter dict (packed BFV
  or CKKS), "context_id": hex, "task"}``
- ``partner_key.pem`` -- the partner's P-256 private key (mode 0600; in a real
  deployment generated at the partner's site, only the public key ever leaves it)
- ``he_secret.wrapped`` -- the HE secret context wrapped to that key
  (:mod:`sealfl.he.kit_wrap`, label :data:`HE_SECRET_LABEL`)

Kits of sealfl 0.1 are read too, for one release: ``"ckks"`` for ``"he"`` and
``ckks_secret.wrapped`` (wrapped with the label ``b"ckks-secret-context"``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from Crypto.PublicKey import ECC

from sealfl.clients.errors import KitError
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
_OLD_PARAMS_KEY = "ckks"


def slug(name: str) -> str:
    """Directory-safe form of a partner name: ``"VA Long Beach"`` -> ``"va-long-beach"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


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


def load_kit(path: str) -> PartnerKit:
    """Load and unwrap the kit in directory ``path`` (cached per process).

    Raises KitError naming the missing/unreadable file, or if the secret does not unwrap
    with this kit's private key.
    """
    d = Path(path)
    _check_kit_dir(d)
    try:
        meta = json.loads((d / "kit.json").read_text())
        key = ECC.import_key((d / "partner_key.pem").read_bytes())
        secret_file, label = HE_SECRET_FILE, HE_SECRET_LABEL
        if not (d / secret_file).exists() and (d / _OLD_SECRET[0]).exists():
            secret_file, label = _OLD_SECRET
        wrapped = (d / secret_file).read_bytes()
    except FileNotFoundError as exc:
        raise KitError(f"startup kit {d} is incomplete: {exc.filename} is missing; re-issue the kit") from exc
    except (ValueError, json.JSONDecodeError) as exc:
        raise KitError(f"startup kit {d} is unreadable: {exc}") from exc
    if slug(str(meta.get("partner", ""))) != d.resolve().name:
        raise KitError(f"startup kit {d} names partner {meta.get('partner')!r}, which does not match its "
                       "directory; kit files were mixed up between partners -- re-issue the kit")
    try:
        secret = unwrap(wrapped, key, label)
    except KeyWrapError as exc:
        raise KitError(f"startup kit {d}: {exc}") from exc
    try:
        params = meta.get(HE_PARAMS_KEY, meta.get(_OLD_PARAMS_KEY))
        codec = codecs.from_bytes(secret, codecs.params_from_dict(params), bytes.fromhex(meta["context_id"]))
    except CiphertextError as exc:
        raise KitError(f"startup kit {d}: {exc}") from exc
    if not codec.has_secret_key:
        raise KitError(f"startup kit {d}: the unwrapped HE context holds no secret key")
    return PartnerKit(meta["partner"], int(meta["index"]), meta["consortium"], codec, meta.get("task", "heart-logreg"),
                      key)
