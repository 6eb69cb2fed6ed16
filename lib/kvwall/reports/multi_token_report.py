"""Chapter 5's serving-kernel section: ours with speculative decoding's verify shapes (``multi_token_decode``: q_len
query tokens a request beside FlashMLA's ``s_q``), and what a call costs the host (``host_us`` of chapter 5's
benchmark, the plan's µs of ``multi_token_decode``) beside FlashInfer's and FlashMLA's planned calls."""

from __future__ import annotations

from statistics import median
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvwall.reports.plots import arrange
from kvwall.reports.tables import Table, number, scientific, times
from kvwall.results import Result

__all__ = ["verify_rows", "verify_table", "verify_figure", "verify_text", "host_rows", "host_table", "host_text",
           "PEER_NAMES"]

#: How the tables name each path of ``multi_token_decode``.
PEER_NAMES = {"ours": "ours", "flashmla_dense_bf16": "FlashMLA BF16", "flashmla_dense_fp8": "FlashMLA FP8"}
#: The host-cost table's strategies of chapter 5's benchmark, in order, and how it names them.
HOST_STRATEGIES = {"ours": "ours", "flashinfer_fp8_fa2": "FlashInfer FP8 (fa2)", "flashinfer_bf16_precast":
                   "FlashInfer BF16", "flashmla_dense_bf16": "FlashMLA BF16", "flashmla_dense_fp8": "FlashMLA FP8"}


def verify_rows(result: Result) -> list[dict[str, Any]]:
    """One row per (heads, context, batch, q_len): each path's µs and error, ours' path, and ours' µs over its own
    q_len-1 µs at the same point (what a verify of q_len tokens costs in decode steps)."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in result.rows:
        if r.get("section") != "point":
            continue
        key = (r["heads"], r["context"], r["batch"], r["q_len"])
        row = out.setdefault(key, dict(zip(("heads", "context", "batch", "q_len"), key)))
        row[r["path"]] = r.get("us")
        row[r["path"] + "_err"] = r.get("rel_err_f64")
        if r["path"] == "ours":
            row.update(kernel_path=r.get("kernel_path"), plan_us=r.get("plan_us"), ours_host_us=r.get("host_us"))
    for (h, c, b, q), row in out.items():
        one = out.get((h, c, b, 1), {}).get("ours")
        row["ours_vs_q1"] = row["ours"] / one if row.get("ours") and one else None
        bf16 = row.get("flashmla_dense_bf16")
        row["ours_vs_bf16"] = bf16 / row["ours"] if bf16 and row.get("ours") else None
    return [out[k] for k in sorted(out)]


def verify_table(result: Result) -> Table:
    return Table(verify_rows(result), {
        "heads": "heads", "context": ("context", number(0)), "batch": "batch", "q_len": "q_len",
        "ours µs": ("ours", number(1)), "ours' path": "kernel_path", "ours / ours at q_len 1": ("ours_vs_q1", times(2)),
        "FlashMLA BF16 µs": ("flashmla_dense_bf16", number(1)), "FlashMLA FP8 µs": ("flashmla_dense_fp8", number(1)),
        "FlashMLA BF16 / ours": ("ours_vs_bf16", times(2)), "ours' error": ("ours_err", scientific),
        "FlashMLA FP8's error": ("flashmla_dense_fp8_err", scientific)},
        "Ours with q_len query tokens a request (speculative decoding's verify: causal over the draft) beside "
        "FlashMLA dense with s_q = q_len, on one page table (pages of 64), one run; device µs per layer (CUDA graphs, "
        "L2 flushed); errors against float64 on the FP8 cache's exact values (FlashMLA FP8 with its FP8 query). "
        + result.caption())


def verify_figure(result: Result, title: str = "A verify of q_len tokens, in decode steps (recorded, H200)"
                  ) -> go.Figure:
    """One panel per head count: ours' µs (solid) and FlashMLA BF16's (dotted) at each q_len over their own µs at
    q_len 1, one colour per (context, batch)."""
    rows = verify_rows(result)
    heads = sorted({r["heads"] for r in rows})
    shapes = sorted({(r["context"], r["batch"]) for r in rows})
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    fig = make_subplots(rows=1, cols=len(heads), shared_yaxes=True, horizontal_spacing=0.04)
    for col, h in enumerate(heads, start=1):
        for i, (c, b) in enumerate(shapes):
            for path, dash in (("ours", "solid"), ("flashmla_dense_bf16", "dot")):
                mine = sorted((r for r in rows if (r["heads"], r["context"], r["batch"]) == (h, c, b) and r.get(path)),
                              key=lambda r: r["q_len"])
                one = next((r[path] for r in mine if r["q_len"] == 1), None)
                if not one:
                    continue
                fig.add_trace(go.Scatter(
                    x=[r["q_len"] for r in mine], y=[r[path] / one for r in mine], mode="lines+markers",
                    line=dict(dash=dash, color=colors[i % len(colors)]), legendgroup=f"{c}{b}",
                    showlegend=col == 1 and path == "ours", name=f"{c // 1024}K tokens × {b}",
                    hovertemplate=f"{PEER_NAMES[path]}, {h} heads, {c // 1024}K × {b}, q_len %{{x}}: "
                                  f"%{{y:.2f}}× its q_len-1 µs<extra></extra>"), row=1, col=col)
        fig.update_xaxes(type="log", tickvals=[1, 2, 4, 8], title_text=f"q_len, {h} heads", row=1, col=col)
    fig.update_yaxes(title_text="µs / µs at q_len 1", row=1, col=1)
    fig.update_layout(title=title)
    return arrange(fig, [result.caption(), "Solid: ours; dotted: FlashMLA BF16 (s_q = q_len) on the same requests. "
                         "1 means a verify costs one decode step."], height=560)


def verify_text(result: Result) -> str:
    """What a verify costs: ours' µs at q_len 2 and 4 over its q_len-1 µs (median over the points), and how often
    ours is faster than FlashMLA BF16 and FP8 at q_len 2 and 4; ours' worst error."""
    rows = verify_rows(result)
    parts = []
    for q in (2, 4):
        at = [r for r in rows if r["q_len"] == q and r.get("ours")]
        if not at:
            continue
        ratio = median(r["ours_vs_q1"] for r in at if r.get("ours_vs_q1"))
        beat_bf16 = sum(1 for r in at if r.get("flashmla_dense_bf16") and r["ours"] < r["flashmla_dense_bf16"])
        beat_fp8 = sum(1 for r in at if r.get("flashmla_dense_fp8") and r["ours"] < r["flashmla_dense_fp8"])
        timed = sum(1 for r in at if r.get("flashmla_dense_bf16"))
        parts.append(f"at q_len {q} ours takes {ratio:.2f}× its own decode time (median of {len(at)} points) and is "
                     f"faster than FlashMLA BF16 at {beat_bf16} of {timed} points, than FlashMLA FP8 at {beat_fp8}")
    errs = [r["ours_err"] for r in rows if r.get("ours_err") is not None]
    fp8 = [r["flashmla_dense_fp8_err"] for r in rows if r.get("flashmla_dense_fp8_err") is not None]
    tail = f" Ours' error against float64 is at most {max(errs):.1e}" if errs else ""
    if fp8:
        tail += f"; FlashMLA FP8's (its FP8 query) up to {max(fp8):.1e}"
    return ("; ".join(parts) + "." if parts else "No multi-token point was timed.") + (tail + "." if tail else "")


def host_rows(bench: Result, multi: Result | None = None) -> list[dict[str, Any]]:
    """Host µs per eager planned call of each strategy at each of chapter 5's points (its ``host_us``), FlashInfer's
    ``plan()`` µs, and ours' plan µs where ``multi_token_decode`` planned the same point (at q_len 1)."""
    out: dict[tuple, dict[str, Any]] = {}
    for r in bench.rows:
        if r.get("section") != "bench" or r.get("strategy") not in HOST_STRATEGIES or r.get("host_us") is None:
            continue
        key = (r["heads"], r["context"], r["batch"])
        row = out.setdefault(key, dict(zip(("heads", "context", "batch"), key)))
        row[r["strategy"]] = r["host_us"]
        if r["strategy"] == "ours":
            row["ours_device_us"] = r.get("us")
        if r["strategy"].startswith("flashinfer") and r.get("plan_ms") is not None:
            row["flashinfer_plan_us"] = r["plan_ms"] * 1e3
    if multi is not None:  # ours' plan where multi_token_decode planned the same point (q_len 1, host lengths)
        for r in multi.rows:
            key = (r.get("heads"), r.get("context"), r.get("batch"))
            if r.get("section") == "point" and r.get("path") == "ours" and r.get("q_len") == 1 and key in out:
                out[key]["ours_plan_us"] = r.get("plan_us")
    return [out[k] for k in sorted(out)]


def host_table(bench: Result, multi: Result | None = None) -> Table:
    cols: dict[str, Any] = {"heads": "heads", "context": ("context", number(0)), "batch": "batch"}
    cols |= {f"{name} host µs": (key, number(1)) for key, name in HOST_STRATEGIES.items()}
    cols |= {"ours device µs": ("ours_device_us", number(1)), "ours' plan µs": ("ours_plan_us", number(0)),
             "FlashInfer's plan µs": ("flashinfer_plan_us", number(0))}
    return Table(host_rows(bench, multi), cols,
                 "Host µs per eager call, plan made beforehand (calls only enqueued, after a warm-up): what the CPU "
                 "pays per layer where a step is not captured in a CUDA graph. Ours' plan: plan_mla_decode with host "
                 "lengths (no device read), best of 5, timed by multi_token_decode at its points (q_len 1; blank "
                 "elsewhere); FlashInfer's: its plan(), once per point. " + bench.caption() + (" " + multi.caption() if multi is not None else ""))


def host_text(bench: Result, multi: Result | None = None) -> str:
    rows = host_rows(bench, multi)
    ours = [r["ours"] for r in rows if r.get("ours") is not None]
    fi = [r["flashinfer_fp8_fa2"] for r in rows if r.get("flashinfer_fp8_fa2") is not None]
    mla = [r["flashmla_dense_bf16"] for r in rows if r.get("flashmla_dense_bf16") is not None]
    if not ours:
        return "Chapter 5's benchmark recorded no host time for ours."
    text = (f"An eager call of ours costs {min(ours):.0f}–{max(ours):.0f} µs of host time (median {median(ours):.0f})"
            + (f"; FlashInfer's planned run {min(fi):.0f}–{max(fi):.0f}" if fi else "")
            + (f"; FlashMLA BF16's {min(mla):.0f}–{max(mla):.0f}" if mla else "") + ".")
    plans = [r["ours_plan_us"] for r in rows if r.get("ours_plan_us")]
    fi_plans = [r["flashinfer_plan_us"] for r in rows if r.get("flashinfer_plan_us")]
    if plans:
        text += (f" Ours' plan of a step takes {min(plans):.0f}–{max(plans):.0f} µs with host lengths (no device read)"
                 + (f"; FlashInfer's plan() {min(fi_plans):.0f}–{max(fi_plans):.0f} µs" if fi_plans else "") + ".")
    return text
