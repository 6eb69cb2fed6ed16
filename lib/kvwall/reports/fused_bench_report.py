"""Chapter 5's grid: ours against every peer of the one peer table, point by point.

:class:`Grid` indexes a recorded ``fused_decode_bench`` run (or ``fused_decode_paths``: the same row format, each of
ours' paths forced, page 1 and 64) by (strategy, page size, heads, context, batch). The functions below turn it into the
chapter's lead (where ours loses, and to whom), the per-head-count account of wins and losses, the conclusion's
table (what to run), and the appendix's full tables (every strategy at every point, page 1 against page 64, mixed
batches, host time). Strategy names and labels come from the peer table
(:data:`kvwall.experiments.fused_decode.strategies.STRATEGIES`); a point's roofline is the row's ``roofline_us``
(:func:`kvwall.model.roofline.roofline_us`); "speed relative to X" is always X's µs over the other's.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvwall.experiments.fused_decode.strategies import STRATEGIES
from kvwall.model.paths import KERNEL_NAMES
from kvwall.reports import accuracy_regimes, plots
from kvwall.reports.tables import Table, number, plain, scientific, times
from kvwall.results import Result

__all__ = ["OURS", "OURS_PAGE64", "FM_BF16", "FM_FP8", "FLASHINFER", "SGLANG", "LEAD_PEERS", "Point", "Grid",
           "grid_text", "label", "point_label", "geomean", "Lead", "lead", "lead_figure", "by_heads_text",
           "loss_groups", "losses_text", "accuracy_text", "what_to_run", "conclusion_text", "flashmla_fp8_error",
           "path_counts", "context_label", "us_cell", "SHORT"]

OURS, OURS_PAGE64 = "ours", "ours_page64"
FM_BF16, FM_FP8 = "flashmla_dense_bf16", "flashmla_dense_fp8"
#: FlashInfer's three ways of computing the decode on this GPU (its best is the lead's FlashInfer line).
FLASHINFER = ("flashinfer_fp8_fa2", "flashinfer_fp8_fa3", "flashinfer_bf16_precast")
SGLANG = "sglang_triton_fp8"
#: The casts before FlashInfer's BF16 attention (chapters 1 and 4).
CASTS = ("full_cast_bf16", "index_then_cast", "gather_cast_bf16")
#: The lead's peers, in the order its figure and table show them ("flashinfer" = the best of FLASHINFER).
LEAD_PEERS = (FM_BF16, FM_FP8, "flashinfer", SGLANG)
#: Strategies whose query is FP8 (SGLang, FlashMLA FP8): not BF16-accurate.
FP8_QUERY = tuple(s.name for s in STRATEGIES.values() if s.query == "fp8")
COLORS = {OURS: "#d62728", FM_BF16: "#e377c2", FM_FP8: "#8c564b", "flashinfer": "#1f77b4", SGLANG: "#9467bd"}
#: Short column headers for the appendix's wide tables (the caption spells each out with its label).
SHORT = {OURS: "ours", FM_BF16: "FM BF16", FM_FP8: "FM FP8", "flashinfer_fp8_fa2": "FI FP8 fa2",
         "flashinfer_fp8_fa3": "FI FP8 fa3", "flashinfer_bf16_precast": "FI BF16", SGLANG: "SGLang",
         "gather_cast_bf16": "gather", "index_then_cast": "index", "full_cast_bf16": "full cast"}

#: (heads, context, batch)
Point = tuple[int, int, int]


def label(strategy: str) -> str:
    """The reader-facing name of a strategy (the peer table's label; "flashinfer": FlashInfer's best)."""
    if strategy == "flashinfer":
        return "FlashInfer (best of its three)"
    if strategy == OURS:
        return "ours"
    if strategy in KERNEL_NAMES:
        return KERNEL_NAMES[strategy]
    return STRATEGIES[strategy].label if strategy in STRATEGIES else strategy


def point_label(p: Point) -> str:
    """``"16 h, 128K, b8"`` (contexts under 1K in tokens: ``"16 h, 64 tokens, b1"``)."""
    ctx = f"{p[1] // 1024}K" if p[1] >= 1024 else f"{p[1]} tokens"
    return f"{p[0]} h, {ctx}, b{p[2]}"


def context_label(c: int) -> str:
    return f"{c // 1024}K" if c >= 1024 else str(c)


def geomean(xs: Iterable[float | None]) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def us_cell(v: float | None) -> str:
    """µs with three significant digits at most (the wide tables' cells): 9.87, 15.3, 153, 1,534."""
    if v is None:
        return "—"
    return f"{v:,.2f}" if v < 10 else f"{v:,.1f}" if v < 100 else f"{v:,.0f}"


@dataclass
class Grid:
    """A recorded ``fused_decode_bench`` (or ``fused_decode_paths``) run indexed by strategy, page size and point.
    ``floor_contexts``: contexts that are fixed-cost probes (``fused_decode_paths``' 64 tokens), not grid points."""

    result: Result
    by: dict[tuple[str, int, int, int, int], dict[str, Any]] = field(init=False)
    points: list[Point] = field(init=False)
    floor_points: list[Point] = field(init=False)

    def __post_init__(self) -> None:
        rows = self.result.table("bench")
        self.by = {(r["strategy"], r["page_size"], r["heads"], r["context"], r["batch"]): r for r in rows}
        floors = set(self.result.params.get("floor_contexts") or [])
        every = {(r["heads"], r["context"], r["batch"]) for r in rows}
        self.points = sorted(p for p in every if p[1] not in floors)
        self.floor_points = sorted(p for p in every if p[1] in floors)

    @property
    def caption(self) -> str:
        return self.result.caption()

    def row(self, strategy: str, point: Point, page_size: int | None = None) -> dict[str, Any] | None:
        """The row of ``strategy`` at ``point`` (on ``page_size``; None: the strategy's own layout in the peer table,
        or its only row)."""
        if page_size is None:
            page_size = STRATEGIES[strategy].page_size if strategy in STRATEGIES else 1
            found = self.by.get((strategy, page_size, *point))
            if found is not None:
                return found
            return next((r for (s, _, *p), r in self.by.items() if s == strategy and tuple(p) == point), None)
        return self.by.get((strategy, page_size, *point))

    def us(self, strategy: str, point: Point, page_size: int | None = None) -> float | None:
        """Device µs per call; None where the strategy did not run (or failed) there. ``"flashinfer"``: the fastest
        of FlashInfer's three."""
        if strategy == "flashinfer":
            return min((u for u in (self.us(s, point) for s in FLASHINFER) if u), default=None)
        r = self.row(strategy, point, page_size)
        return r["us"] if r and r.get("us") else None

    def best_flashinfer(self, point: Point) -> str | None:
        timed = {s: self.us(s, point) for s in FLASHINFER if self.us(s, point)}
        return min(timed, key=timed.get) if timed else None

    def err(self, strategy: str, point: Point) -> float | None:
        """Relative error against float64 at ``point`` (FlashInfer's best: the error of the one that was fastest)."""
        if strategy == "flashinfer":
            strategy = self.best_flashinfer(point) or FLASHINFER[0]
        return (self.row(strategy, point) or {}).get("rel_err_f64")

    def strategies(self) -> list[str]:
        """The strategies of the run, in the peer table's order."""
        names = {s for s, *_ in self.by}
        return [s for s in STRATEGIES if s in names] + sorted(names - set(STRATEGIES))

    @property
    def ceilings(self) -> dict[str, Any]:
        """The run's measured ceilings (``ceilings`` row of the bench, ``build`` row of the paths run)."""
        for section in ("ceilings", "build"):
            found = [r for r in self.result.rows if r.get("section") == section]
            if found:
                return found[0]
        return {}


def path_counts(grid: Grid, strategy: str = OURS) -> Counter:
    """How many grid points ``strategy`` (ours) ran on each path (its rows' ``kernel_path``)."""
    return Counter(grid.row(strategy, p)["kernel_path"] for p in grid.points
                   if grid.us(strategy, p) and grid.row(strategy, p).get("kernel_path"))


# ---------------------------------------------------------------------------------------------------------
# The lead: where ours loses
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lead:
    text: str
    table: Table
    values: dict[str, Any]


def _faster(grid: Grid, a: str, b: str, points: Iterable[Point]) -> tuple[int, int]:
    """(points where ``a`` is faster than ``b``, points where both ran)."""
    both = [p for p in points if grid.us(a, p) and grid.us(b, p)]
    return sum(grid.us(a, p) < grid.us(b, p) for p in both), len(both)


def grid_text(grid: Grid) -> str:
    """The grid in words, from the run's parameters: head counts, contexts, batches, the mixed-batch rule, the pool."""
    p = grid.result.params
    ctx = ", ".join(context_label(c) for c in p["contexts"])
    batches = [b for b in p["batches"] if b > 1]
    return (f"The grid: **{', '.join(map(str, p['heads']))} heads** per GPU × one request of **{ctx} tokens**, or a "
            f"mixed batch of {', '.join(map(str, batches))} requests holding a quarter of batch × context tokens in all "
            f"(at most {p['max_total_tokens']:,}), on random slots of one {p['pool_slots']:,}-token FP8 pool: "
            f"{len(grid.points)} points.")


def lead(grid: Grid) -> Lead:
    """The chapter's opening: over the grid, how often each peer of :data:`LEAD_PEERS` is faster than ours, by how
    much, and at what error; ours' own wins against FlashMLA; a table of it all."""
    pts = [p for p in grid.points if grid.us(OURS, p)]
    n = len(pts)
    values: dict[str, Any] = {"grid_points": n}
    rows = [{"path": label(OURS), "reads": "FP8 cache, BF16 query", "faster": "—", "speed": "—",
             "err": max((grid.err(OURS, p) for p in pts if grid.err(OURS, p)), default=None)}]
    for peer in LEAD_PEERS:
        wins, both = _faster(grid, peer, OURS, pts)
        speed = [grid.us(OURS, p) / grid.us(peer, p) for p in pts if grid.us(peer, p)]
        errs = [grid.err(peer, p) for p in pts if grid.us(peer, p) and grid.err(peer, p)]
        reads = ("FP8 or BF16 cache, BF16 query" if peer == "flashinfer" else
                 f"{STRATEGIES[peer].cache.upper()} cache, {STRATEGIES[peer].query.upper()} query")
        rows.append({"path": label(peer), "reads": reads, "faster": f"{wins} of {both}",
                     "speed": f"{min(speed):.2f}–{max(speed):.2f}×" if speed else "—",
                     "err": max(errs, default=None)})
        values[f"{peer}_faster_than_ours"] = wins
        values[f"{peer}_points"] = both
    fastest = [p for p in pts if all(grid.us(OURS, p) <= u for s in LEAD_PEERS if (u := grid.us(s, p)))]
    values["ours_fastest"] = len(fastest)
    fm8_fastest = [p for p in pts if grid.us(FM_FP8, p) and all(grid.us(FM_FP8, p) <= u for s in (OURS, *LEAD_PEERS)
                                                                 if (u := grid.us(s, p)))]
    values["fm_fp8_fastest"] = len(fm8_fastest)
    same_inputs = [s for s in grid.strategies() if s != OURS and s not in KERNEL_NAMES and s not in FP8_QUERY
                   and STRATEGIES.get(s) and STRATEGIES[s].cache == "fp8" and STRATEGIES[s].page_size == 1]
    fp8_cache_wins = [p for p in pts if all(grid.us(OURS, p) <= u for s in same_inputs if (u := grid.us(s, p)))]
    values["ours_fastest_fp8_cache_bf16_query"] = len(fp8_cache_wins)
    table = Table(rows, {"path": "path", "reads": "reads", "faster than ours at (points)": "faster",
                         "ours' µs / its µs (>1: it is faster)": ("speed", plain),
                         "worst error vs float64": ("err", scientific)},
                  grid.caption + " Ours' µs over the path's at the same point (above 1×, the path is faster); "
                  "FlashInfer: at each point the fastest of its FP8 fa2, FP8 fa3 and BF16 (on a BF16 copy of the "
                  "pool) kernels, and that one's error.")
    fm8, fm8_n = values[f"{FM_FP8}_faster_than_ours"], values[f"{FM_FP8}_points"]
    fm16, fm16_n = values[f"{FM_BF16}_faster_than_ours"], values[f"{FM_BF16}_points"]
    worst = max((p for p in pts if grid.us(FM_FP8, p)), key=lambda p: grid.us(OURS, p) / grid.us(FM_FP8, p),
                default=None)
    err_x = [grid.err(FM_FP8, p) / grid.err(OURS, p) for p in pts if grid.err(FM_FP8, p) and grid.err(OURS, p)]
    values.update(ours_faster_than_fm_fp8=fm8_n - fm8, ours_faster_than_fm_bf16=fm16_n - fm16,
                  fm_fp8_err_over_ours_min=min(err_x) if err_x else None)
    text = (f"Over the **{n} points** of the grid, ours is faster than FlashMLA's FP8 kernel at "
            f"**{fm8_n - fm8} of {fm8_n}** and than FlashMLA's BF16 kernel at **{fm16_n - fm16} of {fm16_n}**; "
            f"it is the fastest of the kernels timed at **{len(fastest)}**, FlashMLA FP8 at **{len(fm8_fastest)}**.")
    if worst is not None:
        text += (f" It loses most at {point_label(worst)}, where FlashMLA FP8 is "
                 f"**{grid.us(OURS, worst) / grid.us(FM_FP8, worst):.1f}×** faster.")
    fi, fi_n = values["flashinfer_faster_than_ours"], values["flashinfer_points"]
    sg, sg_n = values[f"{SGLANG}_faster_than_ours"], values[f"{SGLANG}_points"]
    failed = next((r["error"] for r in grid.by.values() if r["strategy"] == SGLANG and r.get("error")), None)
    sglang = (f"SGLang's Triton kernel at {sg} of {sg_n}" if sg_n or not failed else
              f"SGLang's Triton kernel did not run in this recording ({failed.split(':')[0]}: "
              f"{failed.split(': ', 1)[-1][:90]})")
    text += (f" FlashInfer's best is faster than ours at {fi} of {fi_n} points, {sglang}. Among the ways to decode from the FP8 cache with a BF16 query (ours, FlashInfer's native FP8, "
             f"the casts before FlashInfer BF16), ours is the fastest at **{len(fp8_cache_wins)} of {n}**.")
    if err_x:
        text += (f" FlashMLA FP8 buys its speed with accuracy: it quantizes the query to FP8, and on this grid's "
                 f"{_regime_said(grid)} its error against float64 is **{min(err_x):.0f}–{max(err_x):.0f}×** ours at "
                 "every point; FlashMLA BF16 needs a BF16 cache, twice the bytes per token.")
    return Lead(text, table, values)


def _regime_said(grid: Grid) -> str:
    """The grid's input regime, named, with the logits' spread and the output's norm drawn here (chapter 5b's table
    of regimes has every other one)."""
    found = next((m for m in accuracy_regimes.fp8_query_multipliers(None, grid.result) if m.strategy == FM_FP8), None)
    if found is None or found.logit_spread is None or found.output_norm is None:
        return f"inputs ({accuracy_regimes.RANDOM_INPUTS})"
    lo, hi = (f"{v:.2f}" for v in found.logit_spread)
    return (f"inputs ({accuracy_regimes.RANDOM_INPUTS}: logits spread {lo if lo == hi else f'{lo}–{hi}'}, attention "
            f"near uniform, the output {found.output_norm[1]:.0%} of a value's norm or less)")


def lead_figure(grid: Grid) -> go.Figure:
    """One panel per head count: every lead peer's and ours' speed relative to FlashMLA BF16 (its µs over theirs,
    log scale) at each (context, batch) point; the legend names each one's worst error against float64."""
    heads = sorted({p[0] for p in grid.points})
    cols = 2 if len(heads) > 1 else 1
    nrows = -(-len(heads) // cols)
    fig = make_subplots(rows=nrows, cols=cols, subplot_titles=[f"{h} heads" for h in heads], shared_yaxes=True,
                        vertical_spacing=0.16, horizontal_spacing=0.05)
    ratios: list[float] = []
    for strategy in (OURS, *[s for s in LEAD_PEERS if s != FM_BF16]):
        errs = [grid.err(strategy, p) for p in grid.points if grid.us(strategy, p) and grid.err(strategy, p)]
        name = f"{label(strategy)} (error ≤ {max(errs):.1e})" if errs else label(strategy)
        for i, h in enumerate(heads):
            pts = [p for p in grid.points if p[0] == h]
            outer, inner, ys = [], [], []
            for p in pts:
                outer.append(context_label(p[1]))
                inner.append(str(p[2]))
                fm, us = grid.us(FM_BF16, p), grid.us(strategy, p)
                ys.append(fm / us if fm and us else None)
            ratios += [y for y in ys if y]
            fig.add_scatter(x=[outer, inner], y=ys, mode="markers", name=name, legendgroup=strategy,
                            showlegend=i == 0, row=i // cols + 1, col=i % cols + 1,
                            marker=dict(color=COLORS[strategy], size=10 if strategy == OURS else 7,
                                        symbol="circle" if strategy == OURS else "diamond",
                                        line=dict(width=1, color="white")),
                            hovertemplate=f"{h} heads, %{{x}}<br>{label(strategy)}: %{{y:.2f}}× FlashMLA BF16's "
                                          "speed<extra></extra>")
    for i in range(len(heads)):
        fig.add_hline(y=1.0, line_dash="dash", line_color="#333", row=i // cols + 1, col=i % cols + 1)
    ticks = [t for t in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5) if ratios and
             min(ratios) * 0.8 <= t <= max(ratios) * 1.25]
    fig.update_yaxes(type="log", tickvals=ticks, ticktext=[f"{t:g}×" for t in ticks],
                     range=[math.log10(min(ratios) * 0.8), math.log10(max(ratios) * 1.25)] if ratios else None)
    fig.update_yaxes(title_text="FlashMLA BF16 µs / its µs", col=1)
    fig.update_layout(title="FlashMLA BF16's time / each path's time, per point (>1: the path is faster)")
    caption = (grid.caption + " y: FlashMLA BF16's µs over the path's; above 1× (dashed) the path is faster. "
               "Ticks: batch, under it the context (K tokens) "
               "(batches > 1: mixed lengths, a quarter of batch × context tokens in all). CUDA graphs, L2 flushed; "
               "ours on page-size-1 slots, FlashMLA on 64-token pages of the same pool.")
    fig = plots.with_caption(fig, caption, height=300 * nrows + 80, legend="top")
    # Room for the first row's panel titles under the legend, and for the second line of category labels
    # (context under batch) above the caption.
    fig.layout.annotations[-1].yshift -= 18
    fig.update_layout(margin=dict(t=fig.layout.margin.t + 24, b=fig.layout.margin.b + 18),
                      height=fig.layout.height + 42)
    return fig


def by_heads_text(grid: Grid) -> tuple[str, dict[str, Any]]:
    """Per head count: ours against FlashMLA FP8 and BF16 (points won, geometric-mean speed), and the path ours ran."""
    lines, values = [], {}
    for h in sorted({p[0] for p in grid.points}):
        pts = [p for p in grid.points if p[0] == h and grid.us(OURS, p)]
        w8, n8 = _faster(grid, OURS, FM_FP8, pts)
        w16, n16 = _faster(grid, OURS, FM_BF16, pts)
        g8 = geomean(grid.us(FM_FP8, p) / grid.us(OURS, p) for p in pts if grid.us(FM_FP8, p))
        g16 = geomean(grid.us(FM_BF16, p) / grid.us(OURS, p) for p in pts if grid.us(FM_BF16, p))
        ran = Counter(grid.row(OURS, p).get("kernel_path") or "triton" for p in pts)
        paths = ", ".join(f"the {KERNEL_NAMES[k]} at {v}" for k, v in ran.most_common())
        won = [f"{context_label(p[1])}·{p[2]}" for p in pts if grid.us(FM_BF16, p) and grid.us(OURS, p) < grid.us(FM_BF16, p)]
        where = f": context·batch {', '.join(won)}" if won else ""
        lines.append(f"- **{h} heads**: faster than FlashMLA FP8 at {w8} of {n8} points (its speed "
                     f"{g8:.2f}× FlashMLA FP8's, geometric mean), than FlashMLA BF16 at {w16} of {n16} "
                     f"({g16:.2f}×{where}); ours ran {paths}." if g8 and g16 else f"- **{h} heads**: FlashMLA not timed.")
        values[f"h{h}"] = {"vs_fm_fp8_wins": w8, "vs_fm_bf16_wins": w16, "points": len(pts),
                           "vs_fm_fp8_geomean": g8, "vs_fm_bf16_geomean": g16, "paths": dict(ran)}
    return "\n".join(lines), values


def loss_groups(grid: Grid) -> dict[str, dict[str, Any]]:
    """The grid cut where the story changes: 16 and 32 heads (memory-bound), 64 and 128 heads at batch 1, and at
    batch 8 or more (compute-bound). Per group: points, ours' geometric-mean speed relative to FlashMLA FP8 and BF16,
    and the share of the roofline ours reaches (its range)."""
    groups = {"few_heads": lambda p: p[0] <= 32, "many_heads_b1": lambda p: p[0] >= 64 and p[2] == 1,
              "many_heads_batched": lambda p: p[0] >= 64 and p[2] > 1}
    out = {}
    for name, keep in groups.items():
        pts = [p for p in grid.points if keep(p) and grid.us(OURS, p)]
        if not pts:
            continue
        share = [grid.row(OURS, p)["roofline_us"] / grid.us(OURS, p) for p in pts]
        tflops = [grid.row(OURS, p).get("tflops") for p in pts if grid.row(OURS, p).get("tflops")]
        fm_tflops = [grid.row(FM_BF16, p).get("tflops") for p in pts if (grid.row(FM_BF16, p) or {}).get("tflops")]
        out[name] = {"points": len(pts),
                     "vs_fm_fp8": geomean(grid.us(FM_FP8, p) / grid.us(OURS, p) for p in pts if grid.us(FM_FP8, p)),
                     "vs_fm_bf16": geomean(grid.us(FM_BF16, p) / grid.us(OURS, p) for p in pts
                                           if grid.us(FM_BF16, p)),
                     "share_min": min(share), "share_max": max(share),
                     "tflops_max": max(tflops, default=None), "fm_bf16_tflops_max": max(fm_tflops, default=None)}
    return out


def losses_text(grid: Grid) -> tuple[str, dict[str, Any]]:
    """Where the story changes (:func:`loss_groups`), in numbers: ours' share of the roofline and its speed against
    FlashMLA in each group, and the best tensor rates at 64 and 128 heads; Markdown and the values."""
    g = loss_groups(grid)
    lines = []

    def heads(keep) -> str:
        hs = sorted({p[0] for p in grid.points if keep(p)})
        return " and ".join(map(str, hs)) + " heads"

    if "few_heads" in g:
        x = g["few_heads"]
        lines.append(f"- **{heads(lambda p: p[0] <= 32)}** ({x['points']} points; memory-bound): ours reaches "
                     f"{x['share_min']:.0%}–{x['share_max']:.0%} of the roofline, at {x['vs_fm_fp8']:.2f}× FlashMLA "
                     f"FP8's speed and {x['vs_fm_bf16']:.2f}× FlashMLA BF16's (geometric means).")
    if "many_heads_b1" in g:
        x = g["many_heads_b1"]
        lines.append(f"- **{heads(lambda p: p[0] >= 64)}, one request** ({x['points']} points): "
                     f"{x['vs_fm_fp8']:.2f}× FlashMLA FP8's speed, {x['vs_fm_bf16']:.2f}× FlashMLA BF16's.")
    if "many_heads_batched" in g:
        x = g["many_heads_batched"]
        tf = (f"; at most {x['tflops_max']:.0f} TFLOP/s against FlashMLA BF16's {x['fm_bf16_tflops_max']:.0f}"
              if x.get("tflops_max") and x.get("fm_bf16_tflops_max") else "")
        batches = sorted({p[2] for p in grid.points if p[2] > 1})
        lines.append(f"- **{heads(lambda p: p[0] >= 64)}, batches of {batches[0]} to {batches[-1]}** ({x['points']} "
                     "points; compute-bound): "
                     f"{x['vs_fm_fp8']:.2f}× FlashMLA FP8's speed, {x['vs_fm_bf16']:.2f}× FlashMLA BF16's{tf}.")
    return "\n".join(lines), g


def conclusion_text(table: Table) -> str:
    """Which kernel :func:`what_to_run` found fastest per class, in one sentence per winner."""
    by: dict[str, list[str]] = {}
    for r in table.rows:
        winner = r["fastest"].split(" (")[0]
        by.setdefault(winner, []).append(f"{r['heads']} heads at batch {r['batch']}")
    return " ".join(f"**{w}** is the fastest BF16-accurate kernel for {', '.join(where)}." for w, where in by.items())


# ---------------------------------------------------------------------------------------------------------
# The conclusion
# ---------------------------------------------------------------------------------------------------------


def accuracy_text(grid: Grid, paths: Grid | None = None) -> tuple[str, dict[str, Any]]:
    """Every output of the benchmark (and of the paths run) was checked against float64 before it was timed: the
    worst relative error of ours, of each path forced, and of FlashMLA's kernels over the grid; Markdown and values."""
    def worst(g: Grid, strategy: str, page: int | None = None) -> float | None:
        errs = [r.get("rel_err_f64") for (s, pg, *_), r in g.by.items()
                if s == strategy and (page is None or pg == page) and r.get("rel_err_f64")]
        return max(errs, default=None)

    found = {OURS: worst(grid, OURS)}
    if paths:
        found.update({k: worst(paths, k) for k in KERNEL_NAMES})
    found.update({FM_BF16: worst(grid, FM_BF16), FM_FP8: worst(grid, FM_FP8)})
    found = {k: v for k, v in found.items() if v}
    if not found:
        return "", {}
    n = len(grid.points) + (len(paths.points) if paths else 0)
    text = (f"Every output of the benchmark{' and of the paths run' if paths else ''} was checked against float64 "
            f"before it was timed ({n} points): the worst relative error is " +
            ", ".join(f"{label(k)} **{v:.1e}**" for k, v in found.items()) + ".")
    return text, {f"{k}_worst_rel_err": v for k, v in found.items()}


def what_to_run(grid: Grid) -> Table:
    """Per head count and batch class, which BF16-accurate kernel was fastest at the recorded points (ours on the FP8
    cache, FlashMLA BF16 or FlashInfer on a BF16 cache twice the size, ...), how ours compares with FlashMLA BF16, and
    what FlashMLA FP8 (FP8 query) buys against it."""
    accurate = [s for s in grid.strategies() if s not in FP8_QUERY and s != OURS_PAGE64 and s not in KERNEL_NAMES]
    err_x = geomean(grid.err(FM_FP8, p) / grid.err(OURS, p) for p in grid.points
                    if grid.err(FM_FP8, p) and grid.err(OURS, p))
    rows = []
    for heads in sorted({p[0] for p in grid.points}):
        for name, batches in (("1", {1}), ("8–64", {8, 32, 64})):
            pts = [p for p in grid.points if p[0] == heads and p[2] in batches and grid.us(OURS, p)]
            if not pts:
                continue
            wins = Counter(min((s for s in accurate if grid.us(s, p)), key=lambda s: grid.us(s, p)) for p in pts)
            top, k = wins.most_common(1)[0]
            rows.append({"heads": heads, "batch": name, "fastest": f"{label(top)} ({k} of {len(pts)})",
                         "vs": geomean(grid.us(FM_BF16, p) / grid.us(OURS, p) for p in pts if grid.us(FM_BF16, p)),
                         "fp8": geomean(grid.us(FM_BF16, p) / grid.us(FM_FP8, p) for p in pts
                                        if grid.us(FM_BF16, p) and grid.us(FM_FP8, p))})
    fp8_header = ("FlashMLA BF16 µs / FlashMLA FP8's µs (>1: FP8 faster" +
                  (f"; {err_x:.0f}× our error on {accuracy_regimes.RANDOM_INPUTS})" if err_x else ")"))
    return Table(rows, {"heads per GPU": "heads", "batch": "batch", "fastest BF16-accurate kernel": ("fastest", plain),
                        "FlashMLA BF16 µs / ours' µs (>1: ours faster)": ("vs", times(2)),
                        fp8_header: ("fp8", times(2))},
                 grid.caption + " Geometric means over the grid's points (contexts 4K, 32K, 128K) of FlashMLA BF16's "
                                "time over the kernel's: above 1×, the kernel is faster than FlashMLA BF16. "
                                "BF16-accurate: every kernel that keeps the query in BF16.")


def flashmla_fp8_error(validation: Result | None) -> tuple[float | None, float | None]:
    """From a recorded ``fused_decode_validation``: FlashMLA dense FP8's worst relative error against float64 over the
    cases it ran, and ours' worst (the rows of path ``ours``; a run without them: every path's), or Nones."""
    if validation is None:
        return None, None
    fm = [r["rel_err"] for r in validation.rows if r.get("section") == "fp8_peers" and r.get("peer") == FM_FP8
          and r.get("rel_err") is not None]
    cases = [r for r in validation.rows if r.get("section") == "cases" and r.get("rel_err") is not None]
    ours = [r["rel_err"] for r in cases if r.get("path") == OURS] or [r["rel_err"] for r in cases]
    return max(fm, default=None), max(ours, default=None)
