"""``decode_step_paths``: chapter 1's decode-step model (GLM-5, 78 layers, a 495K-token pool, 16 heads per GPU, the
original's rest of the layer as a labelled stand-in) run with each path of :mod:`kvwall.model.step_paths` in one
process, on the same pool and page table: on a GPU each whole step captured in a CUDA graph and replayed (and each
phase's 78 layers in a graph of their own), on a CPU eager with a clock on every phase. Every path's attention output is
checked against float64 first, and the step's transient memory is measured.

``ours`` is the dispatcher's path with the step's plan (made once, outside the graph). FlashMLA dense FP8 and BF16
(``flashmla_fp8``, ``flashmla_bf16``; GPU, SM90) read the same requests' tokens on random pages of 64 of the same
pool (:func:`flashmla_step_path`: the pool's layer buffers viewed as pages, no copy; the FP8 query quantized per
tensor once, outside the step, as chapter 5's benchmark does).

Device time at full scale: **70 s** for the 8 paths measured on the H200 (2026-12-01, a trial run of this code, not
recorded; FlashInfer's JIT cache warm from an earlier run on the same machine: on a fresh one add ~20 s); 81 s on
2026-11-30 for 6 paths.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from kvwall.kernels.mla_decode.reference import mla_decode_reference, split_latent_cache
from kvwall.measure.accuracy import finite_or_none, relative_error
from kvwall.measure.failures import error_text, traceback_tail
from kvwall.measure.timing import copy_bandwidth_gbps, graph_ms, matmul_tflops, release_memory, synchronize
from kvwall.model.attention import flashinfer_version, prebuild_flashinfer_mla
from kvwall.model.decode_step import PHASES, STANDIN_LABEL, DecodeStepModel, RestOfLayerStandIn
from kvwall.model.geometry import GLM5
from kvwall.model.original import ORIGINAL
from kvwall.model.step_paths import (
    PATH_INFO,
    STEP_PATHS,
    CacheViews,
    bf16_backend_for,
    build_step_path,
    kv_bytes_per_token,
)
from kvwall.model.pool import DecodeBatch, TokenPool, make_decode_batch, mixed_lengths
from kvwall.peers.flashmla import PAGE_SIZE, FlashMLADecode, random_page_table
from kvwall.results import Result, collect_provenance
from kvwall.experiments.registry import Experiment

__all__ = [
    "EXPERIMENTS",
    "run_decode_step_paths",
    "run_decode_step_batches",
    "batch_lengths",
    "BATCH_PATHS",
    "flashmla_step_path",
    "PagedViews",
    "FlashMLAStepDecode",
]

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
DC = GLM5.kv_lora_rank


class PagedViews:
    """FlashMLA's KV work: none -- the layer's pool buffer seen as ``[pages, 64, 1, 576]`` (its whole pages, no
    copy), handed to the attention as both views."""

    name = "the cache as it is, seen as pages of 64 (no copy)"

    def prepare_kv(self, pool: TokenPool, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        del dtype  # FlashMLA reads the cache's own dtype
        buf = pool.key_buffer(layer)
        pages = buf.shape[0] // PAGE_SIZE
        paged = buf[: pages * PAGE_SIZE].view(pages, PAGE_SIZE, 1, buf.shape[-1])
        return paged, paged


class FlashMLAStepDecode:
    """FlashMLA dense decode on the step's page table (pages of 64): built on the first call, with that call's
    queries (the step's queries are the same tensors every layer), then each layer's call points it at that layer's
    pages; FP8: every layer's call quantizes the query as SGLang does (static, the cache's scale), inside the timing."""

    def __init__(self, block_table: torch.Tensor, seqlens: torch.Tensor, sm_scale: float, fp8: bool) -> None:
        self.block_table, self.seqlens, self.sm_scale, self.fp8 = block_table, seqlens, sm_scale, fp8
        self.decode: FlashMLADecode | None = None

    def __call__(self, q_nope, q_pe, ckv, kpe):
        del kpe  # the same pages
        if self.decode is None:
            self.decode = FlashMLADecode(q_nope, q_pe, ckv, self.block_table, self.seqlens, self.sm_scale, fp8=self.fp8)
        self.decode.k_cache = ckv
        return self.decode()


def flashmla_step_path(
    path: str, pool: TokenPool, batch: DecodeBatch, *, seed: int
) -> tuple[PagedViews, FlashMLAStepDecode, dict[str, Any], torch.Tensor]:
    """``(strategy, attention, info, token slots)`` of ``flashmla_fp8`` / ``flashmla_bf16``: the batch's requests,
    the same lengths, on random pages of 64 of the pool (seeded); the token slots, request by request, are what the
    float64 reference reads."""
    if pool.device.type != "cuda":
        raise RuntimeError(f"path {path!r} runs FlashMLA's SM90 kernels: it needs an NVIDIA GPU (H100 / H200).")
    lens = batch.context_lens.tolist()
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    table, seqlens = random_page_table(lens, pool.num_slots // PAGE_SIZE, gen, pool.device)
    offsets = torch.arange(PAGE_SIZE, device=pool.device)
    slots = torch.cat(
        [
            (table[i, : -(-n // PAGE_SIZE)].long()[:, None] * PAGE_SIZE + offsets).flatten()[:n]
            for i, n in enumerate(lens)
        ]
    )
    attention = FlashMLAStepDecode(table, seqlens, pool.geometry.sm_scale, fp8=path == "flashmla_fp8")
    info = {
        "attention": f"FlashMLA dense {'FP8' if attention.fp8 else 'BF16'} (legacy SM90), pages of 64",
        "backend": "flash_mla",
        "page_size": PAGE_SIZE,
    }
    return PagedViews(), attention, info, slots.to(torch.int32)


#: The strategies that hand the attention views of the cache (no copy): their KV phase launches no kernel.
NO_KV_WORK = (CacheViews, PagedViews)


def _graph_phase_ms(model: DecodeStepModel, device: torch.device, replays: int) -> dict[str, float]:
    """Each phase's ``layers`` calls captured in a CUDA graph of their own: device ms per step, by phase. A strategy
    of :data:`NO_KV_WORK` launches nothing in its KV phase: that phase is 0 ms, not captured (an empty graph, which
    torch warns about, and whose replay would time the replay call, not KV work)."""
    pool, layers = model.pool, model.pool.num_layers
    ckv, kpe = model.strategy.prepare_kv(pool, 0, model.q_dtype)
    bodies: dict[str, Callable[[], object]] = {
        PHASES[0]: lambda: [pool.write_new_tokens(i, model.batch.new_token_slots, model.new_kv) for i in range(layers)],
        PHASES[1]: lambda: [model.strategy.prepare_kv(pool, i, model.q_dtype) for i in range(layers)],
        PHASES[2]: lambda: [model.attention(model.q_nope, model.q_pe, ckv, kpe) for _ in range(layers)],
        STANDIN_LABEL: lambda: [model.rest_of_layer() for _ in range(layers)],
    }
    if isinstance(model.strategy, NO_KV_WORK):
        bodies.pop(PHASES[1])
    timed = {phase: graph_ms([body], device, warmup=1, replays=replays) for phase, body in bodies.items()}
    return {PHASES[1]: 0.0, **timed}


def _eager_phase_ms(model: DecodeStepModel, steps: int) -> tuple[float, dict[str, float]]:
    """Median eager step (a clock at every phase boundary) and each phase's median ms per step."""
    per_step = []
    for _ in range(steps):
        phases = dict.fromkeys(PHASES, 0.0)
        for row in model.timed_step():
            phases[row["phase"]] += row["ms"]
        per_step.append(phases)
    totals = [sum(p.values()) for p in per_step]
    return statistics.median(totals), {p: statistics.median(s[p] for s in per_step) for p in PHASES}


def _transient_bytes(model: DecodeStepModel, device: torch.device) -> int | None:
    """Peak device memory one step allocates beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model.step()
    synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def _path_row(
    path: str, pool: TokenPool, batch, standin, device: torch.device, *, bf16_backend: str, steps: int, seed: int
) -> dict[str, Any]:
    info = PATH_INFO[path]
    row: dict[str, Any] = {
        "section": "path",
        "path": path,
        "label": info.label,
        "cache_dtype": str(info.cache_dtype).removeprefix("torch."),
        "kv_bytes_per_token": kv_bytes_per_token(pool.geometry, info.cache_dtype),
    }
    slots = batch.kv_indices
    if info.peer:
        strategy, attention, built, slots = flashmla_step_path(path, pool, batch, seed=seed)
    else:
        strategy, attention, built = build_step_path(path, pool, batch, bf16_backend=bf16_backend)
    row.update(built, strategy=strategy.name)
    model = DecodeStepModel(pool, batch, strategy, attention, standin, seed=seed)
    model.step()  # warm-up: JIT, allocator; the pool's new-token slots now hold their steady values
    if isinstance(attention, FlashMLAStepDecode) and attention.decode is not None:
        row["flash_mla"] = attention.decode.version
    ckv, kpe = strategy.prepare_kv(pool, 0, BF16)
    out = attention(model.q_nope, model.q_pe, ckv, kpe).double()
    del ckv, kpe
    ref = mla_decode_reference(
        model.q_nope,
        model.q_pe,
        *split_latent_cache(pool.key_buffer(0), DC),
        batch.kv_indptr,
        slots,
        pool.geometry.sm_scale,
        compute_dtype=torch.float64,
    )
    row["rel_err_vs_float64"] = finite_or_none(relative_error(out, ref))
    row["transient_bytes"] = _transient_bytes(model, device)
    if device.type == "cuda":
        step = graph_ms([model.step], device, warmup=0, replays=steps)
        phases = _graph_phase_ms(model, device, steps)
        row.update(timing="cuda_graph", step_ms=step)
    else:
        step, eager = _eager_phase_ms(model, steps)
        phases = {p: eager[p] for p in (PHASES[0], PHASES[1], PHASES[2], STANDIN_LABEL)}
        phases[PHASES[2]] += eager[PHASES[3]]  # freeing the materialized KV is the attention phase's tail
        row.update(timing="eager, clock at each phase", step_ms=step)
    row.update(
        write_kv_ms=phases[PHASES[0]],
        kv_ms=phases[PHASES[1]],
        attention_ms=phases[PHASES[2]],
        rest_ms=phases[STANDIN_LABEL],
    )
    return row


def run_decode_step_paths(
    device: torch.device,
    *,
    pool_tokens: int,
    layers: int,
    tensor_parallel: int,
    context_lens: list[int],
    paths: list[str],
    steps: int,
    bf16_backend: str = "auto",
    seed: int = 0,
) -> Result:
    """Rows: one ``setup`` (what ran: GPU, ceilings, FlashInfer backend, the stand-in), then one ``path`` row per
    path (step ms, phases, accuracy, transient memory, bytes per token), or that path's ``error``."""
    unknown = set(paths) - set(STEP_PATHS)
    if unknown:
        raise ValueError(f"unknown paths {sorted(unknown)}; known: {STEP_PATHS}.")
    t0 = time.perf_counter()
    geometry = GLM5.with_tensor_parallel(tensor_parallel)
    backend = bf16_backend_for(device) if bf16_backend == "auto" else bf16_backend
    fp8_pool = TokenPool.random(geometry, pool_tokens + 1, layers, device=device, seed=seed)
    batch = make_decode_batch(context_lens, fp8_pool.num_slots, seed=seed, device=device)
    standin = RestOfLayerStandIn.from_original(GLM5.num_layers, device)
    setup: dict[str, Any] = {
        "section": "setup",
        "device": str(device),
        "bf16_backend": backend,
        "flashinfer": flashinfer_version(),
        "standin_ms_per_layer": standin.ms_per_layer,
        "original_step_ms": ORIGINAL.step_ms,
        "original_cast_ms": ORIGINAL.cast_ms,
        "heads_per_gpu": geometry.heads_per_gpu,
        "tokens": batch.total_tokens,
    }
    if device.type == "cuda":
        setup.update(
            gpu=torch.cuda.get_device_name(device),
            copy_gbps=copy_bandwidth_gbps(device, 1 << 30)[1],
            bf16_tflops=matmul_tflops(device),
            flashinfer_prebuild=prebuild_flashinfer_mla(device),
        )
    rows: list[dict] = [setup]
    bf16_pool: TokenPool | None = None
    for path in paths:
        pool = fp8_pool
        if PATH_INFO[path].cache_dtype == BF16:
            if bf16_pool is None:  # the same values, held in BF16 (FP8 -> BF16 is exact)
                bf16_pool = TokenPool(geometry, [b.to(BF16) for b in fp8_pool.buffers])
            pool = bf16_pool
        try:
            rows.append(_path_row(path, pool, batch, standin, device, bf16_backend=backend, steps=steps, seed=seed))
        except Exception as exc:  # noqa: BLE001 - a path that cannot run here is a finding, recorded
            rows.append(
                {
                    "section": "path",
                    "path": path,
                    "label": PATH_INFO[path].label,
                    "error": error_text(exc, 600),
                    "traceback_tail": traceback_tail(),
                }
            )
        release_memory(device)
    setup["seconds_total"] = round(time.perf_counter() - t0, 1)
    params = dict(
        pool_tokens=pool_tokens,
        layers=layers,
        tensor_parallel=tensor_parallel,
        context_lens=list(context_lens),
        paths=list(paths),
        steps=steps,
        bf16_backend=bf16_backend,
        seed=seed,
    )
    return Result("decode_step_paths", params, rows, collect_provenance(device, __name__))


#: The paths the answer names (chapter 6's decision), timed on the whole step at every batch.
BATCH_PATHS = ["full_pool_cast", "gather_cast", "ours", "bf16_cache", "flashmla_fp8", "flashmla_bf16"]


def batch_lengths(batch: int, context: int, max_tokens: int, *, seed: int) -> list[int]:
    """Batch 1: one request of ``context`` tokens (the book's headline step); larger batches: mixed lengths
    (:func:`kvwall.model.pool.mixed_lengths`) summing to ``min(batch * context, max_tokens)``."""
    if batch == 1:
        return [int(context)]
    return mixed_lengths(min(batch * context, max_tokens), batch, seed=seed + batch)


def run_decode_step_batches(
    device: torch.device,
    *,
    pool_tokens: int,
    layers: int,
    tensor_parallel: int,
    batches: list[int],
    context: int,
    max_tokens: int,
    paths: list[str],
    steps: int,
    bf16_backend: str = "auto",
    seed: int = 0,
) -> Result:
    """:func:`run_decode_step_paths` at each of ``batches`` (lengths from :func:`batch_lengths`): every row says its
    ``batch`` and ``tokens``. The rest of the layer is the original's batch-1 stand-in at every batch (the MoE and
    projections of a real batch cost more: the stand-in is labelled so wherever it is shown)."""
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for b in batches:
        lens = batch_lengths(b, context, max_tokens, seed=seed)
        part = run_decode_step_paths(
            device,
            pool_tokens=pool_tokens,
            layers=layers,
            tensor_parallel=tensor_parallel,
            context_lens=lens,
            paths=paths,
            steps=steps,
            bf16_backend=bf16_backend,
            seed=seed,
        )
        rows += [{**r, "batch": b, "tokens": sum(lens)} for r in part.rows]
        release_memory(device)
    rows[0]["seconds_total"] = round(time.perf_counter() - t0, 1)
    params = dict(
        pool_tokens=pool_tokens,
        layers=layers,
        tensor_parallel=tensor_parallel,
        batches=list(batches),
        context=context,
        max_tokens=max_tokens,
        paths=list(paths),
        steps=steps,
        bf16_backend=bf16_backend,
        seed=seed,
    )
    return Result("decode_step_batches", params, rows, collect_provenance(device, __name__))


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "decode_step_paths",
        run_decode_step_paths,
        full=dict(
            pool_tokens=495_000,
            layers=78,
            tensor_parallel=4,
            context_lens=[8192],
            paths=list(STEP_PATHS),
            steps=5,
            bf16_backend="auto",
            seed=0,
        ),
        small=dict(
            pool_tokens=50_000,
            layers=2,
            tensor_parallel=4,
            context_lens=[2048],
            paths=[p for p in STEP_PATHS if not PATH_INFO[p].gpu_only],
            steps=3,
            bf16_backend="auto",
            seed=0,
        ),
        about="chapter 1's decode step with every path past the wall (CUDA-graph replayed), same pool",
        requires=("cuda", "flashinfer"),
    ),
    Experiment(
        "decode_step_batches",
        run_decode_step_batches,
        full=dict(
            pool_tokens=495_000,
            layers=78,
            tensor_parallel=4,
            batches=[1, 8, 32, 64],
            context=8192,
            max_tokens=400_000,
            paths=list(BATCH_PATHS),
            steps=5,
            bf16_backend="auto",
            seed=0,
        ),
        small=dict(
            pool_tokens=20_000,
            layers=2,
            tensor_parallel=4,
            batches=[1, 2],
            context=512,
            max_tokens=1024,
            paths=[p for p in BATCH_PATHS if not PATH_INFO[p].gpu_only],
            steps=1,
            bf16_backend="auto",
            seed=0,
        ),
        about="the whole decode step at batch 1-64 with every path the answer names (CUDA-graph replayed)",
        requires=("cuda", "flashinfer"),
    ),
]
