"""The ways past the wall, each as one decode step's KV strategy and attention kernel (chapter 6).

A *path* is what a layer does between the FP8 pool and its attention output. Chapter 1's decode-step model
(:class:`kvwall.model.decode_step.DecodeStepModel`) runs any of them unchanged, so every path is timed on the
same step, the same pool, the same page table and the same modelled rest of the layer:

========================  ========================================================================  ==========
path                      per layer                                                                 cache
========================  ========================================================================  ==========
``full_pool_cast``        the whole layer's pool cast to BF16 (the original), FlashInfer BF16       FP8
``index_then_cast``       PyTorch ``pool.index_select(0, kv_indices).to(bf16)``, FlashInfer BF16    FP8
``gather_cast``           chapter 4's ``gather_cast`` kernel (real rows only), FlashInfer BF16      FP8
``ours``                  chapter 5's FP8 MLA decode, the path the dispatcher picks: no BF16 copy   FP8
``flashinfer_fp8``        FlashInfer's native FP8 MLA (fa3; SM90 only, FlashInfer >= 0.6.14)        FP8
``bf16_cache``            no cast at all: the cache is BF16 (twice the bytes per token)            BF16
``flashmla_fp8``          FlashMLA dense FP8 (SM90; pages of 64, FP8 query)                         FP8
``flashmla_bf16``         FlashMLA dense BF16 (SM90; pages of 64)                                   BF16
========================  ========================================================================  ==========

Every FlashInfer BF16 path uses the same FlashInfer backend (``bf16_backend``: fa3 on Hopper, fa2 elsewhere), so
no path is pinned to a slower kernel than its peers. On a CPU, FlashInfer does not run: the BF16 paths attend with
the float32 reference (:class:`kvwall.model.attention.ReferenceMLADecode`) and ``ours`` runs in Triton's
interpreter; ``flashinfer_fp8`` and the FlashMLA paths are GPU-only. ``ours`` is the call a user makes:
:func:`kvwall.kernels.mla_decode` with the step's plan (:func:`kvwall.kernels.plan_mla_decode`), on the path the
plan picks for the GPU and the batch: the Triton path (portable: any GPU Triton supports, and the CPU interpreter),
the wgmma path (Hopper, 64 heads per CTA) or the tokens-on-M wgmma path (Hopper, 16 or 32 heads per CTA). FlashMLA
is a peer's kernel (:mod:`kvwall.peers`, a layer above this one): its two paths are described here and built by
:mod:`kvwall.experiments.answer.step`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from kvwall.kernels.mla_decode.dispatch import mla_decode, plan_mla_decode
from kvwall.kernels.mla_decode.reference import split_latent_cache
from kvwall.model.attention import FlashInferMLADecode, MLADecode, ReferenceMLADecode
from kvwall.model.geometry import MLAGeometry, dtype_bytes
from kvwall.model.pool import DecodeBatch, TokenPool
from kvwall.model.strategies import FullPoolCast, GatherCast, IndexThenCast, KVStrategy, compact_batch

__all__ = [
    "STEP_PATHS",
    "PathInfo",
    "PATH_INFO",
    "CacheViews",
    "KERNEL_NAMES",
    "kernel_that_ran",
    "kernels_that_ran",
    "OursDecode",
    "FlashInferFP8Decode",
    "bf16_backend_for",
    "build_step_path",
    "kv_bytes_per_token",
]

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


@dataclass(frozen=True)
class PathInfo:
    """What a path is, for tables: a short label, its cache dtype, and whether it reads FP8 without any copy."""

    label: str
    cache_dtype: torch.dtype
    copies_kv: bool
    gpu_only: bool = False
    #: A peer's kernel built above this layer (:mod:`kvwall.experiments.answer.step`), not by :func:`build_step_path`.
    peer: bool = False


PATH_INFO: dict[str, PathInfo] = {
    "full_pool_cast": PathInfo("whole-pool cast + FlashInfer BF16 (the original)", FP8, True),
    "index_then_cast": PathInfo("PyTorch index_select().to(bf16) + FlashInfer BF16", FP8, True),
    "gather_cast": PathInfo("gather_cast kernel + FlashInfer BF16 (chapter 4)", FP8, True),
    "ours": PathInfo("ours: FP8 MLA decode, the dispatcher's path (chapter 5)", FP8, False),
    "flashinfer_fp8": PathInfo("FlashInfer native FP8 MLA (SM90, >= 0.6.14)", FP8, False, gpu_only=True),
    "bf16_cache": PathInfo("BF16 cache + FlashInfer BF16 (2x memory)", BF16, False),
    "flashmla_fp8": PathInfo("FlashMLA dense FP8 (SM90, pages of 64, FP8 query)", FP8, False, gpu_only=True, peer=True),
    "flashmla_bf16": PathInfo(
        "FlashMLA dense BF16 (SM90, pages of 64, 2x memory)", BF16, False, gpu_only=True, peer=True
    ),
}
#: The paths chapter 6 runs on the decode step, in the order the book shows them.
STEP_PATHS = tuple(PATH_INFO)


def kv_bytes_per_token(geometry: MLAGeometry, cache_dtype: torch.dtype, *, index_bytes: int = 4) -> int:
    """Bytes one token costs the KV pool over every layer (latent + rotary in ``cache_dtype``), plus its
    page-table index (page size 1)."""
    return geometry.num_layers * geometry.kv_dim * dtype_bytes(cache_dtype) + index_bytes


def bf16_backend_for(device: torch.device) -> str:
    """The FlashInfer backend every BF16 path uses: fa3 on Hopper (SM90), where it is FlashInfer's fastest MLA
    decode, else fa2 (fa3 is SM90-only)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        return "fa3"
    return "fa2"


class CacheViews:
    """No KV work at all: the layer's pool as ``(ckv, kpe)`` views, in whatever dtype the cache holds."""

    def __init__(self, name: str) -> None:
        self.name = name

    def prepare_kv(self, pool: TokenPool, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        del dtype  # the attention reads the cache's own dtype
        return split_latent_cache(pool.key_buffer(layer), pool.geometry.kv_lora_rank)


#: The paths of ours, by the dispatcher's name for each (:data:`kvwall.kernels.mla_decode.dispatch.KERNEL_PATHS`, in
#: its order).
KERNEL_NAMES: dict[str, str] = {
    "triton": "Triton path",
    "wgmma": "wgmma path",
    "wgmma_tokens": "tokens-on-M wgmma path",
}


def kernel_that_ran(row: Mapping[str, Any]) -> str:
    """Which path a recorded ``ours`` row ran: its ``kernel_path`` (a row without one ran the Triton path)."""
    return row.get("kernel_path") or "triton"


def kernels_that_ran(rows: Iterable[Mapping[str, Any]]) -> Counter[str]:
    """How many of the ``ours`` rows that ran (no ``error``) ran each path."""
    return Counter(kernel_that_ran(r) for r in rows if r.get("path") == "ours" and not r.get("error"))


class OursDecode:
    """Ours on a batch: :func:`kvwall.kernels.mla_decode` with the step's plan (:func:`kvwall.kernels.plan_mla_decode`,
    made once here (one read of the batch's lengths), on layer 0's FP8 views: every layer has the same layout), reused
    by every layer -- as a serving engine calls it."""

    def __init__(self, geometry: MLAGeometry, batch: DecodeBatch, pool: TokenPool) -> None:
        heads = geometry.heads_per_gpu
        ckv, kpe = split_latent_cache(pool.key_buffer(0), geometry.kv_lora_rank)
        self.plan = plan_mla_decode(
            batch.kv_indptr, batch.kv_indices, heads=heads, sm_scale=geometry.sm_scale, ckv_cache=ckv, kpe_cache=kpe
        )
        self.out = torch.empty(batch.batch_size, heads, geometry.kv_lora_rank, dtype=BF16, device=pool.device)
        self.name = f"ours, {KERNEL_NAMES[self.plan.path]} ({self.plan.work.items} work items)"

    def __call__(self, q_nope, q_pe, ckv, kpe):
        return mla_decode(q_nope, q_pe, ckv, kpe, self.plan, out=self.out)


class FlashInferFP8Decode(FlashInferMLADecode):
    """FlashInfer's native FP8 MLA (scales 1: the pool holds unscaled e4m3 values)."""

    def __call__(self, q_nope, q_pe, ckv, kpe):
        return self.run(q_nope, q_pe, ckv, kpe, fp8_scales=(1.0, 1.0))


def build_step_path(
    path: str, pool: TokenPool, batch: DecodeBatch, *, bf16_backend: str
) -> tuple[KVStrategy, MLADecode, dict[str, Any]]:
    """``(strategy, attention, info)`` of ``path`` for ``batch`` on ``pool`` (whose dtype must be the path's cache
    dtype). ``info`` says which attention ran and with which FlashInfer backend (``ours``: which path,
    ``kernel_path``, and the dispatcher's reason, ``path_why``)."""
    if path not in PATH_INFO:
        raise ValueError(f"unknown path {path!r}; choose from {STEP_PATHS}.")
    if PATH_INFO[path].peer:
        raise ValueError(
            f"path {path!r} runs a peer's kernel (kvwall.peers): kvwall.experiments.answer.step builds "
            "it (kvwall.model sits below the peers)."
        )
    want = PATH_INFO[path].cache_dtype
    if pool.dtype != want:
        raise ValueError(f"path {path!r} reads a {want} cache; the pool holds {pool.dtype}.")
    geometry, on_gpu = pool.geometry, pool.device.type == "cuda"
    if PATH_INFO[path].gpu_only and not on_gpu:
        raise RuntimeError(f"path {path!r} runs FlashInfer's native FP8 kernel: it needs an NVIDIA GPU (SM90).")
    strategy: KVStrategy
    attn_batch = batch
    if path == "full_pool_cast":
        strategy = FullPoolCast()
    elif path == "index_then_cast":
        strategy, attn_batch = IndexThenCast(batch), compact_batch(batch)
    elif path == "gather_cast":
        strategy, attn_batch = GatherCast(batch, pool), compact_batch(batch)
    else:
        strategy = CacheViews(f"the {'FP8' if want == FP8 else 'BF16'} cache as it is (no copy)")
    attention: MLADecode
    if path == "ours":
        attention = OursDecode(geometry, batch, pool)
        return (
            strategy,
            attention,
            {
                "attention": attention.name,
                "backend": attention.plan.path,
                "kernel_path": attention.plan.path,
                "path_why": attention.plan.why,
            },
        )
    if path == "flashinfer_fp8":
        attention = FlashInferFP8Decode.for_batch(geometry, batch, kv_dtype=FP8, backend="fa3")
        return strategy, attention, {"attention": attention.name, "backend": attention.backend}
    if on_gpu:
        attention = FlashInferMLADecode.for_batch(geometry, attn_batch, backend=bf16_backend)
        return strategy, attention, {"attention": attention.name, "backend": attention.backend}
    attention = ReferenceMLADecode(geometry, attn_batch)
    return strategy, attention, {"attention": "float32 reference (CPU)", "backend": "reference"}
