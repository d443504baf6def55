"""Signed release deltas: a binary patch per changed file plus a statement the release
enclave signs, pinning the exact base release and the release the patches produce.

A delta directory holds ``delta.dsse.json`` and ``patches/<file>.hdiff`` (HDiffPatch
format, ``hdiffpatch`` on PyPI). ``delta.dsse.json`` is a DSSE envelope (payloadType
``application/vnd.in-toto+json``, the release key) over an in-toto Statement v1::

    {"_type": "https://in-toto.io/Statement/v1",
     "subject": [{"name": <release name>, "digest": {"sha256": <result root digest>}}],
     "predicateType": "https://sealfl.dev/delta/v1",
     "predicate": {
       "algorithm": "hdiffpatch",
       "base": {"name": str, "version": int, "root_digest": hex64},
       "result": {"name": str, "version": int, "root_digest": hex64},
       "files": [{"name": str, "length": int,  "sha256": hex64,      # the result file
                  "from": str | null,                                # base file it is patched from (null: empty)
                  "patch": str | null, "patch_length": int, "patch_sha256": hex64 | null}]}}
                                                                     # patch null: the base file, unchanged

Everything here is pure over bytes: :func:`verify_delta_statement` checks the signature,
the statement and every field; :func:`check_patch_header` reads the output size an
HDiffPatch patch declares, so a patch that would expand beyond the signed length is refused
*before* it is applied (the patch library allocates what its header says). The device side
(:mod:`sealfl.enclave.device.delta`) applies it and verifies the result in full.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from Crypto.PublicKey import ECC

from sealfl.attestation.canonical import JSONFormatError, canonical_json, loads_strict
from sealfl.attestation.dsse import sign_envelope, verify_envelope
from sealfl.attestation.errors import DeltaError, SignatureError
from sealfl.attestation.intoto import one_subject_statement
from sealfl.common.fields import Fields

__all__ = ["DELTA_FILE", "PATCH_DIR", "PREDICATE_TYPE", "ALGORITHM", "DeltaFile", "DeltaStatement",
           "build_delta_statement", "verify_delta_statement", "check_patch_header"]

DELTA_FILE = "delta.dsse.json"
PATCH_DIR = "patches"
PREDICATE_TYPE = "https://sealfl.dev/delta/v1"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
ALGORITHM = "hdiffpatch"
#: largest delta statement read (bytes)
MAX_STATEMENT_BYTES = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MAX_FILES = 4096
_MAX_LENGTH = 1 << 40
_MAGIC = b"HDIFF13&"
_COMPRESSIONS = (b"", b"zstd", b"zlib", b"lzma", b"lzma2", b"bz2", b"lz4", b"lz4hc", b"brotli", b"xz")


@dataclass(frozen=True)
class DeltaFile:
    """One result file: ``name`` of ``length`` bytes with SHA-256 ``sha256``, made by
    ``patch`` (a file under ``patches/``, ``patch_length`` bytes, ``patch_sha256``) from the
    base file ``source`` (None: from empty), or copied from the base unchanged (``patch`` None)."""

    name: str
    length: int
    sha256: str
    source: str | None
    patch: str | None
    patch_length: int
    patch_sha256: str | None


@dataclass(frozen=True)
class DeltaStatement:
    """A verified delta statement (module docstring): the base and result releases
    (``(name, version, root_digest)``) and the result's files."""

    name: str
    base_version: int
    base_root_digest: str
    version: int
    root_digest: str
    files: tuple[DeltaFile, ...]


def build_delta_statement(predicate: dict, signing_key: ECC.EccKey) -> bytes:
    """The bytes of ``delta.dsse.json`` for ``predicate`` (module docstring), signed.

    Raises:
        DeltaError: the predicate is not well-formed.
    """
    fields = Fields(f"{DELTA_FILE} predicate", DeltaError)
    _check_predicate(predicate, fields)
    res = predicate["result"]
    statement = {"_type": STATEMENT_TYPE, "subject": [{"name": res["name"], "digest": {"sha256": res["root_digest"]}}],
                 "predicateType": PREDICATE_TYPE, "predicate": predicate}
    return canonical_json(sign_envelope(canonical_json(statement), PAYLOAD_TYPE, signing_key)) + b"\n"


def _release_ref(fields: Fields, pred: dict, key: str) -> tuple[str, int, str]:
    ref = fields.get(pred, key, "object", "predicate")
    at = f"predicate.{key}"
    name = fields.get(ref, "name", "string", at)
    version = fields.get(ref, "version", "integer", at, lo=0)
    digest = fields.get(ref, "root_digest", "hex64", at)
    return name, version, digest


def _check_predicate(pred: dict, fields: Fields) -> DeltaStatement:
    fields.object(pred, "predicate")
    algorithm = fields.get(pred, "algorithm", "string", "predicate")
    if algorithm != ALGORITHM:
        raise fields.fail("predicate.algorithm", f"is {algorithm!r:.40}; this device applies only {ALGORITHM!r}")
    base = _release_ref(fields, pred, "base")
    result = _release_ref(fields, pred, "result")
    if base[0] != result[0]:
        raise fields.fail("predicate.result.name", f"is {result[0]!r}, but the base release is {base[0]!r}: a delta "
                          "never turns one model into another")
    if result[1] <= base[1]:
        raise fields.fail("predicate.result.version", f"is {result[1]}, not newer than the base's {base[1]}")
    files, seen = [], set()
    for i, entry in enumerate(fields.get(pred, "files", "array", "predicate", nonempty=True, max_len=_MAX_FILES)):
        at = f"predicate.files[{i}]"
        fields.object(entry, at)
        name = fields.get(entry, "name", "string", at)
        if not _NAME.match(name) or name in seen:
            raise fields.fail(f"{at}.name", f"{name!r:.80} is not a plain, unique file name")
        seen.add(name)
        length = fields.get(entry, "length", "integer", at, lo=0)
        if length > _MAX_LENGTH:
            raise fields.fail(f"{at}.length", f"{length} bytes is beyond any release file")
        digest = fields.get(entry, "sha256", "hex64", at)
        source, patch = entry.get("from"), entry.get("patch")
        for key, value in (("from", source), ("patch", patch)):
            if value is not None and (not isinstance(value, str) or not _NAME.match(value)):
                raise fields.fail(f"{at}.{key}", f"{value!r:.80} is not null or a plain file name")
        plen = fields.get(entry, "patch_length", "integer", at, lo=0)
        psha = entry.get("patch_sha256")
        if patch is None:
            if source != name or psha is not None or plen != 0:
                raise fields.fail(at, "an unchanged file (patch null) must come from the base file of its own name, "
                                  "with patch_length 0 and patch_sha256 null")
        else:
            fields.hex64(psha, f"{at}.patch_sha256")
        files.append(DeltaFile(name, length, digest, source, patch, plen, psha))
    patches = [f.patch for f in files if f.patch is not None]
    if len(set(patches)) != len(patches):
        raise fields.fail("predicate.files", "two files name the same patch")
    return DeltaStatement(result[0], base[1], base[2], result[1], result[2], tuple(files))


def verify_delta_statement(data: bytes, trusted: Sequence[ECC.EccKey]) -> DeltaStatement:
    """Verify ``delta.dsse.json`` bytes: a DSSE signature of a pinned release key over an
    in-toto Statement v1 of predicate type ``https://sealfl.dev/delta/v1`` whose one subject
    is the result release, and a well-formed predicate. Pure.

    Raises:
        DeltaError: any check fails; the message names the field.
    """
    if len(data) > MAX_STATEMENT_BYTES:
        raise DeltaError(f"{DELTA_FILE}: larger than {MAX_STATEMENT_BYTES} bytes, not a delta statement")
    try:
        payload = verify_envelope(loads_strict(data), trusted, expected_payload_type=PAYLOAD_TYPE)
    except (JSONFormatError, SignatureError) as exc:
        raise DeltaError(f"{DELTA_FILE}: {exc}; the delta is refused (install the full release)") from exc
    fields = Fields(DELTA_FILE, DeltaError)
    statement, name, digest = one_subject_statement(payload, PREDICATE_TYPE, fields, DELTA_FILE, DeltaError)
    parsed = _check_predicate(statement.get("predicate"), fields)
    if (name, digest) != (parsed.name, parsed.root_digest):
        raise fields.fail("subject[0]", "names another release than predicate.result")
    return parsed


def _uint(data: bytes, pos: int) -> tuple[int, int]:
    value = 0
    for i in range(pos, min(len(data), pos + 9)):
        value = (value << 7) | (data[i] & 0x7F)
        if not data[i] & 0x80:
            return value, i + 1
    raise DeltaError("the patch header is truncated or its sizes are malformed")


def check_patch_header(patch: bytes, *, new_length: int, old_length: int) -> None:
    """Refuse an HDiffPatch patch (``HDIFF13&<compression>\\0`` then the packed new and
    old sizes, HDiffPatch's ``hpatch_compressedDiffInfo``) unless it declares exactly the
    signed ``new_length`` and the base file's ``old_length``. Pure; read before applying, so
    the patch library never allocates more than the signed size.

    Raises:
        DeltaError: not an HDiffPatch patch, an unknown compression, or other sizes.
    """
    if not patch.startswith(_MAGIC):
        raise DeltaError(f"not an HDiffPatch patch (starts {patch[:8]!r})")
    end = patch.find(b"\0", len(_MAGIC), len(_MAGIC) + 16)
    if end < 0 or patch[len(_MAGIC):end] not in _COMPRESSIONS:
        raise DeltaError("the patch names an unknown compression")
    new_size, pos = _uint(patch, end + 1)
    old_size, _ = _uint(patch, pos)
    if new_size != new_length:
        raise DeltaError(f"the patch would produce {new_size} bytes, but the signed length is {new_length}: refused "
                         "before applying it")
    if old_size != old_length:
        raise DeltaError(f"the patch is for a {old_size}-byte base file, but the base file has {old_length} bytes")
