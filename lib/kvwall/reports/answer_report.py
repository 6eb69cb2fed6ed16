"""Chapter 6's analysis: every path on the decode step, the sweep, the cost model fitted and validated on it, and the
readings chapter 6 and the front page put into their sentences. Every number comes from a recorded or live result, or
from :mod:`kvwall.model.cost` fitted on the recorded sweep; the functions return numbers, tables and figures, and the
chapter writes the sentences, gluing the numbers in (myst-nb).

The chapter's fixed words that are not in its Markdown -- the answer's rows, the paths' names, the tables' columns and
the figures' labels -- are data, in ``book/answer.yml`` beside the chapter (:data:`WORDS`)."""

from __future__ import annotations

import statistics
import string
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvwall.model.cost import PATHS, CostModel, Point, fit_cost_model, split_train_test, validate
from kvwall.model.geometry import GLM5
from kvwall.model.original import ORIGINAL
from kvwall.model.step_paths import kernel_that_ran, kernels_that_ran
from kvwall.reports.plots import with_caption
from kvwall.reports.rows import Row, rows_of
from kvwall.reports.tables import Table
from kvwall.reports.words import columns, read_words
from kvwall.results import Result


#: Chapter 6's words that are data: the answer's rows (:mod:`kvwall.reports.decision`), names, columns and labels.
WORDS = read_words("answer.yml")


class Filler(string.Formatter):
    """Fills a template of ``book/answer.yml``: ``{name}`` is a value, else a piece (a template, or a mapping of
    templates by ``cases[name]``), filled in turn; ``{name!c}`` capitalises its first letter."""

    def __init__(self, values: Mapping[str, Any], pieces: Mapping[str, Any], cases: Mapping[str, Any]) -> None:
        super().__init__()
        self.values, self.pieces, self.cases = values, pieces, cases

    def get_value(self, key: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        return self.values[key] if key in self.values else self.fill(self.pieces[key], self.cases.get(key))

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        return value[:1].upper() + value[1:] if conversion == "c" else super().convert_field(value, conversion)

    def fill(self, template: Any, case: Any = None) -> Any:
        """A template (a str, or a mapping from which ``case`` picks one), filled; a list comes back as it is."""
        template = template[case] if isinstance(template, Mapping) else template
        return self.format(template) if isinstance(template, str) else template


def fill(template: Any, case: Any = None, /, **values: Any) -> Any:
    """``template`` of :data:`WORDS` (``case`` picking it from a mapping) filled with ``values`` and the shared
    pieces."""
    return Filler(values, WORDS.pieces, {}).fill(template, case)


#: Ours in the sweep: the dispatcher's path (:data:`OURS`), and the Triton path forced.
OURS_PATHS = ("ours", "triton")
OURS, TRITON = OURS_PATHS
#: The sweep's axes (``kvwall.experiments.answer.sweep``), and the paths the readings name besides ours.
CONTEXT, BATCH, HEADS = "context", "batch", "heads"
GATHER_CAST, BF16_CACHE, INDEX_THEN_CAST = "gather_cast", "bf16_cache", "index_then_cast"
FLASHMLA_BF16, FLASHMLA_FP8 = "flashmla_bf16", "flashmla_fp8"
#: A reference line or a model's curve in a figure: drawn, never hovered; and a log axis with a tick per decade.
GUIDE = dict(mode="lines", hoverinfo="skip")
LOG_DECADES = dict(type="log", dtick=1)
#: Short names of the step's paths for axes and tables, and the sweep's paths' colours (in the figures' order).
STEP_NAMES = {path: w.name for path, w in WORDS.paths.items() if "name" in w}
SWEEP_COLORS = {path: w.color for path, w in WORDS.paths.items()}
MISS = 0.20  # a held-out prediction off by more than this is listed, with why
MB = 1e6  # the book's megabyte: 10^6 bytes (chapter 6's memory section says so)
CAST = "full_pool_cast"  # the original path: the whole pool cast to BF16 every layer


def sweep_rows(result: Result) -> list[Row]:
    """The ``point`` rows of a ``path_sweep`` result."""
    return rows_of(result, "point")


def _setup(result: Result) -> Row:
    return rows_of(result, "setup")[0]


# ---------------------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------------------


def step_rows(result: Result) -> list[Row]:
    """One row per path that ran: its step, the original path's step over it, time saved, the KV work per step
    (preparation + attention), and what it costs in memory."""
    paths = [r for r in rows_of(result, "path") if r.step_ms is not None]
    base = next((r.step_ms for r in paths if r.path == CAST), None)
    fp8 = next((r.kv_bytes_per_token for r in paths if r.cache_dtype == "float8_e4m3fn"), None)
    return [
        Row(
            r,
            name=STEP_NAMES.get(r.path, r.path),
            kv_work_ms=r.kv_ms + r.attention_ms,
            speedup=base and base / r.step_ms,
            time_saved=base and 1 - r.step_ms / base,
            tokens_per_fp8_pool=fp8 and fp8 / r.kv_bytes_per_token,
            cache=WORDS.cache_names.get(r.cache_dtype, r.cache_dtype),
            transient_mb=None if r.transient_bytes is None else r.transient_bytes / MB,
        )
        for r in paths
    ]


def step_table(result: Result, caption: str) -> Table:
    """The step per path: time, against the original path, KV work, accuracy. On a CPU (small scale, Triton kernels
    interpreted) ratios to the original path would compare an interpreter with PyTorch's CPU kernels: left out."""
    cpu = _setup(result).device == "cpu"
    spec = {head: c for head, c in WORDS.step_table.items() if not (cpu and c[0] in ("speedup", "time_saved"))}
    return Table(step_rows(result), columns(spec), caption)


def memory_table(result: Result, caption: str) -> Table:
    """What each path costs in memory: KV bytes per token over the model's layers, tokens held in the FP8 pool's
    memory, and the extra peak one step allocates (measured on a GPU)."""
    return Table(step_rows(result), columns(WORDS.memory_table), caption)


def step_figure(result: Result, title: str, caption: Sequence[str]) -> go.Figure:
    """Stacked bars, one per path: the step's phases (ms)."""
    rows, labels = step_rows(result), WORDS.step_figure
    x = [r.name for r in rows]
    fig = go.Figure()
    for key, name, color in labels.phases:
        fig.add_bar(name=name, x=x, y=[r[key] for r in rows], marker_color=color, hovertemplate=labels.hover)
    for name, r in zip(x, rows):
        fig.add_annotation(
            x=name,
            y=r.step_ms,
            text=fill(labels.bar, ms=r.step_ms),
            showarrow=False,
            yanchor="bottom",
            font=dict(size=11),
        )
    fig.update_layout(
        barmode="stack", title=title, yaxis_title=labels.y, yaxis_range=[0, max(r.step_ms for r in rows) * 1.12]
    )
    return with_caption(fig, caption, height=560)


def headline_point(result: Result) -> Point:
    """The step's geometry as a cost-model point: GLM-5 at the step's heads per GPU, its batch and pool."""
    p = Row(result.params)
    return Point(
        heads=_setup(result).heads_per_gpu,
        batch=len(p.context_lens),
        tokens=sum(p.context_lens),
        pool_tokens=p.pool_tokens,
        geometry=GLM5.with_tensor_parallel(p.tensor_parallel),
    )


# ---------------------------------------------------------------------------------------------------------
# The sweep and the cost model
# ---------------------------------------------------------------------------------------------------------


def sweep_samples(result: Result) -> list[tuple[str, str, Point, float]]:
    """``(axis, path, point, µs per layer)`` for every timed point of a ``path_sweep`` result."""
    return [
        (r.axis, r.path, Point(r.heads, r.batch, r.tokens, r.pool_tokens), float(r.us))
        for r in sweep_rows(result)
        if r.us
    ]


@dataclass
class SweepFit:
    """The model fitted on the even points of each sweep series, and its errors on the odd ones."""

    model: CostModel
    held_out: list[Row]
    trained: int

    @property
    def median_abs_err(self) -> float:
        return statistics.median(abs(r.rel_err) for r in self.held_out)

    def share_within(self, bound: float = MISS) -> float:
        return sum(abs(r.rel_err) <= bound for r in self.held_out) / len(self.held_out)


def fit_sweep(result: Result) -> SweepFit:
    train, test = split_train_test(sweep_samples(result))
    model = fit_cost_model(train)
    return SweepFit(model, [Row(r) for r in validate(model, test)], len(train))


def validation_table(fit: SweepFit, caption: str) -> Table:
    """Per path: what each component was fitted to (rates, launch constant) and the held-out error."""
    rows = []
    for path, comp in PATHS.items():
        errs = [abs(r.rel_err) for r in fit.held_out if r.path == path]
        if errs:
            att, prep = fit.model.components[comp.attention], fit.model.components.get(comp.prep)
            rows.append(
                dict(
                    path=path,
                    held_out=len(errs),
                    median=statistics.median(errs),
                    max=max(errs),
                    attention=fill(WORDS.fitted.attention, bool(att.tflops), c=att),
                    preparation=fill(WORDS.fitted.preparation, c=prep) if prep else WORDS.fitted.none,
                )
            )
    return Table(rows, columns(WORDS.validation_table), caption)


def _why(row: Row) -> str:
    """Why a held-out point misses, from what the model leaves out (the chapter explains each reason)."""
    why, (path, batch, heads) = WORDS.misses, (row.path, row.batch, row.heads)
    if path in OURS_PATHS and batch > 1:
        return why.mixed_batch
    if path in OURS_PATHS and heads >= 64:
        return why.many_heads
    return why.one_request if batch == 1 else why.many_heads if heads >= 64 else why.other


def misses_table(fit: SweepFit, caption: str) -> Table:
    """The held-out points the model misses by more than :data:`MISS`, grouped by why: how many, which paths, and
    the worst one."""
    groups: dict[str, list[Row]] = {}
    for r in fit.held_out:
        if abs(r.rel_err) > MISS:
            groups.setdefault(_why(r), []).append(r)
    rows = [
        dict(
            why=why,
            misses=len(ms),
            paths=", ".join(dict.fromkeys(r.path for r in ms)),
            worst=fill(WORDS.misses.worst, w=max(ms, key=lambda r: abs(r.rel_err))),
        )
        for why, ms in groups.items()
    ]
    return Table(rows, columns(WORDS.misses_table), caption)


def validation_figure(fit: SweepFit, title: str, caption: Sequence[str]) -> go.Figure:
    """Predicted against measured (held-out points only), log-log, with the ±20 % band."""
    fig, held, labels = go.Figure(), fit.held_out, WORDS.validation_figure
    times = [t for r in held for t in (r.measured_us, r.predicted_us)]
    lo, hi = min(times) * 0.8, max(times) * 1.25
    for k, dash in ((1.0, "solid"), (1 + MISS, "dot"), (1 - MISS, "dot")):
        fig.add_scatter(
            x=[lo, hi],
            y=[lo * k, hi * k],
            line=dict(color="#999", dash=dash, width=1),
            showlegend=False,
            **GUIDE,
        )
    for path in dict.fromkeys(r.path for r in held):
        sel = [r for r in held if r.path == path]
        fig.add_scatter(
            name=path,
            x=[r.measured_us for r in sel],
            y=[r.predicted_us for r in sel],
            mode="markers",
            marker=dict(size=8, color=SWEEP_COLORS.get(path.removesuffix("_fa2"))),
            customdata=[[r.axis, r.heads, r.batch, r.tokens, r.rel_err * 100] for r in sel],
            hovertemplate=labels.hover,
        )
    fig.update_layout(title=title, xaxis_title=labels.x, yaxis_title=labels.y)
    fig.update_xaxes(LOG_DECADES)
    fig.update_yaxes(LOG_DECADES)
    return with_caption(fig, caption, height=640)


def sweep_figure(result: Result, fit: SweepFit, title: str, caption: Sequence[str]) -> go.Figure:
    """The four axes, measured (markers) and the model (dashed lines), µs per layer, log scales."""
    # Each panel says what it varies in its x-axis title (no subplot titles: they would crowd the legend above).
    fig = make_subplots(rows=2, cols=2, horizontal_spacing=0.1, vertical_spacing=0.16)
    samples = sweep_samples(result)
    for i, (axis, key, x_title) in enumerate(WORDS.sweep_figure.axes):
        row, col, log_x = i // 2 + 1, i % 2 + 1, axis in (BATCH, HEADS)
        for path, color in SWEEP_COLORS.items():
            pts = [(p, us) for a, pa, p, us in samples if a == axis and pa == path and (axis != HEADS or p.batch == 1)]
            if pts:
                xs = [getattr(p, key) for p, _ in pts]
                fig.add_scatter(
                    x=xs,
                    y=[us for _, us in pts],
                    mode="markers",
                    marker=dict(color=color, size=7),
                    name=path,
                    legendgroup=path,
                    showlegend=i == 0,
                    row=row,
                    col=col,
                    hovertemplate=WORDS.sweep_figure.hover,
                )
                fig.add_scatter(
                    x=xs,
                    y=[fit.model.layer_us(path, p) for p, _ in pts],
                    line=dict(color=color, dash="dash", width=1),
                    legendgroup=path,
                    showlegend=False,
                    row=row,
                    col=col,
                    **GUIDE,
                )
        fig.update_xaxes(type="log", dtick="D2" if log_x else 1, title_text=x_title, row=row, col=col)
        fig.update_yaxes(LOG_DECADES, title_text=WORDS.sweep_figure.y if col == 1 else None, row=row, col=col)
    fig.update_layout(title=title)
    return with_caption(fig, caption, height=900)


# ---------------------------------------------------------------------------------------------------------
# Readings the chapter's sentences quote (glued into its Markdown)
# ---------------------------------------------------------------------------------------------------------


def _sweep_us(sweep: Result) -> dict[tuple[str, str, int, int, int], float]:
    return {(r.axis, r.path, r.batch, r.tokens, r.heads): r.us for r in sweep_rows(sweep) if r.us}


def _axis(us: Mapping[tuple[Any, ...], float], axis: str, path: str, heads: int = 16) -> dict[int, float]:
    """One path along the sweep's ``context`` axis (tokens -> µs) or ``batch`` axis (batch -> µs), at ``heads``."""
    return {(k[2] if axis == BATCH else k[3]): v for k, v in us.items() if k[:2] == (axis, path) and k[4] == heads}


@dataclass(frozen=True)
class CastStep:
    """The book's own step with the whole-pool cast (one name wherever it is quoted; the original's 86 ms is the
    original's): its ms, the GPU (or device) and the clock it was timed with (``cuda_graph``, ``events``, ...)."""

    ms: float
    gpu: str
    timing: str


def cast_step(step: Result) -> CastStep:
    cast, setup = next(r for r in step_rows(step) if r.path == CAST), _setup(step)
    return CastStep(cast.step_ms, setup.gpu or setup.device, cast.timing or "")


@dataclass(frozen=True)
class Lead:
    """The answer for dense MLA models in numbers: the step with the cast, the fastest (``best``) and slowest
    (``worst``) other path (rows of :func:`step_rows`), the request's tokens; at one request, the lengths the sweep
    measured, those where ours is the fastest BF16-accurate path and those where FlashMLA FP8 is faster than ours
    (None: not in the sweep); in mixed batches (16 heads), the batches measured, those where ours is slower than
    gather_cast + FlashInfer, and at the largest: gather_cast's time over ours' and FlashMLA BF16's (None: not
    measured)."""

    cast: CastStep
    best: Row
    worst: Row
    context: int
    lengths: list[int]
    ours_fastest: list[int]
    flashmla_fp8_faster: list[int] | None
    batches: list[int]
    ours_slower: list[int]
    gather_over_ours: float | None
    flashmla_bf16_over_ours: float | None

    @property
    def spread_ms(self) -> float:
        return self.worst.step_ms - self.best.step_ms


def lead(step: Result, sweep: Result) -> Lead:
    """What every path saves on the step, how little separates them at one request, where ours wins and loses
    against gather_cast and FlashMLA at one request and in batches."""
    free = [r for r in step_rows(step) if r.path != CAST]
    us = _sweep_us(sweep)
    ours_b, gather_b, fm_b = (_axis(us, BATCH, p) for p in (OURS, GATHER_CAST, FLASHMLA_BF16))
    batches = sorted(b for b in ours_b if b > 1 and b in gather_b)
    ctx_ours, fm_fp8 = _axis(us, CONTEXT, OURS), _axis(us, CONTEXT, FLASHMLA_FP8)
    others = [
        _axis(us, CONTEXT, p) for p in (GATHER_CAST, BF16_CACHE, "flashinfer_fp8", FLASHMLA_BF16, INDEX_THEN_CAST)
    ]
    lengths = sorted(ctx_ours)
    big = batches[-1] if batches else None
    return Lead(
        cast_step(step),
        min(free, key=lambda r: r.step_ms),
        max(free, key=lambda r: r.step_ms),
        Row(step.params).context_lens[0],
        lengths,
        [t for t in lengths if all(ctx_ours[t] <= o.get(t, float("inf")) for o in others)],
        [t for t in lengths if t in fm_fp8 and fm_fp8[t] < ctx_ours[t]] if fm_fp8 else None,
        batches,
        [b for b in batches if ours_b[b] > gather_b[b]],
        big and gather_b[big] / ours_b[big],
        fm_b[big] / ours_b[big] if big in fm_b else None,
    )


def memory(step: Result) -> dict[str, Any]:
    """What the step's caches cost: bytes a token over every layer (FP8 and BF16), the pool, its GB in FP8 and the
    BF16 tokens the same memory holds, the extra peak of the whole-pool cast and of index-then-cast (MB), and the
    buffer gather_cast preallocates for the request's tokens (MB)."""
    s, point = {r.path: r for r in step_rows(step)}, headline_point(step)
    fp8, bf16, pool, geometry = (
        s[OURS].kv_bytes_per_token,
        s[BF16_CACHE].kv_bytes_per_token,
        point.pool_tokens,
        point.geometry,
    )
    return dict(
        fp8_bytes=fp8,
        bf16_bytes=bf16,
        layers=geometry.num_layers,
        kv_dim=geometry.kv_dim,
        pool=pool,
        pool_gb=pool * fp8 / 1e9,
        bf16_tokens=int(pool * fp8 / bf16),
        cast_mb=s[CAST].transient_mb,
        index_mb=s[INDEX_THEN_CAST].transient_mb,
        gather_mb=Row(step.params).context_lens[0] * geometry.kv_dim * 2 / MB,
    )


@dataclass(frozen=True)
class Findings:
    """What the sweep shows: one layer's whole-pool cast + attention at the smallest and largest pool (``pool``:
    ``(pool tokens, µs)`` each); per path, one request's µs at the shortest and longest context (``context``: path ->
    ``(µs, µs)``, 16 heads); the heads measured at one request, its context, ours' µs at the fewest and most heads and
    the path ours ran at the most."""

    pool: tuple[tuple[int, float], tuple[int, float]]
    lengths: tuple[int, int]
    context: dict[str, tuple[float, float]]
    heads: tuple[int, int]
    heads_context: int
    ours_heads_us: tuple[float, float]
    ours_many_heads_path: str


def findings(sweep: Result) -> Findings:
    us = _sweep_us(sweep)
    pool = sorted((r.pool_tokens, r.us) for r in sweep_rows(sweep) if r.axis == "pool" and r.path == CAST and r.us)
    lo, hi = min(t for a, _, _, t, _ in us if a == CONTEXT), max(t for a, _, _, t, _ in us if a == CONTEXT)
    one = {k: v for k, v in us.items() if k[0] == HEADS and k[2] == 1}
    heads, ctx = sorted({k[4] for k in one}), next(k[3] for k in one)
    many = next(
        kernel_that_ran(r)
        for r in sweep_rows(sweep)
        if (r.axis, r.path, r.batch, r.heads) == (HEADS, OURS, 1, heads[-1])
    )
    context = {
        path: (_axis(us, CONTEXT, path).get(lo), _axis(us, CONTEXT, path).get(hi)) for path in {k[1] for k in us}
    }
    return Findings(
        (pool[0], pool[-1]),
        (lo, hi),
        context,
        (heads[0], heads[-1]),
        ctx,
        (one[(HEADS, OURS, 1, ctx, heads[0])], one[(HEADS, OURS, 1, ctx, heads[-1])]),
        many,
    )


def kernels_ran(result: Result) -> tuple[list[tuple[str, int]], int, str | None]:
    """Which of ours' paths a step or sweep ``result`` ran: ``(path, points)`` most first, the points ours ran, and
    the dispatcher's reason where it ran once."""
    rows = [
        r
        for r in (sweep_rows(result) if result.experiment == "path_sweep" else map(Row, result.rows))
        if r.path == OURS and not r.error
    ]
    return kernels_that_ran(rows).most_common(), len(rows), rows[0].path_why if len(rows) == 1 else None


def front_page_figure(step: Result, caption: Sequence[str]) -> go.Figure:
    """The book's answer in one figure: the original's step (its own figure) and chapter 6's step on the H200 with
    each path (horizontal bars, ms per step), each bar saying what its cache holds in the same memory."""
    rows, labels = step_rows(step), WORDS.front_page_figure
    colors = labels.colors
    y = [fill(labels.original, gpu=ORIGINAL.gpu)] + [r.name for r in rows]
    x = [ORIGINAL.step_ms] + [r.step_ms for r in rows]
    text = [f"{ORIGINAL.step_ms:g} ms"] + [
        fill(labels.bar, r.tokens_per_fp8_pool >= 1, ms=r.step_ms, tokens=r.tokens_per_fp8_pool) for r in rows
    ]
    marker = [colors.original] + [
        colors.cast
        if r.path == CAST
        else colors.bf16_cache
        if r.cache_dtype == "bfloat16"
        else colors.fp8_query
        if r.path == FLASHMLA_FP8
        else colors.fp8_cache
        for r in rows
    ]
    fig = go.Figure(
        go.Bar(
            x=x,
            y=y,
            orientation="h",
            text=text,
            textposition="outside",
            marker_color=marker,
            cliponaxis=False,
            hovertemplate=labels.hover,
        )
    )
    fig.update_layout(
        title=labels.title,
        xaxis_title=labels.x,
        xaxis_range=[0, max(x) * 1.3],
        yaxis=dict(autorange="reversed"),
        showlegend=False,
        bargap=0.25,
    )
    return with_caption(fig, caption, height=140 + 34 * len(y), legend="none")
