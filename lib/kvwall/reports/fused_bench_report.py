"""Chapter 5's grid: ours against every peer of the one peer table, point by point, as numbers and tables.

:class:`Grid` indexes a recorded ``fused_decode_bench`` run (or ``fused_decode_paths``: the same row format, each of
ours' paths forced, page 1 and 64) by (strategy, page size, heads, context, batch). The functions below count what the
chapter's lead says (where ours loses, and to whom), the per-head-count account of wins and losses, the worst checked
errors and the conclusion's table (what to run); the appendix's full tables are :mod:`.fused_lab_report`. Strategy
names and labels come from the peer table (:data:`kvwall.experiments.fused_decode.strategies.STRATEGIES`); a point's
roofline is the row's ``roofline_us`` (:func:`kvwall.model.roofline.roofline_us`); "speed relative to X" is always
X's µs over the other's.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvwall.experiments.fused_decode.strategies import STRATEGIES
from kvwall.model.step_paths import KERNEL_NAMES
from kvwall.reports import accuracy_regimes, plots
from kvwall.reports.rows import Row, rows_of
from kvwall.reports.tables import MISSING, Table
from kvwall.reports.words import columns, read_words
from kvwall.results import Result

OURS, OURS_PAGE64 = "ours", "ours_page64"
FM_BF16, FM_FP8 = "flashmla_dense_bf16", "flashmla_dense_fp8"
#: FlashInfer's three ways of computing the decode on this GPU (its best is the lead's FlashInfer line).
FLASHINFER = ("flashinfer_fp8_fa2", "flashinfer_fp8_fa3", "flashinfer_bf16_precast")
SGLANG = "sglang_triton_fp8"
#: The lead's peers, in the order its figure and table show them (FI_BEST: the best of FLASHINFER at each point).
FI_BEST = "flashinfer"
LEAD_PEERS = (FM_BF16, FM_FP8, FI_BEST, SGLANG)
#: Strategies whose query is FP8 (SGLang, FlashMLA FP8): not BF16-accurate.
FP8_QUERY = tuple(s.name for s in STRATEGIES.values() if s.query == "fp8")
COLORS = {OURS: "#d62728", FM_BF16: "#e377c2", FM_FP8: "#8c564b", FI_BEST: "#1f77b4", SGLANG: "#9467bd"}
#: Short column headers for the appendix's wide tables (the caption spells each out with its label).
SHORT = {
    OURS: "ours",
    FM_BF16: "FM BF16",
    FM_FP8: "FM FP8",
    "flashinfer_fp8_fa2": "FI FP8 fa2",
    "flashinfer_fp8_fa3": "FI FP8 fa3",
    "flashinfer_bf16_precast": "FI BF16",
    SGLANG: "SGLang",
    "gather_cast_bf16": "gather",
    "index_then_cast": "index",
    "full_cast_bf16": "full cast",
}

#: (heads, context, batch)
Point = tuple[int, int, int]
#: Chapter 5's and its lab page's tables' columns and figures' labels (``book/fused.yml``).
WORDS = read_words("fused.yml")


def label(strategy: str) -> str:
    """The reader-facing name of a strategy (the peer table's label; :data:`FI_BEST`: FlashInfer's best)."""
    names = {OURS: OURS, FI_BEST: "FlashInfer (best of its three)", **KERNEL_NAMES}
    return names.get(strategy) or (STRATEGIES[strategy].label if strategy in STRATEGIES else strategy)


def context_label(c: int) -> str:
    return f"{c // 1024}K" if c >= 1024 else str(c)


def point_label(p: Point) -> str:
    """``"16 h, 128K, b8"`` (contexts under 1K in tokens: ``"16 h, 64 tokens, b1"``)."""
    return f"{p[0]} h, {context_label(p[1]) if p[1] >= 1024 else f'{p[1]} tokens'}, b{p[2]}"


def geomean(xs: Iterable[float | None]) -> float | None:
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def us_cell(v: float | None) -> str:
    """µs with three significant digits at most (the wide tables' cells): 9.87, 15.3, 153, 1,534."""
    return MISSING if v is None else f"{v:,.2f}" if v < 10 else f"{v:,.1f}" if v < 100 else f"{v:,.0f}"


@dataclass
class Grid:
    """A recorded ``fused_decode_bench`` (or ``fused_decode_paths``) run indexed by strategy, page size and point.
    ``floor_points``: points whose context is a fixed-cost probe (``fused_decode_paths``' 64 tokens), not the grid."""

    result: Result
    by: dict[tuple[str, int, int, int, int], Row] = field(init=False)
    points: list[Point] = field(init=False)
    floor_points: list[Point] = field(init=False)

    def __post_init__(self) -> None:
        rows = rows_of(self.result, "bench")
        self.by = {(r.strategy, r.page_size, r.heads, r.context, r.batch): r for r in rows}
        floors = set(self.result.params.get("floor_contexts") or [])
        every = {(r.heads, r.context, r.batch) for r in rows}
        self.points = sorted(p for p in every if p[1] not in floors)
        self.floor_points = sorted(p for p in every if p[1] in floors)

    @property
    def caption(self) -> str:
        return self.result.caption()

    def row(self, strategy: str, point: Point, page_size: int | None = None) -> Row | None:
        """The row of ``strategy`` at ``point`` (on ``page_size``; None: the strategy's own layout in the peer table,
        or its only row)."""
        if page_size is not None:
            return self.by.get((strategy, page_size, *point))
        own = self.by.get((strategy, STRATEGIES[strategy].page_size if strategy in STRATEGIES else 1, *point))
        return own or next((r for (s, _, *p), r in self.by.items() if s == strategy and tuple(p) == point), None)

    def us(self, strategy: str, point: Point, page_size: int | None = None) -> float | None:
        """Device µs per call; None where the strategy did not run (or failed) there. ``"flashinfer"``: the fastest
        of FlashInfer's three (:data:`FI_BEST`)."""
        if strategy == FI_BEST:
            return min((u for u in (self.us(s, point) for s in FLASHINFER) if u), default=None)
        return (self.row(strategy, point, page_size) or Row()).us or None

    def best_flashinfer(self, point: Point) -> str | None:
        timed = {s: u for s in FLASHINFER if (u := self.us(s, point))}
        return min(timed, key=timed.get) if timed else None

    def err(self, strategy: str, point: Point) -> float | None:
        """Relative error against float64 at ``point`` (FlashInfer's best: the error of the one that was fastest)."""
        if strategy == FI_BEST:
            strategy = self.best_flashinfer(point) or FLASHINFER[0]
        return (self.row(strategy, point) or Row()).rel_err_f64

    def strategies(self) -> list[str]:
        """The strategies of the run, in the peer table's order."""
        names = {s for s, *_ in self.by}
        return [s for s in STRATEGIES if s in names] + sorted(names - set(STRATEGIES))

    @property
    def ceilings(self) -> Row:
        """The run's measured ceilings (``ceilings`` row of the bench, ``build`` row of the paths run)."""
        return next(iter(rows_of(self.result, "ceilings") + rows_of(self.result, "build")), Row())


def path_counts(grid: Grid, strategy: str = OURS) -> Counter:
    """How many grid points ``strategy`` (ours) ran on each path (its rows' ``kernel_path``)."""
    ran = [grid.row(strategy, p) for p in grid.points if grid.us(strategy, p)]
    return Counter(r.kernel_path for r in ran if r.kernel_path)


# ---------------------------------------------------------------------------------------------------------
# The lead: where ours loses
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lead:
    table: Table
    values: dict[str, Any]


def _faster(grid: Grid, a: str, b: str, points: Iterable[Point]) -> tuple[int, int]:
    """(points where ``a`` is faster than ``b``, points where both ran)."""
    both = [p for p in points if grid.us(a, p) and grid.us(b, p)]
    return sum(grid.us(a, p) < grid.us(b, p) for p in both), len(both)


def _fastest(grid: Grid, strategy: str, others: Iterable[str], points: Iterable[Point]) -> int:
    """Points where ``strategy`` ran and is at least as fast as every one of ``others`` that ran there."""
    others = list(others)
    return sum(
        1
        for p in points
        if grid.us(strategy, p) and all(grid.us(strategy, p) <= u for s in others if (u := grid.us(s, p)))
    )


def lead(grid: Grid, caption: str) -> Lead:
    """The chapter's opening, counted over the grid: how often each peer of :data:`LEAD_PEERS` is faster than ours (its
    ``{peer}_faster_than_ours`` of ``{peer}_points``), ours' own wins, where it loses most (``worst_point``, by
    ``worst_x``), how often ours and FlashMLA FP8 are the fastest of all, ours among the FP8-cache BF16-query ways,
    FlashMLA FP8's error over ours' (``fm_fp8_err_over_ours_min`` / ``_max``) and SGLang's error where it did not run;
    and a table of it all."""
    pts = [p for p in grid.points if grid.us(OURS, p)]
    values: dict[str, Any] = dict(grid_points=len(pts))
    rows = [
        dict(
            path=label(OURS),
            reads="FP8 cache, BF16 query",
            faster=MISSING,
            speed=MISSING,
            err=max((e for p in pts if (e := grid.err(OURS, p))), default=None),
        )
    ]
    for peer in LEAD_PEERS:
        wins, both = _faster(grid, peer, OURS, pts)
        speed = [grid.us(OURS, p) / u for p in pts if (u := grid.us(peer, p))]
        s = STRATEGIES.get(peer)
        rows.append(
            dict(
                path=label(peer),
                faster=f"{wins} of {both}",
                err=max((e for p in pts if grid.us(peer, p) and (e := grid.err(peer, p))), default=None),
                reads=f"{s.cache.upper()} cache, {s.query.upper()} query" if s else "FP8 or BF16 cache, BF16 query",
                speed=f"{min(speed):.2f}–{max(speed):.2f}×" if speed else MISSING,
            )
        )
        values.update({f"{peer}_faster_than_ours": wins, f"{peer}_points": both})
    same_inputs = [
        s
        for s in grid.strategies()
        if s != OURS
        and s not in KERNEL_NAMES
        and s not in FP8_QUERY
        and STRATEGIES.get(s)
        and STRATEGIES[s].cache == "fp8"
        and STRATEGIES[s].page_size == 1
    ]
    worst = max(
        (p for p in pts if grid.us(FM_FP8, p)), key=lambda p: grid.us(OURS, p) / grid.us(FM_FP8, p), default=None
    )
    err_x = [e / o for p in pts if (e := grid.err(FM_FP8, p)) and (o := grid.err(OURS, p))]
    failed = next((r.error for r in grid.by.values() if r.strategy == SGLANG and r.error), None)
    values.update(
        ours_fastest=_fastest(grid, OURS, LEAD_PEERS, pts),
        fm_fp8_fastest=_fastest(grid, FM_FP8, (OURS, *LEAD_PEERS), pts),
        ours_fastest_fp8_cache_bf16_query=_fastest(grid, OURS, same_inputs, pts),
        ours_faster_than_fm_fp8=values[f"{FM_FP8}_points"] - values[f"{FM_FP8}_faster_than_ours"],
        ours_faster_than_fm_bf16=values[f"{FM_BF16}_points"] - values[f"{FM_BF16}_faster_than_ours"],
        worst_point=worst,
        worst_x=grid.us(OURS, worst) / grid.us(FM_FP8, worst) if worst else None,
        fm_fp8_err_over_ours_min=min(err_x, default=None),
        fm_fp8_err_over_ours_max=max(err_x, default=None),
        sglang_error=failed,
    )
    return Lead(Table(rows, columns(WORDS.lead_table), caption), values)


def grid_regime(grid: Grid) -> accuracy_regimes.RegimeMultiplier | None:
    """FlashMLA FP8's error multiplier on the grid's inputs (:data:`accuracy_regimes.RANDOM_INPUTS`), with the
    logits' spread and the output's norm drawn here (chapter 5b's table of regimes has every other one)."""
    return next((m for m in accuracy_regimes.fp8_query_multipliers(None, grid.result) if m.strategy == FM_FP8), None)


def lead_figure(grid: Grid, caption: str) -> go.Figure:
    """One panel per head count: every lead peer's and ours' speed relative to FlashMLA BF16 (its µs over theirs,
    log scale) at each (context, batch) point; the legend names each one's worst error against float64."""
    heads = sorted({p[0] for p in grid.points})
    cols = 2 if len(heads) > 1 else 1
    nrows = -(-len(heads) // cols)
    labels = WORDS.lead_figure
    fig = make_subplots(
        rows=nrows,
        cols=cols,
        subplot_titles=[labels.panel.format(h=h) for h in heads],
        shared_yaxes=True,
        vertical_spacing=0.16,
        horizontal_spacing=0.05,
    )
    ratios: list[float] = []
    for strategy in (OURS, *[s for s in LEAD_PEERS if s != FM_BF16]):
        errs = [e for p in grid.points if grid.us(strategy, p) and (e := grid.err(strategy, p))]
        name = f"{label(strategy)} (error ≤ {max(errs):.1e})" if errs else label(strategy)
        for i, h in enumerate(heads):
            pts = [p for p in grid.points if p[0] == h]
            ys = [fm / us if (fm := grid.us(FM_BF16, p)) and (us := grid.us(strategy, p)) else None for p in pts]
            ratios += [y for y in ys if y]
            fig.add_scatter(
                x=[[context_label(p[1]) for p in pts], [str(p[2]) for p in pts]],
                y=ys,
                mode="markers",
                name=name,
                legendgroup=strategy,
                showlegend=i == 0,
                row=i // cols + 1,
                col=i % cols + 1,
                marker=dict(
                    color=COLORS[strategy],
                    size=10 if strategy == OURS else 7,
                    symbol="circle" if strategy == OURS else "diamond",
                    line=dict(width=1, color="white"),
                ),
                hovertemplate=labels.hover.format(h=h, name=label(strategy)),
            )
    for i in range(len(heads)):
        fig.add_hline(y=1.0, line_dash="dash", line_color="#333", row=i // cols + 1, col=i % cols + 1)
    ticks = [
        t
        for t in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5)
        if ratios and min(ratios) * 0.8 <= t <= max(ratios) * 1.25
    ]
    fig.update_yaxes(
        type="log",
        tickvals=ticks,
        ticktext=[f"{t:g}×" for t in ticks],
        range=[math.log10(min(ratios) * 0.8), math.log10(max(ratios) * 1.25)] if ratios else None,
    )
    fig.update_yaxes(title_text=labels.y, col=1)
    fig.update_layout(title=labels.title)
    fig = plots.with_caption(fig, caption, height=300 * nrows + 80, legend="top")
    # Room for the first row's panel titles under the legend, and for the second line of category labels
    # (context under batch) above the caption.
    fig.layout.annotations[-1].yshift -= 18
    fig.update_layout(
        margin=dict(t=fig.layout.margin.t + 24, b=fig.layout.margin.b + 18), height=fig.layout.height + 42
    )
    return fig


# ---------------------------------------------------------------------------------------------------------
# Where ours wins, where it loses
# ---------------------------------------------------------------------------------------------------------


def by_heads(grid: Grid, caption: str) -> tuple[Table, dict[str, Any]]:
    """Per head count: ours against FlashMLA FP8 and BF16 (points won, geometric-mean speed, the points where ours
    beat FlashMLA BF16) and the paths ours ran; a table and its values by ``h{heads}``."""
    rows, values = [], {}
    for h in sorted({p[0] for p in grid.points}):
        pts = [p for p in grid.points if p[0] == h and grid.us(OURS, p)]
        (w8, n8), (w16, n16) = _faster(grid, OURS, FM_FP8, pts), _faster(grid, OURS, FM_BF16, pts)
        g8, g16 = (geomean(u / grid.us(OURS, p) for p in pts if (u := grid.us(fm, p))) for fm in (FM_FP8, FM_BF16))
        ran = Counter(grid.row(OURS, p).kernel_path or "triton" for p in pts)
        won = [f"{context_label(p[1])}·{p[2]}" for p in pts if (u := grid.us(FM_BF16, p)) and grid.us(OURS, p) < u]
        rows.append(
            dict(
                heads=h,
                fp8=f"{w8} of {n8}",
                g8=g8,
                bf16=f"{w16} of {n16}",
                g16=g16,
                won=", ".join(won),
                ran=", ".join(f"{KERNEL_NAMES[k]} at {v}" for k, v in ran.most_common()),
            )
        )
        values[f"h{h}"] = dict(
            vs_fm_fp8_wins=w8,
            vs_fm_bf16_wins=w16,
            points=len(pts),
            vs_fm_fp8_geomean=g8,
            vs_fm_bf16_geomean=g16,
            paths=dict(ran),
        )
    return Table(rows, columns(WORDS.by_heads_table), caption), values


def loss_groups(grid: Grid) -> dict[str, dict[str, Any]]:
    """The grid cut where the story changes: ``few_heads`` (16 and 32 heads: memory-bound), ``many_heads_b1`` (64 and
    128 heads at batch 1) and ``many_heads_batched`` (at batch 8 or more: compute-bound). Per group: its head counts
    and batches, points, ours' geometric-mean speed relative to FlashMLA FP8 and BF16, the share of the roofline ours
    reaches (its range) and the best tensor rates of ours and FlashMLA BF16 (TFLOP/s)."""
    groups = dict(
        few_heads=lambda p: p[0] <= 32,
        many_heads_b1=lambda p: p[0] >= 64 and p[2] == 1,
        many_heads_batched=lambda p: p[0] >= 64 and p[2] > 1,
    )
    out = {}
    for name, keep in groups.items():
        pts = [p for p in grid.points if keep(p) and grid.us(OURS, p)]
        if not pts:
            continue
        share = [grid.row(OURS, p).roofline_us / grid.us(OURS, p) for p in pts]
        out[name] = dict(
            points=len(pts),
            heads=sorted({p[0] for p in pts}),
            batches=sorted({p[2] for p in pts}),
            vs_fm_fp8=geomean(u / grid.us(OURS, p) for p in pts if (u := grid.us(FM_FP8, p))),
            vs_fm_bf16=geomean(u / grid.us(OURS, p) for p in pts if (u := grid.us(FM_BF16, p))),
            share_min=min(share),
            share_max=max(share),
            tflops_max=max((t for p in pts if (t := grid.row(OURS, p).tflops)), default=None),
            fm_bf16_tflops_max=max((t for p in pts if (t := (grid.row(FM_BF16, p) or Row()).tflops)), default=None),
        )
    return out


def worst_errors(grid: Grid, paths: Grid | None = None) -> dict[str, float]:
    """Every output of the benchmark (and of the paths run) was checked against float64 before it was timed: the
    worst relative error of ours, of each path forced, and of FlashMLA's kernels over the grid (those that have
    one)."""

    def worst(g: Grid, strategy: str) -> float | None:
        return max((r.rel_err_f64 for (s, *_), r in g.by.items() if s == strategy and r.rel_err_f64), default=None)

    found = {
        OURS: worst(grid, OURS),
        **{k: worst(paths, k) for k in KERNEL_NAMES if paths},
        FM_BF16: worst(grid, FM_BF16),
        FM_FP8: worst(grid, FM_FP8),
    }
    return {k: v for k, v in found.items() if v}


# ---------------------------------------------------------------------------------------------------------
# The conclusion
# ---------------------------------------------------------------------------------------------------------


def what_to_run(grid: Grid, caption: str) -> Table:
    """Per head count and batch class, which BF16-accurate kernel was fastest at the recorded points (ours on the FP8
    cache, FlashMLA BF16 or FlashInfer on a BF16 cache twice the size, ...), how ours compares with FlashMLA BF16, and
    what FlashMLA FP8 (FP8 query) buys against it. Each row's ``winner``: the fastest kernel's label."""
    accurate = [s for s in grid.strategies() if s not in FP8_QUERY and s != OURS_PAGE64 and s not in KERNEL_NAMES]
    err_x = geomean(e / o for p in grid.points if (e := grid.err(FM_FP8, p)) and (o := grid.err(OURS, p)))
    rows = []
    for heads in sorted({p[0] for p in grid.points}):
        for name, batches in (("1", {1}), ("8–64", {8, 32, 64})):
            pts = [p for p in grid.points if p[0] == heads and p[2] in batches and grid.us(OURS, p)]
            if not pts:
                continue
            wins = Counter(min((s for s in accurate if grid.us(s, p)), key=lambda s: grid.us(s, p)) for p in pts)
            (top, k), fm = wins.most_common(1)[0], {p: grid.us(FM_BF16, p) for p in pts}
            rows.append(
                dict(
                    heads=heads,
                    batch=name,
                    winner=label(top),
                    fastest=f"{label(top)} ({k} of {len(pts)})",
                    vs=geomean(u / grid.us(OURS, p) for p, u in fm.items() if u),
                    fp8=geomean(u / f8 for p, u in fm.items() if u and (f8 := grid.us(FM_FP8, p))),
                )
            )
    fp8_x = f"; {err_x:.0f}× our error on {accuracy_regimes.RANDOM_INPUTS})" if err_x else ")"
    return Table(rows, columns(WORDS.what_to_run_table, fp8_x=fp8_x), caption)


def flashmla_fp8_error(validation: Result | None) -> tuple[float | None, float | None]:
    """From a recorded ``fused_decode_validation``: FlashMLA dense FP8's worst relative error against float64 over the
    cases it ran, and ours' worst (the rows of path ``ours``; a run without them: every path's), or Nones."""
    if validation is None:
        return None, None
    fm = [r.rel_err for r in rows_of(validation, "fp8_peers") if r.peer == FM_FP8 and r.rel_err is not None]
    cases = [r for r in rows_of(validation, "cases") if r.rel_err is not None]
    ours = [r.rel_err for r in cases if r.path == OURS] or [r.rel_err for r in cases]
    return max(fm, default=None), max(ours, default=None)
