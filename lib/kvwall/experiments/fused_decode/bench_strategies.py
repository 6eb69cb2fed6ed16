"""The strategies ``fused_decode_bench`` times at each point, each built into one call (everything outside the call --
plan(), buffers, SGLang's split choice, one-off BF16 pools, FlashMLA's metadata -- done while building it).

- ``fused_fp8``: :func:`kvwall.kernels.mla_decode_fp8` straight from the FP8 pool (unchecked, with the launch shape and
  the plan -- balanced work list -- a checked call would make);
- ``fused_fp8_page64``: the same on FlashMLA's layout (pages of 64, the same page table as the FlashMLA rows);
- ``full_cast_bf16``: the original -- the whole pool cast to BF16 every call, then FlashInfer BF16 attention;
- ``gather_cast_bf16``: chapter 4 -- only the rows the batch reads, cast into a compact BF16 buffer, then FlashInfer;
- ``flashinfer_fp8_fa2`` / ``flashinfer_fp8_fa3``: FlashInfer's native FP8 MLA;
- ``flashinfer_bf16_precast``: FlashInfer BF16 attention alone, on a pool cast once outside the timing;
- ``sglang_triton_fp8``: SGLang's Triton MLA decode (:mod:`kvwall.peers.sglang`) with SGLang's own split policy;
- ``flashmla_dense_bf16`` / ``flashmla_dense_fp8``: FlashMLA (:mod:`kvwall.peers.flashmla`) on the same number of
  tokens per request laid out on random pages of 64 of the same pool (page 64 is the only size it takes; BF16 on a
  copy of the pool cast once outside the timing; FP8 with the query quantized per tensor).

Every FlashInfer BF16 path runs ``cast_backend`` (fa3 on Hopper), falling back to fa2 where it refuses, saying why.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvwall.kernels.gather.kernel import gather_cast
from kvwall.kernels.mla_decode.reference import mla_decode_reference
from kvwall.kernels.mla_decode.kernel import default_config, mla_decode_fp8, plan_mla_decode
from kvwall.measure.failures import error_text
from kvwall.measure.timing import synchronize
from kvwall.model.attention import FlashInferMLADecode
from kvwall.model.geometry import GLM5
from kvwall.model.pool import mixed_lengths
from kvwall.peers.flashmla import PAGE_SIZE, FlashMLADecode, random_page_table
from kvwall.peers.sglang import SGLangTritonMLA, sglang_max_kv_splits

__all__ = ["STRATEGIES", "BenchPoint", "bench_lengths", "make_point", "build_strategy", "paged_layout",
           "reference_f64"]

DC, DR = GLM5.kv_lora_rank, GLM5.qk_rope_head_dim
D = DC + DR
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
SM_SCALE = GLM5.sm_scale

STRATEGIES = ("fused_fp8", "fused_fp8_page64", "full_cast_bf16", "gather_cast_bf16", "flashinfer_fp8_fa2", "flashinfer_fp8_fa3",
              "flashinfer_bf16_precast", "sglang_triton_fp8", "flashmla_dense_bf16", "flashmla_dense_fp8")

Call = Callable[[], torch.Tensor]


@dataclass
class BenchPoint:
    """One (heads, context, batch) point: request lengths, BF16 queries, and page-size-1 slots of the pool."""

    heads: int
    context: int
    batch: int
    lens: list[int]
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    indptr: torch.Tensor
    idx: torch.Tensor
    lens_t: torch.Tensor
    seed: int = 0

    @property
    def tokens(self) -> int:
        return sum(self.lens)


def bench_lengths(context: int, batch: int, *, max_total: int, seed: int) -> list[int]:
    """Batch 1: ``[context]``; larger batches: :func:`kvwall.model.pool.mixed_lengths` summing to
    ``min(context * batch // 4, max_total)``."""
    if batch == 1:
        return [int(context)]
    total = min(context * batch // 4, max_total)
    return mixed_lengths(total, batch, seed=seed)


def make_point(heads: int, context: int, batch: int, *, pool_slots: int, max_total: int, gen: torch.Generator,
               seed: int, device: torch.device) -> BenchPoint:
    """One bench point: :func:`bench_lengths`, random slots (repeats allowed) of a ``pool_slots`` pool, BF16 queries."""
    point_seed = seed + 1000 * batch + context
    lens = bench_lengths(context, batch, max_total=max_total, seed=point_seed)
    n = sum(lens)
    return BenchPoint(heads, context, batch, lens,
                      (torch.randn(batch, heads, DC, generator=gen, device=device) * 0.5).to(BF16),
                      (torch.randn(batch, heads, DR, generator=gen, device=device) * 0.5).to(BF16),
                      torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device),
                      torch.randint(0, pool_slots, (n,), generator=gen, device=device, dtype=torch.int32),
                      torch.tensor(lens, dtype=torch.int32, device=device), seed=point_seed)


def paged_layout(pt: BenchPoint, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA's layout of the point (the same for every paged strategy, seeded by the point): ``(block_table
    [B, max pages], cache_seqlens [B], token slots of the pool, request by request)``, pages of 64."""
    device = pool.device
    gen = torch.Generator(device=device).manual_seed(pt.seed)
    table, seqlens = random_page_table(pt.lens, pool.shape[0] // PAGE_SIZE, gen, device)
    offsets = torch.arange(PAGE_SIZE, device=device)
    slots = torch.cat([(table[i, :-(-n // PAGE_SIZE)].long()[:, None] * PAGE_SIZE + offsets).flatten()[:n]
                       for i, n in enumerate(pt.lens)])
    return table, seqlens, slots


def reference_f64(pt: BenchPoint, pool: torch.Tensor, paged: bool) -> torch.Tensor:
    """Float64 MLA decode of the point on the FP8 pool's exact values: page-size-1 slots (``pt.idx``), or FlashMLA's
    paged layout (:func:`paged_layout`)."""
    slots = paged_layout(pt, pool)[2] if paged else pt.idx.long()
    indptr = torch.tensor([0, *torch.tensor(pt.lens).cumsum(0).tolist()], dtype=torch.int64, device=pool.device)
    return mla_decode_reference(pt.q_nope, pt.q_pe, pool[:, 0, :DC], pool[:, 0, DC:], indptr, slots, SM_SCALE,
                                compute_dtype=torch.float64)


def _bf16_wrapper(backend: str, pt: BenchPoint, indices: torch.Tensor, info: dict[str, Any],
                  check: Callable[[FlashInferMLADecode], object]) -> FlashInferMLADecode:
    """FlashInfer BF16 planned with ``backend`` (its first run ``check``-ed), else with fa2; ``info`` gets the
    backend that ran, plan ms, and ``<backend>_error`` when the first refused."""
    tried: dict[str, str] = {}
    for name in dict.fromkeys((backend, "fa2")):
        try:
            wrapper = FlashInferMLADecode(pt.heads, pt.indptr, indices, pt.lens_t, SM_SCALE, kv_dtype=BF16,
                                          backend=name)
            check(wrapper)
            synchronize(pt.idx.device)
        except Exception as exc:  # noqa: BLE001 - fa3 may not run a shape: fall back to fa2, say so
            tried[name] = error_text(exc)
            continue
        info.update(backend=wrapper.backend, plan_ms=wrapper.plan_ms,
                    **{f"{k}_error": v for k, v in tried.items()})
        return wrapper
    raise RuntimeError(f"no FlashInfer BF16 backend ran: {tried}")


def _fused(pt: BenchPoint, pool: torch.Tensor, out: torch.Tensor, info: dict[str, Any]) -> Call:
    # What a checked call would pick: the launch shape for the longest request and the batch's plan (its work list,
    # made once here as a decode step makes it once for all its layers); the timed call is unchecked.
    device = pool.device
    cfg = default_config(pt.heads, DC, device, max(pt.lens))
    plan = plan_mla_decode(pt.indptr, heads=pt.heads, config=cfg)
    info.update(work_items=plan.items, chunk_tokens=plan.work_list.chunk_tokens,
                imbalance=plan.work_list.imbalance(), config=dataclasses.asdict(cfg))
    c2, k2 = pool[:, 0, :DC], pool[:, 0, DC:]
    return lambda: mla_decode_fp8(pt.q_nope, pt.q_pe, c2, k2, pt.indptr, pt.idx, SM_SCALE, out=out, check_range=False,
                                  config=cfg, plan=plan)


def _fused_paged(pt: BenchPoint, pool: torch.Tensor, out: torch.Tensor, info: dict[str, Any]) -> Call:
    # The same kernel on FlashMLA's layout: the same tokens per request on random pages of 64 of the same pool.
    device = pool.device
    pages = pool.shape[0] // PAGE_SIZE
    paged = pool[:pages * PAGE_SIZE].view(pages, PAGE_SIZE, D)
    table, seqlens, _ = paged_layout(pt, pool)
    n_pages = [-(-n // PAGE_SIZE) for n in pt.lens]
    indptr = torch.tensor([0, *torch.tensor(n_pages).cumsum(0).tolist()], dtype=torch.int32, device=device)
    indices = torch.cat([table[i, :n] for i, n in enumerate(n_pages)]).contiguous()
    cfg = default_config(pt.heads, DC, device, max(pt.lens))
    plan = plan_mla_decode(indptr, seqlens, heads=pt.heads, page_size=PAGE_SIZE, config=cfg)
    info.update(page_size=PAGE_SIZE, work_items=plan.items, chunk_tokens=plan.work_list.chunk_tokens,
                imbalance=plan.work_list.imbalance(), config=dataclasses.asdict(cfg))
    c3, k3 = paged[:, :, :DC], paged[:, :, DC:]
    return lambda: mla_decode_fp8(pt.q_nope, pt.q_pe, c3, k3, indptr, indices, SM_SCALE, out=out, kv_len=seqlens,
                                  check_range=False, config=cfg, plan=plan)


def _full_cast(pt: BenchPoint, pool: torch.Tensor, out: torch.Tensor, info: dict[str, Any], backend: str) -> Call:
    def call_on(wrapper: FlashInferMLADecode) -> torch.Tensor:
        p = pool.to(BF16)
        return wrapper.run(pt.q_nope, pt.q_pe, p[:, :, :DC], p[:, :, DC:], out=out)

    wrapper = _bf16_wrapper(backend, pt, pt.idx, info, call_on)
    return lambda: call_on(wrapper)


def _gather_cast(pt: BenchPoint, pool: torch.Tensor, out: torch.Tensor, info: dict[str, Any], backend: str) -> Call:
    buf = torch.empty(pt.tokens, 1, D, dtype=BF16, device=pool.device)
    compact = torch.arange(pt.tokens, dtype=torch.int32, device=pool.device)

    def call_on(wrapper: FlashInferMLADecode) -> torch.Tensor:
        gather_cast(pool, pt.idx, None, out=buf, check_range=False)
        return wrapper.run(pt.q_nope, pt.q_pe, buf[:, :, :DC], buf[:, :, DC:], out=out)

    wrapper = _bf16_wrapper(backend, pt, compact, info, call_on)
    info["buffer_bytes"] = buf.numel() * 2
    return lambda: call_on(wrapper)


def _precast(pt: BenchPoint, pool: torch.Tensor, out: torch.Tensor, info: dict[str, Any], backend: str) -> Call:
    pb = pool.to(BF16)

    def call_on(wrapper: FlashInferMLADecode) -> torch.Tensor:
        return wrapper.run(pt.q_nope, pt.q_pe, pb[:, :, :DC], pb[:, :, DC:], out=out)

    wrapper = _bf16_wrapper(backend, pt, pt.idx, info, call_on)
    info["pool_bf16_bytes"] = pb.numel() * 2
    return lambda: call_on(wrapper)


def _flashinfer_fp8(pt: BenchPoint, pool: torch.Tensor, out: torch.Tensor, info: dict[str, Any],
                    backend: str) -> Call:
    wrapper = FlashInferMLADecode(pt.heads, pt.indptr, pt.idx, pt.lens_t, SM_SCALE, kv_dtype=FP8, backend=backend)
    info.update(backend=wrapper.backend, plan_ms=wrapper.plan_ms)
    ckv8, kpe8 = pool[:, :, :DC], pool[:, :, DC:]
    return lambda: wrapper.run(pt.q_nope, pt.q_pe, ckv8, kpe8, out, fp8_scales=(1.0, 1.0))


def _sglang(pt: BenchPoint, pool: torch.Tensor, out: torch.Tensor, info: dict[str, Any], *, sm_count: int,
            max_context: int) -> tuple[Call, SGLangTritonMLA]:
    q = torch.cat([pt.q_nope, pt.q_pe], dim=-1).contiguous()  # SGLang's q: [B, H, 576], BF16
    sg = SGLangTritonMLA.load(q, pool, out, pt.indptr, pt.idx, pt.lens_t, SM_SCALE, kv_lora_rank=DC)
    max_splits = sglang_max_kv_splits(sm_count, max_context)
    num_kv_splits = sg.own_splits(max_splits, sm_count)
    chosen = num_kv_splits.tolist()
    call = sg.call(num_kv_splits, max_splits)
    try:
        call()
        synchronize(pool.device)
    except Exception as exc:  # noqa: BLE001 - PDL launch refused: SGLang without PDL, recorded
        info["pdl_error"] = error_text(exc)
        sg.use_pdl = False
    info.update(max_kv_splits=max_splits, num_kv_splits_min=min(chosen), num_kv_splits_max=max(chosen),
                use_pdl=sg.use_pdl, sglang_file=sg.kernels.get("file"), sglang_source=sg.kernels.get("source"))
    return call, sg


def _flashmla(pt: BenchPoint, pool: torch.Tensor, info: dict[str, Any], fp8: bool) -> Call:
    pages = pool.shape[0] // PAGE_SIZE
    paged = pool[:pages * PAGE_SIZE].view(pages, PAGE_SIZE, 1, D)
    table, seqlens, _ = paged_layout(pt, pool)
    cache = paged if fp8 else paged.to(BF16)
    decode = FlashMLADecode(pt.q_nope, pt.q_pe, cache, table, seqlens, SM_SCALE, fp8=fp8)
    info.update(page_size=PAGE_SIZE, flash_mla=decode.version, name=decode.name)
    if not fp8:
        info["pool_bf16_bytes"] = cache.numel() * 2
    return decode


def build_strategy(name: str, pt: BenchPoint, pool: torch.Tensor, *, cast_backend: str, sglang_max_context: int,
                   sm_count: int) -> tuple[Call, dict[str, Any], SGLangTritonMLA | None]:
    """(the call to time, fields for the row, SGLang's batch for its split sweep) for one strategy at one point."""
    out = torch.empty(pt.batch, pt.heads, DC, dtype=BF16, device=pool.device)
    info: dict[str, Any] = {}
    if name == "fused_fp8":
        return _fused(pt, pool, out, info), info, None
    if name == "fused_fp8_page64":
        return _fused_paged(pt, pool, out, info), info, None
    if name == "full_cast_bf16":
        return _full_cast(pt, pool, out, info, cast_backend), info, None
    if name == "gather_cast_bf16":
        return _gather_cast(pt, pool, out, info, cast_backend), info, None
    if name in ("flashinfer_fp8_fa2", "flashinfer_fp8_fa3"):
        return _flashinfer_fp8(pt, pool, out, info, name.rsplit("_", 1)[1]), info, None
    if name == "flashinfer_bf16_precast":
        return _precast(pt, pool, out, info, cast_backend), info, None
    if name == "sglang_triton_fp8":
        call, sg = _sglang(pt, pool, out, info, sm_count=sm_count, max_context=sglang_max_context)
        return call, info, sg
    if name in ("flashmla_dense_bf16", "flashmla_dense_fp8"):
        return _flashmla(pt, pool, info, name.endswith("fp8")), info, None
    raise ValueError(f"unknown strategy {name!r}; known: {STRATEGIES}")
