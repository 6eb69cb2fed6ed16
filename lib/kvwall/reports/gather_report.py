"""Chapter 4's analysis of the gather-cast kernel: the byte prediction, the validation suite's summary,
and the bandwidth benchmark against the copy ceiling. Numbers and tables; chapter 4 writes the sentences.

Bytes come from :mod:`kvwall.model.roofline`. The decode-step analysis (chapter 1's step with each KV
strategy) is in :mod:`kvwall.reports.gather_step_report`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from kvwall.model.geometry import GLM5, MLAGeometry
from kvwall.model.original import ORIGINAL
from kvwall.model.roofline import attention_read_bytes, full_pool_cast_bytes, gather_cast_bytes
from kvwall.reports.rows import Row, rows_of
from kvwall.reports.tables import CHECK_COLUMNS, Table
from kvwall.results import Result

#: Implementation names the benchmark records.
TORCH_OP = "PyTorch index_select().to(bf16)"
KERNELS = ("gather_cast (Triton)", "gather_cast (CUDA C++)")
#: The benchmark's single-request layout.
RANDOM_SLOTS = "batch 1, random slots"
#: The whole-pool casts the benchmark records: ours, and PyTorch's.
FULL_CASTS = ("full_cast (Triton)", "PyTorch pool.to(bf16)")
#: The benchmark's sections of timed points: the eager sweep over n, and the same replayed as CUDA graphs.
SWEEP, GRAPH = "sweep", "graph"


@dataclass(frozen=True)
class Prediction:
    """Bytes per layer (one gathered row, the whole-pool cast, the gather-cast of one request, PyTorch's two-kernel
    gather over a graph's capacity, the BF16 attention's read) and, with a copy bandwidth and a recorded step, the
    step the gather-cast should give (None without them)."""

    row_read: int
    row_written: int
    index_bytes: int
    per_row: int
    pool_tokens: int
    full_pool_bytes: int
    context: int
    gather_bytes: int
    capacity: int
    torch_capacity_bytes: int
    attention_bytes: int
    layers: int
    copy_gbps: float | None = None
    per_layer_us: float | None = None
    kv_ms_per_step: float | None = None
    cast_ms_per_step: float | None = None
    cast_ms_at_copy: float | None = None
    before_step_ms: float | None = None
    step_ms: float | None = None
    time_saved: float | None = None


def predict(
    context: int,
    capacity: int,
    *,
    copy_gbps: float | None = None,
    before: Mapping[str, float] | None = None,
    pool_tokens: int = ORIGINAL.pool_tokens,
    geometry: MLAGeometry = GLM5,
) -> Prediction:
    """Bytes per layer of the whole-pool cast, a gather-cast of one ``context``-token request and PyTorch's
    two-kernel gather over a graph's ``capacity``; with the copy bandwidth and chapter 1's recorded step summary
    (``before``: ``step_ms``, ``cast_op_ms_per_step``), the step the gather-cast should give."""
    full = Row(full_pool_cast_bytes(geometry, pool_tokens)).total
    gather, per_row = gather_cast_bytes(context, geometry), gather_cast_bytes(1, geometry)
    # index_select().to(): the FP8 rows gathered into an FP8 temporary (written, then read again) with int64 indices.
    torch_capacity = gather_cast_bytes(capacity, geometry, index_bytes=8) + 2 * capacity * geometry.kv_dim
    p = Prediction(
        geometry.kv_dim,
        2 * geometry.kv_dim,
        per_row - 3 * geometry.kv_dim,
        per_row,
        pool_tokens,
        full,
        context,
        gather,
        capacity,
        torch_capacity,
        attention_read_bytes(geometry, context),
        geometry.num_layers,
    )
    if not (copy_gbps and before):
        return p
    per_layer_us, b = gather / (copy_gbps * 1e3), Row(before)
    kv_ms = geometry.num_layers * per_layer_us / 1e3
    after = b.step_ms - b.cast_op_ms_per_step + kv_ms
    return dataclasses.replace(
        p,
        copy_gbps=copy_gbps,
        per_layer_us=per_layer_us,
        kv_ms_per_step=kv_ms,
        cast_ms_per_step=b.cast_op_ms_per_step,
        cast_ms_at_copy=full / (copy_gbps * 1e6),
        before_step_ms=b.step_ms,
        step_ms=after,
        time_saved=1 - after / b.step_ms,
    )


def _count(rows: list[Row]) -> str:
    return f"{sum(bool(r.ok) for r in rows)} / {len(rows)}"


#: The suite's sections past the cases, as the table names them.
_SECTIONS = {
    "graph": "CUDA graph: capture once, replay with new indices/lengths/scale",
    "errors": "bad inputs raise before launch",
}


def suite_table(result: Result, caption: str) -> Table:
    """The validation suite per implementation (with and without FP8 NaNs in the pool), then CUDA graphs, errors,
    ``full_cast`` and the CUDA twin's nvcc compile."""
    rows, cases = [], rows_of(result, "cases")
    for impl, nan in sorted({(r.impl, r.nan_inputs) for r in cases}):
        sel = [r for r in cases if (r.impl, r.nan_inputs) == (impl, nan)]
        rows.append(
            dict(
                what=f"{impl}: cases" + (" (FP8 NaNs in the pool)" if nan else ""),
                passed=_count(sel),
                detail=f"{sum(r.mismatched_values for r in sel)} mismatched values, "
                f"{sum(r.overwritten_poison for r in sel)} poisoned values overwritten",
            )
        )
    for section, what in _SECTIONS.items():
        checks = rows_of(result, section)
        rows += [
            dict(what=f"{impl}: {what}", passed=_count([r for r in checks if r.impl == impl]), detail="")
            for impl in sorted({r.impl for r in checks})
        ]
    full_cast, nvcc = rows_of(result, "full_cast")[0], rows_of(result, "nvcc")[0]
    rows.append(dict(what="full_cast, whole pool", passed=_count([full_cast]), detail=f"shape {full_cast.shape}"))
    rows.append(
        dict(
            what="nvcc, CUDA C++ twin",
            passed={True: "compiled", False: "FAILED", None: "no nvcc"}[nvcc.ok],
            detail=nvcc.summary,
        )
    )
    return Table(rows, CHECK_COLUMNS, caption)


def bench_series(result: Result) -> dict[str, tuple[list[float], list[float]]]:
    """GB/s of every implementation and layout against rows gathered (for :func:`kvwall.reports.plots.lines`), and
    the device copy as the ceiling."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for r in rows_of(result, SWEEP):
        xs, ys = series.setdefault(f"{r.impl}, {r.layout}", ([], []))
        xs.append(r.n)
        ys.append(r.gbps)
    ns = sorted({n for xs, _ in series.values() for n in xs})
    series["device-to-device copy (ceiling)"] = (ns, [_copy(result)] * len(ns))
    return series


def _copy(result: Result) -> float:
    return rows_of(result, "copy")[0].gbps


def _at(result: Result, impl: str, n: int, layout: str = RANDOM_SLOTS, section: str = SWEEP) -> Row:
    """The benchmark row of ``impl`` at ``n`` rows (in ``layout`` for the sweep)."""
    sweep = section == SWEEP
    for r in rows_of(result, section):
        if r.impl == impl and r.n == n and (not sweep or r.layout == layout):
            return r
    raise KeyError(
        f"{result.path or result.experiment}: no {section} row for {impl!r} at n={n}"
        + (f" ({layout})" if sweep else "")
        + "."
    )


def of_copy(result: Result, n: int, impl: str = KERNELS[0]) -> float:
    """Share of the copy bandwidth ``impl`` reached gathering ``n`` random slots."""
    return _at(result, impl, n).of_copy


def _kernels(result: Result) -> list[str]:
    recorded = {r.impl for r in rows_of(result, SWEEP)}
    return [k for k in KERNELS if k in recorded]


@dataclass(frozen=True)
class Targets:
    """The benchmark point by point (``rows``: each implementation at each size, a sweep row with ``us``,
    ``vs_torch``, PyTorch's time over its own, and ``batch``, its share of the copy ceiling in the mixed-length batch
    of ``batch_layout``), and the values the kernel's targets are stated in (:func:`targets`)."""

    rows: list[Row]
    batch_layout: str
    values: dict[str, Any]


def targets(result: Result, sizes: tuple[int, ...] = (4096, 32768, 131072, 524288)) -> Targets:
    """Each implementation at ``sizes`` rows against the copy ceiling and PyTorch, and the values the kernel's targets
    are stated in: for its best implementation (``kernel``), the least share of the copy ceiling and speed-up over
    PyTorch at n >= 32K, µs at 4K timed alone and in a graph, and both whole-pool casts' share of the copy ceiling
    (``full_cast_of_copy``, ``torch_cast_of_copy``)."""
    batch_layout, kernels, rows = f"batch {Row(result.params).batch}, mixed lengths", _kernels(result), []
    for n in sizes:
        torch_ms = _at(result, TORCH_OP, n).ms
        rows += [
            Row(r, us=r.ms * 1e3, vs_torch=torch_ms / r.ms, batch=_at(result, r.impl, n, batch_layout).of_copy)
            for r in (_at(result, impl, n) for impl in [*kernels, TORCH_OP])
        ]
    best, sweep = kernels[0], rows_of(result, SWEEP)
    large = [r for r in sweep if r.impl == best and r.n >= 32768]
    torch_ms = {r.n: r.ms for r in sweep if r.impl == TORCH_OP and r.layout == RANDOM_SLOTS}
    full_pool = {r.impl: r.of_copy for r in rows_of(result, "full_pool")}
    return Targets(
        rows,
        batch_layout,
        dict(
            kernel=best,
            copy_gbps=_copy(result),
            pool_tokens=Row(result.params).pool_tokens,
            min_of_copy_n_ge_32k=min(r.of_copy for r in large),
            min_speedup_vs_torch_n_ge_32k=min(torch_ms[r.n] / r.ms for r in large if r.layout == RANDOM_SLOTS),
            us_at_4k=_at(result, best, 4096).ms * 1e3,
            us_at_4k_graph=_at(result, best, 4096, section=GRAPH).ms * 1e3,
            full_cast_of_copy=full_pool[FULL_CASTS[0]],
            torch_cast_of_copy=full_pool[FULL_CASTS[1]],
        ),
    )


def launch(result: Result, n: int = 32768) -> dict[str, Any]:
    """What is left at ``n`` rows for the best kernel: its bytes' time at the copy rate (``floor_us``), its time alone
    (``timed_us``), an empty launch's device time alone and in a graph (``empty_us``, ``empty_graph_us``), its share
    of the copy ceiling in a graph at ``n`` and ``2 n`` (``graph_of_copy``, ``graph_of_copy_2n``; None where not
    timed); and the launch shapes it used (``config``: the recorded row, None if not recorded) with the bytes of FP8
    loads in flight per thread for large n (``bytes_in_flight``)."""
    best, copy = _kernels(result)[0], _copy(result)
    graph = {r.n: r.gbps / copy for r in rows_of(result, GRAPH) if r.impl == best}
    empty = next(r for r in rows_of(result, "launch") if r.impl == best)
    config = next(iter(rows_of(result, "config")), None)
    large = config and Row(config.large_config)
    return dict(
        n=n,
        floor_us=gather_cast_bytes(n) / (copy * 1e3),
        timed_us=_at(result, best, n).ms * 1e3,
        empty_us=empty.device_ms * 1e3,
        empty_graph_us=empty.graph_ms * 1e3,
        graph_of_copy=graph.get(n),
        graph_of_copy_2n=graph.get(2 * n),
        config=config,
        bytes_in_flight=large and large.block * 64 // (32 * large.num_warps),
    )
