"""Row schema of ``sglang_patch_check``: one ``checks`` row per (variant, case), one ``meta`` row."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from kvwall.experiments.schemas.base import Row

__all__ = ["SGLangPatchCheckRow"]


class SGLangPatchCheck(Row):
    """A variant's decode step vs the unpatched backend's and the float64 reference.

    ``attention``: what computed the attention (FlashInfer on a GPU; on a CPU the recording fake wrapper with the
    torch reference; ``mla_decode_fp8`` for the fused patch). ``planned_indices``: what the decode wrapper was
    planned with ("pool slots", "0..n-1", "not planned", or "other"). ``rows_read_exact``: the BF16 rows the planned
    indices reach equal ``pool[kv_indices].to(bfloat16)`` bit for bit, every layer (None when no wrapper ran).
    Errors: ``max_abs_diff`` and ``rel_err`` (||a - b|| / ||b||, all layers) vs the unpatched output and vs the
    float64 reference over the dequantized cache."""

    section: Literal["checks"]
    variant: str
    case: str
    batch: int
    tokens: int
    pool_slots: int
    layers: int
    heads: int
    attention: str
    kv_path: str
    whole_pool_casts: int
    planned_indices: str
    kv_buffer_rows: int | None
    rows_read_exact: bool | None
    max_abs_diff_vs_unpatched: float
    rel_err_vs_unpatched: float
    bit_identical_vs_unpatched: bool
    within_bf16_tolerance: bool
    max_abs_err_vs_f64: float
    rel_err_vs_f64: float
    ok: bool
    problems: list[str]


class SGLangPatchMeta(Row):
    """What was checked: the upstream file and patches (sha256 of their bytes) and why sglang itself was not
    imported."""

    section: Literal["meta"]
    upstream: str
    upstream_sha256: str
    patch_sha256: dict[str, str]
    flashinfer: str | None
    import_blocker: str
    tolerance: dict[str, float]


SGLangPatchCheckRow = Annotated[Union[SGLangPatchCheck, SGLangPatchMeta], Field(discriminator="section")]
