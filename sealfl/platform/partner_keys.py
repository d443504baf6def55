"""The consortium partners' public (kit) keys, as the aggregator needs them to check who
signed a reply (:mod:`sealfl.server.intake`).

Each kit directory ``partners/<slug>/`` holds ``partner_key.pub.pem`` (written by
:func:`sealfl.platform.consortium.create_consortium`; in a real consortium the one file a
partner sends the coordinator). Public keys are not secrets: the server configuration
may carry them.
"""

from __future__ import annotations

from sealfl.attestation.errors import KeyFormatError
from sealfl.attestation.keys import load_public_key
from sealfl.clients.kit import kit_dir
from sealfl.common.fsutil import read_capped
from sealfl.platform.consortium import Consortium
from sealfl.platform.errors import ConsortiumError

#: the largest PEM file read for one public key (a P-256 SubjectPublicKeyInfo PEM is ~180 bytes)
MAX_PEM_BYTES = 4096


def partner_public_keys(cons: Consortium) -> dict[str, str]:
    """``{partner name: PEM text}`` for every partner of ``cons``.

    Raises ConsortiumError naming the file that is missing, too large or not a P-256
    public key.
    """
    out = {}
    for partner in cons.partners:
        path = kit_dir(cons.dir, partner) / "partner_key.pub.pem"
        try:
            pem = read_capped(path, MAX_PEM_BYTES)
        except OSError as exc:
            raise ConsortiumError(f"cannot read the public key of partner {partner!r} ({path}): "
                                  f"{exc.strerror or exc}; ask the partner for its partner_key.pub.pem") from exc
        if len(pem) > MAX_PEM_BYTES:
            raise ConsortiumError(f"{path} is larger than {MAX_PEM_BYTES} bytes; not a public key file")
        try:
            load_public_key(pem)
        except KeyFormatError as exc:
            raise ConsortiumError(f"{path} is not a P-256 public key: {exc}") from exc
        out[partner] = pem.decode("ascii")
    return out
