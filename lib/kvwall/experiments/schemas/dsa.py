"""Row schema of ``dsa_decode``: SGLang's DSA decode path (the indexer, its top-k, FlashMLA's sparse FP8 decode)
beside the dense paths at chapter 5's points."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvwall.experiments.schemas.base import Row
from kvwall.experiments.schemas.fused_decode import FusedDecodeBenchBench

__all__ = ["DSADecodeRow", "DSAForcedDenseRow", "ChaptersGpuModeRow"]


class DSADecodeSetup(Row):
    section: Literal["setup"]
    device: str
    gpu: str | None = None
    sms: int | None = None
    copy_gbps: float | None = None
    flash_mla: dict[str, Any] | None = None
    quantizer: str
    quantizer_bytes_match: bool | None = None
    index_heads: int
    topk: int
    us_means: str
    index_dot: str | None = None
    seconds_total: float | None = None


class DSADecodePart(Row):
    """One part of the DSA decode of a layer at one point (``part``: ``indexer_logits``, ``topk``,
    ``sparse_decode``, or ``layer``, the three back to back), its time, the bytes it must read and its accuracy."""

    section: Literal["dsa"]
    part: Literal["indexer_logits", "topk", "sparse_decode", "layer"]
    heads: int
    padded_heads: int
    context: int
    batch: int
    tokens: int
    selected: int
    floor_bytes: int
    us: float | None
    timing: str
    host_us: float | None = None
    floor_us: float | None = None
    rel_err_f64: float | None = None
    rel_err_vs_bf16: float | None = None
    storage_rel_err: float | None = None
    plain_storage_rel_err: float | None = None
    dense_storage_rel_err: float | None = None
    logits_rel_err_f64: float | None = None
    topk_recall: float | None = None
    error: str | None = None


class DSADenseRow(FusedDecodeBenchBench):
    """A dense path at the same point, timed exactly as chapter 5's benchmark times it."""


#: One row of ``dsa_decode``, by its section.
DSADecodeRow = Annotated[DSADecodeSetup | DSADecodePart | DSADenseRow, Field(discriminator="section")]


class DSAForcedCitation(Row):
    section: Literal["citations"]
    fact: str
    value: str
    lines: list[str]
    ok: bool


class DSAForcedDense(Row):
    """:class:`kvwall.peers.sglang_dsa.ForcedDenseResult`'s fields (those the chapters read typed here; the rest kept
    as recorded)."""

    section: Literal["forced_dense"]
    sglang: str
    torch_version: str
    dsa_row_bytes: int
    dsa_row_bytes_trtllm: int
    key_buffer_last_dim: int
    dense_latent_rel_err: float
    dense_rope_nan_tokens: float
    dense_output_rel_err: float
    mla_pool_output_rel_err: float
    set_kv_buffer_error: str
    seconds_total: float


#: One row of ``dsa_forced_dense``, by its section.
DSAForcedDenseRow = Annotated[DSAForcedCitation | DSAForcedDense, Field(discriminator="section")]


class ChaptersGpuSetup(Row):
    section: Literal["setup"]
    gpu: str
    budget_s: int
    timeout_s: int
    chapters: list[str]
    seconds_total: float | None = None


class ChaptersGpuChapter(Row):
    section: Literal["chapter"]
    chapter: str
    source_sha256: str
    params: str
    rc: int | None
    seconds: float | None
    duration_s: float | None = None
    error: str | None = None


#: One row of ``chapters_gpu_mode``.
ChaptersGpuModeRow = Annotated[ChaptersGpuSetup | ChaptersGpuChapter, Field(discriminator="section")]
