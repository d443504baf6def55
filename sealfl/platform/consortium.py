"""Consortium set-up: the HE key ceremony and the partners' startup kits.

``create_consortium(dir, name, partners)`` writes::

    consortium.json                 name, partners, HE params (CKKS, or BFV with --he bfv), context id, task
    aggregator/public.ckks          public HE context: NO secret key (checked on write)
    partners/<slug>/kit.json        see sealfl.clients.kit
    partners/<slug>/partner_key.pem partner's P-256 private key (0600)
    partners/<slug>/ckks_secret.wrapped  HE secret context wrapped to that key

The HE secret context exists in memory only during the ceremony; on disk it is only
ever wrapped (to each partner key) or, for the release enclave, sealed by the TEE
(:func:`sealfl.platform.release.provision_release_enclave`).

In a real deployment each partner generates its key at its own site and sends only
the public key (``partner_public_keys``); the demo generates all of them here.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from Crypto.PublicKey import ECC

from sealfl.clients.errors import ClientError
from sealfl.clients.tasks import get_task
from sealfl.clients.kit import CKKS_LABEL, kit_dir, slug
from sealfl.common import codecs
from sealfl.common.errors import CiphertextError
from sealfl.common.keywrap import wrap

from .errors import ConsortiumError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Consortium:
    """A loaded ``consortium.json``."""

    dir: Path
    name: str
    partners: list[str]
    ckks: codecs.Params  # the campaign's HE parameters: CKKS (default) or packed BFV (the name is kept)
    context_id: str
    task: str

    @property
    def public_context(self) -> Path:
        return self.dir / "aggregator" / "public.ckks"

    @classmethod
    def load(cls, d: str | Path) -> "Consortium":
        """Raises ConsortiumError if ``d`` holds no consortium."""
        d = Path(d)
        try:
            meta = json.loads((d / "consortium.json").read_text())
        except FileNotFoundError as exc:
            raise ConsortiumError(f"{d} is not a consortium directory (no consortium.json); run 'sealfl consortium create'") from exc
        try:
            params = codecs.params_from_dict(meta["ckks"])
        except CiphertextError as exc:
            raise ConsortiumError(f"{d}/consortium.json: {exc}") from exc
        return cls(d, meta["name"], list(meta["partners"]), params, meta["context_id"], meta["task"])


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def create_consortium(d: str | Path, name: str, partners: list[str], *, params: codecs.Params | None = None,
                      task: str = "heart") -> tuple[Consortium, codecs.Codec]:
    """Run the key ceremony and write the consortium directory.

    ``params`` picks the HE scheme (:mod:`sealfl.common.codecs`; default CKKS).
    Returns the loaded :class:`Consortium` and the SECRET codec (so the caller can seal it
    into the release enclave; drop it afterwards).
    Raises ConsortiumError if ``d`` is not empty, partner names collide (also after
    mapping to directory names), ``task`` is not a registered task
    (:mod:`sealfl.clients.tasks`), or a partner has no data for it.
    """
    d = Path(d)
    if (d / "consortium.json").exists():
        raise ConsortiumError(f"{d} already holds a consortium; choose another directory")
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise ConsortiumError(f"{d} exists and is not an empty directory; choose a new directory")
    if len(set(partners)) != len(partners) or len(partners) < 2:
        raise ConsortiumError("need at least 2 partners with distinct names")
    slugs = [slug(p) for p in partners]
    if len(set(slugs)) != len(slugs) or "" in slugs:
        raise ConsortiumError(f"partner names must map to distinct directory names, got {dict(zip(partners, slugs))}")
    try:
        the_task = get_task(task)
    except ClientError as exc:
        raise ConsortiumError(str(exc)) from exc
    unknown = [p for p in partners if p not in the_task.partners]
    if unknown:
        raise ConsortiumError(f"the {task} task has data for {the_task.partners_doc} {', '.join(the_task.partners)} "
                              f"only; unknown partner(s): {', '.join(unknown)}")
    t0 = time.perf_counter()
    codec = codecs.generate(params)
    secret = codec.secret_context_bytes()
    public = codec.public_context_bytes()
    (d / "aggregator").mkdir(parents=True, exist_ok=True)
    (d / "aggregator" / "public.ckks").write_bytes(public)
    check = codecs.from_bytes(public, codec.params, codec.context_id)
    if check.has_secret_key:  # the aggregator must never get a secret key
        raise ConsortiumError("internal error: the public HE context still holds the secret key")
    for i, partner in enumerate(partners):
        kd = kit_dir(d, partner)
        kd.mkdir(parents=True, exist_ok=True)
        key = ECC.generate(curve="P-256")
        _write_private(kd / "partner_key.pem", key.export_key(format="PEM").encode())
        (kd / "partner_key.pub.pem").write_text(key.public_key().export_key(format="PEM"))
        (kd / "ckks_secret.wrapped").write_bytes(wrap(secret, key.public_key(), CKKS_LABEL))
        (kd / "kit.json").write_text(json.dumps({
            "partner": partner, "index": i, "consortium": name, "ckks": codec.params.to_dict(),
            "context_id": codec.context_id.hex(), "task": task,
        }, indent=2))
    (d / "consortium.json").write_text(json.dumps({
        "name": name, "partners": partners, "ckks": codec.params.to_dict(), "context_id": codec.context_id.hex(),
        "task": task, "created": time.time(),
    }, indent=2))
    log.info("consortium %s: %d partner kits, HE %s, in %.1f s", name, len(partners), codec.params.to_dict(),
             time.perf_counter() - t0)
    return Consortium.load(d), codec
