"""Gather a release's provenance from the consortium and the campaign directory (coordinator side).

:func:`campaign_provenance` returns the predicate of :mod:`sealfl.attestation.provenance`
without ``version`` and ``release_enclave``: the release enclave adds those itself and signs.
Sources: ``consortium.json`` (name, context id, partners, HE parameters), the aggregator's
public HE context file (its SHA-256), the campaign's ``server_config.json`` (its SHA-256, the
server optimizer), ``rounds.jsonl`` (each round's ``aggregate_sha256`` and ``accepted``
partners) and the final checkpoint the enclave decrypted (its ``model_ct``'s SHA-256).

Refusals (:class:`~sealfl.platform.errors.ReleaseError`, nothing is released): the round log
is empty, a round lacks its aggregate digest or its partners (a campaign run by an older
sealfl: run it again), or the last logged round is not the checkpoint's (its round or
aggregate digest differs: the log and the checkpoint are of different runs).
"""

from __future__ import annotations

import dataclasses
import hashlib
from importlib import metadata
from pathlib import Path

from sealfl.common.fields import is_sha256_hex
from sealfl.platform.consortium import Consortium
from sealfl.platform.errors import ReleaseError
from sealfl.server.bookkeeping import CampaignDir

__all__ = ["campaign_provenance", "round_entries", "sealfl_version"]


def sealfl_version() -> str:
    """The installed sealfl's version (``0+unknown`` when it runs from a source tree only)."""
    try:
        return metadata.version("sealfl")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def round_entries(records: list[dict], where: str) -> list[dict]:
    """``[{"round", "aggregate_sha256", "partners"}]`` from ``rounds.jsonl`` records, ascending
    (a round logged twice -- a resumed campaign -- keeps its last record). Pure.

    Raises:
        ReleaseError: no round, or a round without ``aggregate_sha256`` or ``accepted``.
    """
    by_round: dict[int, dict] = {}
    for rec in records:
        by_round[rec["round"]] = rec
    if not by_round:
        raise ReleaseError(f"{where} records no finished round; the release's provenance needs the round log")
    out = []
    for number in sorted(by_round):
        rec = by_round[number]
        digest, accepted = rec.get("aggregate_sha256"), rec.get("accepted")
        if not is_sha256_hex(digest):
            raise ReleaseError(f"{where}: round {number} records no aggregate_sha256 (the campaign was run by an "
                               "older sealfl); run the campaign again to release it with provenance")
        if not (isinstance(accepted, list) and accepted and all(isinstance(p, str) for p in accepted)):
            raise ReleaseError(f"{where}: round {number} records no partners that counted ('accepted'); "
                               "run the campaign again")
        out.append({"round": number, "aggregate_sha256": digest, "partners": sorted(accepted)})
    return out


def campaign_provenance(cons: Consortium, campaign_dir: str | Path, ckpt: dict, *, optimizer: object,
                        gate: dict, export: dict, quantization: dict) -> dict:
    """The provenance predicate of a release of ``campaign_dir`` (module docstring).

    Args:
        cons: the consortium.
        campaign_dir: the finished campaign.
        ckpt: its final checkpoint (``model_ct`` bytes, ``round``) as the enclave decrypted it.
        optimizer: the campaign's :class:`~sealfl.he.server_opt.ServerOpt` (a dataclass).
        gate, export, quantization: the gate's figures and the export/quantization settings.

    Raises:
        ReleaseError: see the module docstring; or the public HE context is unreadable.
    """
    cd = CampaignDir(campaign_dir)
    rounds = round_entries(cd.rounds(), str(cd.rounds_path))
    decrypted = hashlib.sha256(bytes(ckpt["model_ct"])).hexdigest()
    last = rounds[-1]
    if last["round"] != ckpt["round"] or last["aggregate_sha256"] != decrypted:
        raise ReleaseError(f"{cd.rounds_path}: its last round ({last['round']}, aggregate {last['aggregate_sha256'][:16]}) "
                           f"is not the checkpoint's (round {ckpt['round']}, aggregate {decrypted[:16]}): the log "
                           "and the checkpoint are of different runs; not releasing")
    try:
        public = cons.public_context.read_bytes()
    except OSError as exc:
        raise ReleaseError(f"cannot read the aggregator's public HE context {cons.public_context}: "
                           f"{exc.strerror or exc}") from exc
    config = cd.config_path.read_bytes() if cd.has_config() else b""
    he = cons.he_params.to_dict()
    settings = dataclasses.asdict(optimizer)
    return {
        "consortium": {"name": cons.name, "context_id": cons.context_id, "partners": list(cons.partners)},
        "campaign": {"id": Path(campaign_dir).resolve().name, "config_sha256": hashlib.sha256(config).hexdigest()},
        "he": {"codec": str(he.get("scheme", "")).lower(), "params": he,
               "public_params_sha256": hashlib.sha256(public).hexdigest()},
        "rounds": rounds,
        "decrypted_aggregate": {"round": ckpt["round"], "sha256": decrypted},
        "optimizer": {"name": settings.pop("name"), "settings": settings},
        "gate": gate,
        "export": export,
        "quantization": quantization,
        "sealfl_version": sealfl_version(),
    }
