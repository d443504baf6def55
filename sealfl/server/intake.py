"""Who sent a reply, and whether it may count: node binding, partner signatures, one
reply per partner per round -- then the reply's own checks (:mod:`sealfl.server.validation`).

Every round that collects partner replies (the statistics round, train, evaluate, the
release gate's query round) passes the messages it sent and the replies it got through
:func:`screen`. For each reply, in this order:

1. **which message it answers**: ``reply_to_message_id`` must be the id of a message
   sent this round (ids are set by the Grid on the Message objects it pushes -- flwr 1.42
   ``InMemoryGrid`` and ``GrpcGrid`` do), and each message is answered once. The node the
   reply concerns is the *destination of that message*: error replies written by the
   SuperLink itself (node unavailable, reply expired) carry the SuperLink's node id
   (1) as their source, so the source id would name the wrong node;
2. **error replies** are recorded under the partner bound to that node (else
   ``node-<id>``) with Flower's error code and reason;
3. **source**: a content reply must come from the node the message was sent to;
4. **claimed name** (``partner.name``): a str naming a consortium partner;
5. **signature** (when the roster holds partner keys): ``partner.signature`` must be the
   claimed partner's ECDSA P-256 signature over :func:`sealfl.common.protocol.reply_statement`
   (campaign context id, the answered message's id and type, the name, the content digest);
6. **binding**: a node is bound to the partner it first proved to be (the statistics
   round, ``bind=True``); later a node may speak only for its own partner, a partner only
   through its own node, and a node that never bound is refused -- each refusal logs both
   node ids;
7. **one reply per partner**: a second accepted reply for the same partner is refused;
8. the reply kind's own checks (``parse``).

Messages that got no reply by the deadline are recorded too ("no reply"), and listed in
``Screened.unanswered``: the partner is *late*. Its reply may still reach the SuperLink
after the round closed (Flower keeps a message for its TTL, 12 h); :func:`collect_late`
pulls such replies later by message id, so they are recorded as late and never counted.
A refused reply is logged (partner, node ids, reason) and returned in ``rejected``; the
caller records it in ``rounds.jsonl`` and goes on while ``min_partners`` remain.

Before a round is sent, :func:`connected_partner_nodes` picks its destinations: the bound
partners' nodes connected now, as soon as ``min_partners`` of them are.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from sealfl.attestation import keys as _keys
from sealfl.attestation.errors import KeyFormatError
from sealfl.common import protocol as P
from sealfl.common.errors import plain_text
from sealfl.server.errors import NotEnoughPartnersError, ReplyError, ServerError

log = logging.getLogger(__name__)

__all__ = ["Roster", "Screened", "screen", "Overdue", "collect_late", "connected_partner_nodes"]

#: the SuperLink's own node id (flwr.common.constant.SUPERLINK_NODE_ID in flwr 1.42)
SUPERLINK_NODE_ID = 1


@dataclass
class Roster:
    """The aggregator's record of who is who in one run (a campaign or a gate query).

    Attributes:
        partners: the consortium's partner names (the only names a reply may claim).
        keys: partner name -> ECDSA P-256 public key, or None to accept unsigned name
            claims (bound at first contact only; logged as a warning).
        context_id: the campaign's HE context id (32 bytes; part of what partners sign).
        node_of / partner_of: the node <-> partner binding.
        n_train: the training-split count each partner declared in the statistics round.
        n_test: the test-split count each partner reported in its first accepted evaluate.
    """

    partners: tuple[str, ...]
    keys: dict[str, Any] | None
    context_id: bytes
    node_of: dict[str, int] = field(default_factory=dict)
    partner_of: dict[int, str] = field(default_factory=dict)
    n_train: dict[str, int] = field(default_factory=dict)
    n_test: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_pems(cls, partners: Sequence[str], pems: Mapping[str, str] | None, context_id: bytes) -> "Roster":
        """Build a roster from PEM public keys (``{partner: PEM text}``; ``None`` or empty:
        unsigned mode). Raises ServerError if a key is missing, unparsable or not P-256."""
        keys = None
        if pems:
            keys = {}
            for p in partners:
                if p not in pems:
                    raise ServerError(f"no public key for partner {p!r} in the server configuration")
                try:
                    keys[p] = _keys.load_public_key(str(pems[p]).encode())
                except KeyFormatError as exc:
                    raise ServerError(f"public key of partner {p!r} is unusable: {exc}") from exc
        else:
            log.warning("no partner public keys configured: partner name claims are not authenticated")
        return cls(tuple(partners), keys, bytes(context_id))

    @property
    def signed(self) -> bool:
        """True if replies must carry a valid partner signature."""
        return self.keys is not None

    def label(self, node_id: int) -> str:
        """The partner bound to ``node_id``, else ``node-<id>``."""
        return self.partner_of.get(node_id, f"node-{node_id}")

    def bound_nodes(self) -> list[int]:
        """Node ids bound to a partner, in consortium order."""
        return [self.node_of[p] for p in self.partners if p in self.node_of]

    def bind(self, node_id: int, partner: str) -> None:
        """Bind ``node_id`` to ``partner`` (both must be unbound or already bound to each other)."""
        if self.node_of.get(partner, node_id) != node_id or self.partner_of.get(node_id, partner) != partner:
            raise ServerError(f"cannot bind node {node_id} to {partner!r}: already bound otherwise")
        self.node_of[partner] = node_id
        self.partner_of[node_id] = partner

    def check_claim(self, node_id: int, claimed: str, *, bind: bool) -> None:
        """Raise ReplyError unless ``node_id`` may speak for ``claimed`` (step 6)."""
        bound = self.partner_of.get(node_id)
        if bound is not None and bound != claimed:
            raise ReplyError(f"{P.PARTNER}.{P.NAME}", f"node {node_id} is partner {bound!r} but claims {claimed!r}"
                             + (f" (node {self.node_of[claimed]})" if claimed in self.node_of else ""))
        owner = self.node_of.get(claimed)
        if owner is not None and owner != node_id:
            raise ReplyError(f"{P.PARTNER}.{P.NAME}", f"partner {claimed!r} is node {owner}, this reply came from "
                                                      f"node {node_id}")
        if bound is None and not bind:
            raise ReplyError(f"{P.PARTNER}.{P.NAME}", f"node {node_id} (claiming {claimed!r}) did not take part in the "
                                                      "statistics round")

    def check_signature(self, content: Any, claimed: str, message_id: str, message_type: str) -> None:
        """Raise ReplyError unless the reply carries ``claimed``'s signature (step 5)."""
        if self.keys is None:
            return
        sig = content[P.PARTNER][P.SIGNATURE] if P.SIGNATURE in content[P.PARTNER].keys() else None
        if not isinstance(sig, bytes) or not 0 < len(sig) <= 80:
            raise ReplyError(f"{P.PARTNER}.{P.SIGNATURE}", "missing or not a DER ECDSA signature")
        try:
            digest = P.content_digest(content)
        except TypeError as exc:
            raise ReplyError("content", str(exc)) from exc
        stmt = P.reply_statement(self.context_id, message_id, message_type, claimed, digest)
        if not _keys.verify(self.keys[claimed], stmt, sig):
            raise ReplyError(f"{P.PARTNER}.{P.SIGNATURE}", f"does not verify with partner {claimed!r}'s key (another "
                                                           "sender, another message, or altered content)")


@dataclass
class Screened:
    """Outcome of :func:`screen`.

    Attributes:
        accepted: partner -> what ``parse`` returned, for the replies that count.
        rejected: partner (or ``node-<id>``) -> reason, for every refused reply and
            every message that got no reply.
        nodes: partner -> node id of the accepted replies.
        unanswered: message id -> partner (or ``node-<id>``) of the messages that got no
            reply by the deadline (late partners; also in ``rejected``).
    """

    accepted: dict[str, Any] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, int] = field(default_factory=dict)
    unanswered: dict[str, str] = field(default_factory=dict)


def _claimed_name(content: Any) -> str:
    try:
        rec = content[P.PARTNER]
        name = rec[P.NAME]
    except Exception as exc:  # no such record/key, or not a RecordDict
        raise ReplyError(f"{P.PARTNER}.{P.NAME}", "missing") from exc
    if not isinstance(name, str):
        raise ReplyError(f"{P.PARTNER}.{P.NAME}", f"must be a string, got {type(name).__name__}")
    return name


def error_reason(reason: Any, limit: int = 300) -> str:
    """One line of an error reply's reason for logs and ``rounds.jsonl``: Flower's simulation
    puts a ClientApp's whole traceback there, coloured; keep its last line (the exception),
    without terminal escape codes (:func:`sealfl.common.errors.plain_text`), at most
    ``limit`` characters."""
    lines = plain_text(str(reason), 1 << 20).split(" | ")
    text = lines[-1] if lines else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def screen(replies: Iterable[Any], sent: Sequence[Any], roster: Roster, parse: Callable[[str, Any], Any], *,
           phase: str, bind: bool = False) -> Screened:
    """Check every reply of one round (steps 1-8 of the module docstring).

    Args:
        replies: the Messages ``grid.send_and_receive`` returned.
        sent: the Messages sent this round (their ids set by the Grid).
        roster: the run's :class:`Roster` (updated: new bindings when ``bind``).
        parse: ``parse(partner, content)`` -> parsed reply, raising ReplyError.
        phase: a word for the log (``"statistics"``, ``"train"``, ``"evaluate"``, ``"gate query"``).
        bind: bind unbound nodes to the partner they prove to be (statistics round / gate query).
    Returns:
        :class:`Screened`.
    """
    out = Screened()
    by_id = {m.metadata.message_id: m for m in sent if m.metadata.message_id}
    answered: set[str] = set()

    def refuse(label: str, reason: str, src: int, dst: int | None) -> None:
        key = label
        k = 2
        while key in out.rejected:  # keep every reason (e.g. two nodes both claiming A)
            key = f"{label}#{k}"
            k += 1
        out.rejected[key] = reason
        log.warning("%s round: refused the reply for %s (from node %s, sent to node %s): %s",
                    phase, label, src, dst if dst is not None else "?", reason)

    for reply in replies:
        md = reply.metadata
        src = md.src_node_id
        msg = by_id.get(md.reply_to_message_id)
        if msg is None:
            refuse(roster.label(src), f"answers no message of this {phase} round", src, None)
            continue
        dst = msg.metadata.dst_node_id
        label = roster.label(dst)
        if md.reply_to_message_id in answered:
            refuse(label, "a second reply to the same message", src, dst)
            continue
        answered.add(md.reply_to_message_id)
        if reply.has_error():
            who = "the SuperLink" if src == SUPERLINK_NODE_ID else f"node {src}"
            refuse(label, f"no reply: error {reply.error.code} reported by {who}: {error_reason(reply.error.reason)}",
                   src, dst)
            continue
        if src != dst:
            refuse(label, f"reply from node {src} to a message sent to node {dst}", src, dst)
            continue
        proven = None  # the claimed name once its signature verified (signed mode)
        try:
            claimed = _claimed_name(reply.content)
            if claimed not in roster.partners:
                raise ReplyError(f"{P.PARTNER}.{P.NAME}", f"{claimed!r} is not a partner of this consortium")
            roster.check_signature(reply.content, claimed, msg.metadata.message_id, msg.metadata.message_type)
            proven = claimed if roster.signed else None
            roster.check_claim(dst, claimed, bind=bind)
            if claimed in out.accepted:
                raise ReplyError(f"{P.PARTNER}.{P.NAME}", f"a second reply for partner {claimed!r} in this round "
                                                          f"(nodes {out.nodes[claimed]} and {dst})")
            parsed = parse(claimed, reply.content)
        except ReplyError as exc:
            if dst in roster.partner_of:
                who = label
            elif proven is not None and proven not in roster.node_of:
                who = proven
            else:
                who = _claim_or(label, reply.content)
            refuse(who, str(exc), src, dst)
            continue
        if bind and dst not in roster.partner_of:
            roster.bind(dst, claimed)
        out.accepted[claimed] = parsed
        out.nodes[claimed] = dst
    for mid, msg in by_id.items():
        if mid not in answered:
            dst = msg.metadata.dst_node_id
            refuse(roster.label(dst), f"no reply to the {phase} message within the deadline", SUPERLINK_NODE_ID, dst)
            out.unanswered[mid] = roster.label(dst)
    return out


@dataclass(frozen=True)
class Overdue:
    """A message whose round closed without its reply: who it went to, in which phase and round."""

    partner: str
    phase: str
    round: int


def collect_late(grid: Any, overdue: dict[str, Overdue]) -> dict[str, str]:
    """Pull, once, the replies that came for ``overdue`` messages after their round closed
    (``grid.pull_messages``); each found is removed from ``overdue`` (in place) and returned
    as ``{partner: why}`` for the round log. None of them counts: they are read only to be
    recorded. A failing pull is logged and returns ``{}`` (the campaign goes on)."""
    if not overdue:
        return {}
    try:
        got = list(grid.pull_messages(list(overdue)))
    except Exception as exc:  # noqa: BLE001 - recording lateness never stops a campaign
        log.warning("could not pull late replies: %s", exc)
        return {}
    out: dict[str, str] = {}
    for reply in got:
        o = overdue.pop(reply.metadata.reply_to_message_id, None)
        if o is None:
            continue
        what = "an error reply" if reply.has_error() else "its reply"
        out[o.partner if o.partner not in out else f"{o.partner}#{len(out) + 1}"] = (
            f"{what} to the {o.phase} message of round {o.round} came after that round closed; not counted")
        log.warning("partner %s: %s to the %s message of round %d came after the round closed; not counted",
                    o.partner, what, o.phase, o.round)
    return out


def _claim_or(label: str, content: Any) -> str:
    """For an unbound node whose claim is not proven: ``"<claimed name>? (node-<id>)"`` if
    it claimed a name, else ``node-<id>``."""
    try:
        return f"{_claimed_name(content)[:64]}? ({label})"
    except ReplyError:
        return label


#: seconds between two looks at the connected nodes while fewer than min_partners are
POLL_S = 0.5


def connected_partner_nodes(grid, roster: Roster, min_partners: int, wait_s: float,
                            phase: str) -> tuple[list[int], dict[str, str]]:
    """The nodes of bound partners that are connected, as soon as at least
    ``min_partners`` are (waiting at most ``wait_s`` seconds), and ``{partner: "not
    connected"}`` for the bound partners that are not.

    Raises NotEnoughPartnersError if fewer than ``min_partners`` stay connected for ``wait_s``.
    """
    deadline = time.monotonic() + wait_s
    while True:
        connected = set(grid.get_node_ids())
        nodes = [n for n in roster.bound_nodes() if n in connected]
        if len(nodes) >= min_partners:
            absent = {p: f"not connected at the start of the {phase} round" for p, n in roster.node_of.items()
                      if n not in connected}
            for p, why in absent.items():
                log.warning("partner %s (node %d): %s", p, roster.node_of[p], why)
            return nodes, absent
        if time.monotonic() >= deadline:
            raise NotEnoughPartnersError(
                f"{phase} round: only {len(nodes)} partner node(s) connected for {wait_s:.0f} s "
                f"({', '.join(roster.partner_of[n] for n in nodes) or 'none'}), min_partners={min_partners}")
        time.sleep(POLL_S)
