"""The checks every path of the fused FP8 MLA decode runs on a call before any launch (the Triton path's
:func:`~kvwall.kernels.mla_decode.triton_path.mla_decode_fp8`, the wgmma paths through :mod:`.hopper`, the front door
:mod:`.dispatch`): dtypes, shapes, strides, devices, ``out``, the scales, and with ``check_range`` the page table
against the cache. Each failure is raised naming the argument (``mla_decode_fp8: ...``)."""

from __future__ import annotations

import functools
import math
from numbers import Real

import torch

from kvwall.kernels._args import FLOAT32_MAX, below_float32_normal, scale_number
from kvwall.kernels._common import Fail, check_indices_in_range, check_kv_indptr, fail, refuse_graph_capture

__all__ = ["Q_DTYPE", "KV_DTYPE", "INDEX_DTYPES", "LOG2E", "MAX_Q_LEN", "as_rows", "parse_scale", "validate_call"]

Q_DTYPE = torch.bfloat16
KV_DTYPE = torch.float8_e4m3fn
INDEX_DTYPES = (torch.int32, torch.int64)
LOG2E = 1.4426950408889634
#: The most query tokens a request may bring (the front door's MAX_Q_LEN): a plan's rows are at most this x MAX_HEADS.
MAX_Q_LEN = 8

_fail: Fail = functools.partial(fail, "mla_decode_fp8")


def as_rows(name: str, cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A ``[pages * page_size, D]`` row view (no copy) of a ``[slots, D]`` or ``[pages, page_size, D]`` cache,
    and the page size."""
    if cache.dim() == 3:
        pages, page_size, d = cache.shape
        if pages >= 1 and page_size > 1 and cache.stride(0) != page_size * cache.stride(1):
            _fail(
                ValueError,
                f"{name} has shape {tuple(cache.shape)} and strides {cache.stride()}: the tokens of "
                "consecutive pages must be evenly spaced (page stride = page_size x token stride), as in one "
                "[pages, page_size, 576] pool.",
            )
        if cache.stride(-1) != 1:
            _fail(
                ValueError,
                f"{name} has strides {cache.stride()}: the values of a row must be contiguous "
                "(last stride 1); a row stride of 576 (a view of one [slots, 1, 576] pool) is fine.",
            )
        rows = cache.as_strided((pages * page_size, d), (cache.stride(1) if page_size > 1 else cache.stride(0), 1))
    elif cache.dim() == 2:
        rows, page_size = cache, 1
    else:
        _fail(ValueError, f"{name} has shape {tuple(cache.shape)}; expected [slots, D] or [pages, page_size, D].")
    if rows.shape[0] < 1:
        _fail(ValueError, f"{name} has no slots (shape {tuple(cache.shape)}).")
    if rows.stride(-1) != 1:
        _fail(
            ValueError,
            f"{name} has strides {cache.stride()}: the values of a row must be contiguous "
            "(last stride 1); a row stride of 576 (a view of one [slots, 1, 576] pool) is fine.",
        )
    return rows, page_size


def parse_scale(name: str, scale, device: torch.device) -> tuple[torch.Tensor | None, float]:
    """A ``ckv_scale`` / ``kpe_scale`` argument as ``(tensor, 1.0)`` (a one-element float32 tensor on ``device``, read
    in the kernel) or ``(None, number)``; anything else is refused, naming ``name``."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
            _fail(
                ValueError,
                f"{name} must be a Python number or a one-element float32 tensor on {device}; got "
                f"{scale.dtype} {tuple(scale.shape)} on {scale.device}.",
            )
        return scale.reshape(1), 1.0
    value = scale_number(name, scale, _fail)
    if device.type == "cpu" and below_float32_normal(value):  # the interpreter would take it as a float64
        return torch.tensor([value], dtype=torch.float32), 1.0
    return None, value


def validate_call(
    q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, out, check_range, kv_len
) -> tuple[torch.Tensor, torch.Tensor, int, int | None]:
    """Every check of a :func:`mla_decode_fp8` call (both paths run it), each failure raised before any launch:
    dtypes, shapes, strides, devices, ``out``, and with ``check_range`` the index buffers against the cache (host
    reads; refused inside CUDA-graph capture). Returns the caches' ``[slots, D]`` row views, the page size and the
    longest request in tokens (None for an unchecked call)."""
    named = [
        ("q_nope", q_nope),
        ("q_pe", q_pe),
        ("ckv_cache", ckv_cache),
        ("kpe_cache", kpe_cache),
        ("kv_indptr", kv_indptr),
        ("kv_indices", kv_indices),
    ] + ([("kv_len", kv_len)] if kv_len is not None else [])
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, f"{name} must be a tensor, got {type(t).__name__}.")
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        if t.dtype != Q_DTYPE:
            _fail(TypeError, f"{name} has dtype {t.dtype}; it must be {Q_DTYPE}.")
        if t.dim() != 3:
            _fail(ValueError, f"{name} has shape {tuple(t.shape)}; expected [batch, heads, dim].")
        if t.stride(-1) != 1:
            _fail(ValueError, f"{name} has strides {t.stride()}: the last dim must be contiguous; pass .contiguous().")
    for name, t in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        if t.dtype != KV_DTYPE:
            _fail(
                TypeError,
                f"{name} has dtype {t.dtype}; it must be {KV_DTYPE} (the FP8 KV cache). For a BF16 "
                "cache use a BF16 MLA kernel (FlashInfer).",
            )
    for name, t in named[4:]:
        if t.dtype not in INDEX_DTYPES:
            _fail(TypeError, f"{name} has dtype {t.dtype}; it must be int32 or int64.")
        if t.dim() != 1 or not t.is_contiguous():
            _fail(
                ValueError, f"{name} must be a contiguous 1-D tensor; got shape {tuple(t.shape)} strides {t.stride()}."
            )
    if q_nope.shape[:2] != q_pe.shape[:2]:
        _fail(
            ValueError, f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} must have the same batch and heads."
        )
    ckv, page_size = as_rows("ckv_cache", ckv_cache)
    kpe, kpe_page = as_rows("kpe_cache", kpe_cache)
    if page_size != kpe_page:
        _fail(ValueError, f"ckv_cache pages hold {page_size} tokens but kpe_cache pages hold {kpe_page}.")
    if ckv.shape[0] != kpe.shape[0]:
        _fail(ValueError, f"ckv_cache has {ckv.shape[0]} slots but kpe_cache has {kpe.shape[0]}.")
    batch, heads, dc = q_nope.shape
    dr = q_pe.shape[-1]
    if ckv.shape[-1] != dc or kpe.shape[-1] != dr:
        _fail(
            ValueError,
            f"latent widths disagree: q_nope {dc} vs ckv_cache {ckv.shape[-1]}, q_pe {dr} vs "
            f"kpe_cache {kpe.shape[-1]}.",
        )
    for name, d, least in (("kv_lora_rank (q_nope/ckv width)", dc, 64), ("rope width (q_pe/kpe width)", dr, 16)):
        if d < least or d & (d - 1):
            _fail(
                ValueError,
                f"{name} is {d}; it must be a power of two >= {least} (512 and 64 for DeepSeek/GLM "
                "MLA; the latent is processed in four chunks of at least 16).",
            )
    if batch < 1 or heads < 1:
        _fail(ValueError, f"q_nope has shape {tuple(q_nope.shape)}: batch and heads must be at least 1.")
    if page_size > 1 and kv_len is None:
        _fail(
            ValueError,
            f"the caches have {page_size}-token pages: pass kv_len (tokens per request), as "
            "FlashInfer's plan() takes kv_len_arr; kv_indptr/kv_indices then count pages.",
        )
    if page_size == 1 and kv_len is not None:
        _fail(
            ValueError,
            "kv_len is for paged caches (page size > 1); with one token per page the lengths are "
            "kv_indptr's differences.",
        )
    if kv_len is not None and kv_len.numel() != batch:
        _fail(ValueError, f"kv_len has {kv_len.numel()} entries; expected batch = {batch}.")
    devices = {t.device for _, t in named}
    if len(devices) != 1:
        _fail(ValueError, f"all tensors must be on one device; got {sorted(map(str, devices))}.")
    device = q_nope.device
    if device.type not in ("cuda", "cpu"):
        _fail(ValueError, f"tensors are on {device}; it runs on CUDA (compiled) or CPU (Triton interpreter).")
    if kv_indptr.numel() != batch + 1:
        _fail(ValueError, f"kv_indptr has {kv_indptr.numel()} entries; expected batch + 1 = {batch + 1}.")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, Real) or not math.isfinite(float(sm_scale)):
        _fail(TypeError, f"sm_scale must be a finite Python number, got {sm_scale!r}.")
    if abs(float(sm_scale)) * LOG2E > FLOAT32_MAX:  # the kernel takes sm_scale * log2(e) as a float32
        _fail(
            ValueError,
            f"sm_scale={sm_scale!r} is too large: |sm_scale| must be at most {FLOAT32_MAX / LOG2E:.3g} "
            "(sm_scale * log2(e) must be a float32); the usual value is 1/sqrt(head dim), 1/sqrt(576) for MLA.",
        )
    if out is not None:
        if (
            not isinstance(out, torch.Tensor)
            or out.dtype != Q_DTYPE
            or tuple(out.shape) != (batch, heads, dc)
            or out.device != device
            or out.stride(-1) != 1
        ):
            _fail(
                ValueError,
                f"out must be a {Q_DTYPE} tensor of shape {(batch, heads, dc)} on {device} with a "
                f"contiguous last dim; got {getattr(out, 'dtype', type(out).__name__)} "
                f"{tuple(getattr(out, 'shape', ()))} on {getattr(out, 'device', '?')} strides "
                f"{out.stride() if isinstance(out, torch.Tensor) else '?'}.",
            )
    if kv_indices.numel() > 2**31 - 1:
        _fail(ValueError, f"kv_indices has {kv_indices.numel()} entries: more than 2^31 - 1 in one batch; split it.")
    max_len = None
    if check_range:
        refuse_graph_capture(device, _fail)
        ptr = check_kv_indptr(kv_indptr, kv_indices.numel(), _fail)
        check_indices_in_range(
            kv_indices[: ptr[-1]], ckv.shape[0] // page_size, "slots" if page_size == 1 else "pages", "the cache", _fail
        )
        pages = [b - a for a, b in zip(ptr, ptr[1:])]
        if kv_len is None:
            max_len = max(pages)
        else:
            lens = kv_len.tolist()
            for i, (n, p) in enumerate(zip(lens, pages)):
                if n < 0 or n > p * page_size:
                    _fail(
                        ValueError,
                        f"kv_len[{i}] = {n} does not fit request {i}'s {p} pages of {page_size} "
                        f"tokens (0..{p * page_size}).",
                    )
            max_len = max(lens)
    return ckv, kpe, page_size, max_len
