"""Chapter 5's benchmark and profile: the fused FP8 kernel against every path, point by point.

:class:`FusedBench` indexes a recorded ``fused_decode_bench`` run by (strategy, heads, context, batch); the
functions below turn it, and the ``fused_decode_ncu`` profile, into the chapter's figures, tables and
targets. A point's roofline is the experiment's ``roofline_us`` (from :func:`kvwall.model.roofline.roofline_us`,
one byte count); "of roofline" is always that over the measured µs.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvwall.notebook import plots
from kvwall.notebook.tables import Table, number, percent, times
from kvwall.results import Result

__all__ = ["STRATEGY_NAMES", "STRATEGY_COLORS", "Point", "FusedBench", "bench_figures", "bench_table", "Targets",
           "against_flashmla", "flashmla_fp8_error",
           "targets", "balance_table", "page_table", "host_table", "per_point", "tensor_rate_table", "ncu_tables", "ncu_text",
           "loop_mix", "instruction_mix_table"]

#: Reader-facing names of the strategies the benchmark times, in the order tables list them.
STRATEGY_NAMES = {
    "fused_fp8": "fused FP8 (this chapter)", "fused_fp8_page64": "fused FP8, page 64 (FlashMLA's layout)",
    "full_cast_bf16": "whole-pool cast + FlashInfer BF16 (original)",
    "gather_cast_bf16": "gather-cast + FlashInfer BF16 (ch. 4)", "flashinfer_fp8_fa2": "FlashInfer FP8, fa2",
    "flashinfer_fp8_fa3": "FlashInfer FP8, fa3", "flashinfer_bf16_precast": "FlashInfer BF16 on a BF16 cache",
    "sglang_triton_fp8": "SGLang Triton (FP8 pool)",
    "flashmla_dense_fp8": "FlashMLA dense FP8 (FP8 query, page 64)",
    "flashmla_dense_bf16": "FlashMLA dense BF16 on a BF16 cache (page 64)"}
STRATEGY_COLORS = {
    "fused_fp8": "#d62728", "fused_fp8_page64": "#ff9896", "full_cast_bf16": "#7f7f7f", "gather_cast_bf16": "#ff7f0e",
    "flashinfer_fp8_fa2": "#1f77b4", "flashinfer_fp8_fa3": "#17becf", "flashinfer_bf16_precast": "#2ca02c",
    "sglang_triton_fp8": "#9467bd", "flashmla_dense_fp8": "#8c564b", "flashmla_dense_bf16": "#e377c2"}
FUSED = "fused_fp8"
FUSED_PAGED = "fused_fp8_page64"
#: Our kernel under either layout: never "another path" for the fused kernel's comparisons.
OURS = (FUSED, FUSED_PAGED)
FLASHINFER_FP8 = ("flashinfer_fp8_fa2", "flashinfer_fp8_fa3")
BF16_CACHE = "flashinfer_bf16_precast"
#: The paths that need a BF16 cache (twice the bytes per token of the FP8 pool).
BF16_CACHE_PATHS = (BF16_CACHE, "flashmla_dense_bf16")
FLASHMLA_FP8, FLASHMLA_BF16 = "flashmla_dense_fp8", "flashmla_dense_bf16"
ORIGINAL_PATH = "full_cast_bf16"

#: (heads, context, batch)
Point = tuple[int, int, int]


def _label(p: Point) -> str:
    return f"{p[0]} h, {p[1] // 1024}K, b{p[2]}"


def _share(row: Mapping[str, Any] | None) -> float | None:
    return row["roofline_us"] / row["us"] if row and row.get("us") else None


@dataclass
class FusedBench:
    """A recorded ``fused_decode_bench`` run, indexed by strategy and point."""

    result: Result
    by: dict[tuple[str, int, int, int], dict[str, Any]] = field(init=False)
    points: list[Point] = field(init=False)

    def __post_init__(self) -> None:
        rows = self.result.table("bench")
        self.by = {(r["strategy"], r["heads"], r["context"], r["batch"]): r for r in rows}
        self.points = sorted({(r["heads"], r["context"], r["batch"]) for r in rows})

    def row(self, strategy: str, point: Point) -> dict[str, Any] | None:
        """The benchmark row of ``strategy`` at ``point``, None where it was not timed."""
        return self.by.get((strategy, *point))

    def us(self, strategy: str, point: Point) -> float | None:
        """Device µs per call, None where the strategy did not run (or failed) there."""
        r = self.row(strategy, point)
        return r["us"] if r and r.get("us") else None

    def fastest_flashinfer_fp8(self, point: Point) -> float | None:
        """µs of the faster of FlashInfer's two FP8 kernels at ``point``."""
        return min((u for u in (self.us(s, point) for s in FLASHINFER_FP8) if u), default=None)

    @property
    def caption(self) -> str:
        """The recorded run's provenance line."""
        return self.result.caption()

    @property
    def ceilings(self) -> dict[str, Any]:
        """The run's measured ceilings (copy GB/s, BF16 TFLOP/s) and what its columns mean."""
        return self.result.table("ceilings")[0]


def bench_figures(bench: FusedBench) -> list[go.Figure]:
    """One figure per batch size: µs per layer against context, one panel per head count, the roofline dotted."""
    figures = []
    heads_set = sorted({p[0] for p in bench.points})
    for batch in sorted({p[2] for p in bench.points}):
        fig = make_subplots(rows=1, cols=len(heads_set), subplot_titles=[f"{h} heads" for h in heads_set],
                            shared_yaxes=True)
        for col, heads in enumerate(heads_set, 1):
            contexts = sorted({p[1] for p in bench.points if p[0] == heads and p[2] == batch})
            for strategy, name in STRATEGY_NAMES.items():
                ys = [bench.us(strategy, (heads, c, batch)) for c in contexts]
                if any(y is not None for y in ys):
                    fig.add_scatter(x=contexts, y=ys, mode="lines+markers", name=name, legendgroup=strategy,
                                    showlegend=col == 1, row=1, col=col,
                                    line=dict(color=STRATEGY_COLORS[strategy], width=3 if strategy == FUSED else 1.5))
            roof = [(bench.row(FUSED, (heads, c, batch)) or {}).get("roofline_us") for c in contexts]
            fig.add_scatter(x=contexts, y=roof, mode="lines", name="roofline", legendgroup="roofline",
                            showlegend=col == 1, line=dict(color="black", dash="dot"), row=1, col=col)
        fig.update_xaxes(type="log", tickvals=[4096, 32768, 131072], ticktext=["4K", "32K", "128K"])
        fig.update_xaxes(title_text="context (tokens per request)", row=1, col=(len(heads_set) + 1) // 2)
        fig.update_yaxes(type="log")
        fig.update_yaxes(title_text="µs per layer (CUDA graph)", row=1, col=1)
        fig.update_layout(title=f"Decode attention, batch {batch}: time per layer")
        plots.with_caption(fig, [bench.caption], height=520)
        fig.update_layout(legend=dict(orientation="h", x=0, y=1.1, xanchor="left", yanchor="bottom"),
                          margin=dict(t=170), title=dict(y=0.98, yanchor="top"))
        figures.append(fig)
    return figures


def bench_table(bench: FusedBench) -> Table:
    """µs per layer of every strategy at every point, its share of the roofline in brackets."""
    rows = []
    for p in bench.points:
        row: dict[str, Any] = {"point": _label(p), "roof": (bench.row(FUSED, p) or {}).get("roofline_us")}
        for s in STRATEGY_NAMES:
            r = bench.row(s, p) or {}
            row[s] = (f"{r['us']:,.1f} ({_share(r):.0%})" if r.get("us") else ("error" if r.get("error") else ""))
        rows.append(row)
    return Table(rows, {"heads, context, batch": "point", "roofline µs": ("roof", number(1)),
                        **{name: s for s, name in STRATEGY_NAMES.items()}},
                 bench.caption + " µs per layer (share of the roofline in brackets).")


@dataclass(frozen=True)
class Targets:
    """The second-generation kernel's targets (the project's issue 12), each with the measured figure and a
    verdict, and the headline against the original's path."""

    table: Table
    text: str
    values: dict[str, Any]


def _verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def _ns_per_token(bench: FusedBench, strategy: str, p: Point) -> float | None:
    r = bench.row(strategy, p)
    return r["us"] / r["tokens"] * 1e3 if r and r.get("us") else None


def targets(bench: FusedBench, validation: Result | None = None, key: Point = (16, 131072, 1)) -> Targets:
    """The six targets, point by point over the recorded run: accuracy (the validation's error ratio to the BF16
    path; FlashMLA FP8's error over ours in the benchmark), faster than FlashMLA BF16 everywhere, 16 heads at >= 70 %
    of the roofline and faster than FlashMLA FP8 from 32K tokens, >= 600 TFLOP/s at 64/128 heads and batch >= 8,
    page 1 within 10 % of page 64, and batch-32 ns per token within 15 % of batch 1's at equal total tokens."""
    pts = [p for p in bench.points if bench.us(FUSED, p)]
    rows: list[dict[str, Any]] = []
    values: dict[str, Any] = {"points": len(pts)}
    # 1. accuracy
    ratios = [r["ratio"] for r in validation.table("cases") if r.get("ratio") is not None
              and (r.get("bf16_rel_err") or 0) > 0] if validation else []
    ours_err = {p: bench.row(FUSED, p).get("rel_err_f64") for p in pts}
    fm_x = [bench.row(FLASHMLA_FP8, p)["rel_err_f64"] / ours_err[p] for p in pts
            if ours_err[p] and (bench.row(FLASHMLA_FP8, p) or {}).get("rel_err_f64")]
    acc_ok = bool(ratios) and max(ratios) <= 2 and bool(fm_x) and min(fm_x) >= 10
    rows.append({"target": "accuracy: error vs float64 ≤ 2× the BF16 path's, ≥ 10× better than FlashMLA FP8",
                 "measured": (f"ours / BF16 path {min(ratios):.2f}–{max(ratios):.2f}× over {len(ratios)} validation "
                              f"cases; FlashMLA FP8's error {min(fm_x):.0f}–{max(fm_x):.0f}× ours at {len(fm_x)} "
                              f"benchmark points" if ratios and fm_x else "not measured"),
                 "verdict": _verdict(acc_ok)})
    values.update(max_ratio_to_bf16_path=max(ratios) if ratios else None, min_flashmla_fp8_err_x=min(fm_x) if fm_x else None)
    # 2. faster than FlashMLA BF16 everywhere
    both = [p for p in pts if bench.us(FLASHMLA_BF16, p)]
    slower = [p for p in both if bench.us(FUSED, p) >= bench.us(FLASHMLA_BF16, p)]
    worst = max(both, key=lambda p: bench.us(FUSED, p) / bench.us(FLASHMLA_BF16, p)) if both else None
    rows.append({"target": "faster than FlashMLA dense BF16 (on a BF16 cache) at every point",
                 "measured": (f"faster at {len(both) - len(slower)} of {len(both)} points; slower at "
                              f"{'; '.join(_label(p) for p in slower[:6])}{'…' if len(slower) > 6 else ''} "
                              f"(worst {_label(worst)}: {bench.us(FUSED, worst) / bench.us(FLASHMLA_BF16, worst):.1f}×)"
                              if slower else f"faster at all {len(both)} points"),
                 "verdict": _verdict(bool(both) and not slower)})
    values.update(faster_than_flashmla_bf16=len(both) - len(slower), flashmla_bf16_points=len(both))
    # 3. 16 heads, >= 32K tokens: >= 70 % of the roofline and faster than FlashMLA FP8
    mem = [p for p in pts if p[0] == 16 and bench.row(FUSED, p)["tokens"] >= 32768]
    shares = {p: _share(bench.row(FUSED, p)) for p in mem}
    beat = [p for p in mem if bench.us(FLASHMLA_FP8, p) and bench.us(FUSED, p) < bench.us(FLASHMLA_FP8, p)]
    head = bench.row(FUSED, key) or {}
    rows.append({"target": "16 heads, ≥ 32K tokens in the batch: ≥ 70 % of the FP8 roofline, faster than FlashMLA FP8",
                 "measured": (f"{min(shares.values()):.0%}–{max(shares.values()):.0%} of the roofline over {len(mem)} "
                              f"points ({_label(key)}: {head.get('us', float('nan')):.1f} µs, target "
                              f"≤ {head.get('roofline_us', float('nan')) / 0.7:.0f}); faster than FlashMLA FP8 at "
                              f"{len(beat)} of {len(mem)}" if mem else "not measured"),
                 "verdict": _verdict(bool(mem) and min(shares.values()) >= 0.7 and len(beat) == len(mem))})
    values.update(min_share_16h=min(shares.values()) if shares else None, us_b1_16h_128k=head.get("us"),
                  roofline_us_b1_16h_128k=head.get("roofline_us"))
    # 4. 64/128 heads, batch >= 8: >= 600 TFLOP/s
    comp = [bench.row(FUSED, p)["tflops"] for p in pts if p[0] >= 64 and p[2] >= 8 and bench.row(FUSED, p).get("tflops")]
    fm_tf = [bench.row(FLASHMLA_BF16, p)["tflops"] for p in pts if p[0] >= 64 and p[2] >= 8
             and (bench.row(FLASHMLA_BF16, p) or {}).get("tflops")]
    rows.append({"target": "64/128 heads, batch ≥ 8: ≥ 600 TFLOP/s (16-bit-accurate math)",
                 "measured": (f"{min(comp):.0f}–{max(comp):.0f} TFLOP/s (FlashMLA BF16 at the same points "
                              f"{min(fm_tf):.0f}–{max(fm_tf):.0f})" if comp and fm_tf else "not measured"),
                 "verdict": _verdict(bool(comp) and min(comp) >= 600)})
    values.update(max_tflops_64_128h=max(comp) if comp else None)
    # 5. page 1 within 10 % of page 64
    paged = {p: bench.us(FUSED, p) / bench.us(FUSED_PAGED, p) for p in pts if bench.us(FUSED_PAGED, p)}
    off = max((abs(x - 1) for x in paged.values()), default=None)
    rows.append({"target": "page 1 (SGLang's layout) within 10 % of page 64 at the same tokens",
                 "measured": (f"page 1 / page 64 = {min(paged.values()):.2f}–{max(paged.values()):.2f} over "
                              f"{len(paged)} points" if paged else "not measured"),
                 "verdict": _verdict(off is not None and off <= 0.10 + 1e-9)})
    values.update(page1_over_page64_min=min(paged.values()) if paged else None,
                  page1_over_page64_max=max(paged.values()) if paged else None)
    # 6. balance: batch 32 (mixed) against batch 1 at equal total tokens
    pairs = []
    for p in pts:
        if p[2] != 32:
            continue
        tokens = bench.row(FUSED, p)["tokens"]
        single = next((q for q in pts if q[0] == p[0] and q[2] == 1 and bench.row(FUSED, q)["tokens"] == tokens), None)
        if single:
            pairs.append((p, single, _ns_per_token(bench, FUSED, p) / _ns_per_token(bench, FUSED, single)))
    rows.append({"target": "mixed batch 32 within 15 % of batch 1's ns per token at equal total tokens",
                 "measured": ("; ".join(f"{p[0]} heads, {bench.row(FUSED, p)['tokens'] // 1024}K tokens: "
                                        f"{x:.2f}×" for p, _, x in pairs) if pairs else "no equal-token pair"),
                 "verdict": _verdict(bool(pairs) and max(x for *_, x in pairs) <= 1.15)})
    values.update(balance_ratios={f"{p[0]}h": x for p, _, x in pairs})
    table = Table(rows, {"target (issue 12)": "target", "measured": "measured", "verdict": "verdict"},
                  bench.caption + (" Accuracy ratios: " + validation.caption()[0].lower() + validation.caption()[1:]
                                   if validation else ""))
    x_original = {p[1]: bench.us(ORIGINAL_PATH, p) / bench.us(FUSED, p) for p in pts
                  if p[0] == 16 and p[2] == 1 and bench.us(ORIGINAL_PATH, p)}
    met = sum(r["verdict"] == "met" for r in rows)
    text = (f"**{met} of {len(rows)} targets met.** Against the problem this book started from — the original's "
            "path, the whole-pool cast then FlashInfer BF16 — one layer at batch 1 with 16 heads is "
            + ", ".join(f"{c // 1024}K **{x:.0f}×**" for c, x in sorted(x_original.items())) + " faster.")
    values.update(targets_met=met, x_vs_original_path_b1_16h=x_original)
    return Targets(table, text, values)


def balance_table(bench: FusedBench) -> Table:
    """Mixed batches under the plan: work items, the plan's imbalance (largest item over the mean), ns per token,
    and batch 1's ns per token at the same head count (the same total tokens where the run has it)."""
    rows = []
    for p in bench.points:
        fused = bench.row(FUSED, p)
        if not fused or not fused.get("us") or p[2] == 1:
            continue
        same = next((q for q in bench.points if q[0] == p[0] and q[2] == 1
                     and (bench.row(FUSED, q) or {}).get("tokens") == fused["tokens"]), None)
        single = same or max((q for q in bench.points if q[0] == p[0] and q[2] == 1 and bench.us(FUSED, q)),
                             key=lambda q: q[1], default=None)
        b1 = (f"{_ns_per_token(bench, FUSED, single):.2f} ({bench.row(FUSED, single)['tokens'] // 1024}K"
              + (", same tokens)" if same else ")")) if single else "—"
        rows.append({"point": _label(p), "lens": f"{fused['len_min']:,}–{fused['len_max']:,}",
                     "tokens": fused["tokens"], "items": fused.get("work_items"), "chunk": fused.get("chunk_tokens"),
                     "imbalance": fused.get("imbalance"), "per_token": _ns_per_token(bench, FUSED, p), "b1": b1})
    return Table(rows, {"point": "point", "request lengths": "lens", "tokens": ("tokens", number(0)),
                        "work items": "items", "chunk tokens": ("chunk", number(0)),
                        "largest item / mean": ("imbalance", times(2)), "ns per token": ("per_token", number(2)),
                        "batch 1 ns per token (its tokens)": "b1"},
                 bench.caption + " Work items per head block; the chunk is the plan's largest item.")


def page_table(bench: FusedBench) -> Table:
    """The fused kernel on SGLang's page-1 layout and on FlashMLA's 64-token pages, at every point."""
    rows = [{"point": _label(p), "p1": bench.us(FUSED, p), "p64": bench.us(FUSED_PAGED, p),
             "x": bench.us(FUSED, p) / bench.us(FUSED_PAGED, p)}
            for p in bench.points if bench.us(FUSED, p) and bench.us(FUSED_PAGED, p)]
    return Table(rows, {"point": "point", "page 1 µs": ("p1", number(1)), "page 64 µs": ("p64", number(1)),
                        "page 1 / page 64": ("x", times(2))}, bench.caption)


def host_table(bench: FusedBench, heads: int = 16) -> Table:
    """Host µs per eager call of every strategy, batch 1."""
    rows = [{"point": _label(p), **{s: (bench.row(s, p) or {}).get("host_us") for s in STRATEGY_NAMES}}
            for p in bench.points if p[0] == heads and p[2] == 1]
    return Table(rows, {"point": "point", **{name: (s, number(0)) for s, name in STRATEGY_NAMES.items()}},
                 bench.caption + " Host µs per call: " + bench.ceilings.get("host_us_means", ""))


def per_point(bench: FusedBench) -> tuple[Table, str, dict[str, int]]:
    """Per point, the fused kernel against the fastest other path; a sentence on where it wins and loses."""
    rows = []
    for p in bench.points:
        fused = bench.row(FUSED, p)
        others = [bench.row(s, p) for s in STRATEGY_NAMES if s not in OURS and bench.us(s, p)]
        if not fused or not fused.get("us") or not others:
            continue
        peer = min(others, key=lambda r: r["us"])
        rows.append({"point": _label(p), "us": fused["us"], "gbps": fused.get("gbps"), "tflops": fused.get("tflops"),
                     "share": _share(fused), "peer": peer["strategy"], "best": STRATEGY_NAMES[peer["strategy"]],
                     "best_us": peer["us"], "x": fused["us"] / peer["us"]})
    table = Table(rows, {"point": "point", "fused µs": ("us", number(1)), "GB/s": ("gbps", number(0)),
                         "TFLOP/s": ("tflops", number(0)), "of roofline": ("share", percent),
                         "fastest other path": "best", "its µs": ("best_us", number(1)),
                         "fused / it": ("x", times(2))},
                  bench.caption + " GB/s counts the FP8 KV and index bytes; TFLOP/s the attention's FLOPs.")
    wins = [r for r in rows if r["x"] < 1.0]
    beaten_by = Counter(STRATEGY_NAMES[r["peer"]] for r in rows if r["x"] >= 1.0)
    fp8_cache_paths = [s for s in STRATEGY_NAMES if s not in OURS and s not in BF16_CACHE_PATHS]
    fp8_wins = [p for p in bench.points if bench.us(FUSED, p)
                and all(bench.us(FUSED, p) < bench.us(s, p) for s in fp8_cache_paths if bench.us(s, p))]
    n = len(bench.points)
    text = (f"The fused kernel is the fastest path at **{len(wins)} of {n}** points"
            + (f" ({'; '.join(r['point'] for r in wins)})" if wins else "") + ". Where it is not, the faster path is "
            + "; ".join(f"{name} at {k} point{'s' if k > 1 else ''}" for name, k in beaten_by.most_common())
            + ". The BF16 kernels (FlashInfer's, FlashMLA's) need a BF16 cache: twice the bytes per token, half the "
            f"tokens in the same memory. Among the paths that keep the FP8 cache, the fused kernel is the fastest at "
            f"**{len(fp8_wins)} of {n}** points.")
    return table, text, {"points_fused_is_fastest": len(wins), "points_fastest_among_fp8_cache_paths": len(fp8_wins)}


def tensor_rate_table(bench: FusedBench,
                      strategies: tuple[str, ...] = (FUSED, BF16_CACHE, "flashinfer_fp8_fa3")) -> Table:
    """TFLOP/s at batch 1, against the BF16 matmul ceiling of the same run."""
    rows = [{"point": _label(p), **{s: (bench.row(s, p) or {}).get("tflops") for s in strategies}}
            for p in bench.points if p[2] == 1]
    return Table(rows, {"point": "point", **{f"{STRATEGY_NAMES[s]} TFLOP/s": (s, number(0)) for s in strategies}},
                 bench.caption + f" BF16 matmul ceiling in the same run: {bench.ceilings['bf16_tflops']:,.0f} TFLOP/s.")


def _profiles(ncu: Result) -> list[dict[str, Any]]:
    return [r for r in ncu.table("profile") if "error" not in r]


def _stalls(row: Mapping[str, Any]) -> list[str]:
    """The row's stall-reason fields, largest first."""
    return sorted((k for k in row if k.startswith("stall_")), key=lambda k: -row[k])


def ncu_tables(ncu: Result) -> tuple[Table, Table]:
    """Nsight Compute's view of the split kernel (bytes, rates, occupancy), and its stall reasons."""
    prof = _profiles(ncu)
    rows = [{**r, "point": f"{r['heads']} heads, {r['tokens'] // 1024}K", "us": r["duration_ns"] / 1e3,
             "dram": r["dram_read_bytes"] / r["min_bytes"], "l2": r["l2_bytes"] / r["min_bytes"],
             "tflops": r["flops"] / r["duration_ns"] / 1e3, "gbps": r["dram_read_bytes"] / r["duration_ns"],
             "smem_kb": r["dynamic_smem_bytes"] / 1024} for r in prof]
    profile = Table(rows, {"point": "point", "µs under ncu": ("us", number(1)),
                           "HBM read / FP8 bytes": ("dram", times(2)), "GB/s": ("gbps", number(0)),
                           "L2 traffic / FP8 bytes": ("l2", times(2)), "TFLOP/s": ("tflops", number(0)),
                           "registers": ("registers_per_thread", number(0)), "smem KB": ("smem_kb", number(0)),
                           "occupancy %": ("achieved_occupancy_pct", number(0)),
                           "issue slots busy %": ("issue_active_pct", number(0))},
                    ncu.caption() + " ncu locks clocks to base, so its durations exceed the graph timings.")
    stall_rows = [{"reason": k[6:].replace("_", " "), **{f"{r['heads']}h": r[k] for r in prof}}
                  for k in (_stalls(prof[0]) if prof else [])]
    stalls = Table(stall_rows, {"stall reason (warps per issued instruction)": "reason",
                                **{f"{r['heads']} heads": (f"{r['heads']}h", number(2)) for r in prof}},
                   ncu.caption())
    return profile, stalls


def ncu_text(ncu: Result, heads: int = 16) -> str:
    """What Nsight Compute says limits the split kernel at ``heads``: bytes, occupancy, issue, stalls."""
    prof = _profiles(ncu)
    if not prof:
        return "Nsight Compute profiled no launch successfully in this run."
    p = next((r for r in prof if r["heads"] == heads), prof[0])
    top = ", ".join(f"`{k[6:].replace('_', ' ')}` ({p[k]:.2f})" for k in _stalls(p)[:3])
    return (f"At {p['heads']} heads the split kernel reads **{p['dram_read_bytes'] / p['min_bytes']:.2f}×** the FP8 "
            f"bytes from HBM (random slots repeat; each token once), at {p['dram_pct_of_peak']:.0f} % of HBM's peak. "
            f"Its limits are elsewhere: {p['registers_per_thread']:.0f} registers per thread and "
            f"{p['dynamic_smem_bytes'] / 1024:.0f} KB of shared memory per program leave room for "
            f"{p['theoretical_occupancy_pct']:.1f} % of the warps a multiprocessor can hold, and with so few warps the "
            f"schedulers issue in only {p['issue_active_pct']:.0f} % of cycles. The largest stall reasons: {top}. "
            f"The L2 sees {p['l2_bytes'] / p['min_bytes']:.1f}× the FP8 bytes. With {p['grid_size']:.0f} programs of "
            f"{p['block_size']:.0f} threads on 132 multiprocessors, each runs a long chain per tile -- load, convert, "
            "two dependent dots, the softmax between them -- and a multiprocessor holds too few of them to hide it: "
            "a latency-bound kernel, not a bandwidth-bound one.")


def loop_mix(config: Any, cap: int = 90) -> dict[str, Any]:
    """The split kernel (work-list launch) with launch shape ``config`` compiled offline for ``cap`` (no GPU needed):
    PTX instructions of its token loop (the longest backward branch) per thread, each statement of an inline-assembly
    block counted (the 16-bit pairs' conversion is one), and how many are one-byte shared-memory loads."""
    import os
    import re

    from kvwall.kernels.mla_decode.kernel import compile_offline, split_constexprs
    from kvwall.notebook.fused_report import launch_shape

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    ptx = compile_offline("split", split_constexprs(config), config.num_warps, config.num_stages,
                          cap).asm["ptx"].splitlines()
    labels = {line.split(":")[0].strip(): i for i, line in enumerate(ptx) if re.match(r"^\$L__BB\d+_\d+:", line.strip())}
    loop = (0, 0)
    for i, line in enumerate(ptx):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i and i - labels[m.group(1)] > loop[1] - loop[0]:
            loop = (labels[m.group(1)], i)
    counts: Counter = Counter()
    byte_loads = 0
    for line in ptx[loop[0]:loop[1]]:
        for stmt in line.replace("{", ";").replace("}", ";").split(";"):
            m = re.match(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*)((?:\.[a-z0-9_]+)*)", stmt)
            if not m or m.group(1) == "reg":
                continue
            mods = m.group(2).split(".")
            op = m.group(1) + (f".{mods[1]}" if m.group(1) in ("ld", "st", "cp", "mma", "wgmma", "cvt") and len(mods) > 1
                               else "")
            counts[op] += 1
            byte_loads += m.group(1) == "ld" and m.group(2).startswith(".shared") and m.group(2).endswith(".b8")
    import triton

    row = {f"cfg_{k}": v for k, v in dataclasses.asdict(config).items()}
    return {"counts": counts, "total": sum(counts.values()), "byte_loads": byte_loads, "shape": launch_shape(row),
            "triton": triton.__version__}


def instruction_mix_table(mix: Mapping[str, Any], other: Mapping[str, Any] | None = None, top: int = 12) -> Table:
    """The PTX instruction counts of the split kernel's token loop (:func:`loop_mix`) per thread per tile, and beside
    them another shape's (``other``)."""
    ops = [k for k, _ in (mix["counts"] + (other["counts"] if other else Counter())).most_common(top)]
    rows = [{"op": k, "n": mix["counts"].get(k, 0), "m": other["counts"].get(k, 0) if other else None} for k in ops]
    rows.append({"op": "all instructions", "n": mix["total"], "m": other["total"] if other else None})
    rows.append({"op": "of them one-byte shared-memory loads", "n": mix["byte_loads"],
                 "m": other["byte_loads"] if other else None})
    columns = {"PTX instruction (token loop)": "op", mix["shape"]: "n"}
    if other:
        columns[other["shape"]] = "m"
    return Table(rows, columns, f"Computed here: Triton {mix['triton']} compiling for sm_90; per thread per tile.")


def _worst_rel_err(validation: Result | None, peer: str) -> float | None:
    if validation is None:
        return None
    errs = [r["rel_err"] for r in validation.table("fp8_peers") if r.get("peer") == peer and r.get("rel_err") is not None]
    return max(errs, default=None)


def flashmla_fp8_error(validation: Result | None) -> tuple[float | None, float | None]:
    """From a recorded ``fused_decode_validation``: FlashMLA's dense FP8 kernel's worst relative error against float64
    and the fused kernel's worst (BF16-level), or Nones."""
    if validation is None:
        return None, None
    ours = max((r["rel_err"] for r in validation.table("cases") if r.get("rel_err") is not None), default=None)
    return _worst_rel_err(validation, FLASHMLA_FP8), ours


def against_flashmla(bench: FusedBench, validation: Result | None = None) -> tuple[Table, str]:
    """The fused kernel against the best MLA decode kernel that runs on this GPU (FlashMLA, dense FP8 and dense
    BF16), point by point, and a paragraph leading with where the fused kernel loses; accuracy from the recorded
    validation (worst relative error against float64 over the cases each ran)."""
    rows = []
    for p in bench.points:
        fused, fp8, bf16 = (bench.us(s, p) for s in (FUSED, FLASHMLA_FP8, FLASHMLA_BF16))
        if fused:
            rows.append({"point": _label(p), "fused": fused, "fp8": fp8, "bf16": bf16,
                         "x_fp8": fused / fp8 if fp8 else None, "x_bf16": fused / bf16 if bf16 else None})
    table = Table(rows, {"heads, context, batch": "point", "fused FP8 µs": ("fused", number(1)),
                         "FlashMLA FP8 µs": ("fp8", number(1)), "fused / FlashMLA FP8": ("x_fp8", times(2)),
                         "FlashMLA BF16 µs": ("bf16", number(1)), "fused / FlashMLA BF16": ("x_bf16", times(2))},
                  bench.caption + " FlashMLA reads random 64-token pages of the same pool size; the fused kernel "
                  "here reads SGLang's page-1 layout (its page-64 twin, on FlashMLA's pages, is in the tables below).")
    timed = [r for r in rows if r["x_fp8"] is not None]
    if not timed:
        return table, "FlashMLA was not timed in this run (see the benchmark's error rows)."
    loses = [r for r in timed if r["x_fp8"] > 1.0]
    wins = [r for r in timed if r["x_fp8"] <= 1.0]
    worst = max(timed, key=lambda r: r["x_fp8"])
    timed_bf16 = [r for r in rows if r["x_bf16"] is not None]
    slower_than_bf16 = [r for r in timed_bf16 if r["x_bf16"] > 1.0]
    faster_bf16 = [r for r in timed_bf16 if r["x_bf16"] <= 1.0]
    text = (f"**Against the best peer on this GPU, FlashMLA, the fused kernel loses at {len(loses)} of {len(timed)} "
            f"points**: FlashMLA's dense FP8 kernel is faster "
            + (f"everywhere except {'; '.join(r['point'] for r in wins)}" if wins else "at every point")
            + f", by up to {worst['x_fp8']:.1f}× ({worst['point']}). FlashMLA's dense BF16 kernel, on a BF16 cache "
            f"twice the size, is faster at {len(slower_than_bf16)} of {len(timed_bf16)} points; the fused kernel beats "
            f"it at {'; '.join(r['point'] for r in faster_bf16) or 'none'}.")
    untimed = [p for p in bench.points if bench.us(FUSED, p) and not bench.us(FLASHMLA_FP8, p)]
    if untimed:
        why = ((bench.row(FLASHMLA_FP8, untimed[0]) or {}).get("error") or "not run").rstrip(".")
        text += (f" FlashMLA was not timed at {', '.join(_label(p) for p in untimed)} ({why}: its page-64 layout "
                 "cannot hold these batches in the benchmark's pool).")
    err_fp8 = _worst_rel_err(validation, FLASHMLA_FP8)
    err_ours = max((r["rel_err"] for r in validation.table("cases") if r.get("rel_err") is not None),
                   default=None) if validation is not None else None
    if err_ours and err_fp8:
        text += (f" What FlashMLA's FP8 kernel gives up for its speed is accuracy: it quantizes the query (and the "
                 f"softmax weights) to FP8, and its worst relative error against float64 in the validation is "
                 f"{err_fp8:.1e}, {err_fp8 / err_ours:.0f}× the fused kernel's worst ({err_ours:.1e}, at the BF16 "
                 f"path's level).")
    return table, text
