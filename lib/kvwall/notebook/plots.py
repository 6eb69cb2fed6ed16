"""Plotly figures of the book; each carries its provenance line inside the figure."""

from __future__ import annotations

import textwrap
from typing import Iterable, Mapping, Sequence

import plotly.graph_objects as go

from kvwall.model.decode_step import PHASES, STANDIN_LABEL

__all__ = ["with_caption", "step_breakdown", "layer_timeline", "bar", "lines", "PHASE_NAMES"]

#: Reader-facing names of the decode-step phases.
PHASE_NAMES = {
    "write_kv": "write new token's KV",
    "kv_strategy": "whole-pool FP8→BF16 cast",
    "attention": "MLA decode attention",
    "kv_free": "free the cast buffer",
    STANDIN_LABEL: "rest of layer (stand-in,<br>original's non-cast time)",
    "original_cast": "cast, as the original reported",
    "original_rest": "rest, as the original reported",
}
PHASE_COLORS = {
    "write_kv": "#8c8c8c", "kv_strategy": "#d62728", "attention": "#1f77b4", "kv_free": "#ff9896",
    STANDIN_LABEL: "#c7c7c7", "original_cast": "#d62728", "original_rest": "#c7c7c7",
}


def with_caption(fig: go.Figure, caption: str | Sequence[str], *, height: int = 460) -> go.Figure:
    """Put the provenance line(s) under the plot, inside the figure (so it travels with it)."""
    lines_ = [caption] if isinstance(caption, str) else list(caption)
    wrapped = "<br>".join("<br>".join(textwrap.wrap(c, 130)) for c in lines_)
    n = wrapped.count("<br>") + 1
    fig.add_annotation(text=wrapped, xref="paper", yref="paper", x=0, y=0, xanchor="left", yanchor="top",
                       yshift=-60, showarrow=False, align="left", font=dict(size=10, color="#555"))
    fig.update_layout(margin=dict(b=80 + 14 * n, t=60), height=height + 14 * n, template="plotly_white",
                      legend=dict(orientation="v", x=1.02, y=1.0, yanchor="top", xanchor="left"))
    return fig


def step_breakdown(columns: Mapping[str, Mapping[str, float]], title: str, caption: Sequence[str], *,
                   names: Mapping[str, str] | None = None) -> go.Figure:
    """Stacked bars: one column per source (ours live, ours recorded, the original), ms per phase.

    ``names`` overrides phase names (e.g. ``kv_strategy`` when it is not the whole-pool cast)."""
    names = {**PHASE_NAMES, **(names or {})}
    fig = go.Figure()
    phases = [p for p in (*PHASES, "original_cast", "original_rest")
              if any(p in col for col in columns.values())]
    for phase in phases:
        fig.add_bar(name=names.get(phase, phase), x=list(columns),
                    y=[col.get(phase, 0.0) for col in columns.values()], marker_color=PHASE_COLORS.get(phase),
                    hovertemplate="%{x}<br>" + names.get(phase, phase) + ": %{y:.2f} ms<extra></extra>")
    for name, col in columns.items():
        total = sum(col.values())
        cast = col.get("kv_strategy", col.get("original_cast", 0.0))
        fig.add_annotation(x=name, y=total, text=f"{total:,.1f} ms<br>cast {cast / total:.0%}", showarrow=False,
                           yanchor="bottom", font=dict(size=11))
    fig.update_layout(barmode="stack", title=title, yaxis_title="ms per decode step")
    return with_caption(fig, caption, height=520)


def layer_timeline(rows: Iterable[Mapping[str, float | int | str]], title: str, caption: Sequence[str]) -> go.Figure:
    """One decode step, layer by layer: each layer a row, its phases laid out from the layer's start."""
    rows = list(rows)
    layer_start = {}
    for r in rows:
        layer_start[r["layer"]] = min(layer_start.get(r["layer"], float("inf")), float(r["start_ms"]))
    fig = go.Figure()
    for phase in PHASES:
        sel = [r for r in rows if r["phase"] == phase]
        fig.add_bar(name=PHASE_NAMES[phase], orientation="h", y=[r["layer"] for r in sel], x=[r["ms"] for r in sel],
                    base=[float(r["start_ms"]) - layer_start[r["layer"]] for r in sel],
                    marker_color=PHASE_COLORS[phase], customdata=[r["start_ms"] for r in sel],
                    hovertemplate="layer %{y}<br>" + PHASE_NAMES[phase]
                    + ": %{x:.3f} ms<br>starts %{customdata:.2f} ms into the step<extra></extra>")
    fig.update_layout(barmode="overlay", title=title, xaxis_title="ms since the layer began",
                      yaxis=dict(title="layer", autorange="reversed", dtick=max(1, len(layer_start) // 13)),
                      bargap=0.15)
    return with_caption(fig, caption, height=max(420, 7 * len(layer_start) + 260))


def bar(x: Sequence[str], series: Mapping[str, Sequence[float]], title: str, yaxis: str,
        caption: Sequence[str], *, texts: Mapping[str, Sequence[str]] | None = None) -> go.Figure:
    fig = go.Figure()
    for name, ys in series.items():
        fig.add_bar(name=name, x=list(x), y=list(ys), text=(texts or {}).get(name), textposition="outside")
    fig.update_layout(barmode="group", title=title, yaxis_title=yaxis, showlegend=len(series) > 1)
    return with_caption(fig, caption, height=500)


def lines(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], title: str, xaxis: str, yaxis: str,
          caption: Sequence[str], *, log_x: bool = True, log_y: bool = True) -> go.Figure:
    fig = go.Figure()
    for name, (xs, ys) in series.items():
        fig.add_scatter(name=name, x=list(xs), y=list(ys), mode="lines+markers")
    fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title=yaxis)
    fig.update_xaxes(type="log" if log_x else "linear")
    fig.update_yaxes(type="log" if log_y else "linear")
    return with_caption(fig, caption)
