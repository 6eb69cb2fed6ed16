"""Row schemas of chapter 6's experiments (every path on the decode step; the per-layer sweep)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvwall.experiments.schemas.base import Row
from kvwall.experiments.schemas.fused_decode import KernelPath

__all__ = ["DecodeStepPathsRow", "DecodeStepBatchesRow", "PathSweepRow"]


class DecodeStepPathsSetup(Row):
    section: Literal["setup"]
    device: str
    bf16_backend: str
    flashinfer: str | None
    standin_ms_per_layer: float
    original_step_ms: float
    original_cast_ms: float
    heads_per_gpu: int
    tokens: int
    gpu: str | None = None
    copy_gbps: float | None = None
    bf16_tflops: float | None = None
    flashinfer_prebuild: dict[str, Any] | None = None
    seconds_total: float | None = None


class DecodeStepPath(Row):
    """One path's step: ``step_ms`` (CUDA graph on a GPU, eager on a CPU) and its phases, or its ``error``.
    ``ours`` also says which path ran (``kernel_path``) and the dispatcher's reason (``path_why``); the FlashMLA
    paths their ``page_size`` (64) and FlashMLA's version."""

    section: Literal["path"]
    path: str
    label: str
    error: str | None = None
    cache_dtype: str | None = None
    kv_bytes_per_token: int | None = None
    attention: str | None = None
    backend: str | None = None
    kernel_path: KernelPath | None = None
    path_why: str | None = None
    page_size: int | None = None
    flash_mla: str | None = None
    strategy: str | None = None
    rel_err_vs_float64: float | None = None
    transient_bytes: int | None = None
    timing: str | None = None
    step_ms: float | None = None
    write_kv_ms: float | None = None
    kv_ms: float | None = None
    attention_ms: float | None = None
    rest_ms: float | None = None


#: One row of ``decode_step_paths``, by its section.
DecodeStepPathsRow = Annotated[DecodeStepPathsSetup | DecodeStepPath, Field(discriminator="section")]


class DecodeStepBatchesSetup(DecodeStepPathsSetup):
    batch: int


class DecodeStepBatchesPath(DecodeStepPath):
    batch: int
    tokens: int


#: One row of ``decode_step_batches``: the step's rows at one batch, each saying its batch.
DecodeStepBatchesRow = Annotated[DecodeStepBatchesSetup | DecodeStepBatchesPath, Field(discriminator="section")]


class PathSweepCeilings(Row):
    section: Literal["ceilings"]
    gpu: str
    sms: int
    copy_gbps: float
    copy_ms: float
    bf16_tflops: float
    flashinfer: str | None
    flash_mla: str | None
    flashinfer_prebuild: dict[str, Any]
    seconds_total: float | None = None


class PathSweepPoint(Row):
    """One path at one point: µs per layer (``None`` with an ``error`` where it did not run), built from the peer
    table's ``strategy`` (:data:`kvwall.experiments.fused_decode.strategies.STRATEGIES`) on ``page_size``. ``ours``
    and ``triton`` say which path ran (``kernel_path``; ``ours``: the dispatcher's choice, and its ``path_why``)."""

    section: Literal["point"]
    axis: Literal["context", "pool", "batch", "heads"]
    path: str
    heads: int
    context: int
    batch: int
    pool_tokens: int
    tokens: int
    len_max: int
    us: float | None
    timing: str | None = None
    strategy: str | None = None
    page_size: int | None = None
    backend: str | None = None
    kernel_path: KernelPath | None = None
    path_why: str | None = None
    error: str | None = None


#: One row of ``path_sweep``, by its section.
PathSweepRow = Annotated[PathSweepCeilings | PathSweepPoint, Field(discriminator="section")]
