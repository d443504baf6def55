"""A partner's startup kit: who it is and its (wrapped) HE secret context.

Layout of ``<consortium>/partners/<slug>/`` (written by
:mod:`sealfl.platform.consortium`):

- ``kit.json`` -- ``{"partner", "index", "consortium", "ckks": HE parameter dict (CKKS or BFV; the key keeps its name),
  "context_id": hex, "task"}``
- ``partner_key.pem`` -- the partner's P-256 private key (mode 0600; in a real
  deployment generated at the partner's site, only the public key ever leaves it)
- ``ckks_secret.wrapped`` -- the HE secret context wrapped to that key
  (:mod:`sealfl.common.keywrap`, label ``b"ckks-secret-context"``)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from Crypto.PublicKey import ECC

from sealfl.common import codecs
from sealfl.common.errors import CiphertextError
from sealfl.common.keywrap import KeyWrapError, unwrap

from .errors import KitError

CKKS_LABEL = b"ckks-secret-context"


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
def load_kit(path: str) -> PartnerKit:
    """Load and unwrap the kit in directory ``path`` (cached per process).

    Raises KitError naming the missing/unreadable file, or if the secret does not unwrap
    with this kit's private key.
    """
    d = Path(path)
    try:
        meta = json.loads((d / "kit.json").read_text())
        key = ECC.import_key((d / "partner_key.pem").read_bytes())
        wrapped = (d / "ckks_secret.wrapped").read_bytes()
    except FileNotFoundError as exc:
        raise KitError(f"startup kit {d} is incomplete: {exc.filename} is missing; re-issue the kit") from exc
    except (ValueError, json.JSONDecodeError) as exc:
        raise KitError(f"startup kit {d} is unreadable: {exc}") from exc
    if slug(str(meta.get("partner", ""))) != d.resolve().name:
        raise KitError(f"startup kit {d} names partner {meta.get('partner')!r}, which does not match its "
                       "directory; kit files were mixed up between partners -- re-issue the kit")
    try:
        secret = unwrap(wrapped, key, CKKS_LABEL)
    except KeyWrapError as exc:
        raise KitError(f"startup kit {d}: {exc}") from exc
    try:
        codec = codecs.from_bytes(secret, codecs.params_from_dict(meta["ckks"]), bytes.fromhex(meta["context_id"]))
    except CiphertextError as exc:
        raise KitError(f"startup kit {d}: {exc}") from exc
    if not codec.has_secret_key:
        raise KitError(f"startup kit {d}: the unwrapped HE context holds no secret key")
    return PartnerKit(meta["partner"], int(meta["index"]), meta["consortium"], codec, meta.get("task", "heart-logreg"),
                      key)
