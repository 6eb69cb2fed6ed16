"""One roofline for the whole book: the fewest bytes and FLOPs each step of MLA decode must do.

Every "% of roofline", "predicted" or "floor" number in the book comes from these functions, with one
byte count: a decode over ``tokens`` KV tokens reads each token's FP8 latent once (``geometry.kv_dim``
values, 576 B for GLM-5) plus its page-table index (4 B per page of ``page_size`` tokens; 4 B per token
with SGLang's page size 1, so 580 B per token there). Queries and outputs are counted apart
(:func:`qo_bytes`): negligible at long contexts, not with many heads over short requests.

Bandwidths are device-to-device copy rates counting bytes read plus bytes written
(:func:`kvwall.measure.timing.copy_bandwidth_gbps`); FLOP rates are dense BF16 matmul rates.
"""

from __future__ import annotations

import torch

from kvwall.model.geometry import GLM5, MLAGeometry, dtype_bytes

__all__ = [
    "INDEX_BYTES",
    "kv_read_bytes",
    "qo_bytes",
    "decode_flops",
    "gather_cast_bytes",
    "full_pool_cast_bytes",
    "attention_read_bytes",
    "roofline_us",
]

#: Bytes of one page-table entry (int32 ``kv_indices``).
INDEX_BYTES = 4


def _pages(tokens: int, page_size: int) -> int:
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1.")
    return -(-int(tokens) // page_size)


def kv_read_bytes(
    tokens: int,
    geometry: MLAGeometry = GLM5,
    *,
    kv_dtype: torch.dtype = torch.float8_e4m3fn,
    page_size: int = 1,
    index_bytes: int = INDEX_BYTES,
) -> int:
    """The fewest HBM bytes a decode over ``tokens`` KV tokens must read: each token's latent once in
    ``kv_dtype`` plus one page-table index per page (580 B per token for GLM-5, FP8, page size 1)."""
    return int(tokens) * geometry.kv_dim * dtype_bytes(kv_dtype) + _pages(tokens, page_size) * index_bytes


def qo_bytes(batch: int, heads: int, geometry: MLAGeometry = GLM5) -> int:
    """Bytes of BF16 queries read (``q_nope`` + ``q_pe``: ``kv_dim`` values) and outputs written
    (``kv_lora_rank`` values) per decode call."""
    return 2 * int(batch) * int(heads) * (geometry.kv_dim + geometry.kv_lora_rank)


def decode_flops(heads: int, tokens: int, geometry: MLAGeometry = GLM5) -> int:
    """FLOPs of MLA decode attention: per head and token, ``q . k`` over ``kv_dim`` values and ``p . v``
    over ``kv_lora_rank``, two FLOPs per multiply-add: ``2 * heads * tokens * (576 + 512)`` for GLM-5."""
    return 2 * int(heads) * int(tokens) * (geometry.kv_dim + geometry.kv_lora_rank)


def gather_cast_bytes(rows: int, geometry: MLAGeometry = GLM5, *, index_bytes: int = INDEX_BYTES) -> int:
    """Fewest bytes a gather-cast of ``rows`` pool rows moves: FP8 read + BF16 written + the indices read."""
    return (
        int(rows) * geometry.kv_dim * (dtype_bytes(torch.float8_e4m3fn) + dtype_bytes(torch.bfloat16))
        + int(rows) * index_bytes
    )


def full_pool_cast_bytes(
    geometry: MLAGeometry, pool_tokens: int, src: torch.dtype = torch.float8_e4m3fn, dst: torch.dtype = torch.bfloat16
) -> dict[str, int]:
    """Bytes one whole-pool cast moves through device memory, for one layer: every slot read once in
    ``src`` and written once in ``dst``."""
    values = int(pool_tokens) * geometry.kv_dim
    read, written = values * dtype_bytes(src), values * dtype_bytes(dst)
    return {"read": read, "written": written, "total": read + written}


def attention_read_bytes(geometry: MLAGeometry, context_tokens: int, kv_dtype: torch.dtype = torch.bfloat16) -> int:
    """KV bytes decode attention must read for one request (its own tokens, once; indices left out)."""
    return int(context_tokens) * geometry.kv_dim * dtype_bytes(kv_dtype)


def roofline_us(
    heads: int,
    tokens: int,
    copy_gbps: float,
    bf16_tflops: float,
    geometry: MLAGeometry = GLM5,
    *,
    page_size: int = 1,
    index_bytes: int = INDEX_BYTES,
) -> float:
    """Lower bound on one FP8 decode call's device time in µs: the larger of moving :func:`kv_read_bytes`
    at the copy bandwidth (GB/s) and doing :func:`decode_flops` at the BF16 matmul rate (TFLOP/s)."""
    if copy_gbps <= 0 or bf16_tflops <= 0:
        raise ValueError(f"copy_gbps={copy_gbps} and bf16_tflops={bf16_tflops} must be positive.")
    memory = kv_read_bytes(tokens, geometry, page_size=page_size, index_bytes=index_bytes) / (copy_gbps * 1e3)
    compute = decode_flops(heads, tokens, geometry) / (bf16_tflops * 1e6)
    return max(memory, compute)
