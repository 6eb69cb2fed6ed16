"""FlashMLA (DeepSeek's MLA decode kernels), dense BF16 and dense FP8, as the ``sgl-flash-mla==1.0.0`` wheel ships
them for SM90 (``torch.ops.flash_mla_legacy``, reached with ``use_legacy=True``).

The calls, from the wheel's ``flash_mla/flash_mla_interface.py``:

- dense BF16: ``flash_mla_with_kvcache(q[B, 1, H, 576] bf16, k_cache[pages, 64, 1, 576] bf16, block_table[B, P]
  int32, cache_seqlens[B] int32, 512, FlashMLASchedMeta(), softmax_scale=, use_legacy=True)``; the first call fills
  the scheduler metadata, later calls (and a CUDA graph captured after it) reuse it.
- dense FP8: the same with an FP8 query and cache, ``is_fp8_kvcache=True, descale_q=, descale_k=`` (per-tensor,
  float32 tensors of shape ``(1,)`` on the GPU), after ``get_mla_decoding_metadata(cache_seqlens, H, 1,
  is_fp8_kvcache=True, use_legacy=True)`` assigned to the metadata's ``tile_scheduler_metadata, num_splits``.

The FP8 query is made the way SGLang 0.5.23's ``flashmla`` backend makes it (``FlashMLABackend.forward_decode``,
``sglang/srt/layers/attention/flashmla_backend.py``): a *static* per-tensor quantization with the layer's KV-cache
scale -- ``q_fp8 = clamp(q / k_scale, -448, 448)`` in e4m3 (``scaled_fp8_quant(q, k_scale)``, 1.0 when the checkpoint
has no scale), ``descale_q = descale_k = k_scale`` -- on every call, so it is part of what is timed:
:func:`quantize_query_static` does it in one kernel launch, as SGLang's ``sgl_per_tensor_quant_fp8`` does.

Pages of 64 tokens only. The wheel installs with ``pip install --no-deps sgl-flash-mla==1.0.0`` (its metadata asks
for a newer torch than it needs). :func:`load_flash_mla` never raises: a missing or broken install is returned as
``{"error"}`` so a benchmark records it as a row.
"""

from __future__ import annotations

import importlib
from typing import Any, Sequence

import torch
import triton
import triton.language as tl

from kvwall.measure.failures import error_text

__all__ = ["PAGE_SIZE", "FP8_MAX", "load_flash_mla", "random_page_table", "quantize_query_static", "FlashMLADecode"]

#: The page size FlashMLA's dense kernels take.
PAGE_SIZE = 64
#: Largest finite float8_e4m3fn value: a static quantization saturates there.
FP8_MAX = 448.0

_FLASH_MLA: dict[str, Any] = {}


def load_flash_mla() -> dict[str, Any]:
    """``{"module", "version", "file", "has_legacy"}`` of the installed ``flash_mla`` (loaded once), or
    ``{"error"}`` saying why it cannot be used (not installed, fails to load, no SM90 legacy kernels)."""
    if _FLASH_MLA:
        return _FLASH_MLA
    try:
        module = importlib.import_module("flash_mla")
        has_legacy = bool(module.has_legacy())
        _FLASH_MLA.update(
            module=module, version=str(getattr(module, "__version__", "?")), file=module.__file__, has_legacy=has_legacy
        )
        if not has_legacy:
            _FLASH_MLA["error"] = (
                "flash_mla has no legacy (SM90 dense) kernels in this build; install sgl-flash-mla==1.0.0"
            )
    except BaseException as exc:  # noqa: BLE001 - an import that fails is the strategy's error row
        _FLASH_MLA.update(
            error=f"flash_mla import failed (pip install --no-deps sgl-flash-mla==1.0.0): {error_text(exc, 500)}"
        )
    return _FLASH_MLA


def random_page_table(
    lens: Sequence[int], pool_pages: int, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block_table [B, max pages] int32, cache_seqlens [B] int32)``: each request's tokens on random pages of a
    ``pool_pages``-page pool (unused table entries 0): distinct pages while the batch fits the pool, else drawn with
    repeats (as the page-size-1 benchmarks draw slots), so a batch larger than the pool reads some pages twice."""
    pages = [-(-int(n) // PAGE_SIZE) for n in lens]
    if sum(pages) <= pool_pages:
        chosen = torch.randperm(pool_pages, generator=generator, device=generator.device)[: sum(pages)].to(device)
    else:
        chosen = torch.randint(0, pool_pages, (sum(pages),), generator=generator, device=generator.device).to(device)
    table = torch.zeros(len(pages), max(max(pages, default=1), 1), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = chosen[start : start + n].to(torch.int32)
        start += n
    return table, torch.tensor([int(n) for n in lens], dtype=torch.int32, device=device)


@triton.jit
def _quantize_static_kernel(x_ptr, y_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.clamp(x / tl.load(scale_ptr), -448.0, 448.0)
    tl.store(y_ptr + offs, y.to(tl.float8e4nv), mask=mask)


def quantize_query_static(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = clamp(q / scale, -448, 448)`` in e4m3 (round to nearest even), one launch: SGLang's static per-tensor
    query quantization (``scaled_fp8_quant(q, k_scale)``). ``q`` contiguous BF16, ``scale`` a float32 ``(1,)`` tensor,
    ``out`` an e4m3 tensor of ``q``'s shape."""
    n = q.numel()
    block = 1024
    _quantize_static_kernel[(triton.cdiv(n, block),)](q, out, scale, n, BLOCK=block)
    return out


class FlashMLADecode:
    """One batch for FlashMLA's dense decode: queries ``q_nope [B x q_len, H, 512]`` and ``q_pe [B x q_len, H, 64]``
    (BF16; ``q_len`` query tokens a request, causal over them: FlashMLA's ``s_q``), a paged cache ``[pages, 64, 1,
    576]`` (BF16, or FP8 with ``fp8=True``), its page table and lengths.

    FP8: every call quantizes the query as SGLang does (:func:`quantize_query_static` with ``k_scale``, the cache's
    per-tensor scale, which is also ``descale_q`` and ``descale_k``), then decodes. Everything else (metadata, the
    first call that fills BF16's scheduler metadata) happens here; calling the object runs one decode (FP8: the
    quantization and the decode) and returns ``[B x q_len, H, 512]`` BF16."""

    def __init__(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        k_cache: torch.Tensor,
        block_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        sm_scale: float,
        *,
        fp8: bool = False,
        k_scale: float = 1.0,
        q_len: int = 1,
    ) -> None:
        loaded = load_flash_mla()
        if "error" in loaded:
            raise RuntimeError(loaded["error"])
        if k_cache.dim() != 4 or k_cache.shape[1] != PAGE_SIZE or k_cache.shape[2] != 1:
            raise ValueError(f"FlashMLA takes a cache [pages, {PAGE_SIZE}, 1, 576]; got {tuple(k_cache.shape)}.")
        want = torch.float8_e4m3fn if fp8 else torch.bfloat16
        if k_cache.dtype != want:
            raise TypeError(f"FlashMLA dense {'FP8' if fp8 else 'BF16'} takes a {want} cache; got {k_cache.dtype}.")
        module = loaded["module"]
        self._run = module.flash_mla_with_kvcache
        self.version = loaded["version"]
        self.fp8 = fp8
        self.head_dim_v = q_nope.shape[-1]
        # [B, s_q, H, 576]: q_len query tokens a request (speculative verify), causal over them (FlashMLA's
        # bottom-right mask: the last query token sees every cached token)
        q = torch.cat([q_nope, q_pe], dim=-1).view(-1, q_len, q_nope.shape[1], q_nope.shape[2] + q_pe.shape[2])
        q = q.contiguous()
        self.causal = q_len > 1
        self.k_cache, self.block_table, self.cache_seqlens, self.sm_scale = (
            k_cache,
            block_table,
            cache_seqlens,
            sm_scale,
        )
        interface = importlib.import_module("flash_mla.flash_mla_interface")
        self.meta = interface.FlashMLASchedMeta()
        self.kw: dict[str, Any] = {}
        self.q_bf16 = q
        if fp8:
            scale = torch.full((1,), float(k_scale), dtype=torch.float32, device=q.device)
            self.q_scale = scale
            self.q = torch.empty_like(q, dtype=torch.float8_e4m3fn)
            self.kw = {"is_fp8_kvcache": True, "descale_q": scale, "descale_k": scale}
            heads = q.shape[2]
            tile_meta, num_splits = module.get_mla_decoding_metadata(
                cache_seqlens, heads * q_len, 1, is_fp8_kvcache=True, use_legacy=True
            )
            self.meta.tile_scheduler_metadata, self.meta.num_splits = tile_meta, num_splits
        else:
            self.q = q
        self()  # BF16: fills the scheduler metadata; both: loads the kernel before anything times it

    @property
    def name(self) -> str:
        return f"FlashMLA {self.version} dense {'FP8' if self.fp8 else 'BF16'} (legacy SM90)"

    def __call__(self) -> torch.Tensor:
        if self.fp8:
            quantize_query_static(self.q_bf16, self.q_scale, self.q)
        out, _ = self._run(
            self.q,
            self.k_cache,
            self.block_table,
            self.cache_seqlens,
            self.head_dim_v,
            self.meta,
            softmax_scale=self.sm_scale,
            causal=self.causal,
            use_legacy=True,
            **self.kw,
        )
        return out.flatten(0, 1)  # [B x s_q, H, 512]
