"""Torch reference for MLA paged decode attention: the correctness yardstick of the book.

Decode with absorbed up-projections attends in the latent space. For request ``b`` with KV slots
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` and head ``h``::

    logits[h, t] = (q_nope[b, h] . ckv[t] + q_pe[b, h] . kpe[t]) * sm_scale
    out[b, h]    = softmax_t(logits[h]) @ ckv

It reads the cache in whatever dtype it is stored in (bf16 or fp8) and computes in
``compute_dtype`` (float32 by default; float64 for checking other implementations).
"""

from __future__ import annotations

import torch

__all__ = ["mla_decode_reference", "split_latent_cache"]


def split_latent_cache(cache: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(ckv, kpe)`` of an SGLang-layout cache ``[slots, 1, kv_lora_rank + rope]``."""
    if cache.dim() != 3 or cache.shape[-1] <= kv_lora_rank:
        raise ValueError(
            f"cache of shape {tuple(cache.shape)}: expected [slots, page_size, kv_lora_rank + rope] "
            f"with a last dim larger than kv_lora_rank={kv_lora_rank}."
        )
    return cache[..., :kv_lora_rank], cache[..., kv_lora_rank:]


def _check(q_nope, q_pe, ckv, kpe, kv_indptr, kv_indices) -> None:
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(
            f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} must both be [batch, heads, dim] "
            "with the same batch and heads."
        )
    if ckv.shape[:-1] != kpe.shape[:-1]:
        raise ValueError(f"ckv {tuple(ckv.shape)} and kpe {tuple(kpe.shape)} must have the same leading dims.")
    if ckv.shape[-1] != q_nope.shape[-1] or kpe.shape[-1] != q_pe.shape[-1]:
        raise ValueError(
            f"Latent widths disagree: q_nope {q_nope.shape[-1]} vs ckv {ckv.shape[-1]}, "
            f"q_pe {q_pe.shape[-1]} vs kpe {kpe.shape[-1]}."
        )
    batch = q_nope.shape[0]
    if kv_indptr.dim() != 1 or kv_indptr.numel() != batch + 1:
        raise ValueError(f"kv_indptr has {kv_indptr.numel()} entries; expected batch + 1 = {batch + 1}.")
    if kv_indptr.dtype not in (torch.int32, torch.int64) or kv_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"kv_indptr/kv_indices must be int32 or int64, got {kv_indptr.dtype}/{kv_indices.dtype}.")
    devices = {t.device for t in (q_nope, q_pe, ckv, kpe, kv_indptr, kv_indices)}
    if len(devices) != 1:
        raise ValueError(f"All tensors must be on one device; got {sorted(map(str, devices))}.")
    ptr = kv_indptr.tolist()
    if ptr[0] != 0 or any(b < a for a, b in zip(ptr, ptr[1:])) or ptr[-1] > kv_indices.numel():
        raise ValueError(
            f"kv_indptr must start at 0, never decrease, and end at most at len(kv_indices)="
            f"{kv_indices.numel()}; got {ptr[:4]}...{ptr[-1]}."
        )
    if any(b == a for a, b in zip(ptr, ptr[1:])):
        raise ValueError("Every request needs at least one KV token (kv_indptr has an empty request).")
    num_slots = ckv.shape[0] * (ckv.shape[1] if ckv.dim() == 3 else 1)
    used = kv_indices[: ptr[-1]]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_slots):
        raise IndexError(
            f"kv_indices out of range: min {int(used.min())}, max {int(used.max())}, pool has {num_slots} slots."
        )


def mla_decode_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    *,
    compute_dtype: torch.dtype = torch.float32,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MLA decode over a paged (page size 1) latent cache.

    Shapes: ``q_nope [B, H, Dc]``, ``q_pe [B, H, Dr]``, ``ckv [slots, 1, Dc]`` (or ``[slots, Dc]``),
    ``kpe`` likewise with ``Dr``; returns ``out [B, H, Dc]`` in ``compute_dtype`` and, with
    ``return_lse``, the natural-log log-sum-exp of the scaled logits ``[B, H]``.
    """
    _check(q_nope, q_pe, ckv, kpe, kv_indptr, kv_indices)
    ckv2 = ckv.reshape(-1, ckv.shape[-1])
    kpe2 = kpe.reshape(-1, kpe.shape[-1])
    batch, heads, dc = q_nope.shape
    out = torch.empty(batch, heads, dc, dtype=compute_dtype, device=q_nope.device)
    lse = torch.empty(batch, heads, dtype=compute_dtype, device=q_nope.device)
    ptr = kv_indptr.tolist()
    for b in range(batch):
        idx = kv_indices[ptr[b] : ptr[b + 1]].long()
        c = ckv2.index_select(0, idx).to(compute_dtype)  # [n, Dc]
        k = kpe2.index_select(0, idx).to(compute_dtype)  # [n, Dr]
        logits = (q_nope[b].to(compute_dtype) @ c.T + q_pe[b].to(compute_dtype) @ k.T) * sm_scale
        lse[b] = torch.logsumexp(logits, dim=-1)
        out[b] = torch.softmax(logits, dim=-1) @ c
    return (out, lse) if return_lse else out
