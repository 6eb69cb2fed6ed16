"""Plotly figures of the book; each carries its provenance line inside the figure."""

from __future__ import annotations

import re
import textwrap
from typing import Iterable, Mapping, Sequence

import plotly.graph_objects as go
import plotly.io as pio

from kvwall.model.decode_step import PHASES, STANDIN_LABEL
from kvwall.reports.rows import Row

#: plotly's line break in text.
BR = "<br>"
#: The book's plotly template (:func:`arrange` gives it to every figure): plotly's ``plotly_white`` and what the
#: book's figures share, so that a figure states only what differs: a scatter series is drawn as lines and markers.
TEMPLATE = "kvwall"
_WHITE = pio.templates["plotly_white"]
pio.templates[TEMPLATE] = go.layout.Template(
    _WHITE, data_scatter=[go.Scatter(_WHITE.data.scatter[0], mode="lines+markers")]
)
#: The decode-step phases: reader-facing name and colour.
_PHASES = {
    "write_kv": ("write new token's KV", "#8c8c8c"),
    "kv_strategy": ("whole-pool FP8→BF16 cast", "#d62728"),
    "attention": ("MLA decode attention", "#1f77b4"),
    "kv_free": ("free the cast buffer", "#ff9896"),
    STANDIN_LABEL: (f"rest of layer (stand-in,{BR}original's non-cast time)", "#c7c7c7"),
    "original_cast": ("cast, as the original reported", "#d62728"),
    "original_rest": ("rest, as the original reported", "#c7c7c7"),
}
PHASE_NAMES = {phase: name for phase, (name, _) in _PHASES.items()}
PHASE_COLORS = {phase: color for phase, (_, color) in _PHASES.items()}


#: The book's content column at a 1300 px window is about 690 px wide; text is wrapped to fit it.
FIGURE_WIDTH_PX = 690
TITLE_FONT, CAPTION_FONT, LEGEND_FONT, TICK_FONT, AXIS_TITLE_FONT = 16, 10, 11, 12, 13
#: Characters per line that fit the figure's width (about 0.55 em a character, Open Sans / Arial).
TITLE_CHARS = int(FIGURE_WIDTH_PX / (0.55 * TITLE_FONT)) - 4
CAPTION_CHARS = int(FIGURE_WIDTH_PX / (0.55 * CAPTION_FONT)) - 8
_LINE = 1.3  # line height, in font sizes
_PAD = 8  # px between two text blocks
#: The title starts under plotly's mode bar (zoom, pan, download: about 25 px high at the figure's top right).
_TITLE_TOP = 32
#: How the provenance line of a number measured live starts (``ChapterRun.live_caption``), and on a CPU ...
LIVE_CAPTION = "Measured live on this machine"
CPU_LIVE_CAPTION = f"{LIVE_CAPTION}: CPU"
#: ... and what the title of a figure carrying such a line says first, so that nobody reads its bars (small scale,
#: Triton kernels interpreted) as GPU results.
CPU_LIVE_TITLE = "Live on this CPU, small scale: not GPU numbers"


def _lines(text: str) -> int:
    return text.count(BR) + 1 if text else 0


def _wrap(text: str, width: int) -> str:
    """Wrap a plotly string at ``width`` characters, keeping its own ``<br>`` breaks."""
    return BR.join(
        BR.join(textwrap.wrap(part, width, break_long_words=False, break_on_hyphens=False)) for part in text.split(BR)
    )


def _wrap_label(text: str, width: int) -> str:
    """A tick label in lines of at most ``width`` characters where it can: at spaces, and inside a word longer than
    ``width`` after its separators (``0.6.18.post1`` -> ``0.6.18.`` / ``post1``)."""
    pieces: list[tuple[str, str]] = []  # (piece, what joins it to the previous piece)
    for word in text.replace(BR, " ").split():
        parts = re.findall(r"[^._/\-]+[._/\-]*|[._/\-]+", word) if len(word) > width else [word]
        pieces += [(p, " " if i == 0 else "") for i, p in enumerate(parts)]
    lines: list[str] = []
    for piece, joiner in pieces:
        if lines and len(lines[-1]) + len(joiner) + len(piece) <= width:
            lines[-1] += joiner + piece
        else:
            lines.append(piece)
    return BR.join(lines)


def _category_axes(fig: go.Figure) -> dict[str, list[str]]:
    """The x axes whose ticks are the traces' string values (category axes), with those values in order."""
    out: dict[str, list[str]] = {}
    for trace in fig.data:
        xs = getattr(trace, "x", None)
        if (
            trace.type in ("bar", "scatter", "box")
            and xs is not None
            and len(xs)
            and isinstance(xs[0], str)
            and getattr(trace, "orientation", None) != "h"
        ):
            name = "xaxis" + (trace.xaxis[1:] if getattr(trace, "xaxis", None) not in (None, "x") else "")
            out.setdefault(name, [])
            out[name] += [x for x in xs if x not in out[name]]
    return out


#: Characters per line of a category label on a y axis (horizontal bars, heatmap rows).
Y_LABEL_CHARS = 28


def _category_y_width(fig: go.Figure) -> float:
    """Wrap the category labels of the y axis (horizontal bars, heatmap rows) to :data:`Y_LABEL_CHARS` and return
    the width in px of the longest line; 0 when the axis is not a category axis."""
    cats: list[str] = []
    for trace in fig.data:
        ys = getattr(trace, "y", None)
        if ys is not None and len(ys) and isinstance(ys[0], str):
            cats += [y for y in ys if y not in cats]
    if not cats:
        return 0.0
    text = [_wrap_label(c, Y_LABEL_CHARS) for c in cats]
    fig.layout.yaxis.update(tickmode="array", tickvals=cats, ticktext=text)
    font = fig.layout.yaxis.tickfont.size or TICK_FONT
    return max(0.58 * font * len(line) for t in text for line in t.split(BR))


def _legend_rows(names: Sequence[str], width_px: int) -> int:
    """Rows a horizontal legend of ``names`` takes in ``width_px`` (items of a swatch plus text, packed)."""
    rows, used = 1, 0.0
    for name in names:
        item = 40 + 0.6 * LEGEND_FONT * max(len(line) for line in name.split(BR))
        if used and used + item > width_px:
            rows, used = rows + 1, 0.0
        used += item
    return rows


def arrange(
    fig: go.Figure, caption: str | Sequence[str], *, height: int = 460, legend: str = "top", measured: bool = True
) -> go.Figure:
    """Lay out a figure's text so that nothing overlaps and nothing is clipped at the book's column width.

    Top to bottom, in pixels of the figure: the title (wrapped, under plotly's mode bar), the legend when
    ``legend="top"`` (the default: a horizontal legend in rows under the title, so the plot keeps the column's
    width), top tick labels, the plot, the bottom tick labels and x axis title, then the provenance caption
    (wrapped, a fixed distance under the axis title). ``legend="right"`` puts a vertical legend beside the plot,
    from its top; ``"none"`` hides it. Category tick labels are wrapped and kept horizontal, so their height is known:
    the bottom margin is computed from it, not guessed. ``height`` is the plot's own height before the text is added.

    A figure of measurements (``measured``, the default) whose caption says it was measured live on a CPU
    (:data:`CPU_LIVE_CAPTION`) gets :data:`CPU_LIVE_TITLE` at the head of its title; ``measured=False`` (a figure of
    checks, not of times or rates) is left as it is, and says so in ``layout.meta``.
    """
    caption_lines = [caption] if isinstance(caption, str) else list(caption)
    caption_text = _wrap(BR.join(caption_lines), CAPTION_CHARS)
    title = fig.layout.title.text or ""
    if not measured:
        fig.update_layout(meta={**(fig.layout.meta or {}), "measured": False})
    elif any(CPU_LIVE_CAPTION in line for line in caption_lines) and CPU_LIVE_TITLE not in title:
        title = f"<b>{CPU_LIVE_TITLE}</b>" + (f" — {title}" if title else "")
    title = _wrap(title, TITLE_CHARS) if title else ""
    title_h = round(_lines(title) * TITLE_FONT * _LINE) if title else 0
    caption_h = round(_lines(caption_text) * CAPTION_FONT * _LINE) + 4

    # Category ticks: wrapped to the width each category gets, never rotated.
    ticks_bottom, ticks_top = TICK_FONT * _LINE, 0.0
    plot_width = FIGURE_WIDTH_PX - 80 - (160 if legend == "right" else 0)
    for axis, cats in _category_axes(fig).items():
        chars = max(6, int(plot_width / max(1, len(cats)) / (0.6 * TICK_FONT)))
        text = [_wrap_label(c, chars) for c in cats]
        fig.layout[axis].update(tickmode="array", tickvals=cats, ticktext=text, tickangle=0)
        h = max(_lines(t) for t in text) * TICK_FONT * _LINE
        if fig.layout[axis].side == "top":
            ticks_top = max(ticks_top, h)
        else:
            ticks_bottom = max(ticks_bottom, h)
    top_axes = [axis.side == "top" for axis in fig.select_xaxes()]
    if any(top_axes) and not ticks_top:
        ticks_top, ticks_bottom = TICK_FONT * _LINE, 0.0
    x_titles = [axis.title.text for axis, on_top in zip(fig.select_xaxes(), top_axes) if not on_top]
    x_title_h = AXIS_TITLE_FONT * _LINE * max([_lines(t) for t in x_titles if t] or [0])

    names = [t.name for t in fig.data if t.name and t.showlegend is not False]
    show_legend = legend != "none" and fig.layout.showlegend is not False and len(names) > 0
    legend_h = 0
    if show_legend and legend == "top":
        legend_h = round(_legend_rows(names, FIGURE_WIDTH_PX - 20) * (LEGEND_FONT * _LINE + 6)) + 6
    top = _TITLE_TOP + title_h + (_PAD if title else 0) + legend_h + (_PAD if legend_h else 0) + ticks_top + _PAD + 6
    # Under the plot: tick labels, the axis title with plotly's standoff, then the caption.
    axis_h = 6 + ticks_bottom + (10 + x_title_h if x_title_h else 0)
    bottom = round(axis_h + 2 * _PAD + caption_h)
    n_items = len(names) if show_legend and legend == "right" else 0
    plot_h = max(height - 140, round(n_items * (LEGEND_FONT * _LINE + 6)) + 10)

    y_title = 22 if fig.layout.yaxis.title.text else 0
    left = round(max(fig.layout.margin.l or 0, 24 + y_title + max(36.0, _category_y_width(fig))))
    # x: from the figure's left edge (the plot starts ``left`` px in), so a full caption line fits the width.
    fig.add_annotation(
        text=caption_text,
        xref="paper",
        yref="paper",
        x=0,
        y=0,
        xanchor="left",
        yanchor="top",
        xshift=-(left - _PAD),
        yshift=-round(axis_h + _PAD),
        showarrow=False,
        align="left",
        font=dict(size=CAPTION_FONT, color="#555"),
    )
    total = top + plot_h + bottom
    # Title and a top legend are placed in the figure's own coordinates (plotly's "container"), from its left edge.
    at_left = dict(x=_PAD / FIGURE_WIDTH_PX, xref="container", xanchor="left", yref="container", yanchor="top")
    legends = {
        "top": dict(at_left, orientation="h", y=1 - (_TITLE_TOP + title_h + _PAD) / total),
        "right": dict(orientation="v", x=1.02, y=1.0, xanchor="left", yanchor="top"),
    }
    fig.update_layout(
        template=TEMPLATE,
        height=total,
        showlegend=show_legend,
        margin=dict(t=top, b=bottom, l=left, r=fig.layout.margin.r if fig.layout.margin.r is not None else 20),
        title=dict(at_left, text=title, y=1 - _TITLE_TOP / total, font_size=TITLE_FONT, automargin=False),
        legend=dict(legends.get(legend, legends["right"]), font_size=LEGEND_FONT),
    )
    fig.update_xaxes(automargin=False, title_standoff=10)
    fig.update_yaxes(automargin=True)
    return fig


#: The same as :func:`arrange`: the provenance line(s) under the plot, inside the figure (so it travels with it).
with_caption = arrange


def step_breakdown(
    columns: Mapping[str, Mapping[str, float]],
    title: str,
    caption: Sequence[str],
    *,
    names: Mapping[str, str] | None = None,
) -> go.Figure:
    """Stacked horizontal bars: one bar per source (ours live, ours recorded, the original), ms per phase, read
    top to bottom in the order of ``columns``; the legend on top, in the phases' stacking order.

    ``names`` overrides phase names (e.g. ``kv_strategy`` when it is not the whole-pool cast)."""
    names = {**PHASE_NAMES, **(names or {})}
    fig = go.Figure()
    phases = [p for p in _PHASES if any(p in col for col in columns.values())]  # PHASES, then the original's
    # Bar labels on the left, wrapped at words (a source's name may be long: "gather_cast (Triton), capacity ...").
    labels = {name: _wrap(name.replace(BR, " "), 30) for name in columns}
    for phase in phases:
        fig.add_bar(
            name=names.get(phase, phase).replace(BR, " "),
            orientation="h",
            y=list(labels.values()),
            x=[col.get(phase, 0.0) for col in columns.values()],
            marker_color=PHASE_COLORS.get(phase),
            hovertemplate=f"%{{y}}{BR}{names.get(phase, phase)}: %{{x:.2f}} ms<extra></extra>",
        )
    for name, col in columns.items():
        total = sum(col.values())
        cast = col.get("kv_strategy", col.get("original_cast", 0.0))
        fig.add_annotation(
            x=total,
            y=labels[name],
            text=f"{total:,.1f} ms · cast {cast / total:.0%}",
            showarrow=False,
            xanchor="left",
            xshift=4,
            font=dict(size=11),
        )
    longest = max((sum(col.values()) for col in columns.values()), default=1.0)
    # Room right of the longest bar for its total, inside the plot.
    fig.update_layout(
        barmode="stack",
        title=title,
        xaxis_title="ms per decode step",
        xaxis_range=[0, longest * 1.32],
        yaxis=dict(autorange="reversed"),
        bargap=0.3,
        legend_traceorder="normal",
    )
    rows = sum(_lines(label) for label in labels.values())
    return with_caption(fig, caption, height=max(300, 150 + 22 * rows + 14 * len(columns)), legend="top")


def layer_timeline(rows: Iterable[Mapping[str, float | int | str]], title: str, caption: Sequence[str]) -> go.Figure:
    """One decode step, layer by layer: each layer a row, its phases laid out from the layer's start."""
    rows = [Row(r) for r in rows]
    layer_start = {}
    for r in rows:
        layer_start[r.layer] = min(layer_start.get(r.layer, float("inf")), float(r.start_ms))
    fig = go.Figure()
    for phase in PHASES:
        sel = [r for r in rows if r.phase == phase]
        fig.add_bar(
            name=PHASE_NAMES[phase],
            orientation="h",
            y=[r.layer for r in sel],
            x=[r.ms for r in sel],
            base=[float(r.start_ms) - layer_start[r.layer] for r in sel],
            marker_color=PHASE_COLORS[phase],
            customdata=[r.start_ms for r in sel],
            hovertemplate=f"layer %{{y}}{BR}{PHASE_NAMES[phase]}: %{{x:.3f}} ms{BR}"
            "starts %{customdata:.2f} ms into the step<extra></extra>",
        )
    fig.update_layout(
        barmode="overlay",
        title=title,
        xaxis_title="ms since the layer began",
        yaxis=dict(title="layer", autorange="reversed", dtick=max(1, len(layer_start) // 13)),
        bargap=0.15,
    )
    return with_caption(fig, caption, height=max(420, 7 * len(layer_start) + 260))


def bar(
    x: Sequence[str],
    series: Mapping[str, Sequence[float]],
    title: str,
    yaxis: str,
    caption: Sequence[str],
    *,
    texts: Mapping[str, Sequence[str]] | None = None,
    legend: str = "top",
) -> go.Figure:
    fig = go.Figure()
    for name, ys in series.items():
        fig.add_bar(name=name, x=list(x), y=list(ys), text=(texts or {}).get(name), textposition="outside")
    tallest = max((max(ys, default=0.0) for ys in series.values()), default=1.0)
    fig.update_layout(
        barmode="group",
        title=title,
        yaxis_title=yaxis,
        showlegend=len(series) > 1,
        yaxis_range=[0, tallest * (1.15 if texts else 1.05)],
    )
    return with_caption(fig, caption, height=500, legend=legend)


def lines(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    title: str,
    xaxis: str,
    yaxis: str,
    caption: Sequence[str],
    *,
    log_x: bool = True,
    log_y: bool = True,
    legend: str = "top",
) -> go.Figure:
    fig = go.Figure()
    for name, (xs, ys) in series.items():
        fig.add_scatter(name=name, x=list(xs), y=list(ys))
    fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title=yaxis)
    fig.update_xaxes(type="log" if log_x else "linear")
    fig.update_yaxes(type="log" if log_y else "linear")
    return with_caption(fig, caption, legend=legend)
