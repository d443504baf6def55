"""A ServerApp that asks every partner to score candidate ONNX models on its own test split.

Used by the release gate: the coordinator learns only ``{correct, n}`` per partner and
candidate, never a row of data. Message: query ``{"query": "evaluate-onnx"}`` with an
ArrayRecord ``"candidates"`` (candidate name -> ONNX bytes as uint8); reply MetricRecord
``"metrics"`` with ``<candidate>.correct`` and ``<candidate>.n`` per candidate, signed
like every partner reply.

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
    limits = limits or ReplyLimits()
    expected_n = dict(expected_n or {})
    names = sorted(set(candidates) | set(reference_names))

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        roster = Roster.from_pems(list(partners), partner_keys or None, context_id)
        ids = wait_for_nodes(grid, num_partners, timeout_s)
        record = ArrayRecord({k: Array(P.to_u8(v)) for k, v in candidates.items()})
        content = {P.CONFIG: ConfigRecord({P.QUERY: P.QUERY_EVAL_ONNX, **dict(config or {})}), P.CANDIDATES: record}
        if global_arrays:
            content[P.GLOBAL] = ArrayRecord({k: Array(v) for k, v in global_arrays.items()})
        msgs = [Message(content=RecordDict(content), dst_node_id=nid, message_type=MessageType.QUERY) for nid in ids]
        replies = grid.send_and_receive(msgs, timeout=timeout_s)
        screened = screen(replies, msgs, roster,
                          lambda p, c: parse_candidate_reply(c, names, limits=limits, expected_n=expected_n.get(p),
                                                             signed=roster.signed, sums=tuple(sums)),
                          phase="gate query", bind=True)
        result = {"per_partner": {p: screened.accepted[p] for p in sorted(screened.accepted)},
                  "failed": screened.rejected}
        atomic_write(Path(out_path), json.dumps(result, indent=2).encode(), 0o644)

    return app
