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
``fused_fp8``             chapter 5's fused decode, the kernel the dispatcher picks: no BF16 copy   FP8
``flashinfer_fp8``        FlashInfer's native FP8 MLA (fa3; SM90 only, FlashInfer >= 0.6.14)        FP8
``bf16_cache``            no cast at all: the cache is BF16 (twice the bytes per token)            BF16
========================  ========================================================================  ==========

Every FlashInfer BF16 path uses the same FlashInfer backend (``bf16_backend``: fa3 on Hopper, fa2 elsewhere), so
no path is pinned to a slower kernel than its peers. On a CPU, FlashInfer does not run: the BF16 paths attend with
the float32 reference (:class:`kvwall.model.attention.ReferenceMLADecode`) and ``fused_fp8`` runs in Triton's
interpreter; ``flashinfer_fp8`` is GPU-only. ``fused_fp8`` runs whichever of our kernels
:mod:`kvwall.kernels.mla_decode.dispatch` picks for the GPU and the batch (:func:`choose_fused_kernel`): the Triton
kernel on a CPU and on a GPU without a measured table, the CUDA mma.sync or wgmma path where chapter 5 measured it
faster.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from kvwall.kernels.mla_decode import dispatch
from kvwall.kernels.mla_decode.dispatch import KernelPath
from kvwall.kernels.mla_decode.kernel import MLADecodePlan
from kvwall.kernels.mla_decode.reference import split_latent_cache
from kvwall.model.attention import FlashInferMLADecode, MLADecode, ReferenceMLADecode
from kvwall.model.geometry import MLAGeometry, dtype_bytes
from kvwall.model.pool import DecodeBatch, TokenPool
from kvwall.model.strategies import FullPoolCast, GatherCast, IndexThenCast, KVStrategy, compact_batch

__all__ = ["STEP_PATHS", "PathInfo", "PATH_INFO", "CacheViews", "KERNEL_NAMES", "kernel_that_ran", "kernels_that_ran",
           "FusedKernel", "choose_fused_kernel", "FusedFP8Decode", "FlashInferFP8Decode", "bf16_backend_for",
           "build_step_path", "kv_bytes_per_token"]

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


@dataclass(frozen=True)
class PathInfo:
    """What a path is, for tables: a short label, its cache dtype, and whether it reads FP8 without any copy."""

    label: str
    cache_dtype: torch.dtype
    copies_kv: bool
    gpu_only: bool = False


PATH_INFO: dict[str, PathInfo] = {
    "full_pool_cast": PathInfo("whole-pool cast + FlashInfer BF16 (the original)", FP8, True),
    "index_then_cast": PathInfo("PyTorch index_select().to(bf16) + FlashInfer BF16", FP8, True),
    "gather_cast": PathInfo("gather_cast kernel + FlashInfer BF16 (chapter 4)", FP8, True),
    "fused_fp8": PathInfo("fused FP8 MLA decode, ours (chapter 5)", FP8, False),
    "flashinfer_fp8": PathInfo("FlashInfer native FP8 MLA (SM90, >= 0.6.14)", FP8, False, gpu_only=True),
    "bf16_cache": PathInfo("BF16 cache + FlashInfer BF16 (2x memory)", BF16, False),
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


#: Our fused decode's kernels, by the dispatcher's name for each (:mod:`kvwall.kernels.mla_decode.dispatch`).
KERNEL_NAMES: dict[str, str] = {"triton": "Triton kernel", "cuda": "CUDA C++ mma.sync path", "wgmma": "wgmma path"}


def kernel_that_ran(row: Mapping[str, Any]) -> str:
    """Which of our kernels a recorded ``fused_fp8`` row ran: its ``kernel_path``; a row recorded before the path
    ran the dispatcher's choice names none, and ran the Triton kernel."""
    return row.get("kernel_path") or "triton"


def kernels_that_ran(rows: Iterable[Mapping[str, Any]]) -> Counter[str]:
    """How many of the ``fused_fp8`` rows that ran (no ``error``) ran each of our kernels."""
    return Counter(kernel_that_ran(r) for r in rows if r.get("path") == "fused_fp8" and not r.get("error"))


@dataclass(frozen=True)
class FusedKernel:
    """Which kernel of our fused FP8 decode a batch runs, the dispatcher's reason, and that kernel's plan."""

    path: KernelPath
    why: str
    plan: MLADecodePlan

    def call_kwargs(self) -> dict[str, Any]:
        """Keywords only the chosen kernel takes: the Triton kernel's launch shape is its plan's."""
        return {"config": self.plan.config} if self.path == "triton" else {}


def choose_fused_kernel(kv_indptr: torch.Tensor, *, heads: int, ckv: torch.Tensor, kpe: torch.Tensor,
                        device: torch.device) -> FusedKernel:
    """:func:`kvwall.kernels.mla_decode.dispatch.choose_path` for a batch of requests (page size 1) on the FP8 cache
    views ``ckv``/``kpe``, and the plan of the chosen kernel: made here, once per step, outside any CUDA-graph
    capture (it reads the lengths on the host)."""
    ptr = kv_indptr.tolist()
    path, why = dispatch.choose_path(heads, len(ptr) - 1, max(b - a for a, b in zip(ptr, ptr[1:])), device,
                                     ckv_cache=ckv, kpe_cache=kpe)
    plan = dispatch.plan_mla_decode_auto(kv_indptr, heads=heads, device=device, path=path, ckv_cache=ckv,
                                         kpe_cache=kpe)
    return FusedKernel(path, why, plan)


class FusedFP8Decode:
    """Our fused FP8 MLA decode on a batch, on the kernel :func:`choose_fused_kernel` picks for the layer's FP8 cache
    (layer 0's views: every layer has the same layout). The step's plan is made once here and reused by every layer;
    the first call is checked (the range check), the rest unchecked (CUDA-graph capturable)."""

    def __init__(self, geometry: MLAGeometry, batch: DecodeBatch, pool: TokenPool) -> None:
        self.batch, self.sm_scale = batch, geometry.sm_scale
        heads = geometry.heads_per_gpu
        ckv, kpe = split_latent_cache(pool.key_buffer(0), geometry.kv_lora_rank)
        self.kernel = choose_fused_kernel(batch.kv_indptr, heads=heads, ckv=ckv, kpe=kpe, device=pool.device)
        self.out = torch.empty(batch.batch_size, heads, geometry.kv_lora_rank, dtype=BF16, device=pool.device)
        self.name = f"kvwall fused FP8 decode, {self.kernel.path} path ({self.kernel.plan.items} work items)"
        self._checked = False

    def __call__(self, q_nope, q_pe, ckv, kpe):
        out = dispatch.mla_decode(q_nope, q_pe, ckv, kpe, self.batch.kv_indptr, self.batch.kv_indices, self.sm_scale,
                                  plan=self.kernel.plan, out=self.out, check_range=not self._checked,
                                  **self.kernel.call_kwargs())
        self._checked = True
        return out


class FlashInferFP8Decode(FlashInferMLADecode):
    """FlashInfer's native FP8 MLA (scales 1: the pool holds unscaled e4m3 values)."""

    def __call__(self, q_nope, q_pe, ckv, kpe):
        return self.run(q_nope, q_pe, ckv, kpe, fp8_scales=(1.0, 1.0))


def build_step_path(path: str, pool: TokenPool, batch: DecodeBatch, *, bf16_backend: str
                    ) -> tuple[KVStrategy, MLADecode, dict[str, Any]]:
    """``(strategy, attention, info)`` of ``path`` for ``batch`` on ``pool`` (whose dtype must be the path's cache
    dtype). ``info`` says which attention ran and with which FlashInfer backend (``fused_fp8``: which of our
    kernels, ``kernel_path``, and the dispatcher's ``why``)."""
    if path not in PATH_INFO:
        raise ValueError(f"unknown path {path!r}; choose from {STEP_PATHS}.")
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
    if path == "fused_fp8":
        attention = FusedFP8Decode(geometry, batch, pool)
        return strategy, attention, {"attention": attention.name, "backend": attention.kernel.path,
                                     "kernel_path": attention.kernel.path, "why": attention.kernel.why}
    if path == "flashinfer_fp8":
        attention = FlashInferFP8Decode.for_batch(geometry, batch, kv_dtype=FP8, backend="fa3")
        return strategy, attention, {"attention": attention.name, "backend": attention.backend}
    if on_gpu:
        attention = FlashInferMLADecode.for_batch(geometry, attn_batch, backend=bf16_backend)
        return strategy, attention, {"attention": attention.name, "backend": attention.backend}
    attention = ReferenceMLADecode(geometry, attn_batch)
    return strategy, attention, {"attention": "float32 reference (CPU)", "backend": "reference"}
