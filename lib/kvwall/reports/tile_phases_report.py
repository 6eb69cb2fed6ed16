"""Where the wgmma path's cycles go inside a tile: the ``phases`` rows of the recorded ``fused_decode_profile`` result
(the ``KVWALL_TRACE`` build: per warpgroup, the cycles per tile of each phase between two ``clock64`` marks), held
against one tile's tensor-core and shared-memory floors (:func:`kvwall.reports.fused_report.tile_floors`). Every
number comes from the result or from the tile's shape; the chapters write the sentences."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from kvwall.kernels.mla_decode.wgmma import TRACE_PHASES
from kvwall.reports.fused_bench_report import WORDS, Row, rows_of
from kvwall.reports.fused_report import tile_floors
from kvwall.reports.plots import with_caption
from kvwall.reports.tables import Table
from kvwall.reports.words import columns
from kvwall.results import Result

#: Warpgroup 0 and 1's phases, in their order of :data:`TRACE_PHASES`.
WG0, WG1 = TRACE_PHASES[0], TRACE_PHASES[1]


class TilePhases:
    """The traced points of a ``fused_decode_profile`` result."""

    def __init__(self, result: Result):
        self.result = result

    def caption(self) -> str:
        return self.result.caption()

    def rows(self) -> list[Row]:
        return [r for r in rows_of(self.result, "phases") if r.per_tile]

    def figure(self, caption: str) -> go.Figure | None:
        """Cycles per tile by phase, each warpgroup a stacked bar, at every traced point."""
        rows = self.rows()
        if not rows:
            return None
        floors, words = tile_floors(), WORDS.tile_figure
        labels = [
            words.bar.format(heads=r.heads, k=r.context // 1024, batch=r.batch, wg=wg) for r in rows for wg in (0, 1)
        ]
        color = iter(words.colors)
        fig = go.Figure()
        for wg in (0, 1):
            for phase in TRACE_PHASES[wg]:
                xs = [r.per_tile[str(w)].get(phase) if w == wg else None for r in rows for w in (0, 1)]
                fig.add_bar(
                    name=words.phase.format(wg=wg, phase=phase),
                    y=labels,
                    x=xs,
                    orientation="h",
                    marker_color=next(color),
                    hovertemplate=words.hover.format(phase=phase),
                )
        for key, name, dash, line, side in words.floors:
            fig.add_vline(
                x=floors[key],
                line_dash=dash,
                line_color=line,
                annotation=dict(yshift=14),
                annotation_text=words.floor.format(name=name, cycles=floors[key]),
                annotation_position=f"top {side}",
            )
        fig.update_layout(
            barmode="stack",
            title=words.title,
            xaxis_title=words.x,
            yaxis=dict(autorange="reversed"),
            legend=dict(font=dict(size=10), traceorder="normal"),
        )
        return with_caption(fig, caption, height=560)

    def table(self, caption: str) -> tuple[Table, dict[str, Any]]:
        """Per traced point: cycles per tile of each warpgroup against the floors, the fixed cycles per CTA, and
        what the clock reads cost; and the values the chapters quote (``phase_*``: the slower warpgroup's cycles per
        tile, its least multiple of each floor, the scores' multiple of their tensor time at 64 and 128 heads with
        batch >= 8 -- every point where there is none such -- and the most either warpgroup waits, as a share)."""
        rows, out = self.rows(), []
        for r in rows:
            wg0, wg1 = (r.per_tile[w] for w in ("0", "1"))
            slower = max(sum(wg0.values()), sum(wg1.values()))
            out.append(
                Row(
                    point=WORDS.tile_point.format(heads=r.heads, k=r.context // 1024, batch=r.batch),
                    tiles=r.tiles / r.ctas,
                    wg0=sum(wg0.values()),
                    wg1=sum(wg1.values()),
                    slower=slower,
                    scores=wg0[WG0[1]],
                    softmax=wg0[WG0[2]] + wg0[WG0[4]],
                    convert=wg1[WG1[3]] + wg1[WG1[4]],
                    vs_tensor=slower / tile_floors()["tensor"],
                    vs_smem=slower / tile_floors()["smem"],
                    wait=max(wg0[WG0[0]] + wg0[WG0[3]], wg1[WG1[0]] + wg1[WG1[2]]) / slower,
                    fixed=max(sum(v.values()) for v in r.per_cta.values()),
                    cost=r.us_traced / r.us - 1 if r.us and r.us_traced else None,
                )
            )
        table = Table(out, columns(WORDS.tile_table), caption)
        if not out:
            return table, {}
        pick = [o for o, r in zip(out, rows) if r.heads >= 64 and r.batch >= 8] or out
        scores = [o.scores / tile_floors()["scores"] for o in pick]
        slower = [o.slower for o in out]
        return table, dict(
            phase_points=len(out),
            phase_cycles_min=min(slower),
            phase_cycles_max=max(slower),
            phase_scores_over_floor_min=min(scores),
            phase_scores_over_floor_max=max(scores),
            phase_vs_tensor_min=min(o.vs_tensor for o in out),
            phase_vs_smem_min=min(o.vs_smem for o in out),
            phase_wait_share_max=max(o.wait for o in out),
        )
