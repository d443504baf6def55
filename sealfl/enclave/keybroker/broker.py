"""The key broker's decision: a model key only to a device attested in an approved state.

Pure over parsed data plus an injected clock; no network, no disk (the server around it is
:mod:`sealfl.enclave.keybroker.server`). Protocol (challenge-response):

1. ``POST /challenge`` -> ``{"nonce": hex32}``: a fresh random 32-byte nonce, valid for
   ``nonce_ttl_s`` seconds and **once** (:meth:`KeyBroker.challenge`). Challenges are
   bounded so that a flood cannot crowd out a genuine device (:class:`ChallengeLimits`):
   at most ``per_client`` outstanding per client and ``total`` in all -- beyond either, the
   request is refused (HTTP 429 with ``Retry-After``), never an issued challenge evicted --
   and each client's rate is a token bucket (``rate_per_s``, ``burst``; RFC 6585 §4 for
   the 429). Issuing, expiring and looking a challenge up are O(1): challenges live in an
   insertion-ordered table (issue time only grows, so the expired ones are at its front).
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
import hashlib
import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from Crypto.PublicKey import ECC

from sealfl.attestation import hpke_wrap as _wrap
from sealfl.attestation import keys as _keys
from sealfl.attestation.errors import AttestationError, KeyWrapFormatError, PolicyError
from sealfl.attestation.eventlog import AttestationPolicy, verify_evidence
from sealfl.attestation.quote import KEY_REQUEST_PURPOSE
from sealfl.common.fields import Fields
from sealfl.enclave.errors import KeyRequestRefused

__all__ = ["NONCE_SIZE", "ChallengeLimits", "KeyBroker"]

NONCE_SIZE = 32


def _refuse(check: str):
    return lambda msg: KeyRequestRefused(msg, check=check)


@dataclass(frozen=True)
class ChallengeLimits:
    """Bounds on challenges (one object, like TUF's ``UpdaterConfig``).

    Attributes:
        ttl_s: how long a challenge stays valid, seconds.
        per_client: most outstanding (issued, unused, unexpired) challenges of one client.
        total: most outstanding challenges in all.
        rate_per_s: challenges a client earns per second (token bucket refill).
        burst: most challenges a client may ask for at once (bucket size).
        max_clients: clients whose buckets are kept (least recently seen dropped first).
    """

    ttl_s: float = 60.0
    per_client: int = 16
    total: int = 10_000
    rate_per_s: float = 2.0
    burst: int = 8
    max_clients: int = 4096


@dataclass
class _Issued:
    client: str
    at: float


class KeyBroker:
    """Holds release keys, pinned device AKs and the policy; issues challenges; decides.

    Args:
        policy: allowed values (:class:`~sealfl.attestation.eventlog.AttestationPolicy`).
        device_aks: the registered devices' AK public keys.
        keys: ``{release root digest (hex): 32-byte AES-256 key}``.
        nonce_ttl_s: how long a challenge stays valid (seconds; overrides ``limits.ttl_s``).
        limits: the challenge bounds (:class:`ChallengeLimits`).
        clock: monotonic seconds (injected for tests).
    """

    def __init__(self, policy: AttestationPolicy, device_aks: list[ECC.EccKey], keys: Mapping[str, bytes], *,
                 nonce_ttl_s: float | None = None, limits: ChallengeLimits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._aks = {_keys.keyid(k): k for k in device_aks}
        self._keys = dict(keys)
        self.limits = limits or ChallengeLimits()
        self._ttl = self.limits.ttl_s if nonce_ttl_s is None else nonce_ttl_s
        self._clock = clock
        self._nonces: OrderedDict[bytes, _Issued] = OrderedDict()  # SHA-256(nonce) -> who, when; issue order
        self._outstanding: dict[str, deque[float]] = {}  # client -> issue times of its outstanding ones (<= per_client)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (tokens, at)
        self._lock = threading.Lock()  # the server calls from a thread pool

    def reconfigure(self, policy: AttestationPolicy, keys: Mapping[str, bytes]) -> None:
        """Replace the policy and the release keys (a re-read configuration); issued
        challenges and the registered AKs stay."""
        with self._lock:
            self.policy = policy
            self._keys = dict(keys)

    @staticmethod
    def _key(nonce_hex: str) -> bytes:
        return hashlib.sha256(nonce_hex.encode("ascii", "replace")).digest()

    def outstanding(self, client: str | None = None) -> int:
        """Challenges issued and not yet used or expired (of ``client``, or in all)."""
        with self._lock:
            self._expire(self._clock())
            return len(self._nonces) if client is None else len(self._outstanding.get(client, ()))

    def challenge(self, client: str = "") -> str:
        """Issue a fresh 32-byte nonce (hex) to ``client`` (its address), valid once for
        the challenge lifetime. O(1) amortised.

        Raises:
            KeyRequestRefused: (check ``"rate"``, ``.retry_after_s`` set) the client asks
                too fast, has :attr:`ChallengeLimits.per_client` outstanding, or the broker
                has :attr:`ChallengeLimits.total`; nothing issued is ever evicted.
        """
        with self._lock:
            now = self._clock()
            self._expire(now)
            lim = self.limits
            tokens, at = self._buckets.pop(client, (float(lim.burst), now))
            tokens = min(float(lim.burst), tokens + (now - at) * lim.rate_per_s)
            self._buckets[client] = (tokens, now)
            while len(self._buckets) > lim.max_clients:
                self._buckets.popitem(last=False)
            if tokens < 1.0:
                raise self._rate(f"more than {lim.burst} challenges at once or {lim.rate_per_s:g} per second",
                                 (1.0 - tokens) / lim.rate_per_s)
            mine = self._outstanding.get(client, ())
            if len(mine) >= lim.per_client:
                oldest = mine[0]
                raise self._rate(f"{lim.per_client} unused challenges are outstanding for this client; use or let "
                                 "them expire first", oldest + self._ttl - now)
            if len(self._nonces) >= lim.total:
                raise self._rate(f"the broker holds {lim.total} outstanding challenges",
                                 next(iter(self._nonces.values())).at + self._ttl - now)
            self._buckets[client] = (tokens - 1.0, now)
            nonce = secrets.token_hex(NONCE_SIZE)
            self._nonces[self._key(nonce)] = _Issued(client, now)
            self._outstanding.setdefault(client, deque()).append(now)
            return nonce

    @staticmethod
    def _rate(why: str, retry_after_s: float) -> KeyRequestRefused:
        wait = max(1, math.ceil(retry_after_s))
        return KeyRequestRefused(f"too many challenges: {why}; retry after {wait} s", check="rate", retry_after_s=wait)

    def _expire(self, now: float) -> None:
        while self._nonces:
            key, first = next(iter(self._nonces.items()))
            if now - first.at <= self._ttl:
                return
            del self._nonces[key]
            self._forget(first)

    def _forget(self, issued: _Issued) -> None:
        """Drop one outstanding challenge of ``issued.client`` (O(per_client))."""
        mine = self._outstanding.get(issued.client)
        if mine is None:
            return
        mine.remove(issued.at)  # the oldest when it expired; any one of at most per_client when used
        if not mine:
            del self._outstanding[issued.client]

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
        issued = self._nonces.pop(self._key(nonce_hex), None)  # O(1); keyed by a hash, so no timing on the nonce
        if issued is None:
            raise KeyRequestRefused("the nonce was not issued by this broker, was already used, or expired; ask for "
                                    "a new challenge", check="nonce")
        self._forget(issued)
        if self._clock() - issued.at > self._ttl:
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
