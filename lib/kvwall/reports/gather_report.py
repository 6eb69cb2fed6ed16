"""Chapter 4's analysis of the gather-cast kernel: the byte prediction, the validation suite's summary,
and the bandwidth benchmark against the copy ceiling.

Bytes come from :mod:`kvwall.model.roofline`. The decode-step analysis (chapter 1's step with each KV
strategy) is in :mod:`kvwall.reports.gather_step_report`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import plotly.graph_objects as go

from kvwall.model.geometry import GLM5, MLAGeometry
from kvwall.model.original import ORIGINAL
from kvwall.model.roofline import attention_read_bytes, full_pool_cast_bytes, gather_cast_bytes
from kvwall.reports import plots
from kvwall.reports.gather_step_report import reported_gain_readings
from kvwall.reports.tables import CHECK_COLUMNS, Table, ms_as_us, number, percent, times
from kvwall.results import Result

__all__ = ["Prediction", "predict", "suite_table", "sanitizer_text", "bench_figure", "Targets", "targets",
           "launch_text", "launch_tables", "of_copy", "live_bench_table", "TORCH_OP", "KERNELS", "RANDOM_SLOTS"]

#: Implementation names the benchmark records.
TORCH_OP = "PyTorch index_select().to(bf16)"
KERNELS = ("gather_cast (Triton)", "gather_cast (CUDA C++)")
#: The benchmark's single-request layout.
RANDOM_SLOTS = "batch 1, random slots"


@dataclass(frozen=True)
class Prediction:
    """What the arithmetic says, as Markdown, and the byte counts it rests on."""

    text: str
    gather_bytes: int
    full_pool_bytes: int


def predict(context: int, capacity: int, *, copy_gbps: float | None = None,
            before: Mapping[str, float] | None = None, pool_tokens: int = ORIGINAL.pool_tokens,
            geometry: MLAGeometry = GLM5) -> Prediction:
    """Bytes per layer of the whole-pool cast, a gather-cast of one ``context``-token request and PyTorch's
    two-kernel gather over a graph's ``capacity``; with the copy bandwidth and chapter 1's recorded step summary
    (``before``: ``step_ms``, ``cast_op_ms_per_step``), the step the gather-cast should give."""
    full = full_pool_cast_bytes(geometry, pool_tokens)["total"]
    gather = gather_cast_bytes(context, geometry)
    # index_select().to(): the FP8 rows gathered into an FP8 temporary (written, then read again) with int64 indices.
    torch_capacity = gather_cast_bytes(capacity, geometry, index_bytes=8) + 2 * capacity * geometry.kv_dim
    attention = attention_read_bytes(geometry, context)
    row_read, row_written = geometry.kv_dim, 2 * geometry.kv_dim
    per_row = gather_cast_bytes(1, geometry)
    lines = [
        f"- one gathered row: {row_read} B read in FP8 ({row_read / 128:g} lines of 128 B; {row_read // 32} whole "
        f"32-byte sectors, since every row starts on a 32-byte boundary), {row_written} B written in BF16 "
        f"({row_written / 128:g} whole lines) and {per_row - row_read - row_written} B of index: "
        f"**{per_row:,} B per row**",
        f"- whole-pool cast, {pool_tokens:,} slots: **{full / 1e6:,.1f} MB** per layer",
        f"- gather-then-cast of one {context:,}-token request: {context:,} × {per_row:,} B = "
        f"**{gather / 1e6:,.2f} MB**, {full / gather:,.0f}× less",
        f"- PyTorch `index_select().to()` over a graph-sized capacity of {capacity:,} rows (an FP8 temporary "
        f"written and read again, int64 indices): **{torch_capacity / 1e6:,.1f} MB**",
        f"- what the BF16 attention itself reads afterwards: {attention / 1e6:,.2f} MB",
    ]
    if copy_gbps and before:
        per_layer_us = gather / (copy_gbps * 1e3)
        cast_ms_at_copy = full / (copy_gbps * 1e6)
        step_ms = before["step_ms"] - before["cast_op_ms_per_step"] + geometry.num_layers * per_layer_us / 1e3
        lines += [
            "",
            f"At the H200's measured copy bandwidth ({copy_gbps:,.0f} GB/s, chapter 1's recorded run) the gather-cast "
            f"should take **{per_layer_us:.1f} µs per layer** plus its launch, "
            f"{geometry.num_layers * per_layer_us / 1e3:.2f} ms per {geometry.num_layers}-layer step, against the "
            f"whole-pool cast's {before['cast_op_ms_per_step']:.1f} ms (which, even at copy speed, would still cost "
            f"{cast_ms_at_copy:.2f} ms per layer). Chapter 1's recorded step of {before['step_ms']:.1f} ms should drop "
            f"to about **{step_ms:.1f} ms**, {1 - step_ms / before['step_ms']:.0%} less: far beyond "
            f"{reported_gain_readings()}.",
        ]
    return Prediction("\n".join(lines), gather, full)


def _count(rows: list[dict[str, Any]]) -> str:
    return f"{sum(bool(r['ok']) for r in rows)} / {len(rows)}"


def suite_table(result: Result, caption: str) -> Table:
    """The validation suite per implementation (with and without FP8 NaNs in the pool), then CUDA graphs, errors,
    ``full_cast`` and the CUDA twin's nvcc compile."""
    rows = []
    cases = result.table("cases")
    for impl in sorted({r["impl"] for r in cases}):
        for nan in sorted({r["nan_inputs"] for r in cases}):
            sel = [r for r in cases if r["impl"] == impl and r["nan_inputs"] == nan]
            if sel:
                rows.append({"what": f"{impl}: cases" + (" (FP8 NaNs in the pool)" if nan else ""), "passed": _count(sel),
                             "detail": f"{sum(r['mismatched_values'] for r in sel)} mismatched values, "
                                       f"{sum(r['overwritten_poison'] for r in sel)} poisoned values overwritten"})
    sections = {r["section"] for r in result.rows}
    for section, what in (("graph", "CUDA graph: capture once, replay with new indices/lengths/scale"),
                          ("errors", "bad inputs raise before launch")):
        if section in sections:
            for impl in sorted({r["impl"] for r in result.table(section)}):
                sel = [r for r in result.table(section) if r["impl"] == impl]
                rows.append({"what": f"{impl}: {what}", "passed": _count(sel), "detail": ""})
    full_cast = result.table("full_cast")[0]
    rows.append({"what": "full_cast, whole pool", "passed": _count([full_cast]), "detail": f"shape {full_cast['shape']}"})
    nvcc = result.table("nvcc")[0]
    rows.append({"what": "nvcc, CUDA C++ twin", "passed": {True: "compiled", False: "FAILED", None: "no nvcc"}[nvcc["ok"]],
                 "detail": nvcc["summary"]})
    return Table(rows, CHECK_COLUMNS, caption)


def sanitizer_text(result: Result) -> str:
    """compute-sanitizer's command, verdict and the end of its output, as Markdown."""
    san = result.table("sanitizer")[0]
    return (f"`{san.get('command', 'compute-sanitizer')}`: return code {san['returncode']}, **{san['summary']}**. "
            f"The end of its output:\n\n```text\n{san['output_tail']}\n```")


def bench_figure(result: Result, title: str = "Gather-then-cast bandwidth against n") -> go.Figure:
    """GB/s of every implementation and layout against rows gathered, the device copy as the ceiling."""
    sweep = result.table("sweep")
    series: dict[str, tuple[list[float], list[float]]] = {}
    for r in sweep:
        xs, ys = series.setdefault(f"{r['impl']}, {r['layout']}", ([], []))
        xs.append(r["n"])
        ys.append(r["gbps"])
    ns = sorted({r["n"] for r in sweep})
    series["device-to-device copy (ceiling)"] = (ns, [result.table("copy")[0]["gbps"]] * len(ns))
    return plots.lines(series, title=title, xaxis="rows gathered (n)", yaxis="GB/s (bytes read + written)",
                       caption=[result.caption()], log_y=False)


def _at(result: Result, impl: str, n: int, layout: str = RANDOM_SLOTS, section: str = "sweep") -> dict[str, Any]:
    """The benchmark row of ``impl`` at ``n`` rows (in ``layout`` for the sweep)."""
    for r in result.table(section):
        if r["impl"] == impl and r["n"] == n and (section != "sweep" or r["layout"] == layout):
            return r
    raise KeyError(f"{result.path or result.experiment}: no {section} row for {impl!r} at n={n}"
                   + (f" ({layout})" if section == "sweep" else "") + ".")


def of_copy(result: Result, n: int, impl: str = KERNELS[0]) -> float:
    """Share of the copy bandwidth ``impl`` reached gathering ``n`` random slots."""
    return _at(result, impl, n)["of_copy"]


def _kernels(result: Result) -> list[str]:
    recorded = {r["impl"] for r in result.table("sweep")}
    return [k for k in KERNELS if k in recorded]


@dataclass(frozen=True)
class Targets:
    """The benchmark point by point (table), the targets the kernel was built to (Markdown), and their values."""

    table: Table
    text: str
    values: dict[str, float]


def targets(result: Result, sizes: tuple[int, ...] = (4096, 32768, 131072, 524288)) -> Targets:
    """Each implementation at ``sizes`` rows against the copy ceiling and PyTorch, and the kernel's targets."""
    copy = result.table("copy")[0]["gbps"]
    batch_layout = f"batch {result.params['batch']}, mixed lengths"
    kernels = _kernels(result)
    rows = []
    for n in sizes:
        torch_ms = _at(result, TORCH_OP, n)["ms"]
        for impl in [*kernels, TORCH_OP]:
            r = _at(result, impl, n)
            rows.append({"n": n, "impl": impl, "us": r["ms"] * 1e3, "gbps": r["gbps"], "of_copy": r["of_copy"],
                         "vs_torch": torch_ms / r["ms"], "batch": _at(result, impl, n, batch_layout)["of_copy"]})
    table = Table(rows, {"n": ("n", number(0)), "implementation": "impl", "µs": ("us", number(1)),
                         "GB/s": ("gbps", number(0)), "of copy": ("of_copy", percent),
                         "PyTorch µs / this µs": ("vs_torch", times(1)),
                         f"of copy, {batch_layout}": ("batch", percent)},
                  result.caption() + f" Copy ceiling {copy:,.0f} GB/s.")
    best = kernels[0]
    large = [r for r in result.table("sweep") if r["impl"] == best and r["n"] >= 32768]
    torch_ms = {r["n"]: r["ms"] for r in result.table("sweep") if r["impl"] == TORCH_OP and r["layout"] == RANDOM_SLOTS}
    full_pool = {r["impl"]: r for r in result.table("full_pool")}
    values = {
        "min_of_copy_n_ge_32k": min(r["of_copy"] for r in large),
        "min_speedup_vs_torch_n_ge_32k": min(torch_ms[r["n"]] / r["ms"] for r in large if r["layout"] == RANDOM_SLOTS),
        "us_at_4k": _at(result, best, 4096)["ms"] * 1e3,
        "us_at_4k_graph": _at(result, best, 4096, section="graph")["ms"] * 1e3,
        "full_cast_of_copy": full_pool["full_cast (Triton)"]["of_copy"],
        "torch_cast_of_copy": full_pool["PyTorch pool.to(bf16)"]["of_copy"],
    }
    text = (f"Against the targets this kernel was built to, for {best}: at n ≥ 32K it reaches at least "
            f"**{values['min_of_copy_n_ge_32k']:.0%}** of the copy ceiling (target ≥ 85 %) and is at least "
            f"**{values['min_speedup_vs_torch_n_ge_32k']:.1f}×** faster than PyTorch (target ≥ 4×); at n = 4K one call "
            f"takes **{values['us_at_4k']:.1f} µs** timed alone and **{values['us_at_4k_graph']:.1f} µs** per call inside "
            f"a CUDA graph (target ≤ 8 µs). `full_cast` moves the whole {result.params['pool_tokens']:,}-token pool at "
            f"**{values['full_cast_of_copy']:.0%}** of the copy ceiling (target ≥ 90 %); PyTorch's own cast reaches "
            f"{values['torch_cast_of_copy']:.0%}.")
    return Targets(table, text, values)


def launch_text(result: Result, n: int = 32768) -> str:
    """The launch shapes used, and what is left at ``n`` rows: the launch, not the gather."""
    best = _kernels(result)[0]
    copy = result.table("copy")[0]["gbps"]
    graph = {r["n"]: r for r in result.table("graph") if r["impl"] == best}
    launch = next(r for r in result.table("launch") if r["impl"] == best)
    configs = [r for r in result.rows if r["section"] == "config"]
    timed = _at(result, best, n)
    floor_us = gather_cast_bytes(n) / (copy * 1e3)
    text = ""
    if configs:
        c = configs[0]
        bytes_in_flight = c["large_config"]["block"] * 64 // (32 * c["large_config"]["num_warps"])
        text += (f"Launch shapes used: {c['small_label']} up to {c['small_rows']:,} rows, {c['large_label']} above "
                 f"({'tuned on this GPU' if c['tuned'] else 'defaults'}; B: chunks of 64 values per program step, "
                 f"w: warps): {bytes_in_flight} bytes of FP8 loads in flight per thread for large n. ")
    text += (f"Where n = {n // 1024}K falls short: at the copy rate its bytes take {floor_us:.1f} µs, and it measures "
             f"{timed['ms'] * 1e3:.1f} µs timed alone; an empty launch timed alone costs "
             f"{launch['device_ms'] * 1e3:.1f} µs of device time, {launch['graph_ms'] * 1e3:.1f} µs inside a graph. "
             f"Inside a CUDA graph the same {n // 1024}K call ")
    text += (f"runs at **{graph[n]['gbps'] / copy:.0%}** of the copy ceiling" if n in graph else "was not timed")
    if 2 * n in graph:
        text += f" and {2 * n // 1024}K at {graph[2 * n]['gbps'] / copy:.0%}"
    return text + f": what is left at {n // 1024}K is the launch, not the gather."


def launch_tables(result: Result) -> tuple[Table, Table]:
    """The launch floor (empty launches timed alone, in a graph, host µs), and per-call times inside a graph."""
    launch = Table(result.table("launch"),
                   {"implementation": "impl", "device µs, timed alone": ("device_ms", ms_as_us),
                    "device µs, in a graph": ("graph_ms", ms_as_us), "host µs per call": ("host_us_per_call", number(1)),
                    "host µs, with range checks": ("host_us_checked", number(1))},
                   result.caption())
    graph = Table(result.table("graph"),
                  {"n": ("n", number(0)), "implementation": "impl", "µs per call in a graph": ("ms", ms_as_us),
                   "GB/s": ("gbps", number(0))},
                  result.caption() + f" {result.params['graph_sets']} calls per graph, each on its own indices and output.")
    return launch, graph


def live_bench_table(result: Result, caption: str) -> Table:
    """A live benchmark run's sweep and whole-pool casts (PyTorch's paths on a CPU)."""
    return Table(result.table("sweep") + result.table("full_pool"),
                 {"what": "impl", "layout": "layout", "n": ("n", number(0)), "ms": ("ms", number(3)),
                  "GB/s": ("gbps", number(1)), "of copy": ("of_copy", percent)},
                 caption)
