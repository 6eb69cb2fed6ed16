"""Where the wgmma path's cycles go inside a tile: the ``phases`` rows of the recorded ``fused_decode_profile`` result
(the ``KVWALL_TRACE`` build: per warpgroup, the cycles per tile of each phase between two ``clock64`` marks), held
against one tile's tensor-core and shared-memory floors (:func:`kvwall.reports.fused_report.tile_floors`). Every
number comes from the result or from the tile's shape; the sentences are computed from them."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from kvwall.kernels.mla_decode.wgmma import TRACE_PHASES
from kvwall.reports.fused_report import tile_floors
from kvwall.reports.plots import with_caption
from kvwall.reports.tables import Table, number, times
from kvwall.results import Result

__all__ = ["TilePhases", "tile_floors"]


class TilePhases:
    """The traced points of a ``fused_decode_profile`` result."""

    def __init__(self, result: Result):
        self.result = result

    def caption(self) -> str:
        return self.result.caption()

    def rows(self) -> list[dict]:
        return [r for r in self.result.rows if r["section"] == "phases" and r.get("per_tile")]

    def figure(self) -> go.Figure | None:
        """Cycles per tile by phase, each warpgroup a stacked bar, at every traced point."""
        rows = self.rows()
        if not rows:
            return None
        floors = tile_floors()
        labels = [f"{r['heads']} h · {r['context'] // 1024}K · b{r['batch']} · wg {wg}" for r in rows
                  for wg in ("0", "1")]
        palette = ["#c7c7c7", "#1f77b4", "#ff7f0e", "#d9d9d9", "#9467bd", "#aec7e8",
                   "#bdbdbd", "#17becf", "#e0e0e0", "#2ca02c", "#98df8a"]
        fig = go.Figure()
        color = iter(palette)
        for wg in ("0", "1"):
            for phase in TRACE_PHASES[int(wg)]:
                xs = [r["per_tile"][w].get(phase) if w == wg else None for r in rows for w in ("0", "1")]
                fig.add_bar(name=f"wg {wg}: {phase}", y=labels, x=xs, orientation="h", marker_color=next(color),
                            hovertemplate="%{y}<br>" + phase + ": %{x:.0f} cycles per tile<extra></extra>")
        fig.add_vline(x=floors["tensor"], line_dash="dash", line_color="#333",
                      annotation_text=f"tensor floor {floors['tensor']:,.0f}", annotation_position="top left", annotation=dict(yshift=14))
        fig.add_vline(x=floors["smem"], line_dash="dot", line_color="#d62728",
                      annotation_text=f"shared-memory floor {floors['smem']:,.0f}", annotation_position="top right", annotation=dict(yshift=14))
        fig.update_layout(barmode="stack", title="Where a 64-token tile's cycles go, per warpgroup",
                          xaxis_title="cycles per tile (lane 0 of each warpgroup, clock64)",
                          yaxis=dict(autorange="reversed"), legend=dict(font=dict(size=10), traceorder="normal"))
        return with_caption(fig, self.caption() + " The KVWALL_TRACE build of the wgmma kernel, page 64; each bar "
                                                  "sums one warpgroup's phases per tile over every CTA. Floors: "
                                                  "one tile's tensor time at 4,096 FLOP per cycle and its "
                                                  "shared-memory traffic at 128 B per cycle.", height=560)

    def table(self) -> tuple[Table, str, dict[str, Any]]:
        """Per traced point: cycles per tile of each warpgroup against the floors, the fixed cycles per CTA, and
        what the clock reads cost; the sentence and values the chapter quotes."""
        rows = self.rows()
        if not rows:
            return Table([], {"point": "point"}, self.caption()), "The phases were not traced in this recording.", {}
        floors = tile_floors()
        out = []
        for r in rows:
            wg0, wg1 = (sum(r["per_tile"][w].values()) for w in ("0", "1"))
            fixed = max(sum(v.values()) for v in r["per_cta"].values())
            out.append({"point": f"{r['heads']} h, {r['context'] // 1024}K, b{r['batch']}",
                        "tiles": r["tiles"] / r["ctas"], "wg0": wg0, "wg1": wg1,
                        "scores": r["per_tile"]["0"][TRACE_PHASES[0][1]],
                        "softmax": r["per_tile"]["0"][TRACE_PHASES[0][2]] + r["per_tile"]["0"][TRACE_PHASES[0][4]],
                        "convert": r["per_tile"]["1"][TRACE_PHASES[1][3]] + r["per_tile"]["1"][TRACE_PHASES[1][4]],
                        "vs_tensor": max(wg0, wg1) / floors["tensor"], "vs_smem": max(wg0, wg1) / floors["smem"],
                        "wait": max(r["per_tile"]["0"][TRACE_PHASES[0][0]] + r["per_tile"]["0"][TRACE_PHASES[0][3]],
                                    r["per_tile"]["1"][TRACE_PHASES[1][0]] + r["per_tile"]["1"][TRACE_PHASES[1][2]]),
                        "fixed": fixed,
                        "cost": r["us_traced"] / r["us"] - 1 if r.get("us") and r.get("us_traced") else None})
        table = Table(out, {"point": "point", "wg 0 cycles per tile": ("wg0", number(0)), "wg 1": ("wg1", number(0)),
                            "wg 0's scores": ("scores", number(0)), "wg 1's conversion and loads": ("convert", number(0)),
                            "slower wg / tensor floor": ("vs_tensor", times(2)),
                            "slower wg / shared-memory floor": ("vs_smem", times(2)),
                            "clock reads' cost": ("cost", lambda v: "—" if v is None else f"{v:+.0%}")},
                      self.caption() + f" Floors per tile: tensor {floors['tensor']:,.0f} cycles (scores "
                                       f"{floors['scores']:,.0f}), shared memory {floors['smem_bytes'] / 1024:.0f} KB "
                                       f"= {floors['smem']:,.0f} cycles.")
        big = [o for o, r in zip(out, rows) if r["heads"] >= 64 and r["batch"] >= 8]
        pick = big or out
        values = {"phase_points": len(out),
                  "phase_cycles_min": min(max(o["wg0"], o["wg1"]) for o in out),
                  "phase_cycles_max": max(max(o["wg0"], o["wg1"]) for o in out),
                  "phase_scores_over_floor_min": min(o["scores"] for o in pick) / floors["scores"],
                  "phase_scores_over_floor_max": max(o["scores"] for o in pick) / floors["scores"],
                  "phase_vs_tensor_min": min(o["vs_tensor"] for o in out),
                  "phase_vs_smem_min": min(o["vs_smem"] for o in out),
                  "phase_wait_share_max": max(o["wait"] / max(o["wg0"], o["wg1"]) for o in out)}
        text = (f"A tile takes {values['phase_cycles_min']:,.0f}–{values['phase_cycles_max']:,.0f} cycles on the slower "
                f"warpgroup at the {len(out)} traced points: at least {values['phase_vs_tensor_min']:.1f}× its tensor "
                f"floor ({floors['tensor']:,.0f}) and {values['phase_vs_smem_min']:.1f}× its shared-memory floor "
                f"({floors['smem']:,.0f}). At 64 and 128 heads with batch ≥ 8 the scores alone take "
                f"{values['phase_scores_over_floor_min']:.1f}–{values['phase_scores_over_floor_max']:.1f}× their tensor "
                f"time. Neither warpgroup waits long for the other (waiting is at most "
                f"{values['phase_wait_share_max']:.0%} of a tile on either side): each is busy with its own "
                "serial work, so the tile takes the longer of the two chains, not the floor of either.")
        return table, text, values
