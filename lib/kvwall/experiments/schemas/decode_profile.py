"""Row schemas of the ``kvwall.experiments.decode_profile`` experiments: one model per section."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kvwall.experiments.schemas.base import Row

__all__ = ["DecodeProfileRow", "CastKernelsRow", "CastSweepRow", "AttentionSweepRow"]


class DecodeProfileCheck(Row):
    section: Literal["check"]
    attention: str
    rel_err_vs_float64: float


class DecodeProfileStep(Row):
    section: Literal["step"]
    step: int
    ms: float


class DecodeProfileTimeline(Row):
    section: Literal["timeline"]
    layer: int
    phase: str
    start_ms: float
    ms: float


class DecodeProfileBreakdown(Row):
    section: Literal["breakdown"]
    phase: str
    ms_per_step: float


class DecodeProfileOps(Row):
    section: Literal["ops"]
    name: str
    calls_per_step: float
    ms_per_step: float


class DecodeProfileKernels(Row):
    section: Literal["kernels"]
    kernel: str
    name: str
    calls_per_step: float
    ms_per_step: float


class DecodeProfileSummary(Row):
    """``step_ms``: the median phase-clocked step. ``profiled_step_ms``: the mean wall time of the profiled steps
    (absent from recordings made before it was measured). ``cast_share``: ``cast_op_ms_per_step`` over
    ``profiled_step_ms`` where the run has it (both from the profiled steps), else over ``step_ms``."""

    section: Literal["summary"]
    step_ms: float
    cast_op_ms_per_step: float
    profiled_step_ms: float | None = None
    cast_share: float
    layers: int
    heads_per_gpu: int
    pool_slots: int
    cast_bytes_per_layer: int
    standin_ms_per_layer: float
    attention: str
    device_kind: str


#: One row of ``decode_profile``, by its section.
DecodeProfileRow = Annotated[
    DecodeProfileCheck
    | DecodeProfileStep
    | DecodeProfileTimeline
    | DecodeProfileBreakdown
    | DecodeProfileOps
    | DecodeProfileKernels
    | DecodeProfileSummary,
    Field(discriminator="section"),
]


class CastKernelsCopies(Row):
    section: Literal["copies"]
    copy_: str = Field(alias="copy")
    kernel: str
    bytes: int
    ms: float
    gbps: float


class CastKernelsDeviceCopy(Row):
    section: Literal["device_copy"]
    bytes: int
    ms: float
    gbps: float


#: One row of ``cast_kernels``, by its section.
CastKernelsRow = Annotated[CastKernelsCopies | CastKernelsDeviceCopy, Field(discriminator="section")]


class CastSweepSweep(Row):
    section: Literal["sweep"]
    pool_tokens: int
    ms: float
    bytes: int
    gbps: float


#: One row of ``cast_sweep``.
CastSweepRow = CastSweepSweep


class AttentionSweepSweep(Row):
    section: Literal["sweep"]
    context_len: int
    ms: float
    bytes: int
    gbps: float
    attention: str


#: One row of ``attention_sweep``.
AttentionSweepRow = AttentionSweepSweep
