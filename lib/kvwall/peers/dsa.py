"""GLM-5's sparse attention (DSA) as SGLang 0.5.23 runs its decode on Hopper with an FP8 cache: the scaled pool row,
the indexer that picks 2,048 tokens, and FlashMLA's sparse FP8 decode over them.

What SGLang does, read from its 0.5.23 wheel (:mod:`kvwall.peers.sglang_dsa` checks each citation):

- **The pool row** (``sglang/kernels/ops/quantization/dsa_quant_k_cache.py``, ``_quantize_k_cache_fast``): 656 bytes
  per token and layer -- the 512 latent values in e4m3, each tile of 128 with its own float32 scale
  ``max|x| / 448`` (4 scales, 16 bytes), then the 64 rotary values in BF16 (128 bytes). :func:`quantize_v32` writes it
  with the same arithmetic (``x * (1 / scale)``, clamped to ±448), :func:`dequantize_v32` reads it back.
- **The decode** (``dsa_backend.py``, ``_forward_flashmla_kv``): the query heads padded with zeros to 64 (16 per GPU
  at TP 4 become 64; ``new_zeros`` + copy on every call), FlashMLA's ``flash_mla_with_kvcache`` with
  ``indices [B, 1, 2048]`` (slots of the selected tokens, -1 past a short request's end), ``is_fp8_kvcache=True``,
  ``kv_format="V32"``, its split schedule from ``get_mla_metadata(min(len, 2048), 64, 1, 64, fp8, topk=2048)`` made
  once per step (``_compute_flashmla_metadata``). The query stays BF16: FlashMLA dequantizes the tokens it reads.
  :class:`FlashMLASparseDecode` makes the same calls.
- **The indexer** (``dsa/dsa_indexer.py``): per layer, a 32-head (GLM-5; 64 for DeepSeek-V3.2) FP8 query of width 128
  against every token's index key (128 e4m3 + one float32 scale = 132 bytes a token, its own cache), ReLU, a weighted
  sum over its heads, then the top 2,048. SGLang runs DeepGEMM's ``fp8_paged_mqa_logits`` and its own top-k kernel,
  neither of which the GPU machine has: :func:`index_logits` is a Triton stand-in for the first (the same bytes and
  FP8 products, pages of 64), ``torch.topk`` stands in for the second. Both are labelled as stand-ins wherever they are
  timed; the indexer's floor -- 132 bytes a token at the copy bandwidth -- is given beside them.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kvwall.peers.flashmla import PAGE_SIZE, load_flash_mla

__all__ = [
    "TOPK",
    "V32_ROW_BYTES",
    "TILE",
    "INDEX_HEAD_DIM",
    "INDEX_ROW_BYTES",
    "GLM5_INDEX_HEADS",
    "INDEX_DOT",
    "padded_heads",
    "quantize_v32",
    "dequantize_v32",
    "quantize_index_keys",
    "index_logits",
    "index_logits_reference",
    "select_topk",
    "FlashMLASparseDecode",
]

#: GLM-5's ``index_topk``: the tokens each query attends to.
TOPK = 2048
#: Values per scale tile of the DSA pool row.
TILE = 128
#: Bytes per token and layer of SGLang's DSA FP8 pool row (``kv_format`` "V32"): 512 e4m3 + 4 float32 + 64 BF16.
V32_ROW_BYTES = 512 + 4 * 4 + 64 * 2
#: The indexer's key width and its bytes per token (128 e4m3 + one float32 scale).
INDEX_HEAD_DIM = 128
INDEX_ROW_BYTES = INDEX_HEAD_DIM + 4
#: GLM-5's ``index_n_heads`` (DeepSeek-V3.2: 64).
GLM5_INDEX_HEADS = 32
FP8_MAX = 448.0
FP8 = torch.float8_e4m3fn
_DOT_DTYPES = {"fp8": tl.float8e4nv, "bf16": tl.bfloat16, "float32": tl.float32}
#: The product type :func:`index_logits` settled on for the GPU ("fp8", or "bf16" where Triton refused FP8 products).
INDEX_DOT: dict[str, str] = {}


def padded_heads(heads: int) -> int:
    """The head count FlashMLA's sparse decode runs for ``heads`` query heads, as SGLang pads them on SM90
    (``flashmla_kv_num_q_heads``: 64 up to 64 heads, 128 up to 128)."""
    if heads < 1:
        raise ValueError(f"heads must be positive, got {heads}.")
    return 64 if heads <= 64 else 128 if heads <= 128 else heads


def quantize_v32(k: torch.Tensor) -> torch.Tensor:
    """``k [N, 576]`` (BF16: 512 latent + 64 rotary values) -> ``[N, 656]`` uint8 rows in SGLang's DSA layout: per
    tile of 128 latent values ``scale = max|x| / 448``, ``q = clamp(x * (1 / scale), -448, 448)`` in e4m3, then the 4
    scales as float32, then the rotary values' BF16 bytes. (An all-zero tile gives a zero scale and NaNs, as
    SGLang's kernel does.)"""
    if k.dim() != 2 or k.shape[1] != 576 or k.dtype != torch.bfloat16:
        raise ValueError(f"quantize_v32 takes k [N, 576] BF16; got {tuple(k.shape)} {k.dtype}.")
    n = k.shape[0]
    nope = k[:, :512].float().view(n, 512 // TILE, TILE)
    scale = nope.abs().amax(dim=-1) / FP8_MAX
    q = (nope * (1.0 / scale)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch.empty(n, V32_ROW_BYTES, dtype=torch.uint8, device=k.device)
    out[:, :512] = q.view(n, 512).view(torch.uint8)
    out[:, 512:528] = scale.contiguous().view(torch.uint8).view(n, 16)
    out[:, 528:] = k[:, 512:].contiguous().view(torch.uint8).view(n, 128)
    return out


def dequantize_v32(rows: torch.Tensor) -> torch.Tensor:
    """``[N, 656]`` uint8 rows -> ``[N, 576]`` float32: each e4m3 latent value times its tile's scale, then the
    rotary values."""
    if rows.dim() != 2 or rows.shape[1] != V32_ROW_BYTES or rows.dtype != torch.uint8:
        raise ValueError(f"dequantize_v32 takes rows [N, {V32_ROW_BYTES}] uint8; got {tuple(rows.shape)} {rows.dtype}.")
    n = rows.shape[0]
    q = rows[:, :512].contiguous().view(FP8).float().view(n, 512 // TILE, TILE)
    scale = rows[:, 512:528].contiguous().view(torch.float32)
    rope = rows[:, 528:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(q * scale[..., None]).view(n, 512), rope], dim=1)


def quantize_index_keys(keys: torch.Tensor, page_size: int = PAGE_SIZE) -> torch.Tensor:
    """The indexer's key cache: ``keys [pages * page_size, 128]`` (float) -> ``[pages, page_size * 132]`` uint8,
    each page holding its tokens' e4m3 values, then their float32 scales (``max|x| / 448`` per token)."""
    if keys.dim() != 2 or keys.shape[1] != INDEX_HEAD_DIM or keys.shape[0] % page_size:
        raise ValueError(
            f"quantize_index_keys takes keys [pages * {page_size}, {INDEX_HEAD_DIM}]; got {tuple(keys.shape)}."
        )
    pages = keys.shape[0] // page_size
    x = keys.float()
    scale = x.abs().amax(dim=-1).clamp_min(1e-10) / FP8_MAX
    q = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch.empty(pages, page_size * INDEX_ROW_BYTES, dtype=torch.uint8, device=keys.device)
    out[:, : page_size * INDEX_HEAD_DIM] = q.view(torch.uint8).view(pages, page_size * INDEX_HEAD_DIM)
    out[:, page_size * INDEX_HEAD_DIM :] = scale.view(torch.uint8).view(pages, page_size * 4)
    return out


def _index_logits_kernel(
    q_ptr,
    w_ptr,
    cache_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    table_stride,
    out_stride,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    PAGE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    b = tl.program_id(0)
    p = tl.program_id(1)
    n = tl.load(lens_ptr + b)
    t = tl.arange(0, PAGE)
    pos = p * PAGE + t
    if p * PAGE < n:
        page = tl.load(table_ptr + b * table_stride + p).to(tl.int64)
        base = cache_ptr + page * (PAGE * (DIM + 4))
        d = tl.arange(0, DIM)
        h = tl.arange(0, HEADS)
        k = tl.load(base + t[:, None] * DIM + d[None, :]).to(tl.float8e4nv, bitcast=True)
        scale = tl.load((base + PAGE * DIM).to(tl.pointer_type(tl.float32)) + t)
        q = tl.load(q_ptr + b * HEADS * DIM + h[:, None] * DIM + d[None, :]).to(tl.float8e4nv, bitcast=True)
        s = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)))
        s = tl.maximum(s, 0.0) * scale[None, :]
        w = tl.load(w_ptr + b * HEADS + h)
        logit = tl.reduce(
            s * w[:, None], 0, tl.standard._sum_combine
        )  # tl.sum is a jit function the in-process interpreter cannot call
        tl.store(out_ptr + b * out_stride + pos, tl.where(pos < n, logit, float("-inf")))
    else:
        tl.store(out_ptr + b * out_stride + pos, tl.full([PAGE], float("-inf"), tl.float32))


_INDEX_LOGITS: dict[bool, Any] = {}


def _index_logits_launcher(interpreted: bool) -> Any:
    """The kernel compiled for CUDA tensors, or run by Triton's interpreter for CPU tensors (whatever
    ``TRITON_INTERPRET`` said when Triton was imported)."""
    if interpreted not in _INDEX_LOGITS:
        _INDEX_LOGITS[interpreted] = (
            InterpretedFunction(_index_logits_kernel) if interpreted else triton.jit(_index_logits_kernel)
        )
    return _INDEX_LOGITS[interpreted]


def index_logits(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """The indexer's scores of every token of each request, one launch (a stand-in for DeepGEMM's
    ``fp8_paged_mqa_logits``): ``out[b, t] = sum_h weights[b, h] * relu(q[b, h] . key[t]) * key_scale[t]`` for
    ``t < lens[b]``, ``-inf`` past it (up to ``out``'s width, a multiple of 64).

    ``q_fp8 [B, heads, 128]`` e4m3 (heads a power of two, at least 16), ``weights [B, heads]`` float32, ``cache
    [pages, 64 * 132]`` uint8 (:func:`quantize_index_keys`), ``block_table [B, max pages]`` int32, ``lens [B]`` int32,
    ``out [B, max pages * 64]`` float32. On the GPU the products are FP8 (as DeepGEMM's); in the CPU interpreter,
    whose FP8 dots are not supported, float32 on the same FP8 values."""
    b, heads, dim = q_fp8.shape
    if dim != INDEX_HEAD_DIM or q_fp8.dtype != FP8 or heads < 16 or heads & (heads - 1):
        raise ValueError(
            f"index_logits takes q [B, heads (power of two >= 16), {INDEX_HEAD_DIM}] e4m3; got "
            f"{tuple(q_fp8.shape)} {q_fp8.dtype}."
        )
    if out.shape != (b, block_table.shape[1] * PAGE_SIZE) or out.dtype != torch.float32:
        raise ValueError(
            f"out must be [B, max pages * {PAGE_SIZE}] float32 = {(b, block_table.shape[1] * PAGE_SIZE)}; "
            f"got {tuple(out.shape)} {out.dtype}."
        )
    interpreted = q_fp8.device.type != "cuda"
    kernel = _index_logits_launcher(interpreted)
    grid = (b, block_table.shape[1])
    choices = ["float32"] if interpreted else ([INDEX_DOT["gpu"]] if "gpu" in INDEX_DOT else ["fp8", "bf16"])
    for i, choice in enumerate(choices):
        try:
            kernel[grid](
                q_fp8.view(torch.uint8),
                weights,
                cache,
                block_table,
                lens,
                out,
                block_table.stride(0),
                out.stride(0),
                HEADS=heads,
                DIM=dim,
                PAGE=PAGE_SIZE,
                DOT_DTYPE=_DOT_DTYPES[choice],
            )
        except Exception:  # a Triton that cannot compile the FP8 dot takes BF16 products (exact FP8 values)
            if i + 1 == len(choices):
                raise
            continue
        if not interpreted:
            INDEX_DOT["gpu"] = choice
        return out
    return out


def index_logits_reference(
    q_fp8: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, lens: torch.Tensor
) -> list[torch.Tensor]:
    """:func:`index_logits` in float64, request by request (``[lens[b]]`` each)."""
    pages, page_bytes = cache.shape
    vals = (
        cache[:, : PAGE_SIZE * INDEX_HEAD_DIM].contiguous().view(FP8).double().view(pages * PAGE_SIZE, INDEX_HEAD_DIM)
    )
    scales = cache[:, PAGE_SIZE * INDEX_HEAD_DIM :].contiguous().view(torch.float32).double().reshape(-1)
    out = []
    for i, n in enumerate(lens.tolist()):
        np_ = -(-n // PAGE_SIZE)
        slots = (
            block_table[i, :np_].long()[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=cache.device)
        ).reshape(-1)[:n]
        s = (q_fp8[i].double() @ vals[slots].T).clamp_min(0) * scales[slots][None, :]
        out.append((weights[i].double()[:, None] * s).sum(0))
    return out


def select_topk(
    logits: torch.Tensor,
    block_table: torch.Tensor,
    lens: torch.Tensor,
    topk: int = TOPK,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The selected tokens' pool slots, ``[B, 1, topk]`` int32 (-1 past a request shorter than ``topk``): the top
    ``topk`` scores of each row of ``logits`` (``torch.topk``, a stand-in for SGLang's top-k kernel), turned into slots
    through the page table (what SGLang's ``transform_index_page_table_decode`` gives FlashMLA). ``out``: written in
    place (a buffer a CUDA graph or a decode holds) and returned."""
    del lens  # past a request's end its scores are -inf: they are never chosen over a real token
    k = min(topk, logits.shape[1])
    vals, pos = torch.topk(logits, k, dim=1, sorted=False)
    page = torch.gather(block_table, 1, torch.div(pos, PAGE_SIZE, rounding_mode="floor")).long()
    slots = page * PAGE_SIZE + pos % PAGE_SIZE
    slots = torch.where(vals == float("-inf"), torch.full_like(slots, -1), slots).to(torch.int32)
    if k < topk:
        slots = torch.cat([slots, slots.new_full((slots.shape[0], topk - k), -1)], dim=1)
    if out is None:
        return slots.unsqueeze(1)
    return out.copy_(slots.unsqueeze(1))


class FlashMLASparseDecode:
    """FlashMLA's sparse FP8 decode as SGLang's ``flashmla_kv`` calls it: ``q_nope [B, H, 512]`` and ``q_pe [B, H,
    64]`` BF16, the DSA pool ``[pages, 64, 1, 656]`` (uint8 rows of :func:`quantize_v32`), ``indices [B, 1, 2048]``
    int32 slots (-1: none). The split schedule is made here (once per step in SGLang); each call pads the query heads
    with zeros to :func:`padded_heads` (a fresh ``new_zeros`` and a copy, as SGLang does), decodes, and returns the
    first ``H`` heads, ``[B, H, 512]`` BF16."""

    def __init__(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float
    ) -> None:
        loaded = load_flash_mla()
        if "error" in loaded:
            raise RuntimeError(loaded["error"])
        if k_cache.dim() != 4 or k_cache.shape[1:] != (PAGE_SIZE, 1, V32_ROW_BYTES):
            raise ValueError(
                f"the DSA pool must be [pages, {PAGE_SIZE}, 1, {V32_ROW_BYTES}]; got {tuple(k_cache.shape)}."
            )
        if indices.dim() != 3 or indices.shape[1] != 1 or indices.dtype != torch.int32:
            raise ValueError(f"indices must be [B, 1, topk] int32; got {tuple(indices.shape)} {indices.dtype}.")
        module = loaded["module"]
        self.version = loaded["version"]
        self._interface = importlib.import_module("flash_mla.flash_mla_interface")
        self._run = module.flash_mla_with_kvcache
        self.q = torch.cat([q_nope, q_pe], dim=-1).unsqueeze(1).contiguous()  # [B, 1, H, 576]
        self.heads, self.padded = q_nope.shape[1], padded_heads(q_nope.shape[1])
        self.k_cache = k_cache.view(FP8)
        self.indices, self.sm_scale = indices, sm_scale
        self.block_table = torch.empty((self.q.shape[0], 0), dtype=torch.int32, device=self.q.device)
        topk = indices.shape[-1]
        self.cache_seqlens = (indices[:, 0] >= 0).sum(dim=1).to(torch.int32)  # min(len, topk), as SGLang's
        self.tile_meta, self.num_splits = module.get_mla_decoding_metadata(
            self.cache_seqlens, self.padded, 1, self.padded, is_fp8_kvcache=True, topk=topk, use_legacy=True
        )
        self()  # loads the kernel before anything times it

    @property
    def name(self) -> str:
        return f"FlashMLA {self.version} sparse FP8 decode (legacy SM90, V32 rows, heads padded to {self.padded})"

    def __call__(self) -> torch.Tensor:
        q = self.q
        if self.padded != self.heads:
            q = self.q.new_zeros(q.shape[0], 1, self.padded, q.shape[3])
            q[:, :, : self.heads] = self.q
        meta = self._interface.FlashMLASchedMeta(tile_scheduler_metadata=self.tile_meta, num_splits=self.num_splits)
        out, _ = self._run(
            q,
            self.k_cache,
            self.block_table,
            self.cache_seqlens,
            512,
            meta,
            softmax_scale=self.sm_scale,
            is_fp8_kvcache=True,
            indices=self.indices,
            use_legacy=True,
            kv_format="V32",
        )
        return out[:, 0, : self.heads]
