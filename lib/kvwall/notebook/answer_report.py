"""Chapter 6's analysis: every path on the decode step, the sweep, the cost model fitted and validated on it, the
original's GPU, and what to do. Chapter 6 calls these and narrates; every number comes from a recorded or live
result, or from :mod:`kvwall.model.cost` fitted on the recorded sweep."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvwall.model.cost import PATHS, CostModel, Point, fit_cost_model, split_train_test, validate
from kvwall.model.geometry import GLM5
from kvwall.model.original import ORIGINAL
from kvwall.model.paths import KERNEL_NAMES, kernel_that_ran, kernels_that_ran
from kvwall.notebook.original_gpu_report import original_gpu_rows
from kvwall.notebook.plots import with_caption
from kvwall.notebook.tables import Table, number, percent, scientific, times
from kvwall.results import Result

__all__ = ["STEP_NAMES", "SweepFit", "fit_sweep", "step_rows", "step_table", "memory_table", "step_figure", "sweep_figure",
           "validation_figure", "validation_table", "misses_table", "decision_table", "sweep_samples", "headline_point",
           "lead_text", "memory_text", "sweep_findings", "patch_check_table", "patch_meta", "front_page_figure",
           "front_page_text", "fused_kernel_text"]

#: Short names of the step's paths for axes and tables.
STEP_NAMES = {
    "full_pool_cast": "whole-pool cast (original)", "index_then_cast": "PyTorch index-then-cast",
    "gather_cast": "gather_cast (ch. 4)", "fused_fp8": "fused FP8 (ours, ch. 5)",
    "flashinfer_fp8": "FlashInfer FP8 (fa3)", "bf16_cache": "BF16 cache (2× memory)",
}
#: The sweep paths the figures draw, with a colour each (FlashInfer fa2 twins are in the tables and the model).
SWEEP_COLORS = {
    "full_pool_cast": "#d62728", "index_then_cast": "#ff7f0e", "gather_cast": "#2ca02c", "fused_fp8": "#9467bd",
    "flashinfer_fp8": "#8c564b", "bf16_cache": "#1f77b4", "flashmla_bf16": "#17becf", "flashmla_fp8": "#7f7f7f",
}
MISS = 0.20  # a held-out prediction off by more than this is listed, with why


def _rows(result: Result, section: str) -> list[dict[str, Any]]:
    return [r for r in result.rows if r.get("section") == section]


def _setup(result: Result) -> dict[str, Any]:
    return _rows(result, "setup")[0]


# ---------------------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------------------

def step_rows(result: Result) -> list[dict[str, Any]]:
    """One row per path that ran: its step, the original path's step over it, time saved, the KV work per step
    (preparation + attention), and what it costs in memory."""
    paths = [r for r in _rows(result, "path") if r.get("step_ms") is not None]
    base = next((r for r in paths if r["path"] == "full_pool_cast"), None)
    fp8_bytes = next((r["kv_bytes_per_token"] for r in paths if r.get("cache_dtype") == "float8_e4m3fn"), None)
    out = []
    for r in paths:
        kv_work = r["kv_ms"] + r["attention_ms"]
        out.append({**r, "name": STEP_NAMES.get(r["path"], r["path"]), "kv_work_ms": kv_work,
                    "speedup": base["step_ms"] / r["step_ms"] if base else None,
                    "time_saved": 1 - r["step_ms"] / base["step_ms"] if base else None,
                    "tokens_per_fp8_pool": (fp8_bytes / r["kv_bytes_per_token"]) if fp8_bytes else None,
                    "transient_mb": r["transient_bytes"] / 2**20 if r.get("transient_bytes") is not None else None})
    return out


def step_table(result: Result, caption: str) -> Table:
    """The step per path: time, against the original path, KV work, accuracy. On a CPU (small scale, Triton kernels
    interpreted) ratios to the original path would compare an interpreter with PyTorch's CPU kernels: left out."""
    columns = {"path": "name", "step ms": ("step_ms", number(2)), "vs the original": ("speedup", times(2)),
               "time saved": ("time_saved", percent), "KV work ms/step": ("kv_work_ms", number(2)),
               "error vs float64": ("rel_err_vs_float64", scientific), "attention": "backend"}
    if _setup(result)["device"] == "cpu":
        for key in ("vs the original", "time saved"):
            columns.pop(key)
    return Table(step_rows(result), columns, caption)


def memory_table(result: Result, caption: str) -> Table:
    """What each path costs in memory: KV bytes per token over the model's layers, tokens held in the FP8 pool's
    memory, and the extra peak one step allocates (measured on a GPU)."""
    return Table(step_rows(result), {
        "path": "name", "cache": ("cache_dtype", lambda d: {"float8_e4m3fn": "FP8 (e4m3)", "bfloat16": "BF16"}.get(d, d)),
        "KV bytes/token (78 layers)": ("kv_bytes_per_token", number(0)),
        "tokens in the same memory": ("tokens_per_fp8_pool", times(2)),
        "extra peak memory a step, MB": ("transient_mb", number(1))}, caption)


def step_figure(result: Result, title: str, caption: Sequence[str]) -> go.Figure:
    """Stacked bars, one per path: the step's phases (ms)."""
    rows = step_rows(result)
    x = [r["name"].replace(" (", "<br>(").replace(" index-", "<br>index-") for r in rows]
    fig = go.Figure()
    for key, name, color in (("write_kv_ms", "write new token's KV", "#8c8c8c"),
                             ("kv_ms", "KV preparation (cast / gather)", "#d62728"),
                             ("attention_ms", "MLA decode attention", "#1f77b4"),
                             ("rest_ms", "rest of layer (stand-in)", "#c7c7c7")):
        fig.add_bar(name=name, x=x, y=[r[key] for r in rows], marker_color=color,
                    hovertemplate="%{x}<br>" + name + ": %{y:.2f} ms<extra></extra>")
    for name, r in zip(x, rows):
        fig.add_annotation(x=name, y=r["step_ms"], text=f"{r['step_ms']:.1f} ms", showarrow=False,
                           yanchor="bottom", font=dict(size=11))
    fig.update_layout(barmode="stack", title=title, yaxis_title="ms per decode step")
    fig = with_caption(fig, caption, height=600)
    _legend_on_top(fig, per_row=2)
    fig.update_layout(xaxis_tickangle=0, xaxis_tickfont_size=10)
    return fig


def _legend_on_top(fig: go.Figure, per_row: int, top: int = 150) -> None:
    """The legend in rows between the title and the plot (the caption holds the space under it)."""
    fig.update_layout(title=dict(y=0.99, yanchor="top"), margin=dict(t=top),
                      legend=dict(orientation="h", x=0, y=1.01, yanchor="bottom", xanchor="left",
                                  entrywidth=1 / per_row, entrywidthmode="fraction"))


def headline_point(result: Result) -> Point:
    """The step's geometry as a cost-model point: GLM-5 at the step's heads per GPU, its batch and pool."""
    p = result.params
    return Point(heads=_setup(result)["heads_per_gpu"], batch=len(p["context_lens"]), tokens=sum(p["context_lens"]),
                 pool_tokens=p["pool_tokens"], geometry=GLM5.with_tensor_parallel(p["tensor_parallel"]))


# ---------------------------------------------------------------------------------------------------------
# The sweep and the cost model
# ---------------------------------------------------------------------------------------------------------

def sweep_samples(result: Result) -> list[tuple[str, str, Point, float]]:
    """``(axis, path, point, µs per layer)`` for every timed point of a ``path_sweep`` result."""
    return [(r["axis"], r["path"], Point(r["heads"], r["batch"], r["tokens"], r["pool_tokens"]), float(r["us"]))
            for r in _rows(result, "point") if r.get("us")]


@dataclass
class SweepFit:
    """The model fitted on the even points of each sweep series, and its errors on the odd ones."""

    model: CostModel
    held_out: list[dict[str, Any]]
    trained: int

    @property
    def median_abs_err(self) -> float:
        return statistics.median(abs(r["rel_err"]) for r in self.held_out)

    def share_within(self, bound: float = MISS) -> float:
        return sum(abs(r["rel_err"]) <= bound for r in self.held_out) / len(self.held_out)


def fit_sweep(result: Result) -> SweepFit:
    train, test = split_train_test(sweep_samples(result))
    model = fit_cost_model(train)
    return SweepFit(model, validate(model, test), len(train))


def validation_table(fit: SweepFit, caption: str) -> Table:
    """Per path: what each component was fitted to (rates, launch constant) and the held-out error."""
    rows = []
    for path, comp in PATHS.items():
        errs = [abs(r["rel_err"]) for r in fit.held_out if r["path"] == path]
        if not errs:
            continue
        att = fit.model.components[comp.attention]
        prep = fit.model.components.get(comp.prep)
        rows.append({"path": path, "held_out": len(errs), "median": statistics.median(errs), "max": max(errs),
                     "attention": f"{att.gbps:,.0f} GB/s" + (f", {att.tflops:,.0f} TFLOP/s" if att.tflops else "")
                     + f", {att.c0_us:.1f} µs",
                     "preparation": "—" if prep is None else f"{prep.gbps:,.0f} GB/s, {prep.c0_us:.1f} µs"})
    return Table(rows, {"path": "path", "held-out points": "held_out", "median error (abs.)": ("median", percent),
                        "max error (abs.)": ("max", percent), "attention fitted": "attention",
                        "preparation fitted": "preparation"}, caption)


def _why(row: dict[str, Any]) -> str:
    """Why a held-out point misses, from what the model leaves out (the chapter explains each reason)."""
    if row["path"].startswith("fused_fp8") and row["batch"] > 1:
        return "mixed batch: fixed work per chunk"
    if row["path"].startswith("fused_fp8") and row["heads"] >= 64:
        return "many heads: tile and tensor-core rate"
    if row["batch"] == 1:
        return "one request: time rises in steps"
    if row["heads"] >= 64:
        return "many heads: tile and tensor-core rate"
    return "outside the bytes-and-FLOPs terms"


def misses_table(fit: SweepFit, caption: str) -> Table:
    """The held-out points the model misses by more than :data:`MISS`, grouped by why: how many, which paths, and
    the worst one."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in fit.held_out:
        if abs(r["rel_err"]) > MISS:
            groups.setdefault(_why(r), []).append(r)
    rows = []
    for why, misses in groups.items():
        worst = max(misses, key=lambda r: abs(r["rel_err"]))
        rows.append({"why": why, "misses": len(misses), "paths": ", ".join(dict.fromkeys(r["path"] for r in misses)),
                     "worst": f"{worst['path']}, {worst['heads']} heads, batch {worst['batch']}, {worst['tokens']:,} "
                              f"tokens: measured {worst['measured_us']:.0f} µs, predicted {worst['predicted_us']:.0f} "
                              f"µs ({worst['rel_err']:+.0%})"})
    return Table(rows, {"why": "why", "misses": "misses", "paths": "paths", "the worst": "worst"}, caption)


def validation_figure(fit: SweepFit, title: str, caption: Sequence[str]) -> go.Figure:
    """Predicted against measured (held-out points only), log-log, with the ±20 % band."""
    fig = go.Figure()
    lo = min(min(r["measured_us"], r["predicted_us"]) for r in fit.held_out) * 0.8
    hi = max(max(r["measured_us"], r["predicted_us"]) for r in fit.held_out) * 1.25
    for k, dash in ((1.0, "solid"), (1 + MISS, "dot"), (1 - MISS, "dot")):
        fig.add_scatter(x=[lo, hi], y=[lo * k, hi * k], mode="lines", line=dict(color="#999", dash=dash, width=1),
                        showlegend=False, hoverinfo="skip")
    for path in dict.fromkeys(r["path"] for r in fit.held_out):
        sel = [r for r in fit.held_out if r["path"] == path]
        fig.add_scatter(name=path, x=[r["measured_us"] for r in sel], y=[r["predicted_us"] for r in sel],
                        mode="markers", marker=dict(size=8, color=SWEEP_COLORS.get(path.removesuffix("_fa2"))),
                        customdata=[[r["axis"], r["heads"], r["batch"], r["tokens"], r["rel_err"] * 100] for r in sel],
                        hovertemplate=path + "<br>%{customdata[0]} axis, %{customdata[1]} heads, batch "
                        "%{customdata[2]}, %{customdata[3]:,} tokens<br>measured %{x:.1f} µs, predicted "
                        "%{y:.1f} µs (%{customdata[4]:+.0f}%)<extra></extra>")
    fig.update_layout(title=title, xaxis_title="measured µs per layer (held out)", yaxis_title="predicted µs per layer")
    fig.update_xaxes(type="log", dtick=1)
    fig.update_yaxes(type="log", dtick=1)
    fig = with_caption(fig, caption, height=640)
    _legend_on_top(fig, per_row=4, top=150)
    return fig


def sweep_figure(result: Result, fit: SweepFit, title: str, caption: Sequence[str]) -> go.Figure:
    """The four axes, measured (markers) and the model (dashed lines), µs per layer, log scales."""
    axes = (("context", "tokens", "context (batch 1, 16 heads)"), ("pool", "pool_tokens", "pool tokens (8K context)"),
            ("batch", "batch", "batch (mixed lengths, 16 heads)"), ("heads", "heads", "heads per GPU (batch 1, 32K)"))
    fig = make_subplots(rows=2, cols=2, subplot_titles=[a[2] for a in axes], horizontal_spacing=0.08,
                        vertical_spacing=0.14)
    samples = sweep_samples(result)
    for i, (axis, key, _) in enumerate(axes):
        row, col = i // 2 + 1, i % 2 + 1
        for path, color in SWEEP_COLORS.items():
            pts = [(p, us) for a, pa, p, us in samples if a == axis and pa == path
                   and (axis != "heads" or p.batch == 1)]
            if not pts:
                continue
            xs = [getattr(p, key) for p, _ in pts]
            fig.add_scatter(x=xs, y=[us for _, us in pts], mode="markers", marker=dict(color=color, size=7),
                            name=path, legendgroup=path, showlegend=i == 0, row=row, col=col,
                            hovertemplate=path + ": %{y:.1f} µs at %{x:,}<extra></extra>")
            fig.add_scatter(x=xs, y=[fit.model.layer_us(path, p) for p, _ in pts], mode="lines",
                            line=dict(color=color, dash="dash", width=1), legendgroup=path, showlegend=False,
                            row=row, col=col, hoverinfo="skip")
        fig.update_xaxes(type="log", dtick="D2" if axis in ("batch", "heads") else 1, row=row, col=col)
        fig.update_yaxes(type="log", dtick=1, title_text="µs per layer" if col == 1 else None, row=row, col=col)
    fig.update_layout(title=title)
    fig = with_caption(fig, caption, height=900)
    _legend_on_top(fig, per_row=4, top=170)
    fig.update_layout(legend_y=1.07)
    return fig


# ---------------------------------------------------------------------------------------------------------
# What to do
# ---------------------------------------------------------------------------------------------------------

def _link(chapter: str, text: str) -> str:
    """A link to a chapter: MyST resolves it to the page in the built site; JupyterLab opens the file."""
    return f"[{text}]({chapter}.md)"


def decision_table(step: Result, sweep: Result, fit: SweepFit, caption: str) -> Table:
    """Architecture x FlashInfer version x batch regime -> what to run, each with the measured or predicted figure
    that says so and the chapter that shows it."""
    s = {r["path"]: r for r in step_rows(step)}
    us = _sweep_us(sweep)
    long_ = max(t for a, _, b, t, h in us if a == "context")

    def at(path: str, axis: str = "context", batch: int = 1, tokens: int = long_, heads: int = 16) -> float:
        return us[(axis, path, batch, tokens, heads)]

    points = {(a, b, t, h) for a, _, b, t, h in us if a != "pool"}
    fm_wins = sum(min((v, p) for (a2, p, b2, t2, h2), v in us.items() if (a2, b2, t2, h2) == pt)[1] == "flashmla_fp8"
                  for pt in points)
    big_b = max(b for a, _, b, _, _ in us if a == "batch")
    big_t = next(t for a, _, b, t, _ in us if a == "batch" and b == big_b)
    step_ms = {k: v["step_ms"] for k, v in s.items()}
    p = headline_point(step)
    sm120 = {r["path"]: r for r in original_gpu_rows(fit.model, p)}
    ch4, ch5, ch3, ch6 = (_link("04_gather_then_cast", "ch. 4"), _link("05_fused_fp8_decode", "ch. 5"),
                          _link("03_the_other_doors", "ch. 3"), "this chapter")
    rows = [
        {"arch": "SM90 (H100, H200)", "flashinfer": "< 0.6.14 (no FP8 MLA)", "batch": "1 (single stream)",
         "do": "apply the gather_cast patch (below), or decode with the fused FP8 kernel",
         "why": f"step {step_ms['full_pool_cast']:.1f} → {step_ms['gather_cast']:.1f} ms (gather_cast) or "
                f"{step_ms['fused_fp8']:.1f} ms (fused), measured on the H200", "where": f"{ch4}, {ch5}, {ch6}"},
        {"arch": "SM90", "flashinfer": "≥ 0.6.14 (FP8 fa3)", "batch": "any",
         "do": "delete the cast: even FlashInfer's own FP8 kernel beats cast + BF16; but it is the slowest "
               "cast-free path",
         "why": f"per layer at {long_ // 1024}K tokens: FP8 fa3 {at('flashinfer_fp8'):.0f} µs vs cast + BF16 "
                f"{at('full_pool_cast'):.0f} µs ({at('full_pool_cast') / at('flashinfer_fp8'):.1f}× less); "
                f"gather_cast + fa3 {at('gather_cast'):.0f} µs", "where": f"{ch4}, {ch6}"},
        {"arch": "SM90", "flashinfer": "any", "batch": "any, no patch",
         "do": "switch SGLang to `--attention-backend flashmla --page-size 64`: FlashMLA's FP8 decode, no cast, "
               f"the fastest path at {fm_wins} of {len(points)} sweep points, with an FP8 query (chapter 5 measures "
               "its error; SGLang issue #35291 reports GSM8K unchanged)",
         "why": f"per layer at {long_ // 1024}K tokens: FlashMLA FP8 {at('flashmla_fp8'):.0f} µs, our fused kernel "
                f"{at('fused_fp8'):.0f} µs, cast + BF16 {at('full_pool_cast'):.0f} µs", "where": f"{ch5}, {ch6}"},
        {"arch": "SM90", "flashinfer": "any", "batch": f"≥ 16 (mixed, e.g. {big_b} × {big_t // big_b // 1024}K)",
         "do": "gather_cast + fa3 keeps the FP8 cache and BF16 accuracy; FlashMLA BF16 is faster if twice the KV "
               "memory is affordable; FlashMLA FP8 is fastest but quantizes the query (chapter 5's error table)",
         "why": f"batch {big_b}: gather_cast {at('gather_cast', 'batch', big_b, big_t):.0f} µs, fused "
                f"{at('fused_fp8', 'batch', big_b, big_t):.0f} µs, FlashMLA BF16 "
                f"{at('flashmla_bf16', 'batch', big_b, big_t):.0f} µs, FlashMLA FP8 "
                f"{at('flashmla_fp8', 'batch', big_b, big_t):.0f} µs per layer", "where": f"{ch5}, {ch6}"},
        {"arch": "SM120 (RTX PRO 6000, RTX 5090)", "flashinfer": "any, through 0.7.x (no FP8 MLA)",
         "batch": "1 (the original)",
         "do": "apply the gather_cast patch (fa2), or the fused kernel (its 16-head shape fits SM120; at more heads a "
               "smaller shape fits, unmeasured)",
         "why": f"predicted step {sm120['full_pool_cast_fa2']['step_lo']:.0f}–{sm120['full_pool_cast_fa2']['step_hi']:.0f}"
                f" ms → {sm120['gather_cast_fa2']['step_lo']:.0f}–{sm120['gather_cast_fa2']['step_hi']:.0f} ms "
                f"(gather_cast) or {sm120['fused_fp8']['step_lo']:.0f}–{sm120['fused_fp8']['step_hi']:.0f} ms "
                f"(fused); a BF16 cache halves the tokens a GPU holds", "where": f"{ch3}, {ch6}"},
        {"arch": "SM100 (B200)", "flashinfer": "≥ 0.6.x", "batch": "any",
         "do": "FlashInfer's trtllm-gen / CUTLASS MLA read FP8 there (not measured here); the gather_cast patch "
               "works on any GPU",
         "why": "chapter 3 lists which doors exist per architecture", "where": ch3},
    ]
    for r in rows:
        r["setup"] = f"**{r['arch']}**; FlashInfer {r['flashinfer']}; batch {r['batch']}"
    return Table(rows, {"your GPU, FlashInfer, batch": "setup", "do this": "do", "because": "why",
                        "shown in": "where"}, caption)


# ---------------------------------------------------------------------------------------------------------
# Sentences (every number computed from the results)
# ---------------------------------------------------------------------------------------------------------

def _sweep_us(sweep: Result) -> dict[tuple[str, str, int, int, int], float]:
    return {(r["axis"], r["path"], r["batch"], r["tokens"], r["heads"]): r["us"]
            for r in _rows(sweep, "point") if r.get("us")}


def lead_text(step: Result, sweep: Result) -> str:
    """The answer in a paragraph: what every path saves on the step, how little separates them at one request,
    and where our fused kernel loses (against FlashMLA, and at batch > 1)."""
    s = {r["path"]: r for r in step_rows(step)}
    free = [r for k, r in s.items() if k != "full_pool_cast"]
    best, worst = min(free, key=lambda r: r["step_ms"]), max(free, key=lambda r: r["step_ms"])
    us = _sweep_us(sweep)
    batches = sorted({b for a, _, b, _, _ in us if a == "batch"})
    lose_at = [b for b in batches if b > 1 and any(us[("batch", "fused_fp8", b, t, 16)] > us[("batch", p, b, t, 16)]
                                                   for (a, pa, bb, t, h) in us if a == "batch" and bb == b
                                                   and pa == "fused_fp8" for p in ("gather_cast", "bf16_cache"))]
    b_max = batches[-1]
    t_max = next(t for a, _, b, t, _ in us if a == "batch" and b == b_max)
    fm = us[("batch", "flashmla_bf16", b_max, t_max, 16)] / us[("batch", "fused_fp8", b_max, t_max, 16)]
    ctxs = sorted({t for a, _, b, t, _ in us if a == "context"})
    others = ("gather_cast", "bf16_cache", "flashinfer_fp8", "flashmla_bf16", "index_then_cast")
    fastest_accurate = [t for t in ctxs if all(us[("context", "fused_fp8", 1, t, 16)] <= us[("context", p, 1, t, 16)]
                                                for p in others)]
    beats_flashmla_fp8 = [t for t in ctxs if us[("context", "fused_fp8", 1, t, 16)]
                          <= us[("context", "flashmla_fp8", 1, t, 16)]]
    spread = worst["step_ms"] - best["step_ms"]
    return (
        f"**Every way past the wall removes the same thing: the whole-pool cast.** On chapter 1's step (GLM-5, "
        f"{s['full_pool_cast']['step_ms']:.1f} ms with the cast, one request of "
        f"{step.params['context_lens'][0]:,} tokens), every other path lands between {best['step_ms']:.1f} ms "
        f"({best['name']}) and {worst['step_ms']:.1f} ms ({worst['name']}): "
        f"{worst['time_saved']:.0%}–{best['time_saved']:.0%} of the step saved. What separates them, "
        f"{spread:.1f} ms, is {spread / s['full_pool_cast']['step_ms']:.0%} of the original step. "
        f"**Where ours loses:** our fused FP8 kernel is the fastest BF16-accurate path for one request "
        + (f"at every length measured ({ctxs[0] // 1024}K–{ctxs[-1] // 1024}K tokens)"
           if len(fastest_accurate) == len(ctxs) else
           f"at {len(fastest_accurate)} of the {len(ctxs)} lengths measured "
           f"({', '.join(f'{t // 1024}K' for t in fastest_accurate)}; {ctxs[0] // 1024}K–{ctxs[-1] // 1024}K tokens)")
        + f", but FlashMLA's FP8 kernel, which quantizes the query to FP8 and errs far more (chapter 5), is faster at "
        f"{len(ctxs) - len(beats_flashmla_fp8)} of them ("
        + ", ".join(f"{t // 1024}K" for t in ctxs if t not in beats_flashmla_fp8) + "); with mixed "
        f"batches ours is slower than gather_cast + FlashInfer from batch {lose_at[0] if lose_at else '—'} on, and "
        f"FlashMLA's BF16 kernel (on a BF16 cache, twice the memory) runs a batch of {b_max} in {fm:.0%} of our "
        f"kernel's time. What to run therefore depends on your GPU, your FlashInfer and your batch: the table at "
        f"the end says which, and the cost model below predicts the step for GPUs we did not measure, the "
        f"original's included.")


def memory_text(step: Result) -> str:
    s = {r["path"]: r for r in step_rows(step)}
    fp8, bf16 = s["fused_fp8"]["kv_bytes_per_token"], s["bf16_cache"]["kv_bytes_per_token"]
    pool = step.params["pool_tokens"]
    pool_gb = pool * fp8 / 1e9
    return (
        f"An FP8 token costs {fp8:,} bytes across GLM-5's 78 layers (576 values a layer, plus its 4-byte slot index); "
        f"a BF16 token {bf16:,}. The original's {pool:,}-token pool is {pool_gb:.1f} GB per GPU in FP8; the same "
        f"memory holds {int(pool * fp8 / bf16):,} BF16 tokens. The whole-pool cast also needs one layer's pool in "
        f"BF16 while it runs ({s['full_pool_cast']['transient_mb']:,.0f} MB measured as the step's extra peak), "
        f"PyTorch's index-then-cast {s['index_then_cast']['transient_mb']:.1f} MB at this request's length, and "
        f"gather_cast writes into a buffer preallocated for the batch's tokens "
        f"({step.params['context_lens'][0] * 1152 / 2**20:.1f} MB here, allocated once, so no extra peak within a "
        f"step). So the BF16 cache "
        f"is as fast as the best FP8 paths on one request, but it halves how many tokens, and so how many "
        f"concurrent requests, a GPU can hold.")


def sweep_findings(sweep: Result) -> str:
    """Where the cast stops mattering, and where each path wins, read off the sweep."""
    us = _sweep_us(sweep)
    pool_pts = [r for r in _rows(sweep, "point") if r["axis"] == "pool" and r["path"] == "full_pool_cast" and r.get("us")]
    small, large = min(pool_pts, key=lambda r: r["pool_tokens"]), max(pool_pts, key=lambda r: r["pool_tokens"])
    ctx = sorted({t for a, _, b, t, _ in us if a == "context"})
    lo, hi = ctx[0], ctx[-1]

    def c(path: str, t: int) -> float:
        return us[("context", path, 1, t, 16)]

    heads = sorted({h for a, _, b, _, h in us if a == "heads" and b == 1})
    many = next(kernel_that_ran(r) for r in _rows(sweep, "point")
                if (r["axis"], r["path"], r["batch"], r["heads"]) == ("heads", "fused_fp8", 1, heads[-1]))
    return (
        f"- **Pool size is the whole story of the cast.** One layer's whole-pool cast plus attention takes "
        f"{small['us']:,.0f} µs with a {small['pool_tokens']:,}-token pool and {large['us']:,.0f} µs with "
        f"{large['pool_tokens']:,} (8K context either way): × 78 layers, {small['us'] * 78 / 1e3:.0f} to "
        f"{large['us'] * 78 / 1e3:.0f} ms a step. No other path reads the pool's size.\n"
        f"- **Context decides what the cast-free paths cost.** From {lo // 1024}K to {hi // 1024}K tokens (one "
        f"request, 16 heads) a layer costs {c('gather_cast', lo):.0f} → {c('gather_cast', hi):.0f} µs with "
        f"gather_cast + fa3, {c('bf16_cache', lo):.0f} → {c('bf16_cache', hi):.0f} µs on a BF16 cache, "
        f"{c('fused_fp8', lo):.0f} → {c('fused_fp8', hi):.0f} µs with our fused kernel, "
        f"{c('flashmla_fp8', lo):.0f} → {c('flashmla_fp8', hi):.0f} µs with FlashMLA FP8 and "
        f"{c('flashinfer_fp8', lo):.0f} → {c('flashinfer_fp8', hi):.0f} µs with FlashInfer's FP8 fa3. "
        f"gather_cast's price over a BF16 cache is the BF16 write and re-read: "
        f"{c('gather_cast', hi) / c('bf16_cache', hi):.1f}× at {hi // 1024}K.\n"
        f"- **Batches favour the kernels with a real scheduler.** FlashInfer, FlashMLA and our fused kernel plan a "
        f"balanced work list per batch (ours since its second generation, chapter 5); ours still pays a fixed cost "
        f"per chunk of the list (its queries' load, a float32 partial output, its share of the combine) that the "
        f"batch panel shows at short requests.\n"
        f"- **Heads per GPU** ({heads[0]}–{heads[-1]}) barely move the memory-bound paths at one request; our "
        f"fused kernel goes from {us[('heads', 'fused_fp8', 1, 32768, heads[0])]:.0f} to "
        f"{us[('heads', 'fused_fp8', 1, 32768, heads[-1])]:.0f} µs (32K tokens)"
        + (": its many-head tiles are compute-bound on Triton's tensor-core code" if many == "triton" else
           f", on its {KERNEL_NAMES[many]} at {heads[-1]} heads") + " (chapter 5, \"Where it loses, and why\").")


def fused_kernel_text(result: Result, what: str) -> str:
    """Which of our kernels ``what`` (a step or sweep ``result``) ran on its fused path, and why."""
    rows = [r for r in result.rows if r.get("path") == "fused_fp8" and not r.get("error")]
    said = ", ".join(f"the {KERNEL_NAMES[k]}" + (f" at {n} of {len(rows)} points" if len(rows) > 1 else "")
                     for k, n in kernels_that_ran(rows).most_common())
    why = f" (the dispatcher: “{rows[0]['why']}”)" if len(rows) == 1 else ""
    return f"In {what}, our fused path ran {said}, the kernel the dispatcher picked{why}."


def patch_check_table(result: Result, caption: str) -> Table:
    """``sglang_patch_check``: per case and variant, the backend's own decode code run unpatched and patched."""
    rows = _rows(result, "checks")
    return Table(rows, {"case": "case", "batch": "batch", "tokens": ("tokens", number(0)), "variant": "variant",
                        "KV path": "kv_path", "whole-pool casts": "whole_pool_casts",
                        "largest difference vs unpatched": ("max_abs_diff_vs_unpatched", scientific),
                        "bit-identical": "bit_identical_vs_unpatched", "error vs float64": ("rel_err_vs_f64", scientific),
                        "ok": "ok"}, caption)


def patch_meta(result: Result) -> dict[str, Any]:
    return _rows(result, "meta")[0]


def front_page_figure(step: Result) -> go.Figure:
    """The book's answer in one figure: the original's step (its own figure), and chapter 1's step on the H200 with
    each path, ms per step, each bar saying what its cache holds in the same memory."""
    rows = step_rows(step)
    x = ["the original<br>(its figure)"] + [r["name"].replace(" (", "<br>(").replace(" index-", "<br>index-")
                                            for r in rows]
    y = [ORIGINAL.step_ms] + [r["step_ms"] for r in rows]
    text = [f"{ORIGINAL.step_ms:g} ms"] + [
        f"{r['step_ms']:.1f} ms<br>" + ("FP8 cache" if r["tokens_per_fp8_pool"] >= 1 else
                                       f"{r['tokens_per_fp8_pool']:.1f}× the tokens") for r in rows]
    colors = ["#bbbbbb"] + ["#d62728" if r["path"] == "full_pool_cast" else "#1f77b4" for r in rows]
    fig = go.Figure(go.Bar(x=x, y=y, text=text, textposition="outside", marker_color=colors,
                           hovertemplate="%{x}: %{y:.1f} ms a step<extra></extra>"))
    fig.update_layout(title="One GLM-5 decode step, every way past the wall", yaxis_title="ms per decode step",
                      yaxis_range=[0, max(y) * 1.25], showlegend=False, xaxis_tickangle=0, xaxis_tickfont_size=10,
                      uniformtext=dict(minsize=10, mode="show"))
    return with_caption(fig, [f"Blue and red: {step.caption()} Chapter 1's step model (78 layers, 495,000-token "
                              "pool, 16 heads per GPU, one 8K request; the rest of each layer is a stand-in for the "
                              "original's non-cast time). '× the tokens': what a BF16 cache holds in the FP8 pool's "
                              "memory.", f"Grey: the original's reported step on its {ORIGINAL.gpu}, not measured "
                              "here."], height=520)


def front_page_text(step: Result) -> str:
    rows = step_rows(step)
    base = next(r for r in rows if r["path"] == "full_pool_cast")
    free = [r for r in rows if r["path"] != "full_pool_cast"]
    lo, hi = min(r["step_ms"] for r in free), max(r["step_ms"] for r in free)
    saved = min(r["time_saved"] for r in free)
    return (f"**Delete the whole-pool cast: any way of doing it saves at least {saved:.0%} of the step.** On the "
            f"H200, chapter 1's step takes {base['step_ms']:.1f} ms with the cast (the original reported "
            f"{ORIGINAL.step_ms:g} ms on its GPU) and {lo:.1f}–{hi:.1f} ms with every path past the wall; what "
            f"separates those paths, {hi - lo:.1f} ms, is {(hi - lo) / base['step_ms']:.0%} of the original step.")
