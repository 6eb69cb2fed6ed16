"""Torch reference for MLA paged decode attention: the correctness yardstick of the book.

Decode with absorbed up-projections attends in the latent space. For request ``b`` with KV slots
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` and head ``h``::

    logits[h, t] = (q_nope[b, h] . ckv[t] + q_pe[b, h] . kpe[t]) * sm_scale
    out[b, h]    = softmax_t(logits[h]) @ ckv

It reads the cache in whatever dtype it is stored in (bf16 or fp8) and computes in
``compute_dtype`` (float32 by default; float64 for checking other implementations).

Beside it, what checks of the fused FP8 kernel are made of: :func:`make_mla_inputs`, a seeded batch
in every cache layout the kernel takes (:class:`MLAInputs`), and :func:`reference64`, the float64
reference on the *dequantized* cache (``fp8 * scale``) that the kernel's error is measured against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "mla_decode_reference",
    "split_latent_cache",
    "MLAInputs",
    "make_mla_inputs",
    "MLA_LAYOUTS",
    "nonempty_requests",
    "reference64",
]

DC, DR = 512, 64
D = DC + DR
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def split_latent_cache(cache: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(ckv, kpe)`` of an SGLang-layout cache ``[slots, 1, kv_lora_rank + rope]``."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"split_latent_cache: cache must be a torch.Tensor, got {type(cache).__name__}.")
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int) or kv_lora_rank < 1:
        raise TypeError(
            f"split_latent_cache: kv_lora_rank must be a positive int (512 for DeepSeek/GLM), got {kv_lora_rank!r}."
        )
    if cache.dim() != 3 or cache.shape[-1] <= kv_lora_rank:
        raise ValueError(
            f"cache of shape {tuple(cache.shape)}: expected [slots, page_size, kv_lora_rank + rope] "
            f"with a last dim larger than kv_lora_rank={kv_lora_rank}."
        )
    return cache[..., :kv_lora_rank], cache[..., kv_lora_rank:]


def _check(q_nope, q_pe, ckv, kpe, kv_indptr, kv_indices) -> None:
    for name, t in (
        ("q_nope", q_nope),
        ("q_pe", q_pe),
        ("ckv", ckv),
        ("kpe", kpe),
        ("kv_indptr", kv_indptr),
        ("kv_indices", kv_indices),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mla_decode_reference: {name} must be a torch.Tensor, got {type(t).__name__}.")
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


# ----------------------------------------------------------------------------------------------
# Seeded inputs of the fused FP8 kernel and its float64 reference
# ----------------------------------------------------------------------------------------------

#: Cache layouts :func:`make_mla_inputs` builds: strided 2-D views of one ``[slots, 1, 576]`` pool (what SGLang
#: holds), two contiguous caches (plus garbage ``kv_indices`` entries past ``kv_indptr[-1]``: a fixed-capacity
#: buffer), the pool's 3-D ``[slots, 1, D]`` views, and a paged pool ``[pages, page_size, 576]`` with ``kv_len``.
MLA_LAYOUTS = ("pool_view", "contiguous", "pool_view_3d", "paged")


@dataclass
class MLAInputs:
    """What the kernel is called with, and the same batch as token slots of a token-level cache view."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    ckv_cache: torch.Tensor
    kpe_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len: torch.Tensor | None
    tok_ckv: torch.Tensor  # [T, 512] FP8, a view (or the contiguous cache itself)
    tok_kpe: torch.Tensor  # [T, 64]
    tok3_ckv: torch.Tensor  # [T, 1, 512] FP8 for FlashInfer (page size 1)
    tok3_kpe: torch.Tensor
    tok_slots: list[torch.Tensor]  # per request: its token slots (int64, on the device)

    def token_batch(self, keep: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The requests ``keep`` as a page-size-1 batch over the token-level cache: (indptr, indices, lens), int32."""
        device = self.q_nope.device
        lens = [int(self.tok_slots[i].numel()) for i in keep]
        ptr = [0]
        for n in lens:
            ptr.append(ptr[-1] + n)
        indices = (
            torch.cat([self.tok_slots[i] for i in keep]) if keep else torch.empty(0, dtype=torch.int64, device=device)
        )
        return (
            torch.tensor(ptr, dtype=torch.int32, device=device),
            indices.to(torch.int32),
            torch.tensor(lens, dtype=torch.int32, device=device),
        )


def nonempty_requests(lens: Sequence[int]) -> list[int]:
    """The requests that hold at least one token."""
    return [i for i, n in enumerate(lens) if n > 0]


def make_mla_inputs(
    lens: Sequence[int],
    heads: int,
    *,
    seed: int,
    layout: str = "pool_view",
    page_size: int = 1,
    index_dtype: torch.dtype = torch.int32,
    pool_slots: int = 2_000,
    device: torch.device | str = "cpu",
) -> MLAInputs:
    """A seeded batch: BF16 queries ~ N(0, 0.5^2), an FP8 pool ~ N(0, 0.7^2) of at least ``pool_slots`` token
    slots, random slots (repeats allowed, unsorted) per request of ``lens``; ``layout``: one of
    :data:`MLA_LAYOUTS` (``page_size`` only for "paged")."""
    if layout not in MLA_LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {MLA_LAYOUTS}.")
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    lens = list(lens)
    b = len(lens)
    q_nope = (torch.randn(b, heads, DC, generator=g, device=device) * 0.5).to(BF16)
    q_pe = (torch.randn(b, heads, DR, generator=g, device=device) * 0.5).to(BF16)
    kv_len = None
    if layout == "paged":
        p = page_size
        n_pages = [-(-n // p) for n in lens]
        pages_total = max(pool_slots // p, 2 * sum(n_pages), 4)
        pool = (torch.randn(pages_total, p, D, generator=g, device=device) * 0.7).to(FP8)
        pages = torch.randperm(pages_total, generator=g, device=device)[: sum(n_pages)]
        page_ptr = [0]
        for n in n_pages:
            page_ptr.append(page_ptr[-1] + n)
        tok_slots = [
            (pages[page_ptr[i] : page_ptr[i + 1]][:, None] * p + torch.arange(p, device=device)).flatten()[:n]
            for i, n in enumerate(lens)
        ]
        ckv_cache, kpe_cache = pool[..., :DC], pool[..., DC:]
        kv_indptr = torch.tensor(page_ptr, dtype=index_dtype, device=device)
        kv_indices = pages.to(index_dtype)
        kv_len = torch.tensor(lens, dtype=index_dtype, device=device)
        flat = pool.view(-1, 1, D)
        tok3_ckv, tok3_kpe = flat[:, :, :DC], flat[:, :, DC:]
        tok_ckv, tok_kpe = flat[:, 0, :DC], flat[:, 0, DC:]
    else:
        slots = max(pool_slots, 8)
        pool = (torch.randn(slots, 1, D, generator=g, device=device) * 0.7).to(FP8)
        idx = torch.randint(0, slots, (sum(lens),), generator=g, device=device, dtype=torch.int64)
        ptr = [0]
        for n in lens:
            ptr.append(ptr[-1] + n)
        tok_slots = [idx[ptr[i] : ptr[i + 1]] for i in range(b)]
        spare = torch.empty(0, dtype=torch.int64, device=device)
        if layout == "contiguous":
            tok_ckv, tok_kpe = pool[:, 0, :DC].contiguous(), pool[:, 0, DC:].contiguous()
            ckv_cache, kpe_cache = tok_ckv, tok_kpe
            tok3_ckv, tok3_kpe = tok_ckv.unsqueeze(1), tok_kpe.unsqueeze(1)
            spare = torch.full((5,), -12345, dtype=torch.int64, device=device)  # garbage past kv_indptr[-1]
        else:
            tok_ckv, tok_kpe = pool[:, 0, :DC], pool[:, 0, DC:]
            tok3_ckv, tok3_kpe = pool[:, :, :DC], pool[:, :, DC:]
            ckv_cache, kpe_cache = (tok3_ckv, tok3_kpe) if layout == "pool_view_3d" else (tok_ckv, tok_kpe)
        kv_indptr = torch.tensor(ptr, dtype=index_dtype, device=device)
        kv_indices = torch.cat([idx, spare]).to(index_dtype)
    return MLAInputs(
        q_nope,
        q_pe,
        ckv_cache,
        kpe_cache,
        kv_indptr,
        kv_indices,
        kv_len,
        tok_ckv,
        tok_kpe,
        tok3_ckv,
        tok3_kpe,
        tok_slots,
    )


def reference64(
    inp: MLAInputs,
    keep: Sequence[int],
    ckv_scale: float,
    kpe_scale: float,
    sm_scale: float,
    *,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """float64 reference over the dequantized cache (``fp8 * scale`` in float64) for the requests ``keep`` (each
    with at least one token): ``[len(keep), H, Dc]`` and, with ``return_lse``, the natural-log LSE."""
    idx = torch.cat([inp.tok_slots[i].long() for i in keep])
    c = inp.tok_ckv.index_select(0, idx).double() * ckv_scale  # compact: only the rows the batch reads
    k = inp.tok_kpe.index_select(0, idx).double() * kpe_scale
    ptr, _, _ = inp.token_batch(keep)
    compact = torch.arange(idx.numel(), device=idx.device)
    return mla_decode_reference(
        inp.q_nope[list(keep)],
        inp.q_pe[list(keep)],
        c,
        k,
        ptr,
        compact,
        sm_scale,
        compute_dtype=torch.float64,
        return_lse=return_lse,
    )
