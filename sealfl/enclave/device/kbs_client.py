"""The device side of a key request (protocol: :mod:`sealfl.enclave.keybroker.broker`), stdlib HTTP only.

:func:`request_key` asks the broker for a challenge, makes a fresh HPKE key pair, attests
with purpose ``"key-request"`` over ``nonce || SHA-256(public key)``
(:func:`sealfl.enclave.device.evidence.attest_device`), posts the request and unwraps the key.
A challenge refused with 429 is asked again after the broker's ``Retry-After`` when that is
at most :data:`MAX_RETRY_AFTER_S` (twice at most); otherwise the refusal says when to retry.
"""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.error
import urllib.request

from sealfl.attestation import hpke_wrap as _wrap
from sealfl.attestation.keys import keyid, load_public_key
from sealfl.attestation.quote import KEY_REQUEST_PURPOSE
from sealfl.enclave.errors import KeyBrokerError, KeyRequestRefused

__all__ = ["request_key", "broker_key_source", "MAX_RETRY_AFTER_S"]

_MAX_REPLY = 1024 * 1024
#: longest ``Retry-After`` of a refused challenge the device waits for by itself, seconds
MAX_RETRY_AFTER_S = 10.0


def _post(url: str, body: dict, timeout_s: float) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, data = resp.status, resp.read(_MAX_REPLY + 1)
    except urllib.error.HTTPError as exc:
        status, data = exc.code, exc.read(_MAX_REPLY + 1)
        retry = exc.headers.get("Retry-After", "") if exc.headers is not None else ""
        if status == 429:
            wait = float(retry) if retry.isdigit() else 1.0
            raise KeyRequestRefused(f"the key broker at {url} is rate-limiting challenges; retry after {wait:g} s",
                                    check="rate", retry_after_s=wait) from None
    except (urllib.error.URLError, OSError) as exc:
        raise KeyBrokerError(f"cannot reach the key broker at {url}: {exc}") from exc
    try:
        doc = json.loads(data[:_MAX_REPLY])
    except ValueError as exc:
        raise KeyBrokerError(f"the key broker at {url} answered {status} with no JSON") from exc
    if not isinstance(doc, dict):
        raise KeyBrokerError(f"the key broker at {url} answered {status} with {type(doc).__name__}, not an object")
    return status, doc


def _challenge(base: str, timeout_s: float) -> tuple[int, dict]:
    waited = 0
    while True:
        try:
            return _post(base + "/challenge", {}, timeout_s)
        except KeyRequestRefused as exc:
            if waited == 2 or exc.retry_after_s is None or exc.retry_after_s > MAX_RETRY_AFTER_S:
                raise
            waited += 1
            time.sleep(exc.retry_after_s)


def _ask(base: str, attest, ak_keyid: str, timeout_s: float) -> tuple[str, bytes]:
    """One challenge-response; ``attest(quote data) -> evidence``."""
    status, doc = _challenge(base, timeout_s)
    nonce = doc.get("nonce")
    if status != 200 or not isinstance(nonce, str) or len(nonce) != 64:
        raise KeyBrokerError(f"the key broker gave no challenge (HTTP {status}): {doc!r:.200}")
    pair = _wrap.new_request_key()
    pub = _wrap.public_bytes(pair)
    try:
        data = _wrap.binding(bytes.fromhex(nonce), pub)
    except ValueError as exc:
        raise KeyBrokerError(f"the key broker's nonce is not hex: {nonce!r:.80}") from exc
    evidence = attest(data)
    status, doc = _post(base + "/key", {"nonce": nonce, "public_key": base64.b64encode(pub).decode(),
                                        "ak_keyid": ak_keyid, "evidence": evidence}, timeout_s)
    if status != 200:
        raise KeyRequestRefused(f"the key broker refused: {doc.get('error')!s:.2000}", check=str(doc.get("check")))
    try:
        root = doc["release_root"]
        key = _wrap.unwrap(pair, root, base64.b64decode(doc["enc"]), base64.b64decode(doc["wrapped_key"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise KeyBrokerError(f"the key broker's answer is malformed: {exc}") from exc
    return root, key


def request_key(url: str, state_dir: str | os.PathLike, *, timeout_s: float = 30.0) -> tuple[str, bytes]:
    """Obtain the model key for the release this (booted) device runs; takes the device lock.

    Returns:
        ``(release root digest hex, 32-byte key)``.

    Raises:
        KeyRequestRefused: the broker refused (``.check`` from its answer).
        KeyBrokerError: the broker is unreachable or answered malformed.
        TEEStateError / TEEError: the device cannot attest.
    """
    from sealfl.enclave.device.evidence import attest_device, device_public_key

    ak = keyid(load_public_key(device_public_key(state_dir)))
    return _ask(url.rstrip("/"), lambda data: attest_device(state_dir, data, purpose=KEY_REQUEST_PURPOSE), ak,
                timeout_s)


def broker_key_source(url: str, *, timeout_s: float = 30.0):
    """A ``key_source(tee, state_root)`` for :func:`sealfl.enclave.device.boot.boot` (used inside
    the boot, which already holds the device lock and the open TEE)."""
    def source(tee, state_root) -> tuple[str, bytes]:
        from sealfl.enclave.device.evidence import evidence

        return _ask(url.rstrip("/"), lambda data: evidence(tee, state_root, data, KEY_REQUEST_PURPOSE),
                    tee.ak_keyid(), timeout_s)

    return source
