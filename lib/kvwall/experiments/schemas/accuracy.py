"""Row schemas of ``fp8_accuracy`` (:mod:`kvwall.experiments.accuracy`): the setup, one row per case (what its stored
values give), one row per (case, path) (its verdicts against float64, or the error)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvwall.experiments.schemas.base import Row

__all__ = ["FP8AccuracyRow"]


class FP8AccuracySetup(Row):
    section: Literal["setup"]
    device: str
    strategies: list[str]
    skipped: dict[str, str]
    query_quantization: str
    precision: dict[str, dict[str, str]]
    flashinfer: str | None
    flash_mla: str | None
    probes: dict[str, int]
    seconds_total: float


class FP8AccuracyCase(Row):
    """A case: the profile asked for, the shape, and the realized logits of the stored values (medians)."""

    section: Literal["case"]
    case: str
    profile: str
    spread: float
    sinks: int
    sink_mass: float
    needles: int
    margin: float
    heads: int
    context: int
    batch: int
    tokens: int
    len_min: int
    len_max: int
    saturated: int
    floor_rel_err: float | None
    realized_spread: float
    realized_max_gap: float
    realized_margin: float | None
    realized_sink_mass: float
    realized_tail_mass: float
    realized_top_weight: float
    realized_tail_token_weight: float
    realized_tail_token_vs_max: float
    realized_query_rms: float


class FP8AccuracyPath(Row):
    """One path on one case: the output's error, the probes' verdicts -- or the ``error`` that stopped it."""

    section: Literal["path"]
    case: str
    strategy: str
    heads: int
    context: int
    batch: int
    kernel_path: str | None = None
    backend: str | None = None
    page_size: int | None = None
    rel_err: float | None = None
    top_err: float | None = None
    top_err_median: float | None = None
    tail_token_err: float | None = None
    tail_token_flushed: float | None = None
    tail_mass_kept: float | None = None
    tail_mass_kept_median: float | None = None
    sink_mass_ratio: float | None = None
    finite: bool | None = None
    error: str | None = None
    traceback_tail: Any = None


#: One row of ``fp8_accuracy``, by its section.
FP8AccuracyRow = Annotated[FP8AccuracySetup | FP8AccuracyCase | FP8AccuracyPath, Field(discriminator="section")]
