"""A ServerApp that asks every partner to score candidate ONNX models on its own test split.

Used by the release gate: the coordinator learns only ``{correct, n}`` per partner and
candidate, never a row of data. Two rounds (:func:`run_gate_query`):

1. **binding**: the statistics query (``{"query": "stats"}``, no model) goes to every
   connected node; a reply screened as from a consortium partner (its signature over the
   reply, :func:`sealfl.server.intake.screen` with ``bind=True``) binds its node to that
   partner. Its encrypted statistics are not used.
2. **candidates**: query ``{"query": "evaluate-onnx"}`` with an ArrayRecord ``"candidates"``
   (candidate name -> ONNX bytes as uint8) -- the plaintext fp32 and INT8 models -- goes
   **only to the nodes bound in round 1**: a node no partner is bound to (a stranger on the
   grid, a node whose reply failed its checks) never receives a candidate. Reply:
   MetricRecord ``"metrics"`` with ``<candidate>.correct`` and ``<candidate>.n`` per
   candidate, signed like every partner reply.

Each reply is screened (:func:`sealfl.server.intake.screen`: answers our message, from
its node, signed by the partner it names, one per partner) and checked
(:func:`sealfl.server.validation.parse_candidate_reply`: integer counts, ``0 <= correct
<= n``, the same ``n`` for every candidate and, when known, the ``n`` that partner
reported during the campaign). A refused reply is recorded under ``failed`` with the
reason; the caller decides (the gate needs every partner).
The result is written to ``out_path`` (JSON) so the app also works under a SuperLink.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Mapping, Sequence

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from sealfl.common import protocol as P
from sealfl.common.fsutil import atomic_write
from sealfl.server.app import wait_for_nodes
from sealfl.server.intake import Roster, screen
from sealfl.server.validation import ReplyLimits, parse_candidate_reply

log = logging.getLogger(__name__)


def make_eval_server_app(candidates: dict[str, bytes], num_partners: int, out_path: str | Path,
                         timeout_s: float = 600.0, *, partners: Sequence[str] = (),
                         partner_keys: Mapping[str, str] | None = None, context_id: bytes = b"",
                         limits: ReplyLimits | None = None,
                         expected_n: Mapping[str, int] | None = None, reference_names: Sequence[str] = (),
                         sums: Sequence[str] = (), global_arrays: Mapping | None = None,
                         config: Mapping | None = None) -> ServerApp:
    """Build the evaluation ServerApp.

    Args:
        candidates: candidate name -> ONNX bytes.
        num_partners: nodes to wait for.
        out_path: receives ``{"per_partner": {partner: {candidate: {"correct", "n"}}},
            "failed": {partner: reason}}``.
        partners / partner_keys / context_id: who may reply and their P-256 public keys
            (PEM) -- as in :class:`sealfl.server.app.ServerConfig`.
        limits: caps on counts (default :class:`ReplyLimits`).
        expected_n: partner -> test rows it reported during the campaign (optional).
        reference_names: further names partners score without bytes (the task's
            references, e.g. ``fp32`` and ``base`` for the causal-LM task).
        sums: float sums each partner reports per name (e.g. ``nll``).
        global_arrays: arrays of an encrypted ``global`` record sent with the query (the
            final checkpoint: partners decrypt it, as key holders, to build the reference).
        config: scalar settings sent with the query (the campaign's data settings).
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        result = run_gate_query(grid, candidates, num_partners, timeout_s, partners=partners,
                                partner_keys=partner_keys, context_id=context_id, limits=limits, expected_n=expected_n,
                                reference_names=reference_names, sums=sums, global_arrays=global_arrays, config=config)
        atomic_write(Path(out_path), json.dumps(result, indent=2).encode(), 0o644)

    return app


def run_gate_query(grid: Grid, candidates: dict[str, bytes], num_partners: int, timeout_s: float = 600.0, *,
                   partners: Sequence[str] = (), partner_keys: Mapping[str, str] | None = None,
                   context_id: bytes = b"", limits: ReplyLimits | None = None,
                   expected_n: Mapping[str, int] | None = None, reference_names: Sequence[str] = (),
                   sums: Sequence[str] = (), global_arrays: Mapping | None = None,
                   config: Mapping | None = None) -> dict:
    """The ServerApp body (the two rounds of the module docstring); arguments as for
    :func:`make_eval_server_app`.

    Returns:
        ``{"per_partner": {partner: {candidate: {"correct", "n"}}}, "failed": {who: reason},
        "sent_to": {partner: node id}}``; ``failed`` holds the refusals of both rounds.
    """
    limits = limits or ReplyLimits()
    expected_n = dict(expected_n or {})
    names = sorted(set(candidates) | set(reference_names))
    roster = Roster.from_pems(list(partners), partner_keys or None, context_id)
    ids = wait_for_nodes(grid, num_partners, timeout_s)
    query = RecordDict({P.CONFIG: ConfigRecord({P.QUERY: P.QUERY_STATS, **dict(config or {})})})
    asked = [Message(content=query, dst_node_id=nid, message_type=MessageType.QUERY) for nid in ids]
    bound = screen(grid.send_and_receive(asked, timeout=timeout_s), asked, roster, lambda p, c: None,
                   phase="gate binding", bind=True)
    record = ArrayRecord({k: Array(P.to_u8(v)) for k, v in candidates.items()})
    content = {P.CONFIG: ConfigRecord({P.QUERY: P.QUERY_EVAL_ONNX, **dict(config or {})}), P.CANDIDATES: record}
    if global_arrays:
        content[P.GLOBAL] = ArrayRecord({k: Array(v) for k, v in global_arrays.items()})
    msgs = [Message(content=RecordDict(content), dst_node_id=nid, message_type=MessageType.QUERY)
            for nid in roster.bound_nodes()]
    replies = grid.send_and_receive(msgs, timeout=timeout_s) if msgs else []
    screened = screen(replies, msgs, roster,
                      lambda p, c: parse_candidate_reply(c, names, limits=limits, expected_n=expected_n.get(p),
                                                         signed=roster.signed, sums=tuple(sums)),
                      phase="gate query")
    log.info("gate query: candidates sent to %d bound partner node(s); %d node(s) got none", len(msgs),
             len(ids) - len(msgs))
    return {"per_partner": {p: screened.accepted[p] for p in sorted(screened.accepted)},
            "failed": {**bound.rejected, **screened.rejected},
            "sent_to": {p: roster.node_of[p] for p in roster.partners if p in roster.node_of}}
