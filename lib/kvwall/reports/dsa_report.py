"""Chapter 6's section for DSA models (GLM-5, DeepSeek-V3.2): SGLang's own decode path on Hopper measured beside the
dense paths (``dsa_decode``), what a dense backend forced on such a model does to its FP8 pool (``dsa_forced_dense``),
and the DSA decode step composed from measured parts (``decode_step_paths`` + ``dsa_decode``).

The functions return numbers and tables; chapter 6 writes the sentences around them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvwall.model.geometry import GLM5
from kvwall.reports.answer_report import OURS, WORDS, columns, fill
from kvwall.reports.plots import arrange
from kvwall.reports.rows import Row, rows_of
from kvwall.reports.tables import Table
from kvwall.peers.sglang_dsa import DSA_DEFAULTS
from kvwall.results import Result

Span = tuple[float, float]
#: The section's tables' columns and its figure's labels, in ``book/answer.yml``.
_WORDS = WORDS.dsa
#: The DSA's sparse decode kernel (a part of the DSA, and a series of its figure), and the accuracy fields each DSA
#: part's row carries, kept on its point.
SPARSE_DECODE = "sparse_decode"
_ERRORS = {
    SPARSE_DECODE: (
        "rel_err_f64",
        "rel_err_vs_bf16",
        "storage_rel_err",
        "plain_storage_rel_err",
        "dense_storage_rel_err",
    ),
    "indexer_logits": ("logits_rel_err_f64",),
    "topk": ("topk_recall",),
}


def points(result: Result) -> list[Row]:
    """One dict per (heads, context, batch): each DSA part's µs (``sparse_decode``, ``indexer_logits``, ``topk``),
    ``dsa`` (sparse decode + indexer scores: the DSA attention without the top-k, whose kernel here is a stand-in),
    each dense path's µs, and the accuracy fields."""
    out: dict[tuple[int, int, int], Row] = {}
    for r in map(Row, result.rows):
        if r.section not in ("dsa", "bench"):
            continue
        key = (r.heads, r.context, r.batch)
        pt = out.setdefault(key, Row(heads=r.heads, context=r.context, batch=r.batch, tokens=r.tokens))
        if r.section == "bench":
            pt[r.strategy], pt[r.strategy + "_err"] = r.us, r.rel_err_f64
            continue
        pt.update({r.part: r.us}, selected=r.selected, padded_heads=r.padded_heads)
        pt.update({k: r[k] for k in _ERRORS.get(r.part, ()) if r.get(k) is not None})
    for pt in out.values():
        if pt.sparse_decode is not None and pt.indexer_logits is not None:
            pt.update(dsa=pt.sparse_decode + pt.indexer_logits)
        if pt.dsa and pt.ours_page64:
            pt.update(ours_over_dsa=pt.ours_page64 / pt.dsa)
    return sorted(out.values(), key=lambda p: (p.heads, p.batch, p.context))


def dsa_table(result: Result, heads: int, caption: str) -> Table:
    """µs per layer at each context and batch, ``heads`` query heads per GPU: the DSA parts and the dense paths."""
    rows = [Row(p, ctx=f"{p.context // 1024}K") for p in points(result) if p.heads == heads]
    return Table(rows, columns(_WORDS.table), caption)


def dsa_figure(result: Result, heads: int, title: str, notes: list[str]) -> go.Figure:
    """µs per layer against context, one panel per batch: the DSA (decode + indexer, and the sparse decode alone)
    against ours and FlashMLA dense; ``notes`` go under it."""
    pts = [p for p in points(result) if p.heads == heads]
    batches = sorted({p.batch for p in pts})
    fig = make_subplots(rows=1, cols=len(batches), shared_yaxes=True, horizontal_spacing=0.03)
    for i, b in enumerate(batches, start=1):
        sel = sorted((p for p in pts if p.batch == b), key=lambda p: p.context)
        for key, (name, color) in _WORDS.series.items():
            sparse = key == "sparse"
            field = SPARSE_DECODE if sparse else key
            fig.add_trace(
                go.Scatter(
                    x=[p.context for p in sel if p.get(field)],
                    y=[p[field] for p in sel if p.get(field)],
                    name=name,
                    legendgroup=key,
                    showlegend=i == 1,
                    line=dict(color=color, dash="dot" if sparse else "solid"),
                ),
                row=1,
                col=i,
            )
        fig.update_xaxes(
            type="log",
            title_text=fill(_WORDS.x, i == 1, b=b),
            row=1,
            col=i,
            tickvals=list(_WORDS.ticks),
            ticktext=list(_WORDS.ticks.values()),
        )
    fig.update_yaxes(type="log", title_text=_WORDS.y, row=1, col=1)
    fig.update_layout(title=title)
    return arrange(fig, notes, height=480)


@dataclass(frozen=True)
class Accuracy:
    """Relative errors against float64 over the points that were checked (batches up to 8), each a (min, max) span:
    each kernel on the values its cache holds, and what storing the keys alone costs each cache (no kernel; the
    plain e4m3 rows over the DSA's 2,048 tokens, and over every token); the indexer stand-in's worst score error and
    the least share of float64's top 2,048 its own top 2,048 holds."""

    sparse: Span
    ours: Span
    flashmla_fp8: Span
    flashmla_bf16: Span
    storage_dsa: Span
    storage_plain: Span
    storage_plain_all: Span
    logits: float
    recall: float


def _span(xs: list[float]) -> Span:
    return (min(xs), max(xs)) if xs else (math.nan, math.nan)


def accuracy(result: Result) -> Accuracy:
    pts = points(result)

    def span(key: str) -> Span:
        return _span([p[key] for p in pts if p.get(key) is not None])

    return Accuracy(
        span("rel_err_f64"),
        span("ours_page64_err"),
        span("flashmla_dense_fp8_err"),
        span("flashmla_dense_bf16_err"),
        span("storage_rel_err"),
        span("plain_storage_rel_err"),
        span("dense_storage_rel_err"),
        span("logits_rel_err_f64")[1],
        span("topk_recall")[0],
    )


@dataclass(frozen=True)
class Speed:
    """Where the DSA decode wins, at ``heads`` query heads per GPU (run as ``padded_heads``), from the points timed with
    ours: at one request the sparse decode's, the indexer's and the top-k stand-in's µs (spans over the contexts);
    ``wins`` of ``timed`` points where decode + indexer beat ours; the point of the largest batch and context
    (``largest``: batch, context, DSA µs, ours' µs, FlashMLA FP8's µs); the points where ours is faster
    (``losses``: (context, batch)) and ours' µs there."""

    heads: int
    padded_heads: int
    sparse_b1: Span
    indexer_b1: Span
    topk_b1: Span
    wins: int
    timed: int
    largest: tuple[int, int, float, float, float]
    losses: list[tuple[int, int]]
    ours_at_losses: Span


def speed(result: Result, heads: int) -> Speed:
    pts = [p for p in points(result) if p.heads == heads and p.dsa and p.ours_page64]
    one = [p for p in pts if p.batch == 1]
    lost = [p for p in pts if p.dsa >= p.ours_page64]
    big = max(pts, key=lambda p: (p.batch, p.context))
    return Speed(
        heads,
        one[0].padded_heads,
        _span([p.sparse_decode for p in one]),
        _span([p.indexer_logits for p in one]),
        _span([p.topk for p in one]),
        len(pts) - len(lost),
        len(pts),
        (big.batch, big.context, big.dsa, big.ours_page64, big.flashmla_dense_fp8),
        [(p.context, p.batch) for p in lost],
        _span([p.ours_page64 for p in lost]),
    )


def forced_dense(result: Result) -> Row:
    """The ``forced_dense`` row of ``dsa_forced_dense``: what a dense backend forced on a DSA model does to its pool."""
    return rows_of(result, "forced_dense")[0]


@dataclass(frozen=True)
class DSAStep:
    """The DSA decode step at the step's point, composed from measured parts: the step's own write and rest-of-layer
    phases (``decode_step_paths``, ours' row) plus every layer's DSA attention (``dsa_decode`` at the same heads,
    context and batch); ``topk_ms``: what the torch.topk stand-in would add (SGLang's kernel not measured);
    ``dense_ms``: the dense paths' recorded steps at the same request, by path."""

    step_ms: float
    attention_ms: float
    topk_ms: float
    context: int
    heads: int
    batch: int
    layers: int
    dense_ms: Mapping[str, float]


def dsa_step(step: Result, dsa: Result) -> DSAStep | None:
    """:class:`DSAStep` at the step's request (one request of its context, its heads per GPU), or None when
    ``dsa_decode`` has no such point."""
    heads = rows_of(step, "setup")[0].heads_per_gpu
    paths = {r.path: r for r in rows_of(step, "path") if r.step_ms}
    lens = Row(step.params).context_lens
    pt = next(
        (p for p in points(dsa) if (p.heads, p.batch, p.context) == (heads, len(lens), lens[0]) and p.dsa),
        None,
    )
    if OURS not in paths or pt is None or len(lens) != 1:
        return None
    ours, layers = paths[OURS], GLM5.num_layers
    attention = layers * pt.dsa / 1e3
    return DSAStep(
        ours.write_kv_ms + ours.rest_ms + attention,
        attention,
        layers * (pt.topk or 0) / 1e3,
        lens[0],
        heads,
        len(lens),
        layers,
        {k: r.step_ms for k, r in paths.items()},
    )


def defaults_table(forced: Result, caption: str) -> Table:
    """SGLang 0.5.23's DSA kernels per GPU and cache dtype when no DSA backend is named (read from its source)."""
    rows = [Row(asdict(d), decode=f"`{d.decode}`", prefill=f"`{d.prefill}`") for d in DSA_DEFAULTS]
    return Table(rows, columns(_WORDS.defaults_table), caption)


def citations_table(forced: Result, words: Mapping[str, str], caption: str) -> Table:
    """Each fact the chapter states about SGLang (``words``: the fact's name in
    :data:`kvwall.peers.sglang_dsa.FACTS` -> the chapter's words for it), with the wheel's lines it rests on,
    checked."""
    rows = [
        Row(
            fact=words.get(r.fact, r.fact),
            where=", ".join(x.removeprefix("sglang/srt/") for x in r.lines),
            ok=_WORDS.checked[bool(r.ok)],
        )
        for r in rows_of(forced, "citations")
    ]
    return Table(rows, columns(_WORDS.citations_table), caption)
