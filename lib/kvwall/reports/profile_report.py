"""Chapter 1's numbers: the whole-pool cast's bytes, the decode step's profile by its two clocks (live and
recorded), the cast's rate against plain copies, and the cast against attention across the sweeps. Chapter 1
writes the sentences, tables and figures around them.

Bytes come from :mod:`kvwall.model.roofline`; the original's figures from :mod:`kvwall.model.original`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from kvwall.model.geometry import GLM5, MLAGeometry
from kvwall.model.original import ORIGINAL
from kvwall.model.roofline import attention_read_bytes, full_pool_cast_bytes
from kvwall.reports.rows import Row
from kvwall.results import Result


@dataclass(frozen=True)
class CastBytes:
    """What the whole-pool cast moves per layer and step, against what attention over one request reads (MB = 10⁶
    bytes, GB = 10⁹)."""

    read_mb: float  # the FP8 pool, one byte a value
    written_mb: float  # the BF16 copy, two bytes a value
    total_mb: float
    step_gb: float  # ``total_mb`` over every layer of the geometry
    attention_mb: float  # BF16 KV of one ``context``-token request
    over_attention: float  # total / attention


def cast_bytes(context: int, pool_tokens: int = ORIGINAL.pool_tokens, geometry: MLAGeometry = GLM5) -> CastBytes:
    """Bytes the whole-pool cast moves per layer and step, against what attention over ``context`` tokens reads."""
    cast = Row(full_pool_cast_bytes(geometry, pool_tokens))
    read, written, total = cast.read, cast.written, cast.total
    attention = attention_read_bytes(geometry, context)
    return CastBytes(
        read / 1e6, written / 1e6, total / 1e6, total * geometry.num_layers / 1e9, attention / 1e6, total / attention
    )


@dataclass(frozen=True)
class StepShares:
    """The cast's share of a ``decode_profile`` run's step, by its two clocks, each a ratio of numbers from the same
    steps:

    - ``phase_*``: the phase clock (a mark at every phase boundary; the median of each phase over the ``timed_steps``,
      summed), which the figures show: the cast phase over the step;
    - ``profiler_*``: ``aten::copy_``'s self time (``copy_ms``, ``copy_calls`` a step) over the ``profiled_steps``' own
      wall clock (mean per step, profiler overhead in both). ``profiler_step_ms`` and ``profiler_share`` are None for
      a recording made before the profiled steps carried a clock."""

    phase_step_ms: float
    phase_cast_ms: float
    phase_share: float
    copy_ms: float
    copy_calls: float | None
    profiler_step_ms: float | None
    profiler_share: float | None
    timed_steps: int
    profiled_steps: int | None


def phases(result: Result) -> dict[str, float]:
    """ms per step of each phase of the decode step."""
    return {r.phase: r.ms_per_step for r in map(Row, result.table("breakdown"))}


def step_shares(result: Result) -> StepShares:
    """The cast's share of the step by the phase clock and by torch.profiler (see :class:`StepShares`)."""
    summary, by_phase = Row(result.table("summary")[0]), phases(result)
    step, cast = sum(by_phase.values()), by_phase["kv_strategy"]
    copy, profiled = summary.cast_op_ms_per_step, summary.profiled_step_ms
    calls = next((r.calls_per_step for r in map(Row, result.table("ops")) if r.name == "aten::copy_"), None)
    return StepShares(
        step,
        cast,
        cast / step,
        copy,
        calls,
        profiled,
        copy / profiled if profiled else None,
        len(result.table("step")),
        Row(result.params).profile_steps,
    )


def ranked(result: Result, table: str, top: int) -> list[Row]:
    """The first ``top`` rows of a ``decode_profile`` ranking (its ``ops`` or ``kernels`` table, by time per step),
    each with ``share``: its time over the profiled steps' own wall time (None for a recording made before the
    profiled steps carried a clock: a share of the phase-clocked step would divide numbers from two runs)."""
    profiled = step_shares(result).profiler_step_ms
    return [Row(r, share=r.ms_per_step / profiled if profiled else None) for r in map(Row, result.table(table)[:top])]


def copy_rows(result: Result) -> tuple[list[Row], float]:
    """The pool-shaped copies of a ``cast_kernels`` run, each with ``of_copy``, its share of the device-to-device copy
    rate; and that rate (GB/s, read + write)."""
    ceiling = Row(result.table("device_copy")[0]).gbps
    return [Row(r, of_copy=r.gbps / ceiling) for r in map(Row, result.table("copies"))], ceiling


@dataclass(frozen=True)
class CastRate:
    """The FP8 → BF16 cast (row 0 of a ``cast_kernels`` run) against a plain copy and the same-width integer cast
    (row 1), and the rate the original's own figures imply on its GPU."""

    cast_gbps: float
    cast_of_copy: float  # of the device-to-device copy rate
    integer_kernel: str  # the kernel PyTorch picks for the integer cast
    integer_of_copy: float
    cast_of_integer: float  # cast rate / integer cast rate
    original_gbps: float  # the original's cast MB per layer × layers / its cast time
    original_over_cast: float  # original_gbps / cast_gbps


def cast_rate(result: Result, geometry: MLAGeometry = GLM5) -> CastRate:
    """The cast's rate against the copies it is measured beside (see :class:`CastRate`)."""
    cast, integer = copy_rows(result)[0][:2]
    original = ORIGINAL.cast_mb_per_layer * 1e6 * geometry.num_layers / (ORIGINAL.cast_ms * 1e-3) / 1e9
    return CastRate(
        cast.gbps,
        cast.of_copy,
        integer.kernel,
        integer.of_copy,
        cast.gbps / integer.gbps,
        original,
        original / cast.gbps,
    )


@dataclass(frozen=True)
class SweepComparison:
    """The whole-pool cast of ``pool_tokens`` tokens against attention over the longest request of the sweep (ms per
    layer)."""

    pool_tokens: int
    pool_cast_ms: float
    longest_context: int
    longest_attention_ms: float
    cast_over_attention: float


def sweep_comparison(
    cast_sweep: Sequence[Mapping[str, Any]],
    attention_sweep: Sequence[Mapping[str, Any]],
    pool_tokens: int = ORIGINAL.pool_tokens,
) -> SweepComparison:
    """The cast sweep's row at ``pool_tokens`` against the attention sweep's longest context."""
    pool_cast_ms = next(r.ms for r in map(Row, cast_sweep) if r.pool_tokens == pool_tokens)
    longest = max(map(Row, attention_sweep), key=lambda r: r.context_len)
    return SweepComparison(pool_tokens, pool_cast_ms, longest.context_len, longest.ms, pool_cast_ms / longest.ms)
