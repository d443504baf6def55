"""Drawing a campaign report: PNG plots (matplotlib, Agg backend) and one self-contained
``report.html`` that links them, written atomically into the output directory.

Plots: ``accuracy.png`` (pooled and per partner, per round; tasks that score accuracy),
``loss.png`` (training loss and per-partner evaluation loss, or per-partner perplexity =
exp(loss) for a language model), ``traffic.png`` (ciphertext MB received and seconds per
round) and ``refused.png`` (refused replies per round). Every string from the campaign
directory is HTML-escaped; figures come from :func:`sealfl.platform.report.series.series_of`.
"""

from __future__ import annotations

import datetime
import html
import io
import math
from dataclasses import dataclass
from pathlib import Path

from sealfl.common.fsutil import atomic_write
from sealfl.platform.report.series import Series

__all__ = ["Report", "write_report", "is_language_model"]

#: Largest perplexity drawn (exp of a diverged loss would overflow the axis).
MAX_PERPLEXITY = 1e6


@dataclass(frozen=True)
class Report:
    """What :func:`write_report` wrote: the HTML page and the PNGs (paths)."""

    html: Path
    images: tuple[Path, ...]


def is_language_model(s: Series) -> bool:
    """True when partners report a loss but no accuracy (the causal-LM task)."""
    has = lambda d: any(v is not None for vals in d.values() for v in vals)  # noqa: E731
    return has(s.partner_loss) and not has(s.partner_accuracy)


def _perplexity(loss: float | None) -> float | None:
    if loss is None:
        return None
    return math.exp(loss) if loss < math.log(MAX_PERPLEXITY) else MAX_PERPLEXITY


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def _line(ax, x, ys, label, **kw) -> None:
    pts = [(a, b) for a, b in zip(x, ys) if b is not None]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label, **kw)


def _figures(s: Series, lm: bool) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure  # the object API: no global pyplot state

    out: dict[str, bytes] = {}
    x = s.rounds
    if not lm:
        fig = Figure(figsize=(7, 4))
        ax = fig.add_subplot()
        _line(ax, x, s.pooled_accuracy, "pooled test", linewidth=2.5, color="black")
        for name, ys in s.partner_accuracy.items():
            _line(ax, x, ys, name)
        ax.set(xlabel="round", ylabel="test accuracy", title="Accuracy per round")
        ax.grid(alpha=0.3)
        _legend(ax)
        out["accuracy.png"] = _png(fig)
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    if lm:
        for name, ys in s.partner_loss.items():
            _line(ax, x, [_perplexity(v) for v in ys], name)
        ax.set(xlabel="round", ylabel="held-out perplexity", title="Perplexity per round and partner")
    else:
        _line(ax, x, s.train_loss, "training (mean)", linewidth=2.5, color="black")
        for name, ys in s.partner_loss.items():
            _line(ax, x, ys, f"{name} (test)")
        ax.set(xlabel="round", ylabel="loss", title="Loss per round")
    ax.grid(alpha=0.3)
    _legend(ax)
    out["loss.png"] = _png(fig)
    fig = Figure(figsize=(7, 5))
    top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    _line(top, x, s.ciphertext_mb, "ciphertext received")
    _line(top, x, s.aggregate_mb, "aggregate")
    top.set(ylabel="MB", title="Bytes and time per round")
    _legend(top)
    _line(bottom, x, s.round_seconds, "round")
    _line(bottom, x, s.aggregate_seconds, "checking and adding")
    bottom.set(xlabel="round", ylabel="seconds")
    _legend(bottom)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    out["traffic.png"] = _png(fig)
    fig = Figure(figsize=(7, 3))
    ax = fig.add_subplot()
    ax.bar(x, s.refused_per_round, color="firebrick")
    ax.set(xlabel="round", ylabel="replies refused", title="Refused replies per round")
    out["refused.png"] = _png(fig)
    return out


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def _first_last(vals: list[float | None]) -> tuple[float | None, float | None]:
    known = [v for v in vals if v is not None]
    return (known[0], known[-1]) if known else (None, None)


def _when(epoch) -> str:
    if type(epoch) not in (int, float) or not math.isfinite(epoch) or not 0 < epoch < 1e11:
        return "n/a"
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).isoformat(timespec="seconds")


def _html(title: str, status: dict, s: Series, lm: bool, images: list[str]) -> str:
    e = html.escape
    rows = []
    for name in sorted(set(s.partner_accuracy) | set(s.partner_loss)):
        a0, a1 = _first_last(s.partner_accuracy.get(name, []))
        l0, l1 = _first_last(s.partner_loss.get(name, []))
        if lm:
            rows.append(f"<tr><td>{e(name)}</td><td>{_fmt(_perplexity(l0), '.2f')}</td>"
                        f"<td>{_fmt(_perplexity(l1), '.2f')}</td></tr>")
        else:
            rows.append(f"<tr><td>{e(name)}</td><td>{_fmt(a0)}</td><td>{_fmt(a1)}</td><td>{_fmt(l0)}</td>"
                        f"<td>{_fmt(l1)}</td></tr>")
    head = ("<tr><th>partner</th><th>perplexity, round 1</th><th>perplexity, last round</th></tr>" if lm else
            "<tr><th>partner</th><th>accuracy, round 1</th><th>accuracy, last round</th><th>loss, round 1</th>"
            "<th>loss, last round</th></tr>")
    refused = "".join(f"<li>{e(p)}: " + ", ".join(f"{e(why)} &times; {n}" for why, n in reasons.items()) + "</li>"
                      for p, reasons in s.refused.items()) or "<li>none</li>"
    total_mb = sum(v for v in s.ciphertext_mb if v is not None)
    eps = [v for v in s.epsilon if v is not None]
    facts = [("state", str(status.get("status", "n/a"))), ("rounds", f"{len(s.rounds)} of {status.get('num_rounds')}"),
             ("started", _when(status.get("started"))), ("finished", _when(status.get("finished"))),
             ("pooled test accuracy, last round", _fmt(_first_last(s.pooled_accuracy)[1])),
             ("ciphertext received, all rounds", f"{total_mb:.2f} MB"),
             ("aggregator held a secret key", str(status.get("server_has_secret_key", "n/a")))]
    if eps:
        facts.append(("differential privacy: epsilon spent", f"{eps[-1]:.3f}"))
    if s.skipped:
        facts.append(("malformed values left out", str(s.skipped)))
    fact_rows = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in facts)
    imgs = "".join(f'<figure><img src="{e(name)}" alt="{e(name)}"></figure>' for name in images)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
            "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}td,th{padding:.2em .8em;"
            "text-align:left}table{border-collapse:collapse}tr:nth-child(even){background:#f4f4f4}"
            "img{max-width:100%}</style></head><body>"
            f"<h1>{e(title)}</h1><table>{fact_rows}</table><h2>Partners</h2><table>{head}{''.join(rows)}</table>"
            f"<h2>Refused replies</h2><ul>{refused}</ul><h2>Per round</h2>{imgs}</body></html>\n")


def write_report(title: str, status: dict, s: Series, out_dir: Path) -> Report:
    """Write the PNGs and ``report.html`` into ``out_dir`` (created; files replaced atomically).

    Args:
        title: the page's heading (e.g. the campaign directory).
        status: the campaign's parsed ``status.json`` (``status``, ``num_rounds``,
            ``started``/``finished`` epoch seconds, ``server_has_secret_key``).
        s: the figures (:func:`~sealfl.platform.report.series.series_of`).
        out_dir: where to write.

    Returns:
        a :class:`Report` naming the files written.

    Raises:
        OSError: ``out_dir`` cannot be created or written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    lm = is_language_model(s)
    figures = _figures(s, lm) if s.rounds else {}
    paths = []
    for name, data in figures.items():
        atomic_write(out_dir / name, data, 0o644)
        paths.append(out_dir / name)
    page = out_dir / "report.html"
    atomic_write(page, _html(title, status, s, lm, list(figures)).encode("utf-8"), 0o644)
    return Report(page, tuple(paths))
