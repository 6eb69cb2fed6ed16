"""The torch reference of ours with several query tokens a request (speculative decoding's target-verify): each query
token is a decode over the first tokens it may see, so the reference is :func:`mla_decode_reference` on a page table
cut per token.

Token ``j`` of request ``b`` (row ``b x q_len + j`` of ``q_nope``; a request's tokens consecutive, SGLang's layout)
attends to the first ``n_b - (q_len - 1 - j)`` of the request's ``n_b`` tokens: the draft tokens sit at the end of the
request, each seeing itself and what comes before it.
"""

from __future__ import annotations

import torch

from kvwall.kernels.mla_decode.reference import mla_decode_reference

__all__ = ["mla_verify_reference"]


def mla_verify_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    *,
    q_len: int,
    compute_dtype: torch.dtype = torch.float32,
    return_lse: bool = False,
):
    """:func:`mla_decode_reference` for ``q_len`` query tokens a request, causal over them (module docstring):
    ``q_nope [B x q_len, H, Dc]``, the page table of the ``B`` requests (page size 1); every request must hold at
    least ``q_len`` tokens. Returns ``out [B x q_len, H, Dc]`` (and the natural-log LSE with ``return_lse``)."""
    if isinstance(q_len, bool) or not isinstance(q_len, int) or q_len < 1:
        raise ValueError(f"mla_verify_reference: q_len must be a positive int, got {q_len!r}.")
    ptr = kv_indptr.tolist()
    if q_nope.shape[0] != (len(ptr) - 1) * q_len:
        raise ValueError(
            f"mla_verify_reference: q_nope has {q_nope.shape[0]} rows; the page table has "
            f"{len(ptr) - 1} requests of q_len={q_len} tokens each."
        )
    token_ptr, pieces = [0], []
    for a, b in zip(ptr, ptr[1:]):
        if b - a < q_len:
            raise ValueError(f"mla_verify_reference: a request holds {b - a} tokens, fewer than q_len={q_len}.")
        for j in range(q_len):
            seen = b - a - (q_len - 1 - j)
            pieces.append(kv_indices[a : a + seen])
            token_ptr.append(token_ptr[-1] + seen)
    indptr = torch.tensor(token_ptr, dtype=torch.int64, device=kv_indptr.device)
    return mla_decode_reference(
        q_nope, q_pe, ckv, kpe, indptr, torch.cat(pieces), sm_scale, compute_dtype=compute_dtype, return_lse=return_lse
    )
