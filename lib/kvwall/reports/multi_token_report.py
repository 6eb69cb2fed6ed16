"""Chapter 5's serving-kernel section, as numbers and tables: ours with speculative decoding's verify shapes
(``multi_token_decode``: q_len query tokens a request beside FlashMLA's ``s_q``), and what a call costs the host
(``host_us`` of chapter 5's benchmark, the plan's µs of ``multi_token_decode``) beside FlashInfer's and FlashMLA's
planned calls."""

from __future__ import annotations

from statistics import median
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvwall.reports.fused_bench_report import FM_BF16, FM_FP8, OURS, WORDS, Row, rows_of
from kvwall.reports.plots import arrange
from kvwall.reports.tables import Table, number
from kvwall.reports.words import columns
from kvwall.results import Result

#: The host-cost table's strategies of chapter 5's benchmark, in order, and how its headers name them.
HOST_STRATEGIES = {
    OURS: OURS,
    "flashinfer_fp8_fa2": "FlashInfer FP8 (fa2)",
    "flashinfer_bf16_precast": "FlashInfer BF16",
    FM_BF16: "FlashMLA BF16",
    FM_FP8: "FlashMLA FP8",
}


def verify_rows(result: Result) -> list[dict[str, Any]]:
    """One row per (heads, context, batch, q_len): each path's µs and error, ours' path, and ours' µs over its own
    q_len-1 µs at the same point (what a verify of q_len tokens costs in decode steps)."""
    out: dict[tuple, Row] = {}
    for r in rows_of(result, "point"):
        key = (r.heads, r.context, r.batch, r.q_len)
        row = out.setdefault(key, Row(heads=r.heads, context=r.context, batch=r.batch, q_len=r.q_len))
        row.update({r.path: r.us, f"{r.path}_err": r.rel_err_f64})
        if r.path == OURS:
            row.update(kernel_path=r.kernel_path, plan_us=r.plan_us, ours_host_us=r.host_us)
    for (h, c, b, q), row in out.items():
        one = out.get((h, c, b, 1), Row()).ours
        row.update(
            ours_vs_q1=row.ours / one if row.ours and one else None,
            ours_vs_bf16=row[FM_BF16] / row.ours if row.get(FM_BF16) and row.ours else None,
        )
    return [out[k] for k in sorted(out)]


def verify_table(result: Result, caption: str) -> Table:
    return Table(verify_rows(result), columns(WORDS.verify_table), caption)


def verify_figure(result: Result, title: str, caption: str) -> go.Figure:
    """One panel per head count: ours' µs (solid) and FlashMLA BF16's (dotted) at each q_len over their own µs at
    q_len 1, one colour per (context, batch)."""
    rows = verify_rows(result)
    heads = sorted({r.heads for r in rows})
    shapes = sorted({(r.context, r.batch) for r in rows})
    colors, labels = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"], WORDS.verify_figure
    fig = make_subplots(rows=1, cols=len(heads), shared_yaxes=True, horizontal_spacing=0.04)
    for col, h in enumerate(heads, start=1):
        for i, (c, b) in enumerate(shapes):
            for path, dash in ((OURS, "solid"), (FM_BF16, "dot")):
                mine = sorted(
                    (r for r in rows if (r.heads, r.context, r.batch) == (h, c, b) and r.get(path)),
                    key=lambda r: r.q_len,
                )
                one = next((r[path] for r in mine if r.q_len == 1), None)
                if not one:
                    continue
                fig.add_trace(
                    go.Scatter(
                        x=[r.q_len for r in mine],
                        y=[r[path] / one for r in mine],
                        line=dict(dash=dash, color=colors[i % len(colors)]),
                        legendgroup=f"{c}{b}",
                        showlegend=col == 1 and path == OURS,
                        name=labels.name.format(k=c // 1024, b=b),
                        hovertemplate=labels.hover.format(path=HOST_STRATEGIES[path], h=h, k=c // 1024, b=b),
                    ),
                    row=1,
                    col=col,
                )
        fig.update_xaxes(type="log", tickvals=[1, 2, 4, 8], title_text=labels.x.format(h=h), row=1, col=col)
    fig.update_yaxes(title_text=labels.y, row=1, col=1)
    fig.update_layout(title=title)
    return arrange(fig, caption, height=560)


def verify_numbers(result: Result, q_lens: tuple[int, ...] = (2, 4)) -> dict[str, Any]:
    """What a verify costs, per q_len of ``q_lens`` (``q{n}``): ours' µs over its q_len-1 µs (``ratio``, the median
    over the ``points`` timed), and at how many of the points where FlashMLA BF16 was timed (``timed``) ours is faster
    than it (``beat_bf16``) and than FlashMLA FP8 (``beat_fp8``); and the worst error against float64 of ours
    (``ours_err``) and of FlashMLA FP8 (``fp8_err``), None where none was measured."""
    rows = verify_rows(result)
    out: dict[str, Any] = {}
    for q in q_lens:
        at = [r for r in rows if r.q_len == q and r.ours]
        out[f"q{q}"] = dict(
            points=len(at),
            ratio=median(r.ours_vs_q1 for r in at if r.ours_vs_q1) if at else None,
            beat_bf16=sum(1 for r in at if r.get(FM_BF16) and r.ours < r[FM_BF16]),
            beat_fp8=sum(1 for r in at if r.get(FM_FP8) and r.ours < r[FM_FP8]),
            timed=sum(1 for r in at if r.get(FM_BF16)),
        )
    out.update(
        ours_err=max((r.ours_err for r in rows if r.ours_err is not None), default=None),
        fp8_err=max((r[f"{FM_FP8}_err"] for r in rows if r.get(f"{FM_FP8}_err") is not None), default=None),
    )
    return out


def host_rows(bench: Result, multi: Result | None = None) -> list[dict[str, Any]]:
    """Host µs per eager planned call of each strategy at each of chapter 5's points (its ``host_us``), FlashInfer's
    ``plan()`` µs, and ours' plan µs where ``multi_token_decode`` planned the same point (at q_len 1)."""
    out: dict[tuple, Row] = {}
    for r in (r for r in rows_of(bench, "bench") if r.strategy in HOST_STRATEGIES and r.host_us is not None):
        row = out.setdefault((r.heads, r.context, r.batch), Row(heads=r.heads, context=r.context, batch=r.batch))
        row[r.strategy] = r.host_us
        if r.strategy == OURS:
            row.update(ours_device_us=r.us)
        if r.strategy.startswith("flashinfer") and r.plan_ms is not None:
            row.update(flashinfer_plan_us=r.plan_ms * 1e3)
    for r in rows_of(multi, "point") if multi is not None else []:  # ours' plan at q_len 1, host lengths
        if r.path == OURS and r.q_len == 1 and (key := (r.heads, r.context, r.batch)) in out:
            out[key].update(ours_plan_us=r.plan_us)
    return [out[k] for k in sorted(out)]


def host_table(bench: Result, caption: str, multi: Result | None = None) -> Table:
    hosts = {WORDS.host_strategy.format(name=name): (s, number(1)) for s, name in HOST_STRATEGIES.items()}
    cols = columns(WORDS.host_table) | hosts | columns(WORDS.host_table_tail)
    return Table(host_rows(bench, multi), cols, caption)


def host_ranges(bench: Result, multi: Result | None = None) -> dict[str, tuple[float, ...] | None]:
    """(least, most) host µs over chapter 5's points: an eager call of ours (``ours``, with its median third),
    FlashInfer's planned run (``flashinfer``: FP8 fa2), FlashMLA BF16's (``flashmla``), ours' plan of a step with host
    lengths (``ours_plan``) and FlashInfer's ``plan()`` (``flashinfer_plan``); None where none was timed."""
    rows = host_rows(bench, multi)
    keys = dict(
        ours=OURS,
        flashinfer="flashinfer_fp8_fa2",
        flashmla=FM_BF16,
        ours_plan="ours_plan_us",
        flashinfer_plan="flashinfer_plan_us",
    )
    found = {name: [r[k] for r in rows if r.get(k) is not None] for name, k in keys.items()}
    return {
        name: (min(xs), max(xs), *([median(xs)] if name == OURS else [])) if xs else None for name, xs in found.items()
    }
