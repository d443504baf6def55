"""The device side of a key request (protocol: :mod:`sealfl.kbs.broker`), stdlib HTTP only.

:func:`request_key` asks the broker for a challenge, makes a fresh HPKE key pair, attests
with purpose ``"key-request"`` over ``nonce || SHA-256(public key)``
(:func:`sealfl.enclave.measured.attest_device`), posts the request and unwraps the key.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request

from sealfl.attestation.keys import keyid, load_public_key
from sealfl.attestation.quote import KEY_REQUEST_PURPOSE

from . import wrap as _wrap
from .errors import KBSError, KeyRequestRefused

__all__ = ["request_key"]

_MAX_REPLY = 1024 * 1024


def _post(url: str, body: dict, timeout_s: float) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, data = resp.status, resp.read(_MAX_REPLY + 1)
    except urllib.error.HTTPError as exc:
        status, data = exc.code, exc.read(_MAX_REPLY + 1)
    except (urllib.error.URLError, OSError) as exc:
        raise KBSError(f"cannot reach the key broker at {url}: {exc}") from exc
    try:
        doc = json.loads(data[:_MAX_REPLY])
    except ValueError as exc:
        raise KBSError(f"the key broker at {url} answered {status} with no JSON") from exc
    if not isinstance(doc, dict):
        raise KBSError(f"the key broker at {url} answered {status} with {type(doc).__name__}, not an object")
    return status, doc


def request_key(url: str, state_dir: str | os.PathLike, *, timeout_s: float = 30.0) -> tuple[str, bytes]:
    """Obtain the model key for the release this device booted.

    Returns:
        ``(release root digest hex, 32-byte key)``.

    Raises:
        KeyRequestRefused: the broker refused (``.check`` from its answer).
        KBSError: the broker is unreachable or answered malformed.
        TEEStateError / TEEError: the device cannot attest.
    """
    from sealfl.enclave.measured import attest_device, device_public_key

    base = url.rstrip("/")
    status, doc = _post(base + "/challenge", {}, timeout_s)
    nonce = doc.get("nonce")
    if status != 200 or not isinstance(nonce, str) or len(nonce) != 64:
        raise KBSError(f"the key broker gave no challenge (HTTP {status}): {doc!r:.200}")
    pair = _wrap.new_request_key()
    pub = _wrap.public_bytes(pair)
    evidence = attest_device(state_dir, _wrap.binding(bytes.fromhex(nonce), pub), purpose=KEY_REQUEST_PURPOSE)
    ak = keyid(load_public_key(device_public_key(state_dir)))
    status, doc = _post(base + "/key", {"nonce": nonce, "public_key": base64.b64encode(pub).decode(),
                                        "ak_keyid": ak, "evidence": evidence}, timeout_s)
    if status != 200:
        raise KeyRequestRefused(f"the key broker refused: {doc.get('error')!s:.2000}", check=str(doc.get("check")))
    try:
        root = doc["release_root"]
        key = _wrap.unwrap(pair, root, base64.b64decode(doc["enc"]), base64.b64decode(doc["wrapped_key"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise KBSError(f"the key broker's answer is malformed: {exc}") from exc
    return root, key
