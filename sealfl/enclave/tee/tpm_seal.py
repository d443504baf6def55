"""Sealing on a TPM 2.0 for :mod:`sealfl.enclave.tee.tpm`: a fresh 32-byte AES-256 key is sealed
as a TPM keyed-hash object under the owner's primary ECC key (re-derived each time from the
owner seed with ``tpm2_createprimary``) with a ``PolicyPCR`` policy (TPM 2.0 Part 1 §19.7)
over the requested PCR values; the data is AES-256-GCM encrypted under that key
(:mod:`sealfl.enclave.tee.sealed_blob`), with header canonical JSON ``{"alg", "bank",
"policy": {"<i>": hex}, "pub": b64, "priv": b64}`` (the TPM2B public/private parts of the
sealed object), authenticated as GCM AAD.

What the TPM loads is flushed by :meth:`~sealfl.enclave.tee.tpm_tools.Tools.scope` (only
sealfl's own objects); an unseal failure says why: the PCR policy (``TPM_RC_POLICY_FAIL``),
an object of another TPM or owner seed (``TPM_RC_INTEGRITY``, ...), or -- as a
:class:`~sealfl.enclave.errors.TPMError`, not an unseal failure -- anything else the TPM
reported (e.g. its object memory is full).
"""

from __future__ import annotations

import base64
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from Crypto.Random import get_random_bytes

from sealfl.attestation.canonical import JSONFormatError, loads_strict
from sealfl.attestation.quote import PCR_BANK
from sealfl.enclave.errors import TEEError, UnsealError
from sealfl.enclave.tee.sealed_blob import open_blob, seal_blob, split_blob
from sealfl.enclave.tee.tpm_tools import Tools

__all__ = ["MAGIC", "seal", "unseal"]

MAGIC = b"SEALFL-TPMSEAL/1\n"


def seal(tools: Tools, data: bytes, pol: Mapping[int, bytes]) -> bytes:
    """Seal ``data`` to the PCR values ``pol`` (``{index: 32-byte value}``, already checked;
    empty: no policy); returns the blob (module docstring).

    Raises:
        TPMError: a TPM command failed (what it means, what to do).
    """
    key = get_random_bytes(32)
    with tempfile.TemporaryDirectory(prefix="sealfl-tpm-") as tmp, tools.scope(sessions=bool(pol)):
        p = {n: os.path.join(tmp, n) for n in ("prim", "vals", "pol", "pub", "priv", "key")}
        Path(p["key"]).write_bytes(key)
        _primary(tools, p["prim"])
        args = ["tpm2_create", "-C", p["prim"], "-i", p["key"], "-u", p["pub"], "-r", p["priv"]]
        if pol:
            Path(p["vals"]).write_bytes(b"".join(pol[i] for i in sorted(pol)))
            tools.run("tpm2_createpolicy", "--policy-pcr", "-l", _sel(pol), "-f", p["vals"], "-L", p["pol"])
            tools.flush()
            args += ["-L", p["pol"], "-a", "fixedtpm|fixedparent"]
        else:
            args += ["-a", "fixedtpm|fixedparent|userwithauth"]
        tools.run(*args)
        pub, priv = Path(p["pub"]).read_bytes(), Path(p["priv"]).read_bytes()
    return seal_blob(MAGIC, {"alg": "AES-256-GCM", "bank": PCR_BANK,
                             "policy": {str(i): pol[i].hex() for i in sorted(pol)},
                             "pub": base64.b64encode(pub).decode(), "priv": base64.b64encode(priv).decode()},
                     key, data)


def unseal(tools: Tools, blob: bytes) -> bytes:
    """The data sealed in ``blob``: the TPM releases the key only under the PCR policy.

    Raises:
        UnsealError: the blob is malformed or modified; the TPM refused the sealed object
            (another TPM, another owner seed, modified); or the PCR policy is not met.
        TPMError: any other TPM failure (e.g. object memory full), with what to do.
    """
    parts = split_blob(blob, MAGIC, "TPM sealed blob")
    try:
        header = loads_strict(parts.header)
        policy = sorted(int(i) for i in header["policy"])
        pub, priv = base64.b64decode(header["pub"], validate=True), base64.b64decode(header["priv"], validate=True)
    except (JSONFormatError, KeyError, TypeError, ValueError) as exc:
        raise UnsealError(f"TPM sealed blob header is malformed: {exc}") from exc
    with tempfile.TemporaryDirectory(prefix="sealfl-tpm-") as tmp, tools.scope():
        p = {n: os.path.join(tmp, n) for n in ("prim", "pub", "priv", "obj")}
        Path(p["pub"]).write_bytes(pub)
        Path(p["priv"]).write_bytes(priv)
        _primary(tools, p["prim"])
        proc = tools.run("tpm2_load", "-C", p["prim"], "-u", p["pub"], "-r", p["priv"], "-c", p["obj"], check=False)
        if proc.returncode != 0:
            raise _failure(tools, "tpm2_load", proc, "loading the sealed object")
        tools.flush()
        auth = ["-p", f"pcr:{_sel(policy)}"] if policy else []
        proc = tools.run("tpm2_unseal", "-c", p["obj"], *auth, check=False)
        if proc.returncode != 0:
            raise _failure(tools, "tpm2_unseal", proc, "unsealing", policy)
    return open_blob(parts, proc.stdout, "sealed blob failed authentication: it was modified")


def _failure(tools: Tools, command: str, proc, what: str, policy=()) -> TEEError:
    rc = getattr(proc, "rc", None)
    if rc is not None and rc.kind == "policy":
        return UnsealError(f"PCR policy not satisfied ({rc.label()}): PCR(s) {list(policy)} differ from the values "
                           "the data was sealed to (the measured code or boot state changed); re-provision the "
                           "secret")
    if rc is not None and rc.kind == "foreign-object":
        return UnsealError(f"the TPM refused the sealed object ({rc.label()}): it was sealed by another TPM, under "
                           "another owner seed (the TPM was cleared), or modified")
    return tools.error(command, proc, what)


def _primary(tools: Tools, ctx: str) -> None:
    tools.run("tpm2_createprimary", "-C", "o", "-G", "ecc", "-g", "sha256", "-c", ctx)
    tools.flush()  # drops the handle; the context file reloads it


def _sel(indices) -> str:
    return "sha256:" + ",".join(str(i) for i in sorted(indices))
