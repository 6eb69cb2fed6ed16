"""KV strategies: how a layer gets from the FP8 pool to something a BF16 attention kernel accepts.

A strategy's ``prepare_kv`` returns the ``(ckv, kpe)`` views attention reads for one layer.
Chapter 1's :class:`FullPoolCast` is the original one ("before"). Chapter 4's strategies cast only
the rows the batch's page table references.

Every chapter-4 strategy produces a *compact* BF16 buffer whose row ``i`` is the ``i``-th entry of the
batch's ``kv_indices``; the attention is therefore planned with indices ``0..n-1`` (the batch from
:func:`compact_batch`), not with the pool's slots.

- :class:`IndexThenCast`: PyTorch ``pool.index_select(0, idx).to(bfloat16)``, two kernels and an
  FP8 temporary. With ``capacity`` the index buffer is graph-sized (padded with the reserved slot
  0, as a CUDA-graph-captured step must be), so both kernels run over the whole capacity.
- :class:`GatherCast`: the fused kernel (Triton, or the CUDA C++ twin), writing into one
  preallocated buffer of ``capacity`` rows with ``kv_indptr`` read on the device: it touches only
  the real rows whatever the capacity. The call is validated once, when the strategy is built
  (``plan_gather`` with the host-side range check, a sync), and each layer then only launches the
  kernel on that layer's pool (``launch_gather(plan, pool=...)``): no per-layer host sync and no
  per-layer re-validation, which chapter 4's profile showed to matter for an eager step's host time.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvwall.kernels.gather.cuda import launch_gather_cuda
from kvwall.kernels.gather.kernel import launch_gather, plan_gather
from kvwall.kernels.mla_decode.reference import split_latent_cache
from kvwall.model.pool import RESERVED_SLOT, DecodeBatch, TokenPool

__all__ = [
    "KVStrategy",
    "FullPoolCast",
    "compact_batch",
    "IndexThenCast",
    "GatherCast",
    "GATHER_STRATEGIES",
    "make_strategy",
]


class KVStrategy(Protocol):
    name: str

    def prepare_kv(self, pool: TokenPool, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...


class FullPoolCast:
    """SGLang ``flashinfer_mla`` with an FP8 KV cache, before the fix.

    ``forward_decode`` did ``k_buffer = token_to_kv_pool.get_key_buffer(layer_id).to(q.dtype)``:
    the *whole* layer's pool, every slot, cast to BF16 on every layer of every step, because the
    attention kernel only compiled for 16-bit KV. The cast is an ``aten::copy_``.
    """

    name = "full-pool cast (SGLang flashinfer_mla, FP8 KV)"

    def prepare_kv(self, pool: TokenPool, layer: int, dtype: torch.dtype):
        k_buffer = pool.key_buffer(layer).to(dtype)
        return split_latent_cache(k_buffer, pool.geometry.kv_lora_rank)


def compact_batch(batch: DecodeBatch) -> DecodeBatch:
    """The batch as the attention sees it after a gather: request ``b``'s tokens are rows
    ``kv_indptr[b]..kv_indptr[b+1]-1`` of the compact buffer."""
    n = batch.total_tokens
    return DecodeBatch(
        batch.context_lens,
        batch.kv_indptr,
        torch.arange(n, dtype=torch.int32, device=batch.kv_indices.device),
        batch.new_token_slots,
    )


def _capacity_indices(batch: DecodeBatch, capacity: int | None) -> torch.Tensor:
    n = batch.total_tokens
    if capacity is None:
        return batch.kv_indices
    if capacity < n:
        raise ValueError(
            f"capacity={capacity} is smaller than the batch's {n} tokens: a graph captured for "
            f"{capacity} rows cannot hold this batch."
        )
    buf = torch.full((capacity,), RESERVED_SLOT, dtype=batch.kv_indices.dtype, device=batch.kv_indices.device)
    buf[:n] = batch.kv_indices
    return buf


class IndexThenCast:
    """``pool.index_select(0, kv_indices).to(bfloat16)``: the obvious PyTorch gather-then-cast."""

    def __init__(self, batch: DecodeBatch, capacity: int | None = None) -> None:
        self.kv_indices = _capacity_indices(batch, capacity).long()
        self.capacity = capacity
        self.name = (
            "PyTorch index_select().to(bf16), real length"
            if capacity is None
            else f"PyTorch index_select().to(bf16) over a graph-sized capacity of {capacity:,}"
        )

    def attention_batch(self, batch: DecodeBatch) -> DecodeBatch:
        return compact_batch(batch)

    def prepare_kv(self, pool: TokenPool, layer: int, dtype: torch.dtype):
        rows = pool.key_buffer(layer).index_select(0, self.kv_indices).to(dtype)
        return split_latent_cache(rows, pool.geometry.kv_lora_rank)


class GatherCast:
    """The fused gather-then-cast kernel into a preallocated ``capacity``-row buffer."""

    def __init__(
        self, batch: DecodeBatch, pool: TokenPool, *, impl: str = "triton", capacity: int | None = None
    ) -> None:
        if impl not in ("triton", "cuda"):
            raise ValueError(f"impl={impl!r}: use 'triton' or 'cuda'.")
        self.launch = launch_gather if impl == "triton" else launch_gather_cuda
        self.kv_indices = _capacity_indices(batch, capacity)
        self.kv_indptr = batch.kv_indptr
        rows = self.kv_indices.numel()
        self.out = torch.empty((rows, *pool.key_buffer(0).shape[1:]), dtype=torch.bfloat16, device=pool.device)
        # Validate once, with the host-side range checks; every layer's pool has the planned layout, so the
        # per-layer calls only launch (no sync, no re-validation).
        self.plan = plan_gather(pool.key_buffer(0), self.kv_indices, self.kv_indptr, out=self.out, check_range=True)
        self.launch(self.plan)
        self.capacity = capacity
        where = "real length" if capacity is None else f"capacity {capacity:,}, kv_indptr on the device"
        self.name = f"gather_cast ({'Triton' if impl == 'triton' else 'CUDA C++'}), {where}"

    def attention_batch(self, batch: DecodeBatch) -> DecodeBatch:
        return compact_batch(batch)

    def prepare_kv(self, pool: TokenPool, layer: int, dtype: torch.dtype):
        if dtype != torch.bfloat16:
            raise ValueError(f"gather_cast writes bfloat16; the step asked for {dtype}.")
        out = self.launch(self.plan, pool=pool.key_buffer(layer))
        return split_latent_cache(out, pool.geometry.kv_lora_rank)


GATHER_STRATEGIES = (
    "full_pool_cast",
    "index_then_cast",
    "index_then_cast_capacity",
    "gather_cast",
    "gather_cast_capacity",
    "gather_cast_cuda",
    "gather_cast_cuda_capacity",
)


def make_strategy(kind: str, batch: DecodeBatch, pool: TokenPool, capacity: int):
    """One of :data:`GATHER_STRATEGIES`, built for ``batch`` (``capacity`` for the graph-sized ones)."""
    if kind == "full_pool_cast":
        return FullPoolCast()
    if kind.startswith("index_then_cast"):
        return IndexThenCast(batch, capacity if kind.endswith("_capacity") else None)
    if kind.startswith("gather_cast"):
        impl = "cuda" if "_cuda" in kind else "triton"
        return GatherCast(batch, pool, impl=impl, capacity=capacity if kind.endswith("_capacity") else None)
    raise ValueError(f"unknown strategy {kind!r}; choose from {GATHER_STRATEGIES}.")
