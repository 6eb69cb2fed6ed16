"""Row schemas of chapter 5's experiments (ours and its paths, the peer table's benchmark): one model per
section."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvwall.experiments.schemas.base import ErrorCheck, Row, SanitizerRun

__all__ = [
    "KernelPath",
    "FusedDecodeTuningRow",
    "FusedDecodePathsRow",
    "FusedDecodeValidationRow",
    "FusedDecodeBenchRow",
    "FusedDecodeProfileRow",
]

#: Ours' paths (:data:`kvwall.kernels.mla_decode.dispatch.KernelPath`).
KernelPath = Literal["triton", "wgmma", "wgmma_tokens"]
#: What a validated or contracted call ran: one path forced, or ours (the dispatcher with its plan).
ValidatedPath = Literal["triton", "wgmma", "wgmma_tokens", "ours"]


class FusedDecodeTuningCeilings(Row):
    section: Literal["ceilings"]
    copy_gbps: float
    bf16_tflops: float


class _LaunchShape(Row):
    """A launch shape of the Triton path (``cfg_*``: :class:`kvwall.kernels.mla_decode.launch_shape.MLADecodeConfig`'s
    fields) at a head count and token count (rows recorded with the retired options keep them as extra fields)."""

    heads: int
    tokens: int
    cfg_block_h: int
    cfg_block_n: int
    cfg_num_warps: int
    cfg_num_stages: int
    cfg_combine_block_d: int
    cfg_combine_block_s: int
    cfg_combine_warps: int
    cfg_pairs: bool = False


class _TunedLaunch(_LaunchShape):
    """One timed launch of the Triton path: the shape, the time, the roofline."""

    us: float
    roofline_us: float


class FusedDecodeTuningScreen(_LaunchShape):
    """A candidate at the screening point: checked against float32 first (``rel_err``), its compiled resources, and
    its time -- or the ``error`` that stopped it."""

    section: Literal["screen"]
    us: float | None = None
    roofline_us: float | None = None
    rel_err: float | None = None
    regs: int | None = None
    spills: int | None = None
    shared_bytes: int | None = None
    error: str | None = None


class FusedDecodeTuningFastestAny(FusedDecodeTuningScreen):
    """The fastest candidate of a head count's screen, spilling or not (the winners do not spill)."""

    section: Literal["fastest_any"]  # type: ignore[assignment]


class FusedDecodeTuningSweep(_TunedLaunch):
    section: Literal["sweep"]
    splits: int
    split_kernel_us: float | None = None
    combine_kernel_us: float | None = None


class FusedDecodeTuningWinner(_TunedLaunch):
    section: Literal["winner"]
    splits: int
    split_kernel_us: float
    combine_kernel_us: float


#: One row of ``fused_decode_tuning``, by its section.
FusedDecodeTuningRow = Annotated[
    FusedDecodeTuningCeilings
    | FusedDecodeTuningScreen
    | FusedDecodeTuningSweep
    | FusedDecodeTuningWinner
    | FusedDecodeTuningFastestAny,
    Field(discriminator="section"),
]


class FusedDecodeValidationSetup(Row):
    """What ran: the paths of the case table and the contracts (``paths``), why the others did not (``skipped``),
    FlashInfer's prebuild (GPU), the run's seconds."""

    section: Literal["setup"]
    device: str
    paths: list[ValidatedPath]
    skipped: dict[str, str]
    flashinfer_prebuild: dict[str, Any] | None = None
    seconds_total: float | None = None


class FusedDecodeValidationCases(Row):
    """One case on one path: its error against float64 beside the BF16 path's, and the verdict (``passed``: at most
    twice the BF16 path's error, finite, empty requests zero). ``num_splits``/``config``: the Triton path's;
    ``kernel_path``/``path_why``: where ours went and why."""

    section: Literal["cases"]
    path: ValidatedPath
    case: str
    heads: int
    lens: list[Any]
    batch: int
    tokens: int
    layout: str
    page_size: int
    index_dtype: str
    ckv_scale: float
    kpe_scale: float
    seed: int
    num_splits: int | None
    work_items: int | None = None
    rel_err: float | None
    bf16_path: str | None
    bf16_rel_err: float | None
    ratio: float | None
    finite: bool | None
    empty_requests: int
    empty_out_zero: bool | None
    passed: bool
    config: dict[str, Any] | None = None
    bf16_inputs_exact: bool | None = None
    kernel_path: KernelPath | None = None
    path_why: str | None = None


class FusedDecodeValidationFp8Peers(Row):
    section: Literal["fp8_peers"]
    case: str
    heads: int
    lens: list[Any]
    layout: str
    peer: str
    flashinfer: str
    rel_err: float | None
    rel_diff_vs_ours: float | None
    ratio_vs_bf16: float | None
    finite: bool | None = None


class FusedDecodeValidationErrors(ErrorCheck):
    passed: bool


class FusedDecodeValidationGraph(Row):
    section: Literal["graph"]
    heads: int
    trial: int | None
    lens: list[Any] | None = None
    ckv_scale: float | None = None
    kpe_scale: float | None = None
    num_splits: int | None = None
    planned: bool = False
    work_items: int | None = None
    config: dict[str, Any] | None = None
    capacity: int | None = None
    rel_err: float | None = None
    passed: bool
    equal_to_eager: bool | None = None
    empty_out_zero: bool | None = None
    finite: bool | None = None


class FusedDecodeValidationContract(Row):
    """One contract of one path (:func:`kvwall.experiments.fused_decode.contracts.path_contract_rows`)."""

    section: Literal["contract"]
    path: ValidatedPath
    check: str
    ok: bool
    detail: str


#: One row of ``fused_decode_validation``, by its section.
FusedDecodeValidationRow = Annotated[
    FusedDecodeValidationSetup
    | FusedDecodeValidationCases
    | FusedDecodeValidationContract
    | FusedDecodeValidationFp8Peers
    | FusedDecodeValidationErrors
    | FusedDecodeValidationGraph
    | SanitizerRun,
    Field(discriminator="section"),
]


class NcuMetrics(Row):
    """The metrics of :mod:`kvwall.measure.ncu` one launch reads (None: not read)."""

    dram_read_bytes: float | None = None
    dram_write_bytes: float | None = None
    dram_pct_of_peak: float | None = None
    duration_ns: float | None = None
    block_size: float | None = None
    grid_size: float | None = None
    registers_per_thread: float | None = None
    dynamic_smem_bytes: float | None = None
    l2_bytes: float | None = None
    warp_instructions: float | None = None
    theoretical_occupancy_pct: float | None = None
    achieved_occupancy_pct: float | None = None
    stall_barrier: float | None = None
    stall_dispatch_stall: float | None = None
    stall_lg_throttle: float | None = None
    stall_long_scoreboard: float | None = None
    stall_math_pipe_throttle: float | None = None
    stall_mio_throttle: float | None = None
    stall_no_instruction: float | None = None
    stall_not_selected: float | None = None
    stall_short_scoreboard: float | None = None
    stall_wait: float | None = None
    issue_active_pct: float | None = None
    tensor_pipe_pct: float | None = None
    wgmma_instructions: float | None = None
    shared_lsu_pct: float | None = None
    shared_bank_conflicts: float | None = None
    stall_gmma: float | None = None
    shared_ld_wavefronts: float | None = None
    shared_st_wavefronts: float | None = None
    global_ld_requests: float | None = None
    global_ld_sectors: float | None = None
    l1_throughput_pct: float | None = None
    ncu_missing: list[str] | None = None


class FusedDecodeProfileNcu(NcuMetrics):
    """Nsight Compute on one path's split kernel (``error`` where ncu or the path could not run)."""

    section: Literal["profile"]
    heads: int
    tokens: int
    path: KernelPath
    min_bytes: int
    flops: int | None = None
    error: str | None = None


class NcuLaunch(Row):
    """One kernel launch of a profiled call: its name and ncu's duration (clocks locked to base)."""

    kernel: str
    duration_ns: float | None = None


class FusedDecodeProfilePeer(NcuMetrics):
    """One strategy's call at one bench point under Nsight Compute: every launch (``launches``), their summed time,
    and the metrics of the longest launch (``main_kernel``); ``error`` where ncu or the strategy could not run."""

    section: Literal["peers"]
    heads: int
    context: int
    batch: int
    strategy: str
    main_kernel: str | None = None
    launches: list[NcuLaunch] | None = None
    total_duration_ns: float | None = None
    error: str | None = None


class FusedDecodeProfilePhases(Row):
    """The wgmma kernel's cycles per tile by warpgroup ("0", "1") and phase, and per CTA by fixed phase (the
    ``KVWALL_TRACE`` build), beside the shipped (``us``) and traced build's µs; ``error`` where it failed."""

    section: Literal["phases"]
    heads: int
    context: int
    batch: int
    tokens: int
    page_size: int
    us: float | None = None
    us_traced: float | None = None
    work_items: int | None = None
    ctas: int | None = None
    tiles: int | None = None
    per_tile: dict[str, dict[str, float]] | None = None
    per_cta: dict[str, dict[str, float]] | None = None
    error: str | None = None


#: One row of ``fused_decode_profile``, by its section.
FusedDecodeProfileRow = Annotated[
    FusedDecodeProfileNcu | FusedDecodeProfilePeer | FusedDecodeProfilePhases, Field(discriminator="section")
]


class FusedDecodeBenchCeilings(Row):
    section: Literal["ceilings"]
    gpu: str
    sms: int
    copy_gbps: float
    copy_ms: float
    copy_bytes: int
    bf16_tflops: float
    flashinfer: str
    flashinfer_prebuild: dict[str, Any]
    sglang: dict[str, Any]
    flash_mla: dict[str, Any] | None = None
    us_means: str
    host_us_means: str
    active_bytes_means: str
    roofline_means: str
    seconds_to_here: float
    seconds_total: float


class _BenchPoint(Row):
    """What every timed (strategy, point) row carries (``fused_decode_bench``, ``fused_decode_paths``): the strategy
    (a name of :data:`kvwall.experiments.fused_decode.strategies.STRATEGIES`), the layout it ran on, the point, the
    time or the ``error``; ours' rows (and the forced paths') say which path ran (``kernel_path``), ours' why
    (``path_why``)."""

    section: Literal["bench"]
    strategy: str
    heads: int
    context: int
    batch: int
    tokens: int
    len_min: int
    len_max: int
    roofline_us: float
    us: float | None
    timing: str
    gbps: float | None = None
    tflops: float | None = None
    pct_roofline: float | None = None
    work_items: int | None = None
    chunk_tokens: int | None = None
    imbalance: float | None = None
    page_size: int
    rel_err_f64: float | None = None
    kernel_path: KernelPath | None = None
    path_why: str | None = None
    config: dict[str, Any] | None = None
    host_us: float | None = None
    error: str | None = None


class FusedDecodeBenchBench(_BenchPoint):
    active_bytes: int
    qo_bytes: int
    flops: int
    host_us: float | None
    gbps: float | None
    tflops: float | None
    pct_roofline: float | None
    num_splits: int | None = None
    backend: str | None = None
    plan_ms: float | None = None
    rel_diff_vs_ours: float | None = None
    buffer_bytes: int | None = None
    pool_bf16_bytes: int | None = None
    max_kv_splits: int | None = None
    num_kv_splits_min: int | None = None
    num_kv_splits_max: int | None = None
    use_pdl: bool | None = None
    sglang_file: str | None = None
    sglang_source: str | None = None
    sweep_us: dict[str, Any] | None = None
    best_fixed_splits: int | None = None
    best_fixed_us: float | None = None


#: One row of ``fused_decode_bench``, by its section.
FusedDecodeBenchRow = Annotated[FusedDecodeBenchCeilings | FusedDecodeBenchBench, Field(discriminator="section")]


class FusedDecodePathsBuild(Row):
    """The GPU, nvcc, each wgmma kernel's build and ptxas resources (or why it does not run: ``wgmma.runs`` False,
    ``wgmma.why``; ``wgmma_tokens`` the same for the tokens-on-M kernel, per instantiation in ``per_cta``; absent
    from recordings made before it), the ceilings of the run, its seconds; ``dispatch_table``: the table the run's
    dispatcher rows (``ours``, ``ours_page64``) chose by -- its file, the entry read (None: none for this GPU), the
    recording that wrote it, why it was refused (None) -- absent from recordings made before those rows."""

    section: Literal["build"]
    gpu: str
    capability: list[int]
    sms: int
    nvcc: str | None
    copy_gbps: float
    copy_ms: float
    bf16_tflops: float
    wgmma: dict[str, Any]
    wgmma_tokens: dict[str, Any] | None = None
    dispatch_table: dict[str, Any] | None = None
    seconds_total: float | None = None


#: One row of ``fused_decode_paths``, by its section (its ``bench`` rows are ``fused_decode_bench``'s).
FusedDecodePathsRow = Annotated[FusedDecodePathsBuild | FusedDecodeBenchBench, Field(discriminator="section")]
