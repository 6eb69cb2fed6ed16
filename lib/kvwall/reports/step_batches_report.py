"""Chapter 6's decode step at batch 1-64 (``decode_step_batches``): the paths the answer names, the whole step
captured in a CUDA graph at each batch."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from kvwall.reports.answer_report import STEP_NAMES
from kvwall.reports.plots import arrange
from kvwall.reports.tables import Table, number
from kvwall.results import Result

__all__ = ["batch_rows", "batch_table", "batch_figure", "batch_text"]


def batch_rows(result: Result) -> list[dict[str, Any]]:
    """One row per batch: its tokens and each path's step ms (and attention ms) at that batch."""
    out: dict[int, dict[str, Any]] = {}
    for r in result.rows:
        if r.get("section") != "path" or not r.get("step_ms"):
            continue
        row = out.setdefault(r["batch"], {"batch": r["batch"], "tokens": r["tokens"]})
        row[r["path"]] = r["step_ms"]
        row[f"{r['path']}_attention"] = r["attention_ms"] + r["kv_ms"]
    return [out[b] for b in sorted(out)]


def _paths(result: Result) -> list[str]:
    return [p for p in result.params["paths"] if any(p in r for r in batch_rows(result))]


def batch_table(result: Result) -> Table:
    paths = _paths(result)
    return Table(batch_rows(result), {"batch": "batch", "tokens": ("tokens", number(0)),
                                      **{f"{STEP_NAMES.get(p, p)} ms": (p, number(1)) for p in paths}},
                 "The whole decode step (78 layers, CUDA graph replayed) per path and batch; batch 1 is one request of "
                 f"{result.params['context']:,} tokens, larger batches mixed lengths summing to batch × "
                 f"{result.params['context']:,} tokens (at most {result.params['max_tokens']:,}). The rest of each layer "
                 "is the original's batch-1 stand-in at every batch: a real batch's MoE and projections cost more, so "
                 "these steps show what the KV path adds, not a batch's full step. " + result.caption())


def batch_figure(result: Result, title: str = "The decode step at batch 1-64 (recorded, H200)") -> go.Figure:
    rows = batch_rows(result)
    fig = go.Figure()
    for p in _paths(result):
        fig.add_trace(go.Scatter(x=[str(r["batch"]) for r in rows if p in r], y=[r[p] for r in rows if p in r],
                                 name=STEP_NAMES.get(p, p), mode="lines+markers"))
    fig.update_layout(title=title, xaxis_title="requests in the batch", yaxis_title="ms a step")
    return arrange(fig, [result.caption(), "The rest of each layer is the batch-1 stand-in at every batch."])


def batch_text(result: Result) -> str:
    """What the step does with the batch: each path's KV work (preparation + attention) at the smallest and largest
    batch, and which path's step is shortest at each."""
    rows = batch_rows(result)
    first, last = rows[0], rows[-1]
    paths = _paths(result)
    best = {r["batch"]: min((p for p in paths if p in r), key=lambda p: r[p]) for r in rows}
    kv = "; ".join(f"{STEP_NAMES.get(p, p)} {first[p + '_attention']:.1f} → {last[p + '_attention']:.1f} ms"
                   for p in paths if p in first and p in last)
    return (f"KV work a step (preparation + attention, 78 layers) from batch {first['batch']} to batch "
            f"{last['batch']}: {kv}. The shortest step: " + ", ".join(
                f"{STEP_NAMES.get(best[b], best[b])} at batch {b}" for b in sorted(best)) + ".")
