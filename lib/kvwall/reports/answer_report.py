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
from kvwall.reports.plots import with_caption
from kvwall.reports.tables import Table, number, percent, scientific, times
from kvwall.results import Result

__all__ = ["STEP_NAMES", "SweepFit", "fit_sweep", "step_rows", "step_table", "memory_table", "step_figure", "sweep_figure",
           "validation_figure", "validation_table", "misses_table", "sweep_samples", "sweep_rows", "headline_point",
           "lead_text", "memory_text", "sweep_findings", "front_page_figure",
           "cast_step_name", "fused_kernel_text", "OURS_PATHS", "MB"]

#: Ours in the sweep: the dispatcher's path, and the Triton path forced.
OURS_PATHS = ("ours", "triton")
#: Short names of the step's paths for axes and tables.
STEP_NAMES = {
    "full_pool_cast": "whole-pool cast (original)", "index_then_cast": "PyTorch index-then-cast",
    "gather_cast": "gather_cast (ch. 4)", "ours": "ours (ch. 5)",
    "flashinfer_fp8": "FlashInfer FP8 (fa3)", "bf16_cache": "BF16 cache (2× memory)",
    "flashmla_fp8": "FlashMLA FP8 (FP8 query)", "flashmla_bf16": "FlashMLA BF16 (2× memory)",
}
#: The sweep paths the figures draw, with a colour each (FlashInfer fa2 twins are in the tables and the model).
SWEEP_COLORS = {
    "full_pool_cast": "#d62728", "index_then_cast": "#ff7f0e", "gather_cast": "#2ca02c", "ours": "#9467bd",
    "flashinfer_fp8": "#8c564b", "bf16_cache": "#1f77b4", "flashmla_bf16": "#17becf", "flashmla_fp8": "#7f7f7f",
    "triton": "#e377c2",
}
MISS = 0.20  # a held-out prediction off by more than this is listed, with why
MB = 1e6  # the book's megabyte: 10^6 bytes (chapter 6's memory section says so)


def _rows(result: Result, section: str) -> list[dict[str, Any]]:
    return [r for r in result.rows if r.get("section") == section]


def sweep_rows(result: Result) -> list[dict[str, Any]]:
    """The ``point`` rows of a ``path_sweep`` result."""
    return _rows(result, "point")


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
                    "transient_mb": r["transient_bytes"] / MB if r.get("transient_bytes") is not None else None})
    return out


def step_table(result: Result, caption: str) -> Table:
    """The step per path: time, against the original path, KV work, accuracy. On a CPU (small scale, Triton kernels
    interpreted) ratios to the original path would compare an interpreter with PyTorch's CPU kernels: left out."""
    columns = {"path": "name", "step ms": ("step_ms", number(2)), "whole-pool cast step / this step": ("speedup", times(2)),
               "time saved": ("time_saved", percent), "KV work ms/step": ("kv_work_ms", number(2)),
               "error vs float64": ("rel_err_vs_float64", scientific), "attention": "backend"}
    if _setup(result)["device"] == "cpu":
        for key in ("whole-pool cast step / this step", "time saved"):
            columns.pop(key)
    return Table(step_rows(result), columns, caption)


def memory_table(result: Result, caption: str) -> Table:
    """What each path costs in memory: KV bytes per token over the model's layers, tokens held in the FP8 pool's
    memory, and the extra peak one step allocates (measured on a GPU)."""
    return Table(step_rows(result), {
        "path": "name", "cache": ("cache_dtype", lambda d: {"float8_e4m3fn": "FP8 (e4m3)", "bfloat16": "BF16"}.get(d, d)),
        "KV bytes/token (78 layers)": ("kv_bytes_per_token", number(0)),
        "tokens in the same memory / the FP8 cache's": ("tokens_per_fp8_pool", times(2)),
        "extra peak a step, MB": ("transient_mb", number(1))}, caption)


def step_figure(result: Result, title: str, caption: Sequence[str]) -> go.Figure:
    """Stacked bars, one per path: the step's phases (ms)."""
    rows = step_rows(result)
    x = [r["name"] for r in rows]
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
    fig.update_layout(barmode="stack", title=title, yaxis_title="ms per decode step",
                      yaxis_range=[0, max(r["step_ms"] for r in rows) * 1.12])
    return with_caption(fig, caption, height=560)


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
            for r in sweep_rows(result) if r.get("us")]


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
    if row["path"] in OURS_PATHS and row["batch"] > 1:
        return "mixed batch: fixed work per chunk"
    if row["path"] in OURS_PATHS and row["heads"] >= 64:
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
    return with_caption(fig, caption, height=640)


def sweep_figure(result: Result, fit: SweepFit, title: str, caption: Sequence[str]) -> go.Figure:
    """The four axes, measured (markers) and the model (dashed lines), µs per layer, log scales."""
    axes = (("context", "tokens", "context (batch 1, 16 heads)"), ("pool", "pool_tokens", "pool tokens (8K context)"),
            ("batch", "batch", "batch (mixed lengths, 16 heads)"), ("heads", "heads", "heads per GPU (batch 1, 32K)"))
    # Each panel says what it varies in its x-axis title (no subplot titles: they would crowd the legend above).
    fig = make_subplots(rows=2, cols=2, horizontal_spacing=0.1, vertical_spacing=0.16)
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
        fig.update_xaxes(type="log", dtick="D2" if axis in ("batch", "heads") else 1, title_text=axes[i][2],
                         row=row, col=col)
        fig.update_yaxes(type="log", dtick=1, title_text="µs per layer" if col == 1 else None, row=row, col=col)
    fig.update_layout(title=title)
    return with_caption(fig, caption, height=900)


# ---------------------------------------------------------------------------------------------------------
# Sentences (every number computed from the results)
# ---------------------------------------------------------------------------------------------------------

def _sweep_us(sweep: Result) -> dict[tuple[str, str, int, int, int], float]:
    return {(r["axis"], r["path"], r["batch"], r["tokens"], r["heads"]): r["us"]
            for r in sweep_rows(sweep) if r.get("us")}


def cast_step_name(step: Result) -> str:
    """How the book names its own step with the whole-pool cast: the figure, the recording and its clock (one name,
    used wherever that step is quoted; the original's 86 ms is the original's)."""
    s = {r["path"]: r for r in step_rows(step)}
    clock = "CUDA-graph replay" if s["full_pool_cast"].get("timing") == "cuda_graph" else s["full_pool_cast"].get(
        "timing") or "eager"
    gpu = _setup(step).get("gpu") or _setup(step)["device"]
    return f"{s['full_pool_cast']['step_ms']:.1f} ms ({gpu}, {clock})"


def _short(row: dict[str, Any]) -> str:
    return row["name"].split(" (")[0]


def lead_text(step: Result, sweep: Result) -> str:
    """The answer in a paragraph: what every path saves on the step, how little separates them at one request,
    where ours wins and loses against gather_cast and FlashMLA at one request and in batches."""
    s = {r["path"]: r for r in step_rows(step)}
    free = [r for k, r in s.items() if k != "full_pool_cast"]
    best, worst = min(free, key=lambda r: r["step_ms"]), max(free, key=lambda r: r["step_ms"])
    us = _sweep_us(sweep)

    def at(axis: str, path: str) -> dict[int, float]:
        key = 2 if axis == "batch" else 3
        return {k[key]: v for k, v in us.items() if k[0] == axis and k[1] == path and k[4] == 16}

    ours_b, gather_b, fm_b = at("batch", "ours"), at("batch", "gather_cast"), at("batch", "flashmla_bf16")
    batches = sorted(b for b in ours_b if b > 1 and b in gather_b)
    slower = [b for b in batches if ours_b[b] > gather_b[b]]
    b_max = batches[-1] if batches else None
    ctx_ours, others = at("context", "ours"), ("gather_cast", "bf16_cache", "flashinfer_fp8", "flashmla_bf16",
                                               "index_then_cast")
    ctxs = sorted(ctx_ours)
    fastest_accurate = [t for t in ctxs if all(ctx_ours[t] <= at("context", p).get(t, float("inf")) for p in others)]
    fm_fp8 = at("context", "flashmla_fp8")
    fm_faster = [t for t in ctxs if t in fm_fp8 and fm_fp8[t] < ctx_ours[t]]
    spread = worst["step_ms"] - best["step_ms"]
    k = lambda t: f"{t // 1024}K"  # noqa: E731
    text = (
        f"**Every way past the wall removes the same thing: the whole-pool cast.** On this chapter's step (chapter "
        f"1's step model: GLM-5, one request of {step.params['context_lens'][0]:,} tokens), the whole-pool cast "
        f"takes {cast_step_name(step)}; every other path lands between {best['step_ms']:.1f} ms ({_short(best)}) and "
        f"{worst['step_ms']:.1f} ms ({_short(worst)}): {worst['time_saved']:.0%}–{best['time_saved']:.0%} of the "
        f"step saved. What separates them, {spread:.1f} ms, is {spread / s['full_pool_cast']['step_ms']:.0%} of "
        f"the step with the cast. **Where ours wins and loses:** ours is the fastest BF16-accurate path for one "
        f"request at " + (f"every length measured ({k(ctxs[0])}–{k(ctxs[-1])} tokens)"
                          if len(fastest_accurate) == len(ctxs) else
                          f"{len(fastest_accurate)} of the {len(ctxs)} lengths measured ("
                          + (", ".join(map(k, fastest_accurate)) or "none") + f"; {k(ctxs[0])}–{k(ctxs[-1])})"))
    if fm_fp8:
        text += (f"; FlashMLA's FP8 kernel, which quantizes the query to FP8 and errs far more (chapter 5), is "
                 f"faster at {len(fm_faster)} of them" + (f" ({', '.join(map(k, fm_faster))})" if fm_faster else ""))
    if batches:
        if not slower:
            text += (f". With mixed batches of {batches[0]}–{b_max} requests ours is faster than gather_cast + "
                     f"FlashInfer at every batch measured ({gather_b[b_max] / ours_b[b_max]:.1f}× at batch {b_max})")
        else:
            text += (f". With mixed batches ours is slower than gather_cast + FlashInfer at batch "
                     f"{', '.join(map(str, slower))} (of {batches[0]}–{b_max} measured)")
        if b_max in fm_b:
            ratio = fm_b[b_max] / ours_b[b_max]
            text += (f", and FlashMLA's BF16 kernel (on a BF16 cache, twice the memory) runs a batch of {b_max} in "
                     f"{ratio:.0%} of ours' time")
    return text + (". What to run therefore depends on your GPU, your SGLang backend and your batch: the table at the "
                   "end says which, and the cost model below predicts the step for GPUs we did not measure, the "
                   "original's included.")


def memory_text(step: Result) -> str:
    s = {r["path"]: r for r in step_rows(step)}
    fp8, bf16 = s["ours"]["kv_bytes_per_token"], s["bf16_cache"]["kv_bytes_per_token"]
    pool = step.params["pool_tokens"]
    pool_gb = pool * fp8 / 1e9
    return (
        f"Memory in this book is counted in MB of 10^6 bytes (and GB of 10^9). An FP8 token costs {fp8:,} bytes "
        f"across GLM-5's 78 layers (576 values a layer, plus its 4-byte slot index); a BF16 token {bf16:,}. The "
        f"original's {pool:,}-token pool is {pool_gb:.1f} GB per GPU in FP8; the same memory holds "
        f"{int(pool * fp8 / bf16):,} BF16 tokens. The whole-pool cast also needs one layer's pool in BF16 while it "
        f"runs ({s['full_pool_cast']['transient_mb']:,.1f} MB measured as the step's extra peak), PyTorch's "
        f"index-then-cast {s['index_then_cast']['transient_mb']:.1f} MB at this request's length, and gather_cast "
        f"writes into a buffer preallocated for the batch's tokens "
        f"({step.params['context_lens'][0] * 1152 / MB:.1f} MB here, allocated once, so no extra peak within a "
        f"step). So the BF16 cache is as fast as the best FP8 paths on one request, but it halves how many tokens, "
        f"and so how many concurrent requests, a GPU can hold.")


def sweep_findings(sweep: Result) -> str:
    """Where the cast stops mattering, and where each path wins, read off the sweep."""
    us = _sweep_us(sweep)
    pool_pts = [r for r in sweep_rows(sweep) if r["axis"] == "pool" and r["path"] == "full_pool_cast" and r.get("us")]
    small, large = min(pool_pts, key=lambda r: r["pool_tokens"]), max(pool_pts, key=lambda r: r["pool_tokens"])
    ctx = sorted({t for a, _, b, t, _ in us if a == "context"})
    lo, hi = ctx[0], ctx[-1]

    def c(path: str, t: int) -> float:
        return us[("context", path, 1, t, 16)]

    heads = sorted({h for a, _, b, _, h in us if a == "heads" and b == 1})
    head_ctx = next(t for a, _, b, t, h in us if a == "heads" and b == 1)
    many = next(kernel_that_ran(r) for r in sweep_rows(sweep)
                if (r["axis"], r["path"], r["batch"], r["heads"]) == ("heads", "ours", 1, heads[-1]))
    return (
        f"- **Pool size is the whole story of the cast.** One layer's whole-pool cast plus attention takes "
        f"{small['us']:,.0f} µs with a {small['pool_tokens']:,}-token pool and {large['us']:,.0f} µs with "
        f"{large['pool_tokens']:,} (8K context either way): × 78 layers, {small['us'] * 78 / 1e3:.0f} to "
        f"{large['us'] * 78 / 1e3:.0f} ms a step. No other path reads the pool's size.\n"
        f"- **Context decides what the cast-free paths cost.** From {lo // 1024}K to {hi // 1024}K tokens (one "
        f"request, 16 heads) a layer costs {c('gather_cast', lo):.0f} → {c('gather_cast', hi):.0f} µs with "
        f"gather_cast + fa3, {c('bf16_cache', lo):.0f} → {c('bf16_cache', hi):.0f} µs on a BF16 cache, "
        f"{c('ours', lo):.0f} → {c('ours', hi):.0f} µs with ours, "
        f"{c('flashmla_fp8', lo):.0f} → {c('flashmla_fp8', hi):.0f} µs with FlashMLA FP8 and "
        f"{c('flashinfer_fp8', lo):.0f} → {c('flashinfer_fp8', hi):.0f} µs with FlashInfer's FP8 fa3. "
        f"gather_cast's price over a BF16 cache is the BF16 write and re-read: "
        f"{c('gather_cast', hi) / c('bf16_cache', hi):.1f}× at {hi // 1024}K.\n"
        f"- **Batches favour the kernels with a real scheduler.** FlashInfer, FlashMLA and ours plan a balanced "
        f"work list per batch (chapter 5); ours still pays a fixed cost per chunk of the list (its queries' load, a "
        f"float32 partial output, its share of the combine) that the batch panel shows at short requests.\n"
        f"- **Heads per GPU** ({heads[0]}–{heads[-1]}) barely move the memory-bound paths at one request; ours "
        f"goes from {us[('heads', 'ours', 1, head_ctx, heads[0])]:.0f} to "
        f"{us[('heads', 'ours', 1, head_ctx, heads[-1])]:.0f} µs ({head_ctx // 1024}K tokens), on its "
        f"{KERNEL_NAMES[many]} at {heads[-1]} heads (chapter 5 says where its time goes).")


def fused_kernel_text(result: Result, what: str) -> str:
    """Which of ours' paths ``what`` (a step or sweep ``result``) ran, and why."""
    rows = [r for r in (sweep_rows(result) if result.experiment == "path_sweep" else result.rows)
            if r.get("path") == "ours" and not r.get("error")]
    if not rows:
        return f"In {what}, ours did not run."
    said = ", ".join(f"the {KERNEL_NAMES[k]}" + (f" at {n} of {len(rows)} points" if len(rows) > 1 else "")
                     for k, n in kernels_that_ran(rows).most_common())
    why = f" (the dispatcher: “{rows[0]['path_why']}”)" if len(rows) == 1 and rows[0].get("path_why") else ""
    return f"In {what}, ours ran {said}, the path the dispatcher picked{why}."


def _bar_color(r: dict[str, Any]) -> str:
    """The front page's colours: the cast red, FP8-cache paths at BF16 accuracy blue, BF16 caches light blue, an FP8
    query (FlashMLA FP8) amber."""
    if r["path"] == "full_pool_cast":
        return "#d62728"
    if r["cache_dtype"] == "bfloat16":
        return "#9ecae1"
    return "#f2a900" if r["path"] == "flashmla_fp8" else "#1f77b4"


def front_page_figure(step: Result) -> go.Figure:
    """The book's answer in one figure: the original's step (its own figure) and chapter 6's step on the H200 with
    each path (horizontal bars, ms per step), each bar saying what its cache holds in the same memory."""
    rows = step_rows(step)
    y = [f"the original ({ORIGINAL.gpu}, its figure)"] + [r["name"] for r in rows]
    x = [ORIGINAL.step_ms] + [r["step_ms"] for r in rows]
    text = [f"{ORIGINAL.step_ms:g} ms"] + [
        f"{r['step_ms']:.1f} ms" + ("" if r["tokens_per_fp8_pool"] >= 1 else
                                    f" · {r['tokens_per_fp8_pool']:.1f}× the tokens") for r in rows]
    colors = ["#bbbbbb"] + [_bar_color(r) for r in rows]
    fig = go.Figure(go.Bar(x=x, y=y, orientation="h", text=text, textposition="outside", marker_color=colors,
                           cliponaxis=False, hovertemplate="%{y}: %{x:.1f} ms a step<extra></extra>"))
    fig.update_layout(title="One GLM-5 decode step, every way past the wall", xaxis_title="ms per decode step",
                      xaxis_range=[0, max(x) * 1.3], yaxis=dict(autorange="reversed"), showlegend=False, bargap=0.25)
    return with_caption(fig, [f"{step.caption()} Chapter 6's step (chapter 1's step model: 78 layers, "
                              f"{step.params['pool_tokens']:,}-token pool, 16 heads per GPU, one "
                              f"{step.params['context_lens'][0] // 1024}K request; the rest of each layer a stand-in "
                              "for the original's non-cast time), CUDA-graph replay. Red: the whole-pool cast; blue: "
                              "FP8 cache, BF16 accuracy; amber: FP8 query; light blue: a BF16 cache ('× the tokens': "
                              "what it holds in the FP8 pool's memory).",
                              "Grey: the original's reported step on its GPU, not measured here."],
                        height=140 + 34 * len(y), legend="none")
