"""Row schemas of the ``kvwall.experiments.gather_cast`` experiments: one model per section."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvwall.experiments.schemas.base import ErrorCheck, Row, SanitizerRun

__all__ = ["GatherCastValidationRow", "GatherCastBenchRow", "GatherCastProfileRow"]


class GatherCastValidationCases(Row):
    section: Literal["cases"]
    impl: str
    case: str
    device: str
    dim: int
    page_size: int
    index_dtype: str
    real_rows: int
    capacity: int
    nan_inputs: bool
    mismatched_values: int
    overwritten_poison: int
    ok: bool


class GatherCastValidationGraph(Row):
    section: Literal["graph"]
    impl: str
    trial: int
    real_rows: int
    capacity: int
    scale: float
    mismatched_values: int
    overwritten_poison: int
    ok: bool


class GatherCastValidationErrors(ErrorCheck):
    impl: str
    ok: bool


class GatherCastValidationFullCast(Row):
    section: Literal["full_cast"]
    shape: list[Any]
    mismatched_values: int
    ok: bool


class GatherCastValidationNvcc(Row):
    section: Literal["nvcc"]
    ok: bool | None
    summary: str
    registers: dict[str, Any]


#: One row of ``gather_cast_validation``, by its section.
GatherCastValidationRow = Annotated[
    GatherCastValidationCases
    | GatherCastValidationGraph
    | GatherCastValidationErrors
    | GatherCastValidationFullCast
    | GatherCastValidationNvcc
    | SanitizerRun,
    Field(discriminator="section"),
]


class GatherCastBenchCopy(Row):
    section: Literal["copy"]
    bytes: int
    ms: float
    gbps: float


class GatherCastBenchConfig(Row):
    section: Literal["config"]
    gpu: str
    tuned: bool
    small_rows: int
    small_config: dict[str, Any]
    large_config: dict[str, Any]
    small_label: str
    large_label: str


class GatherCastBenchSweep(Row):
    section: Literal["sweep"]
    layout: str
    impl: str
    n: int
    bytes: int
    ms: float
    gbps: float
    of_copy: float


class GatherCastBenchGraph(Row):
    section: Literal["graph"]
    impl: str
    n: int
    ms: float
    bytes: int
    gbps: float
    calls_per_graph: int


class GatherCastBenchLaunch(Row):
    section: Literal["launch"]
    impl: str
    device_ms: float | None
    graph_ms: float | None
    host_us_per_call: float
    host_us_checked: float | None = None


class GatherCastBenchFullPool(Row):
    section: Literal["full_pool"]
    impl: str
    pool_tokens: int
    bytes: int
    ms: float
    gbps: float
    of_copy: float


#: One row of ``gather_cast_bench``, by its section.
GatherCastBenchRow = Annotated[
    GatherCastBenchCopy
    | GatherCastBenchConfig
    | GatherCastBenchSweep
    | GatherCastBenchGraph
    | GatherCastBenchLaunch
    | GatherCastBenchFullPool,
    Field(discriminator="section"),
]


class GatherCastProfileBreakdown(Row):
    section: Literal["breakdown"]
    strategy: str
    phase: str
    ms_per_step: float


class GatherCastProfileMarkedSteps(Row):
    section: Literal["marked_steps"]
    strategy: str
    gc_off: bool
    step: int
    step_ms: float
    host_ms: float
    max_host_gap_ms: float
    host_gaps_over_1ms: int
    host_ms_in_gaps_over_1ms: float
    kv_free_max_us: float
    kv_free_layers_over_10us: int
    gc_passes: int
    gc_gen2: int
    gc_ms: float
    kv_free_ms: float
    kv_strategy_ms: float
    attention_ms: float


class GatherCastProfileGraphBreakdown(Row):
    section: Literal["graph_breakdown"]
    strategy: str
    phase: str
    ms_per_step: float


class GatherCastProfileStrategies(Row):
    section: Literal["strategies"]
    strategy: str
    name: str
    attention: str
    rel_err_vs_float64: float
    step_ms: float
    step_ms_min: float
    step_ms_max: float
    kv_strategy_ms_per_step: float
    layers: int
    capacity: int | None
    unmarked_step_ms: float
    host_enqueue_ms: float
    host_us_per_layer: float
    host_us_prepare_kv: float
    host_us_attention: float
    syncs_per_step: int | None
    graph_step_ms: float | None
    graph_error: str | None
    graph_kv_ms_per_step: float | None
    graph_phase_sum_ms: float | None


class GatherCastProfileCapacity(Row):
    section: Literal["capacity"]
    strategy: str
    capacity: int
    ms_per_layer: float
    ms_per_layer_events: float
    ms_per_layer_graph: float | None
    host_us_per_call: float
    real_tokens: int


class GatherCastProfileGain(Row):
    section: Literal["gain"]
    strategy: str
    step_ms: float
    time_saved: float
    speedup: float
    graph_step_ms: float | None
    graph_time_saved: float | None
    graph_speedup: float | None


#: One row of ``gather_cast_profile``, by its section.
GatherCastProfileRow = Annotated[
    GatherCastProfileBreakdown
    | GatherCastProfileMarkedSteps
    | GatherCastProfileGraphBreakdown
    | GatherCastProfileStrategies
    | GatherCastProfileCapacity
    | GatherCastProfileGain,
    Field(discriminator="section"),
]
