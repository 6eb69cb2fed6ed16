"""Chapter 6's decode step at batch 1-64 (``decode_step_batches``): the paths the answer names, the whole step
captured in a CUDA graph at each batch. Numbers, a table and a figure; chapter 6 writes what they say."""

from __future__ import annotations


import plotly.graph_objects as go

from kvwall.reports.answer_report import STEP_NAMES
from kvwall.reports.plots import arrange
from kvwall.reports.rows import Row
from kvwall.reports.tables import Table, number
from kvwall.results import Result


def batch_rows(result: Result) -> list[Row]:
    """One row per batch: its tokens, and each path's step ms (``<path>``) and KV work ms, preparation + attention
    (``<path>_attention``), at that batch."""
    out: dict[int, Row] = {}
    for r in map(Row, result.table("path")):
        if r.step_ms:
            row = out.setdefault(r.batch, Row(batch=r.batch, tokens=r.tokens))
            row[r.path], row[r.path + "_attention"] = r.step_ms, r.attention_ms + r.kv_ms
    return [out[b] for b in sorted(out)]


def paths(result: Result) -> list[str]:
    """The paths recorded, in the experiment's order."""
    rows = batch_rows(result)
    return [p for p in result.params["paths"] if any(p in r for r in rows)]


def batch_table(result: Result, caption: str) -> Table:
    return Table(
        batch_rows(result),
        {
            "batch": "batch",
            "tokens": ("tokens", number(0)),
            **{f"{STEP_NAMES.get(p, p)} ms": (p, number(1)) for p in paths(result)},
        },
        caption,
    )


def batch_figure(result: Result, title: str, notes: list[str]) -> go.Figure:
    rows = batch_rows(result)
    fig = go.Figure()
    for p in paths(result):
        fig.add_trace(
            go.Scatter(
                x=[str(r.batch) for r in rows if p in r],
                y=[r[p] for r in rows if p in r],
                name=STEP_NAMES.get(p, p),
            )
        )
    fig.update_layout(title=title, xaxis_title="requests in the batch", yaxis_title="ms a step")
    return arrange(fig, notes)


def kv_work(result: Result) -> dict[str, tuple[float, float]]:
    """Each path's KV work a step (preparation + attention, every layer), ms, at the smallest and the largest batch
    (paths recorded at both)."""
    rows = batch_rows(result)
    return {
        p: (rows[0][p + "_attention"], rows[-1][p + "_attention"])
        for p in paths(result)
        if p in rows[0] and p in rows[-1]
    }


def shortest(result: Result) -> dict[int, str]:
    """The path with the shortest step at each batch."""
    return {r.batch: min((p for p in paths(result) if p in r), key=r.__getitem__) for r in batch_rows(result)}
