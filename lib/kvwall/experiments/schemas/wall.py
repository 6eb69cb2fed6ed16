"""Row schemas of the ``kvwall.experiments.wall`` experiments: one model per section."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvwall.experiments.schemas.base import Row

__all__ = ["WallTimelineRow", "WallOnGpuRow"]


class WallTimelineToolchain(Row):
    section: Literal["toolchain"]
    nvcc_version: str | None = None
    nvcc: str | None = None
    python: str
    torch: str


class WallTimelineTimeline(Row):
    section: Literal["timeline"]
    release: str
    backend: str
    arch: str
    q_dtype: str
    kv_dtype: str
    status: str
    duration_s: float | None = None
    from_cache: bool | None = None
    nvcc_version: str | None = None
    python_checks: str | None = None
    built: str | None = None
    outcome: str
    assert_file: str | None = None
    assert_line: int | None = None
    assert_source: str | None = None
    assert_message: str | None = None
    reached_from_mla: bool | None = None
    chain: list[Any] | None = None
    first_error: str | None = None
    first_error_chain: list[Any] | None = None
    other_asserts: list[Any] | None = None
    compiler_excerpt: str | None = None
    refusal_type: str | None = None
    refusal_message: str | None = None
    refusal_where: str | None = None
    refusal_phase: str | None = None
    plan_check_replay: dict[str, Any] | None = None
    compiled_if_forced: bool | None = None


class WallTimelineRelease(Row):
    section: Literal["release"]
    release: str
    installed_from: str
    source: dict[str, Any]
    substituted: dict[str, Any]
    pinned_headers: dict[str, Any]
    dependencies: list[Any]


#: One row of ``wall_timeline``, by its section.
WallTimelineRow = Annotated[
    WallTimelineToolchain | WallTimelineTimeline | WallTimelineRelease,
    Field(discriminator="section"),
]


class WallOnGpuRelease(Row):
    section: Literal["release"]
    release: str
    phase: str
    error: str | None
    flashinfer_version: str | None = None
    flashinfer_file: str | None = None
    gpu: str | None = None
    capability: list[Any] | None = None
    seconds: float | None = None
    installed_from: str | None = None
    exc_type: str | None
    message: str
    output_tail: str
    cases_planned: int
    cases_done: int


class WallOnGpuCase(Row):
    section: Literal["case"]
    release: str
    backend: str
    kv: str
    context_len: int
    mode: str
    status: str
    stage: str | None = None
    exc_type: str | None = None
    message: str | None = None
    seconds: float
    compiler_errors: list[Any] | None = None
    traceback_tail: str | None = None
    plan_s: float | None = None
    run_kwargs: list[Any] | None = None
    rel_err_vs_float64: float | None = None
    finite: bool | None = None
    rel_diff_vs_bf16_path: float | None = None
    bf16_rel_err_vs_float64: float | None = None
    ms: float | None = None


#: One row of ``wall_on_gpu``, by its section.
WallOnGpuRow = Annotated[WallOnGpuRelease | WallOnGpuCase, Field(discriminator="section")]
