"""Row schema of ``multi_token_decode``: ours with speculative decoding's verify shapes (q_len query tokens a
request, causal) beside FlashMLA dense BF16 and FP8, on one page table."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvwall.experiments.schemas.base import Row

__all__ = ["MultiTokenDecodeRow"]


class MultiTokenSetup(Row):
    section: Literal["setup"]
    device: str
    gpu: str | None = None
    us_means: str
    flash_mla: dict[str, Any] | None = None
    seconds_total: float | None = None


class MultiTokenPoint(Row):
    """One path at one (heads, context, batch, q_len): its device and host µs, ours' plan µs and path, and its
    error against float64 on the cache's exact values."""

    section: Literal["point"]
    heads: int
    context: int
    batch: int
    q_len: int
    path: Literal["ours", "flashmla_dense_bf16", "flashmla_dense_fp8"]
    us: float | None
    host_us: float | None
    timing: str
    graph_error: str | None = None
    plan_us: float | None = None
    kernel_path: str | None = None
    path_why: str | None = None
    launch: str | None = None
    rel_err_f64: float | None = None
    error: str | None = None


MultiTokenDecodeRow = Annotated[MultiTokenSetup | MultiTokenPoint, Field(discriminator="section")]
