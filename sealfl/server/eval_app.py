"""A ServerApp that asks every partner to score candidate ONNX models on its own test split.

Used by the release gate: the coordinator learns only ``{correct, n}`` per partner and
candidate, never a row of data. Message: query ``{"query": "evaluate-onnx"}`` with an
ArrayRecord ``"candidates"`` (candidate name -> ONNX bytes as uint8); reply MetricRecord
``"metrics"`` with ``<candidate>.correct`` and ``<candidate>.n`` per candidate.
The result is written to ``out_path`` (JSON) so the app also works under a SuperLink.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from sealfl.common import protocol as P
from sealfl.common.fsutil import atomic_write

from .app import wait_for_nodes
from .strategy import partner_name

log = logging.getLogger(__name__)


def make_eval_server_app(candidates: dict[str, bytes], num_partners: int, out_path: str | Path,
                         timeout_s: float = 600.0) -> ServerApp:
    """Build the evaluation ServerApp. ``out_path`` receives
    ``{"per_partner": {partner: {candidate: {"correct", "n"}}}, "failed": {partner: reason}}``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        ids = wait_for_nodes(grid, num_partners, timeout_s)
        record = ArrayRecord({k: Array(P.to_u8(v)) for k, v in candidates.items()})
        msgs = [Message(content=RecordDict({P.CONFIG: ConfigRecord({"query": P.QUERY_EVAL_ONNX}),
                                            P.CANDIDATES: record}),
                        dst_node_id=nid, message_type=MessageType.QUERY) for nid in ids]
        per: dict[str, dict] = {}
        failed: dict[str, str] = {}
        for msg in grid.send_and_receive(msgs, timeout=timeout_s):
            name = partner_name(msg)
            if msg.has_error():
                failed[name] = msg.error.reason
                log.warning("partner %s could not evaluate the candidates: %s", name, msg.error.reason)
                continue
            m = msg.content[P.METRICS]
            per[name] = {c: {"correct": int(m[f"{c}.correct"]), "n": int(m[f"{c}.n"])} for c in candidates}
        atomic_write(Path(out_path), json.dumps({"per_partner": per, "failed": failed}, indent=2).encode(), 0o644)

    return app
