"""The key broker's decision: a model key only to a device attested in an approved state.

Pure over parsed data plus an injected clock; no network, no disk (the server around it is
:mod:`sealfl.enclave.keybroker.server`). Protocol (challenge-response):

1. ``POST /challenge`` -> ``{"nonce": hex32}``: a fresh random 32-byte nonce, valid for
   ``nonce_ttl_s`` seconds and **once** (:meth:`KeyBroker.challenge`).
2. The device creates a fresh HPKE key pair (:mod:`sealfl.attestation.hpke_wrap`), re-measures its runtime
   and quotes its PCRs with purpose ``"key-request"`` over ``nonce || SHA-256(public key)``
   (:func:`sealfl.attestation.hpke_wrap.binding`), then ``POST /key`` with::

       {"nonce": hex32, "public_key": b64 (65 bytes), "ak_keyid": hex64, "evidence": {...}}

3. :meth:`KeyBroker.release_key` checks, in order: the request's fields; the nonce was
   issued by this broker, is unexpired and unused (then it is consumed, pass or fail); the
   AK is one of the registered devices'; the evidence
   (:func:`sealfl.attestation.eventlog.verify_evidence`: AK signature, qualifying data =
   the purpose label over nonce and key binding -- a public key not bound in the quote fails
   here --, event-log replay, policy of allowed values); a key exists for the attested
   release root. It returns the key HPKE-sealed to the request's public key::

       {"release_root": hex64, "enc": b64, "wrapped_key": b64}

Any failure is :class:`~sealfl.enclave.errors.KeyRequestRefused` naming the check; no key leaves.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from Crypto.PublicKey import ECC

from sealfl.attestation import hpke_wrap as _wrap
from sealfl.attestation import keys as _keys
from sealfl.attestation.errors import AttestationError, KeyWrapFormatError, PolicyError
from sealfl.attestation.eventlog import AttestationPolicy, verify_evidence
from sealfl.attestation.quote import KEY_REQUEST_PURPOSE
from sealfl.common.fields import Fields
from sealfl.enclave.errors import KeyRequestRefused

__all__ = ["NONCE_SIZE", "KeyBroker"]

NONCE_SIZE = 32
#: Most outstanding challenges; the oldest are dropped first beyond it.
MAX_OUTSTANDING = 10_000


def _refuse(check: str):
    return lambda msg: KeyRequestRefused(msg, check=check)


class KeyBroker:
    """Holds release keys, pinned device AKs and the policy; issues challenges; decides.

    Args:
        policy: allowed values (:class:`~sealfl.attestation.eventlog.AttestationPolicy`).
        device_aks: the registered devices' AK public keys.
        keys: ``{release root digest (hex): 32-byte AES-256 key}``.
        nonce_ttl_s: how long a challenge stays valid (seconds).
        clock: monotonic seconds (injected for tests).
    """

    def __init__(self, policy: AttestationPolicy, device_aks: list[ECC.EccKey], keys: Mapping[str, bytes], *,
                 nonce_ttl_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._aks = {_keys.keyid(k): k for k in device_aks}
        self._keys = dict(keys)
        self._ttl = nonce_ttl_s
        self._clock = clock
        self._nonces: dict[str, float] = {}
        self._lock = threading.Lock()  # the server calls from a thread pool

    def challenge(self) -> str:
        """Issue a fresh 32-byte nonce (hex), valid once for ``nonce_ttl_s`` seconds."""
        with self._lock:
            return self._challenge()

    def _challenge(self) -> str:
        now = self._clock()
        self._nonces = {n: t for n, t in self._nonces.items() if now - t <= self._ttl}
        while len(self._nonces) >= MAX_OUTSTANDING:
            self._nonces.pop(next(iter(self._nonces)))
        nonce = secrets.token_hex(NONCE_SIZE)
        self._nonces[nonce] = now
        return nonce

    def release_key(self, request: Any) -> dict:
        """Decide a key request (checks in the module docstring).

        Raises:
            KeyRequestRefused: ``.check`` names what failed.
        """
        with self._lock:
            return self._release_key(request)

    def _release_key(self, request: Any) -> dict:
        fields = Fields("key request", _refuse("request"))
        fields.object(request, "")
        fields.only(request, ("nonce", "public_key", "ak_keyid", "evidence"))
        nonce_hex = fields.get(request, "nonce", "string", max_len=2 * NONCE_SIZE)
        pub_b64 = fields.get(request, "public_key", "string", max_len=256)
        keyid = fields.get(request, "ak_keyid", "hex64")
        evidence = fields.get(request, "evidence", "object")
        issued = next((t for n, t in self._nonces.items() if hmac.compare_digest(n, nonce_hex)), None)
        if issued is None:
            raise KeyRequestRefused("the nonce was not issued by this broker or was already used; ask for a new "
                                    "challenge", check="nonce")
        del self._nonces[nonce_hex]
        if self._clock() - issued > self._ttl:
            raise KeyRequestRefused(f"the nonce is stale (older than {self._ttl:g} s); ask for a new challenge",
                                    check="nonce")
        try:
            public_key = base64.b64decode(pub_b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise KeyRequestRefused(f"key request: field 'public_key' is not base64: {exc}", check="request") from exc
        if len(public_key) != _wrap.PUBLIC_KEY_SIZE:
            raise KeyRequestRefused(f"key request: field 'public_key' must be {_wrap.PUBLIC_KEY_SIZE} bytes "
                                    "(uncompressed P-256)", check="request")
        ak = self._aks.get(keyid)
        if ak is None:
            raise KeyRequestRefused(f"AK {keyid[:16]}… is not a registered device; register its AK public key",
                                    check="ak")
        data = _wrap.binding(bytes.fromhex(nonce_hex), public_key)
        try:
            attested = verify_evidence(evidence, ak, data, self.policy, purpose=KEY_REQUEST_PURPOSE)
        except AttestationError as exc:
            check = "policy" if isinstance(exc, PolicyError) else "evidence"
            raise KeyRequestRefused(f"attestation refused: {exc}", check=check) from exc
        key = self._keys.get(attested.release_root)
        if key is None:
            raise KeyRequestRefused(f"no key is held for release root {attested.release_root[:16]}…", check="key")
        try:
            enc, wrapped = _wrap.wrap(public_key, attested.release_root, key)
        except KeyWrapFormatError as exc:
            raise KeyRequestRefused(str(exc), check="request") from exc
        return {"release_root": attested.release_root, "enc": base64.b64encode(enc).decode(),
                "wrapped_key": base64.b64encode(wrapped).decode()}
