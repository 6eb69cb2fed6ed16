"""An SGLang-like FP8 token pool for MLA, and the page tables of a decode batch.

SGLang's ``MLATokenToKVPool`` keeps one buffer per layer, shaped ``[slots, 1, kv_lora_rank +
qk_rope_head_dim]``, in the KV cache dtype (here ``float8_e4m3fn``); slot 0 is reserved as the
padding slot. With page size 1 a request's tokens live in whatever slots the allocator handed out,
so after some churn they are scattered across the pool; ``kv_indices`` lists them per request and
``kv_indptr`` delimits the requests (CSR layout, as FlashInfer's MLA wrapper takes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvwall.model.geometry import MLAGeometry

__all__ = ["mixed_lengths", "TokenPool", "DecodeBatch", "make_decode_batch", "random_kv"]

KV_CACHE_DTYPE = torch.float8_e4m3fn
RESERVED_SLOT = 0


def random_kv(
    shape: Sequence[int],
    *,
    generator: torch.Generator,
    device: torch.device | str,
    dtype: torch.dtype = KV_CACHE_DTYPE,
) -> torch.Tensor:
    """Standard-normal values quantized to ``dtype`` (the quantization is done by torch)."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    # Fill in chunks: a 495K-slot pool in float32 would be 1.1 GB per layer at once.
    flat = out.view(-1)
    chunk = 1 << 26
    for start in range(0, flat.numel(), chunk):
        stop = min(start + chunk, flat.numel())
        values = torch.randn(stop - start, generator=generator, dtype=torch.float32, device="cpu")
        flat[start:stop] = values.to(device=device).to(dtype)
    return out


@dataclass
class TokenPool:
    """Per-layer FP8 KV buffers, ``[num_slots, 1, kv_dim]`` each; slot 0 reserved."""

    geometry: MLAGeometry
    buffers: list[torch.Tensor]

    @classmethod
    def random(
        cls,
        geometry: MLAGeometry,
        num_slots: int,
        num_layers: int,
        *,
        device: torch.device | str = "cpu",
        seed: int = 0,
        dtype: torch.dtype = KV_CACHE_DTYPE,
    ) -> "TokenPool":
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots}: a pool needs the reserved slot 0 and at least one more.")
        if not 1 <= num_layers:
            raise ValueError(f"num_layers={num_layers} must be at least 1.")
        gen = torch.Generator().manual_seed(seed)
        shape = (num_slots, 1, geometry.kv_dim)
        buffers = []
        first = random_kv(shape, generator=gen, device=device, dtype=dtype)
        buffers.append(first)
        for layer in range(1, num_layers):
            # Layers differ, but drawing 78 x 285 MB of normals on the host is slow: roll the
            # first layer's values by a per-layer offset instead (same distribution, distinct data).
            buffers.append(torch.roll(first.view(torch.uint8), shifts=layer * 977, dims=0).view(dtype))
        return cls(geometry=geometry, buffers=buffers)

    @property
    def num_slots(self) -> int:
        return self.buffers[0].shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.buffers)

    @property
    def dtype(self) -> torch.dtype:
        return self.buffers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    def key_buffer(self, layer: int) -> torch.Tensor:
        """SGLang's ``get_key_buffer(layer_id)``: the whole layer's pool, ``[slots, 1, kv_dim]``."""
        return self.buffers[layer]

    def write_new_tokens(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store the decoded tokens' latent KV (``[batch, 1, kv_dim]``) into their slots.

        Done through a uint8 view, as SGLang does: indexed writes are not implemented for
        float8 tensors on every backend.
        """
        buf = self.buffers[layer]
        buf.view(torch.uint8)[slots] = kv.to(buf.dtype).view(torch.uint8)

    def nbytes_per_layer(self) -> int:
        b = self.buffers[0]
        return b.numel() * b.element_size()


@dataclass
class DecodeBatch:
    """Page tables (page size 1) of a batch of requests, each decoding one token."""

    context_lens: torch.Tensor  # [batch] int32, tokens attended to, the new one included
    kv_indptr: torch.Tensor  # [batch + 1] int32
    kv_indices: torch.Tensor  # [sum(context_lens)] int32, slots in the pool
    new_token_slots: torch.Tensor  # [batch] int64, where each request's new token is written

    @property
    def batch_size(self) -> int:
        return int(self.context_lens.numel())

    @property
    def total_tokens(self) -> int:
        return int(self.kv_indices.numel())

    def to(self, device: torch.device | str) -> "DecodeBatch":
        return DecodeBatch(
            *(t.to(device) for t in (self.context_lens, self.kv_indptr, self.kv_indices, self.new_token_slots))
        )


def make_decode_batch(
    context_lens: Sequence[int],
    num_slots: int,
    *,
    seed: int = 0,
    max_run: int = 256,
    device: torch.device | str = "cpu",
) -> DecodeBatch:
    """Random but realistic page tables: the pool's free slots after churn.

    The allocator's free list is modelled as runs of 1..``max_run`` contiguous slots in random
    order (prefill hands out contiguous runs; finished requests return them in any order), and
    each request takes its tokens from it in turn. Slot 0 is never handed out.
    """
    lens = [int(n) for n in context_lens]
    if not lens or min(lens) < 1:
        raise ValueError(f"context_lens={list(context_lens)!r}: need at least one request, each with >= 1 token.")
    need = sum(lens)
    if need > num_slots - 1:
        raise ValueError(
            f"The batch needs {need} slots but the pool has {num_slots - 1} usable ones "
            f"(num_slots={num_slots}, slot 0 reserved): grow the pool or shorten the contexts."
        )
    gen = torch.Generator().manual_seed(seed)
    # Cut [1, num_slots) into runs, shuffle the runs.
    cuts = torch.randint(1, max_run + 1, (num_slots // 1 + 1,), generator=gen).cumsum(0) + 1
    cuts = cuts[cuts < num_slots]
    starts = torch.cat([torch.tensor([1]), cuts])
    stops = torch.cat([cuts, torch.tensor([num_slots])])
    order = torch.randperm(starts.numel(), generator=gen)
    free = torch.cat([torch.arange(int(starts[i]), int(stops[i])) for i in order.tolist()])
    kv_indices = free[:need].to(torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    new_slots = kv_indices[indptr[1:].long() - 1].long()
    batch = DecodeBatch(
        context_lens=torch.tensor(lens, dtype=torch.int32),
        kv_indptr=indptr,
        kv_indices=kv_indices,
        new_token_slots=new_slots,
    )
    return batch.to(device)


def mixed_lengths(total: int, batch: int, *, seed: int) -> list[int]:
    """``batch`` request lengths (log-uniform spread, each >= 1) summing to ``total``."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.exp(torch.rand(batch, generator=gen, dtype=torch.float64) * 4.0)
    lens = [max(1, int(w)) for w in (weights / weights.sum() * total).tolist()]
    lens[0] += total - sum(lens)
    if lens[0] < 1:
        raise ValueError(f"cannot split {total} tokens over {batch} requests.")
    return lens
