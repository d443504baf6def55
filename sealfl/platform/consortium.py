"""Consortium set-up: the HE key ceremony and the partners' startup kits.

``create_consortium(dir, name, partners)`` writes (every file atomically)::

    consortium.json                 name, partners, "he": HE params (CKKS or packed BFV), context id, task
    aggregator/public.he            public HE context: NO secret key (checked on write)
    partners/<slug>/kit.json        see sealfl.clients.kit
    partners/<slug>/partner_key.pem partner's P-256 private key (0600)
    partners/<slug>/he_secret.wrapped  HE secret context wrapped to that key
    superlink/, authority/, partners/<slug>/{ca.crt,supernode_auth_key*,README.md}, aggregator/{ca.crt,README.md}
                                    Flower deployment kits (sealfl.platform.startup_kits)

Consortia of sealfl 0.1 are read too, for one release: ``"ckks"`` for ``"he"`` in the JSON
files, ``aggregator/public.ckks`` and ``ckks_secret.wrapped`` (:data:`OLD_NAMES`).

The HE secret context exists in memory only during the ceremony; on disk it is only
ever wrapped (to each partner key) or, for the release enclave, sealed by the TEE
(:func:`sealfl.platform.release.provision_release_enclave`).

In a real deployment each partner generates its key at its own site (``sealfl partner
keygen``) and sends only the public key: ``create_consortium(..., public_keys={name: PEM})``
wraps that partner's HE secret and SuperNode authentication key to it and writes no private
key of that partner anywhere (its kit has ``partner_key.pub.pem`` but no ``partner_key.pem``,
``supernode_auth_key.wrapped`` instead of ``supernode_auth_key``). Partners given without a
key (the demo) get keys generated here.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from Crypto.PublicKey import ECC

from sealfl.attestation.canonical import parse_object
from sealfl.clients.errors import ClientError
from sealfl.clients.kit import HE_PARAMS_KEY, HE_SECRET_FILE, HE_SECRET_LABEL, kit_dir, slug
from sealfl.clients.plugins import get_task
from sealfl.common.fields import Fields
from sealfl.common.fsutil import atomic_write, read_capped
from sealfl.he import codecs
from sealfl.he.errors import CiphertextError
from sealfl.he.framed import PACK_PARTNERS
from sealfl.he.kit_wrap import wrap
from sealfl.platform.errors import ConsortiumError

__all__ = ["Consortium", "create_consortium", "PUBLIC_CONTEXT_FILE", "OLD_NAMES", "check_partner_name",
           "parse_public_key", "MAX_PARTNER_NAME", "check_consortium_name", "MAX_CONSORTIUM_NAME"]

log = logging.getLogger(__name__)

CONSORTIUM_FILE = "consortium.json"
#: the aggregator's public HE context (no secret key), relative to the consortium directory
PUBLIC_CONTEXT_FILE = "aggregator/public.he"
#: sealfl 0.1 names still read for one release: new name -> old name
OLD_NAMES = {PUBLIC_CONTEXT_FILE: "aggregator/public.ckks", HE_PARAMS_KEY: "ckks"}
_MAX_FILE = 1 << 20
#: the longest partner name accepted (characters)
MAX_PARTNER_NAME = 64
#: the longest consortium name accepted (characters; what :meth:`Consortium.load` reads)
MAX_CONSORTIUM_NAME = 256


def check_partner_name(name: str) -> str:
    """``name`` if it is a usable partner name: 1..64 printable characters, no leading or
    trailing space, at least one letter or digit, in any script (its kit directory is
    :func:`slug` of it).
    Raises ConsortiumError naming what is wrong."""
    if not isinstance(name, str) or not name or len(name) > MAX_PARTNER_NAME:
        raise ConsortiumError(f"partner name {str(name)[:80]!r}: give 1 to {MAX_PARTNER_NAME} characters")
    if not name.isprintable() or name != name.strip():
        raise ConsortiumError(f"partner name {name!r}: only printable characters, no leading/trailing spaces")
    if not slug(name):
        raise ConsortiumError(f"partner name {name!r} has no letter or digit for its kit directory name")
    return name


def check_consortium_name(name: str) -> str:
    """``name`` if it is a usable consortium name: 1..:data:`MAX_CONSORTIUM_NAME` printable
    characters (what :meth:`Consortium.load` reads back). Raises ConsortiumError naming what
    is wrong."""
    if not isinstance(name, str) or not name or len(name) > MAX_CONSORTIUM_NAME:
        raise ConsortiumError(f"consortium name {str(name)[:80]!r}: give 1 to {MAX_CONSORTIUM_NAME} characters")
    if not name.isprintable():
        raise ConsortiumError(f"consortium name {name!r}: only printable characters")
    return name


def parse_public_key(pem: bytes, where: str) -> ECC.EccKey:
    """The P-256 PUBLIC key in the PEM bytes ``pem`` (from ``where``, for messages).

    Raises ConsortiumError if it is larger than 16 KiB, not a key, not P-256 -- or a
    private key (the partner must keep that; the message says so)."""
    if len(pem) > 16 * 1024:
        raise ConsortiumError(f"{where} is larger than 16 KiB; it is not a public key file")
    try:
        key = ECC.import_key(pem)
    except (ValueError, IndexError, TypeError) as exc:
        raise ConsortiumError(f"{where} is not a PEM public key ({exc}); ask the partner for the partner_key.pub.pem "
                              "'sealfl partner keygen' wrote") from exc
    if key.has_private():
        raise ConsortiumError(f"{where} holds a PRIVATE key; the partner must keep it and send only "
                              "partner_key.pub.pem -- make the partner a new key ('sealfl partner keygen')")
    if key.curve != "NIST P-256":
        raise ConsortiumError(f"{where} is a {key.curve} key; partner keys are P-256 ('sealfl partner keygen')")
    return key


@dataclass(frozen=True)
class Consortium:
    """A loaded ``consortium.json``.

    Attributes:
        dir: the consortium directory.
        name: the consortium's name.
        partners: partner names, in kit order.
        he_params: the HE parameters partners encrypt with (packed BFV or CKKS).
        context_id: hex id of the HE context.
        task: the task plug-in's name (:mod:`sealfl.clients.plugins`).
    """

    dir: Path
    name: str
    partners: list[str]
    he_params: codecs.Params
    context_id: str
    task: str

    @property
    def public_context(self) -> Path:
        """The aggregator's public HE context file (sealfl 0.1's name if only that exists)."""
        new = self.dir / PUBLIC_CONTEXT_FILE
        old = self.dir / OLD_NAMES[PUBLIC_CONTEXT_FILE]
        return old if not new.exists() and old.exists() else new

    @classmethod
    def load(cls, d: str | Path) -> "Consortium":
        """Read ``d/consortium.json``.

        Raises:
            ConsortiumError: ``d`` holds no consortium, or the file is not a JSON object
                with the fields above (the message names the field).
        """
        d = Path(d)
        path = d / CONSORTIUM_FILE
        try:
            data = read_capped(path, _MAX_FILE)
        except FileNotFoundError as exc:
            raise ConsortiumError(f"{d} is not a consortium directory (no {CONSORTIUM_FILE}); run 'sealfl consortium "
                                  "create'") from exc
        except OSError as exc:
            raise ConsortiumError(f"cannot read {path}: {exc.strerror or exc}") from exc
        if len(data) > _MAX_FILE:
            raise ConsortiumError(f"{path} is larger than {_MAX_FILE} bytes; it is not a consortium file")
        fields = Fields(str(path), ConsortiumError)
        meta = parse_object(data, fields, "restore it or create the consortium again")
        key = HE_PARAMS_KEY if HE_PARAMS_KEY in meta else OLD_NAMES[HE_PARAMS_KEY]
        name = fields.get(meta, "name", "string", max_len=MAX_CONSORTIUM_NAME)
        partners = fields.get(meta, "partners", "array", nonempty=True, max_len=10_000)
        for i, p in enumerate(partners):
            fields.string(p, f"partners[{i}]", max_len=256)
        he = fields.get(meta, key, "object")
        context_id = fields.get(meta, "context_id", "string", max_len=128)
        task = fields.get(meta, "task", "string", max_len=64)
        try:
            params = codecs.params_from_dict(he)
        except CiphertextError as exc:
            raise ConsortiumError(f"{path}: field {key!r}: {exc}") from exc
        return cls(d, name, list(partners), params, context_id, task)


def create_consortium(d: str | Path, name: str, partners: list[str], *, params: codecs.Params | None = None,
                      task: str = "heart", superlink_hosts: list[str] | tuple[str, ...] | None = None,
                      public_keys: dict[str, bytes] | None = None) -> tuple[Consortium, codecs.Codec]:
    """Run the key ceremony and write the consortium directory.

    ``params`` picks the HE scheme (:mod:`sealfl.he.codecs`; default packed BFV).
    Returns the loaded :class:`Consortium` and the SECRET codec (so the caller can seal it
    into the release enclave; drop it afterwards).
    Raises ConsortiumError if ``name`` is not 1..256 printable characters, ``d`` is not
    empty, partner names collide (also after mapping to directory names), two partners were
    given the same public key, ``task`` is not a registered task
    (:mod:`sealfl.clients.plugins`), a partner has no data for it, or a narrow BFV packing
    (``params.pack_bits`` < 27) is asked for more than 64 partners.

    ``public_keys`` maps partner names (each also in ``partners``) to the PEM public key the
    partner made on its own machine; those partners bring their own data, their names are
    only checked (:func:`check_partner_name`), and no private key of theirs is written.

    The deployment parts of the kits (consortium CA, SuperLink TLS certificate for
    ``superlink_hosts`` -- default 127.0.0.1 and localhost --, SuperNode authentication
    keys, READMEs) are written by :func:`sealfl.platform.startup_kits.write_startup_kits`.
    """
    from sealfl.platform.startup_kits import DEFAULT_SUPERLINK_HOSTS, san_entries, write_startup_kits

    superlink_hosts = tuple(superlink_hosts or DEFAULT_SUPERLINK_HOSTS)
    san_entries(superlink_hosts)
    check_consortium_name(name)
    d = Path(d)
    if (d / CONSORTIUM_FILE).exists():
        raise ConsortiumError(f"{d} already holds a consortium; choose another directory")
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise ConsortiumError(f"{d} exists and is not an empty directory; choose a new directory")
    public_keys = dict(public_keys or {})
    for p in partners:
        check_partner_name(p)
    stray = [p for p in public_keys if p not in partners]
    if stray:
        raise ConsortiumError(f"public keys given for partners not in the consortium: {', '.join(stray)}")
    given = {p: parse_public_key(pem, f"the public key of partner {p!r}") for p, pem in public_keys.items()}
    if len(set(partners)) != len(partners) or len(partners) < 2:
        raise ConsortiumError("need at least 2 partners with distinct names")
    layout = getattr(params, "update_layout", None)
    if layout is not None and layout.stochastic and len(partners) > PACK_PARTNERS:
        raise ConsortiumError(f"a {layout.bits}-bit packing has room for the rounding of {PACK_PARTNERS} partners, "
                              f"not {len(partners)}: leave --pack-bits at its default 27")
    slugs = [slug(p) for p in partners]
    if len(set(slugs)) != len(slugs) or "" in slugs:
        raise ConsortiumError(f"partner names must map to distinct directory names, got {dict(zip(partners, slugs))}")
    holders: dict[bytes, str] = {}
    for p, key in given.items():
        other = holders.setdefault(key.export_key(format="DER"), p)
        if other != p:  # one private key would open both kits and sign for both partners
            raise ConsortiumError(f"partners {other!r} and {p!r} were given the same public key; each partner "
                                  "sends the partner_key.pub.pem of its own 'sealfl partner keygen'")
    try:
        the_task = get_task(task)
    except ClientError as exc:
        raise ConsortiumError(str(exc)) from exc
    unknown = [p for p in partners if p not in the_task.partners and p not in given]
    if unknown:
        raise ConsortiumError(f"the {task} task has data for {the_task.partners_doc} {', '.join(the_task.partners)} "
                              f"only; unknown partner(s): {', '.join(unknown)} (a partner with its own data "
                              "joins with --partner-key NAME=PUB.pem)")
    t0 = time.perf_counter()
    codec = codecs.generate(params)
    secret = codec.secret_context_bytes()
    public = codec.public_context_bytes()
    (d / "aggregator").mkdir(parents=True, exist_ok=True)
    atomic_write(d / PUBLIC_CONTEXT_FILE, public, 0o644)
    check = codecs.from_bytes(public, codec.params, codec.context_id)
    if check.has_secret_key:  # the aggregator must never get a secret key
        raise ConsortiumError("internal error: the public HE context still holds the secret key")
    for i, partner in enumerate(partners):
        kd = kit_dir(d, partner)
        kd.mkdir(parents=True, exist_ok=True)
        if partner in given:  # the partner's own key: only its public half is here
            pub = given[partner]
        else:  # the demo: the coordinator makes the partner's key
            key = ECC.generate(curve="P-256")
            atomic_write(kd / "partner_key.pem", key.export_key(format="PEM").encode(), 0o600)
            pub = key.public_key()
        atomic_write(kd / "partner_key.pub.pem", pub.export_key(format="PEM").encode(), 0o644)
        atomic_write(kd / HE_SECRET_FILE, wrap(secret, pub, HE_SECRET_LABEL), 0o600)
        atomic_write(kd / "kit.json", json.dumps({
            "partner": partner, "index": i, "consortium": name, HE_PARAMS_KEY: codec.params.to_dict(),
            "context_id": codec.context_id.hex(), "task": task,
        }, indent=2).encode(), 0o644)
    write_startup_kits(d, name, partners, superlink_hosts, wrap_to=given)
    atomic_write(d / CONSORTIUM_FILE, json.dumps({
        "name": name, "partners": partners, HE_PARAMS_KEY: codec.params.to_dict(),
        "context_id": codec.context_id.hex(), "task": task, "created": time.time(),
    }, indent=2).encode(), 0o644)
    log.info("consortium %s: %d partner kits, HE %s, in %.1f s", name, len(partners), codec.params.to_dict(),
             time.perf_counter() - t0)
    return Consortium.load(d), codec
