"""Row schema of ``sglang_patch_check``: one ``checks`` row per (variant, case), one ``meta`` row."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

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
    git_apply_check: dict[str, int] | None = None  # ``git apply --check`` exit code per diff (0: applies)


class SGLangRealMeta(Row):
    """The check inside SGLang's real modules: where the sources came from, how many SGLang files were imported (and
    checked against the wheel's RECORD), each stand-in with the file:line that imported it unguarded, the missing
    modules SGLang imports guarded (its fallback ran), calls into stand-ins during the steps, each variant (sha256,
    ``git apply --check``/``git apply`` exit codes), and the minimal objects that stand for SGLang's runner/batch."""

    section: Literal["real_meta"]
    sglang_source: str | None
    ran: bool
    error: str | None
    sglang_files: int
    files_checked_against_record: int
    files_mismatched: list[str]
    standins: dict[str, str]
    guarded_missing: dict[str, str]
    standin_calls: list[str]
    variants: dict[str, dict[str, Any]]
    minimal_objects: list[str]
    import_s: float | None
    device: str
    cuda_graphs: bool


class SGLangRealCheck(Row):
    """One (mode, phase, variant) of the real backend: ``mode`` decode or verify (target-verify, ``draft_tokens`` per
    request); ``phase`` eager, or replay k of a captured CUDA graph (``capture``: a capture that failed).
    Whole-pool casts (torch's dispatcher sees what a capture records, never what a replay launches):
    ``whole_pool_casts`` per step -- an eager step's (metadata + forward), a graph step's captured ones (replayed
    every step) plus those at replay; ``warmup_casts``: the capture-time metadata and the warm-up forward;
    ``capture_casts``: what the captured graph holds (None without a CUDA graph, ``cuda_graph`` False: on a CPU the
    forward runs at replay, uncaptured); ``replay_casts``: at replay, outside the graph. Rows recorded before these
    were told apart have ``capture_casts`` = warm-up + capture and ``whole_pool_casts`` = replay only.
    Errors vs float64 and vs the unpatched backend on the same inputs."""

    section: Literal["real_check"]
    mode: str
    phase: str
    variant: str
    batch: int
    lens: list[int]
    tokens: int
    draft_tokens: int
    layers: int
    pool_slots: int
    whole_pool_casts: int | None
    capture_casts: int | None
    error: str | None
    ok: bool
    problems: list[str]
    warmup_casts: int | None = None
    replay_casts: int | None = None
    cuda_graph: bool | None = None
    finite: bool | None = None
    max_abs_err_vs_f64: float | None = None
    rel_err_vs_f64: float | None = None
    within_tol_vs_f64: bool | None = None
    max_abs_diff_vs_unpatched: float | None = None
    rel_err_vs_unpatched: float | None = None
    within_tol_vs_unpatched: bool | None = None
    bit_identical_vs_unpatched: bool | None = None


class SGLangRealMemory(Row):
    """What a variant's backend holds per GPU, measured with ``torch.cuda.memory_allocated`` (None off a GPU:
    ``measured`` False): ``setup_bytes`` around its construction + ``init_cuda_graph_state`` (where a compact BF16
    buffer is reserved), ``capture_bytes`` per captured graph (``decode``, ``verify_<n>``: the capture-time
    metadata's buffers -- ours' graph plans, a compact buffer reserved lazily -- and the graph's private pool, the
    forward's outputs and any temporaries the graph holds), ``compact_rows_reserved`` (0: none)."""

    section: Literal["real_memory"]
    variant: str
    measured: bool
    setup_bytes: int | None
    capture_bytes: dict[str, int]
    compact_rows_reserved: int | None
    total_bytes: int | None
    graph_bs: int
    context_len: int
    pool_slots: int
    layers: int


class SGLangRealTiming(Row):
    """The decode step of every layer inside a captured CUDA graph, replayed ``iters`` times (CUDA events): median,
    min, max ms per replay; the unpatched median over this variant's."""

    section: Literal["real_timing"]
    variant: str
    batch: int
    lens: list[int]
    layers: int
    pool_slots: int
    ms_per_step: float | None
    ms_min: float | None
    ms_max: float | None
    iters: int
    speedup_vs_unpatched: float | None
    error: str | None
    us_per_layer: float | None = None  # ms_per_step / layers, in µs
    kernel_us_per_layer: float | None = None  # fused: ours alone in a CUDA graph, same plan and inputs
    kernel_path: str | None = None
    kernel_error: str | None = None


SGLangPatchCheckRow = Annotated[
    Union[SGLangPatchCheck, SGLangPatchMeta, SGLangRealMeta, SGLangRealCheck, SGLangRealTiming, SGLangRealMemory],
    Field(discriminator="section"),
]
