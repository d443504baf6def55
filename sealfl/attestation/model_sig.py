"""``model.sig``: the OpenSSF model-signing v1.0 signature of a release (sigstore/model-transparency).

The file is a Sigstore bundle v0.3 in JSON (``mediaType
application/vnd.dev.sigstore.bundle.v0.3+json``) in *key* mode -- what ``model_signing sign
key`` writes and ``model_signing verify key`` checks::

    {"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
     "verificationMaterial": {"publicKey": {"hint": <hex SHA-256 of the signer's SPKI PEM>},
                              "tlogEntries": []},
     "dsseEnvelope": {"payload": Base64(statement), "payloadType": "application/vnd.in-toto+json",
                      "signatures": [{"sig": Base64(DER ECDSA P-256/SHA-256 over DSSE PAE), "keyid": ""}]}}

and the statement is an in-toto Statement v1::

    {"_type": "https://in-toto.io/Statement/v1",
     "subject": [{"name": <model name>, "digest": {"sha256": <model-signing root digest>}}],
     "predicateType": "https://model_signing/signature/v1.0",
     "predicate": {"serialization": {"method": "files", "hash_type": "sha256",
                                     "allow_symlinks": false, "ignore_paths": ["model.sig"]},
                   "resources": [{"name": <path>, "algorithm": "sha256", "digest": <hex>}, ...]}}

**The model-signing root digest** is model_signing's own (its ``signing.Payload``): SHA-256 over
the concatenated raw 32-byte digests of the resources in ascending name order. It is not
sealfl's manifest root digest (which also hashes the names); a sealfl release's ``model.sig``
lists *every* file of the directory but itself -- the payload and the three sealfl documents
``manifest.json``, ``manifest.dsse.json``, ``attestation.json`` -- so it binds sealfl's root
digest through the signed manifest bytes, and ``model_signing verify key`` finds no unsigned
file in a release.

The release enclave signs it with the release key (:func:`build_model_signature`); devices and
auditors check it with :func:`verify_model_signature` -- no sigstore or model_signing code runs
on a device. Differences from sealfl's own signatures, on purpose: a signature by another
model-signing signer may carry a high ``s`` (``cryptography`` does not normalise), so it is
brought to its low-S form before :func:`sealfl.attestation.keys.verify` (the signature's bytes
carry no identity: the signed statement does); Base64 is strict (RFC 4648 §4) as everywhere.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from Crypto.PublicKey import ECC

from sealfl.attestation import keys as _keys
from sealfl.attestation.canonical import JSONFormatError, b64decode_strict, canonical_json, loads_strict
from sealfl.attestation.dsse import MAX_SIGNATURES, pae
from sealfl.attestation.errors import FormatError, ManifestError, SignatureError
from sealfl.attestation.intoto import one_subject_statement
from sealfl.attestation.manifest import validate_path
from sealfl.common.fields import Fields, is_sha256_hex

__all__ = ["SIGNATURE_FILE", "BUNDLE_MEDIA_TYPE", "PREDICATE_TYPE", "PAYLOAD_TYPE", "ModelSignature",
           "model_root_digest", "key_hint", "build_model_signature", "verify_model_signature",
           "signature_problems"]

SIGNATURE_FILE = "model.sig"
BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
#: most resources one model.sig may list (a release directory holds at most 4096 entries)
MAX_RESOURCES = 4096
_WHAT = SIGNATURE_FILE


@dataclass(frozen=True)
class ModelSignature:
    """A verified ``model.sig``.

    Attributes:
        name: the subject (model) name.
        root_digest: the model-signing root digest (module docstring), lowercase hex.
        files: ``{resource name: SHA-256 hex}`` of every signed file.
        serialization: the predicate's ``serialization`` object, as signed.
        keyid: :func:`sealfl.attestation.keys.keyid` of the trusted key that verified it.
    """

    name: str
    root_digest: str
    files: dict[str, str] = field(repr=False)
    serialization: dict = field(repr=False)
    keyid: str


def model_root_digest(digests: Mapping[str, str]) -> str:
    """model_signing's root digest over ``{name: sha256 hex}`` (module docstring), lowercase hex."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(bytes.fromhex(digests[name]))
    return h.hexdigest()


def key_hint(public_key: ECC.EccKey) -> str:
    """The bundle's ``publicKey.hint``: hex SHA-256 of the key's SubjectPublicKeyInfo PEM as
    ``cryptography`` writes it (64-character Base64 lines, a final newline)."""
    der = public_key.public_key().export_key(format="DER")
    text = base64.b64encode(der).decode("ascii")
    lines = [text[i:i + 64] for i in range(0, len(text), 64)]
    pem = "-----BEGIN PUBLIC KEY-----\n" + "\n".join(lines) + "\n-----END PUBLIC KEY-----\n"
    return hashlib.sha256(pem.encode("ascii")).hexdigest()


def build_model_signature(name: str, digests: Mapping[str, str], signing_key: ECC.EccKey) -> bytes:
    """The bytes of ``model.sig`` for the files ``{name: sha256 hex}`` signed with ``signing_key``.

    Args:
        name: subject name (sealfl writes the release name).
        digests: every file of the directory but ``model.sig`` itself.
        signing_key: ECDSA P-256 private key (the release key).

    Raises:
        ManifestError: no files, an invalid path, ``model.sig`` among them, or a digest that is
            not 64 lowercase hex digits.
    """
    if not digests:
        raise ManifestError("model.sig needs at least one file to sign")
    resources = []
    for path in sorted(digests):
        validate_path(path)
        if path == SIGNATURE_FILE:
            raise ManifestError(f"{SIGNATURE_FILE} cannot sign itself")
        if not is_sha256_hex(digests[path]):
            raise ManifestError(f"digest of {path!r} is not 64 lowercase hex digits")
        resources.append({"name": path, "algorithm": "sha256", "digest": digests[path]})
    statement = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": model_root_digest(digests)}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "serialization": {"method": "files", "hash_type": "sha256", "allow_symlinks": False,
                              "ignore_paths": [SIGNATURE_FILE]},
            "resources": resources,
        },
    }
    payload = canonical_json(statement)
    sig = _keys.sign(signing_key, pae(PAYLOAD_TYPE, payload))
    bundle = {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": key_hint(signing_key)}, "tlogEntries": []},
        "dsseEnvelope": {
            "payload": base64.b64encode(payload).decode("ascii"),
            "payloadType": PAYLOAD_TYPE,
            "signatures": [{"sig": base64.b64encode(sig).decode("ascii"), "keyid": ""}],
        },
    }
    return canonical_json(bundle) + b"\n"


def _b64(fields: Fields, parent: dict, key: str, at: str) -> bytes:
    try:
        return b64decode_strict(fields.get(parent, key, "string", at, nonempty=False, max_len=1 << 30),
                                f"{_WHAT}: field {fields.join(at, key)!r}")
    except FormatError as exc:
        raise SignatureError(str(exc)) from exc


def _signed_payload(bundle: dict, trusted: Sequence[ECC.EccKey], fields: Fields) -> tuple[bytes, str]:
    """The verified DSSE payload of the bundle and the keyid that verified it."""
    if bundle.get("mediaType") != BUNDLE_MEDIA_TYPE:
        raise fields.fail("mediaType", f"is {bundle.get('mediaType')!r:.80}, expected {BUNDLE_MEDIA_TYPE!r} "
                          "(a Sigstore bundle v0.3 as model_signing writes it)")
    material = fields.get(bundle, "verificationMaterial", "object")
    public_key = fields.get(material, "publicKey", "object", "verificationMaterial", default={})
    hint = None  # absent in model_signing's older bundles: any pinned key may have signed
    if "hint" in public_key:
        hint = fields.string(public_key["hint"], "verificationMaterial.publicKey.hint", nonempty=False)
    envelope = fields.get(bundle, "dsseEnvelope", "object")
    payload_type = fields.get(envelope, "payloadType", "string", "dsseEnvelope")
    if payload_type != PAYLOAD_TYPE:
        raise fields.fail("dsseEnvelope.payloadType", f"is {payload_type!r:.80}, expected {PAYLOAD_TYPE!r}")
    payload = _b64(fields, envelope, "payload", "dsseEnvelope")
    signatures = fields.get(envelope, "signatures", "array", "dsseEnvelope", nonempty=True, max_len=MAX_SIGNATURES)
    if not trusted:
        raise SignatureError("no trusted public keys given; pin the release public key (release-signing.pub)")
    candidates = [k for k in trusted if hint in (None, "", key_hint(k))]
    if not candidates:
        raise fields.fail("verificationMaterial.publicKey.hint", "names a key that is not pinned (signed by "
                          "another key); check that the trust directory is this consortium's")
    message = pae(payload_type, payload)
    for i, entry in enumerate(signatures):
        at = fields.join("dsseEnvelope.signatures", i)
        fields.object(entry, at)
        sig = _b64(fields, entry, "sig", at)
        try:
            sig = _keys.canonical_signature(sig)
        except SignatureError:
            continue
        for key in candidates:
            if _keys.verify(key, message, sig):
                return payload, _keys.keyid(key)
    raise SignatureError(f"{_WHAT}: no signature verifies with a pinned release key (trusted keyids "
                         f"{sorted(_keys.keyid(k) for k in candidates)})")


def verify_model_signature(data: bytes, trusted: Sequence[ECC.EccKey]) -> ModelSignature:
    """Verify ``model.sig`` bytes against pinned keys and return what it signs. Pure.

    Checks, in order: strict JSON; the bundle's media type; the key hint (when present) names a
    pinned key; a DSSE signature of a pinned key over PAE(payloadType, payload); the payload is
    an in-toto Statement v1 with predicate type ``https://model_signing/signature/v1.0``, one
    subject with a sha256 digest, ``files`` serialization with ``sha256``, resources of valid
    unique paths with sha256 digests; the subject digest is the resources' root digest.

    Raises:
        SignatureError: any check fails; the message names ``model.sig`` and the field.
    """
    fields = Fields(_WHAT, SignatureError)
    try:
        bundle = loads_strict(data)
    except JSONFormatError as exc:
        raise SignatureError(f"{_WHAT} is not strict JSON: {exc}") from exc
    payload, kid = _signed_payload(bundle, trusted, fields)
    fields = Fields(f"{_WHAT} statement", SignatureError)
    statement, name, root = one_subject_statement(payload, PREDICATE_TYPE, fields, _WHAT, SignatureError,
                                                  name_nonempty=False)
    predicate = fields.get(statement, "predicate", "object")
    serialization = fields.get(predicate, "serialization", "object", "predicate")
    for key, expected in (("method", "files"), ("hash_type", "sha256")):
        if serialization.get(key) != expected:
            raise fields.fail(fields.join("predicate.serialization", key),
                              f"is {serialization.get(key)!r:.80}; sealfl reads only {expected!r}")
    resources = fields.get(predicate, "resources", "array", "predicate", nonempty=True, max_len=MAX_RESOURCES)
    files: dict[str, str] = {}
    for i, entry in enumerate(resources):
        at = fields.join("predicate.resources", i)
        fields.object(entry, at)
        path = fields.get(entry, "name", "string", at)
        try:
            validate_path(path)
        except ManifestError as exc:
            raise fields.fail(fields.join(at, "name"), str(exc)) from exc
        if fields.get(entry, "algorithm", "string", at) != "sha256":
            raise fields.fail(fields.join(at, "algorithm"), "must be 'sha256'")
        if path in files:
            raise fields.fail(fields.join(at, "name"), f"lists {path!r} twice")
        files[path] = fields.get(entry, "digest", "hex64", at)
    recomputed = model_root_digest(files)
    if root != recomputed:
        raise fields.fail("subject[0].digest.sha256", f"is {root}, but the resources give {recomputed}")
    return ModelSignature(name=name, root_digest=root, files=files, serialization=dict(serialization), keyid=kid)


def signature_problems(signed: Mapping[str, str], expected: Mapping[str, str]) -> list[str]:
    """Every difference between the files ``model.sig`` signs and the ``expected`` ones
    (``{name: sha256 hex}``): missing, extra and mismatched names, sorted. Pure."""
    out = [f"missing from {SIGNATURE_FILE}: {n!r}" for n in sorted(set(expected) - set(signed))]
    out += [f"signed by {SIGNATURE_FILE} but not a file of the release: {n!r}" for n in sorted(set(signed) - set(expected))]
    out += [f"{n!r} has sha256 {expected[n]} but {SIGNATURE_FILE} signs {signed[n]}"
            for n in sorted(set(signed) & set(expected)) if signed[n] != expected[n]]
    return out
