"""``sealfl kbs serve``: the key broker over HTTP (FastAPI + uvicorn, bound to 127.0.0.1).

Endpoints (JSON): ``POST /challenge`` -> ``{"nonce": hex}``, or 429 ``{"error", "check":
"rate"}`` with ``Retry-After`` when the client (its address: ``request.client``; behind a
reverse proxy, the address the proxy forwards, trusted only from ``--forwarded-allow-ips``)
or the broker has too many outstanding challenges or asks too fast
(:class:`~sealfl.enclave.keybroker.broker.ChallengeLimits`); ``POST /key`` (body at most
:data:`MAX_BODY` bytes, strict JSON) -> 200 with the wrapped key, or 403
``{"error": message, "check": name}`` when refused, 400 on a malformed body. Protocol and
checks: :mod:`sealfl.enclave.keybroker.broker`.

Configuration files (:func:`load_broker`): the policy (``sealfl attest policy``), one or more
device AK public keys (PEM), and the keys file ``{"<release root hex>": "<base64 32-byte
key>"}`` (mode 0600; refused if group/other-readable). The policy and the keys file are
re-read when they change (:class:`ConfigWatcher`, checked before each key request), so a
release registered by ``sealfl repo publish --encrypt-at-rest`` is served without a restart;
a changed file that does not load is logged and the previous configuration kept.
"""

from __future__ import annotations

import base64
import binascii
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sealfl.attestation.canonical import JSONFormatError, loads_strict
from sealfl.attestation.errors import AttestationError
from sealfl.attestation.eventlog import parse_policy
from sealfl.attestation.keys import load_public_keys
from sealfl.common.fields import Fields
from sealfl.common.fsutil import check_private_file
from sealfl.enclave.errors import KeyBrokerError, KeyRequestRefused
from sealfl.enclave.keybroker.broker import ChallengeLimits, KeyBroker

__all__ = ["MAX_BODY", "ConfigWatcher", "create_app", "load_broker"]

log = logging.getLogger(__name__)
MAX_BODY = 1024 * 1024


def _load_config(policy: Path, keys: Path):
    try:
        pol = parse_policy(loads_strict(Path(policy).read_bytes()), str(policy))
        if not check_private_file(keys):
            raise KeyBrokerError(f"{keys} is readable by group/others; chmod 600 it")
        raw = loads_strict(Path(keys).read_bytes())
    except (OSError, JSONFormatError, AttestationError) as exc:
        raise KeyBrokerError(f"cannot load the key broker configuration: {exc}") from exc
    fields = Fields(str(keys), KeyBrokerError)
    fields.object(raw, "", nonempty=True)
    table = {}
    for root, value in raw.items():
        fields.hex64(root, root)
        try:
            key = base64.b64decode(fields.string(value, root), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise fields.fail(root, f"is not base64: {exc}") from exc
        if len(key) != 32:
            raise fields.fail(root, "is not a 32-byte AES-256 key")
        table[root] = key
    return pol, table


class ConfigWatcher:
    """Re-reads the policy and keys files into ``broker`` when either changed (inode, size,
    mtime); call it before each key request."""

    def __init__(self, broker: KeyBroker, policy: Path, keys: Path) -> None:
        self.broker, self.policy, self.keys = broker, Path(policy), Path(keys)
        self._seen = self._stamp()

    def _stamp(self) -> tuple:
        out = []
        for p in (self.policy, self.keys):
            try:
                st = p.stat()
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def __call__(self) -> None:
        stamp = self._stamp()
        if stamp == self._seen:
            return
        try:
            policy, keys = _load_config(self.policy, self.keys)
        except KeyBrokerError as exc:
            log.warning("the changed key broker configuration does not load, keeping the previous one: %s", exc)
            return
        self._seen = stamp
        self.broker.reconfigure(policy, keys)
        log.info("key broker configuration re-read: %d release key(s)", len(keys))


def load_broker(policy: Path, aks: list[Path], keys: Path, *, nonce_ttl_s: float = 60.0,
                limits: ChallengeLimits | None = None) -> KeyBroker:
    """Build a :class:`KeyBroker` from its files (see module docstring).

    Raises:
        KeyBrokerError: a file is unreadable or malformed (the message names it), or the
            keys file is not private.
    """
    ak_keys = []
    for p in aks:
        try:
            ak_keys += load_public_keys(Path(p).read_bytes())
        except (OSError, AttestationError) as exc:
            raise KeyBrokerError(f"--ak {p}: {exc}") from exc
    pol, table = _load_config(policy, keys)
    return KeyBroker(pol, ak_keys, table, nonce_ttl_s=nonce_ttl_s, limits=limits)


def create_app(broker: KeyBroker, watch: ConfigWatcher | None = None) -> FastAPI:
    """The FastAPI app around ``broker``; ``watch`` (if given) runs before each key request."""
    app = FastAPI(title="sealfl key broker", docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/challenge")
    def challenge(request: Request) -> JSONResponse:
        client = request.client.host if request.client is not None else ""
        try:
            return JSONResponse({"nonce": broker.challenge(client)})
        except KeyRequestRefused as exc:
            log.warning("challenge refused for %s: %s", client, exc)
            return JSONResponse({"error": str(exc), "check": exc.check}, 429,
                                headers={"Retry-After": str(int(exc.retry_after_s or 1))})

    @app.post("/key")
    async def key(request: Request) -> JSONResponse:
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY:
                return JSONResponse({"error": f"request body over {MAX_BODY} bytes", "check": "request"}, 413)
        try:
            doc = loads_strict(body)
        except JSONFormatError as exc:
            return JSONResponse({"error": f"request body is not strict JSON: {exc}", "check": "request"}, 400)
        if watch is not None:
            watch()
        try:
            return JSONResponse(broker.release_key(doc))
        except KeyRequestRefused as exc:
            log.warning("key request refused (%s): %s", exc.check, exc)
            return JSONResponse({"error": str(exc), "check": exc.check}, 403)

    return app
