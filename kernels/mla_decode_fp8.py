"""Fused FP8 MLA decode attention (Triton): reads the FP8 latent cache once, dequantizes in registers,
never writes BF16 KV anywhere.

For request ``b`` with token slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` (page size 1) and head ``h``::

    logits[h, t] = sm_scale * (q_nope[b, h] . ckv[t] * ckv_scale + q_pe[b, h] . kpe[t] * kpe_scale)
    out[b, h]    = softmax_t(logits[h]) @ (ckv * ckv_scale)

the semantics of FlashInfer's MLA ``run(..., ckv_scale=, kpe_scale=)``. The optional log-sum-exp is the
**natural-log** LSE of the scaled logits (as :func:`kvwall.kernels.mla_decode_reference` returns it; FlashInfer's
is base 2: multiply ours by ``1/ln 2``). A request with no tokens gets ``out = 0`` and ``lse = -inf``.

Design (a first, correct version; tuning comes next):

- **Split kernel**, grid ``(B, num_splits, head_blocks)``: a program owns one request, one contiguous
  slice of its tokens (the split) and a block of up to 64 heads (all of them for 16 or 64 heads), so each
  KV token is read from HBM once per split for all those heads (MLA shares the latent across heads).
  It walks its slice in tiles of ``BLOCK_N`` tokens: gathers ``[BLOCK_N, 512]`` FP8 ``ckv`` and
  ``[BLOCK_N, 64]`` ``kpe`` rows through ``kv_indices``, converts them in registers to the dot operand
  type, computes ``q_nope @ ckv^T`` and ``q_pe @ kpe^T`` (two tensor-core dots: 512 + 64 = 576), runs the
  online softmax in base 2 and accumulates ``p @ ckv`` (the same latent tile serves as K and as V).
  It writes a normalized fp32 partial ``[512]`` per head and its base-2 LSE; with one split it writes the
  BF16 output directly and no combine runs.
- **Combine kernel**, grid ``(B, H, 512 / BLOCK_D)``: merges the splits' partials by their LSEs
  (flash-decoding). Empty splits (fewer tokens than splits) carry ``lse = -inf`` and weight 0.
- **Dot operand type** is a compile-time parameter: BF16 on the GPU (FP8 -> BF16 is exact), float32 in
  Triton's interpreter, whose BF16 ``tl.dot`` is broken (Triton issue #11584). The softmax weights ``p`` are
  rounded to the operand type for the second dot, as in flash attention.
- On CPU tensors the kernels run in Triton's interpreter (built here with ``InterpretedFunction``, whatever
  ``TRITON_INTERPRET`` says); on CUDA they are compiled.

Inputs: ``q_nope [B, H, Dc]`` and ``q_pe [B, H, Dr]`` BF16 (last stride 1); ``ckv_cache [slots, Dc]`` and
``kpe_cache [slots, Dr]`` FP8 e4m3 (or ``[slots, 1, D]``), rows of any stride with the last stride 1, so the
views ``pool[:, 0, :512]`` and ``pool[:, 0, 512:]`` of one SGLang ``[slots, 1, 576]`` pool work without a
copy. ``Dc`` and ``Dr`` powers of two (512 and 64 for DeepSeek/GLM). Page sizes above 1 are not supported
yet: pass ``pool.view(-1, 1, D)`` and token indices ``page * page_size + offset``.
Scales: Python numbers or one-element float32 tensors on the cache's device (read in the kernel, so a
captured CUDA graph replays with whatever they hold).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from numbers import Real

import torch
import triton
import triton.language as tl

__all__ = ["mla_decode_fp8", "MLADecodeConfig", "default_config", "default_num_splits"]

Q_DTYPE = torch.bfloat16
KV_DTYPE = torch.float8_e4m3fn
INDEX_DTYPES = (torch.int32, torch.int64)
LOG2E = 1.4426950408889634


def _mla_split_kernel(
    qn_ptr, qp_ptr, ckv_ptr, kpe_ptr, indptr_ptr, indices_ptr,
    ckv_scale_ptr, kpe_scale_ptr, ckv_scale_val, kpe_scale_val, qk_scale,  # qk_scale = sm_scale * log2(e)
    part_o_ptr, part_lse_ptr, out_ptr, lse_ptr,
    H, num_splits,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_ckv, stride_kpe,
    stride_o_b, stride_o_h,
    DC: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SCALE_FROM_PTR: tl.constexpr, DIRECT: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_BF16: tl.constexpr,
):
    b = tl.program_id(0)
    s = tl.program_id(1)
    hb = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dc = tl.arange(0, DC)
    dr = tl.arange(0, DR)

    start = tl.load(indptr_ptr + b).to(tl.int32)
    end = tl.load(indptr_ptr + b + 1).to(tl.int32)
    length = end - start
    # cdiv spelled out: tl.cdiv is a jit function, which a kernel built with InterpretedFunction cannot call
    per_split = ((length + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = start + s * per_split
    hi = tl.minimum(lo + per_split, end)

    if SCALE_FROM_PTR:
        ckv_scale = tl.load(ckv_scale_ptr).to(tl.float32)
        kpe_scale = tl.load(kpe_scale_ptr).to(tl.float32)
    else:
        ckv_scale = ckv_scale_val
        kpe_scale = kpe_scale_val
    c_scale = ckv_scale * qk_scale
    k_scale = kpe_scale * qk_scale

    qn = tl.load(qn_ptr + b.to(tl.int64) * stride_qn_b + heads[:, None] * stride_qn_h + dc[None, :],
                 mask=hmask[:, None], other=0.0)
    qp = tl.load(qp_ptr + b.to(tl.int64) * stride_qp_b + heads[:, None] * stride_qp_h + dr[None, :],
                 mask=hmask[:, None], other=0.0)
    if DOT_BF16:
        qn = qn.to(tl.bfloat16)
        qp = qp.to(tl.bfloat16)
    else:
        qn = qn.to(tl.float32)
        qp = qp.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, DC], 0.0, tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < hi
        slot = tl.load(indices_ptr + n, mask=live, other=0).to(tl.int64)
        c8 = tl.load(ckv_ptr + slot[:, None] * stride_ckv + dc[None, :], mask=live[:, None], other=0.0)
        k8 = tl.load(kpe_ptr + slot[:, None] * stride_kpe + dr[None, :], mask=live[:, None], other=0.0)
        if DOT_BF16:
            c = c8.to(tl.bfloat16)
            k = k8.to(tl.bfloat16)
            sc = tl.dot(qn, tl.trans(c))
            sk = tl.dot(qp, tl.trans(k))
        else:
            c = c8.to(tl.float32)
            k = k8.to(tl.float32)
            sc = tl.dot(qn, tl.trans(c), input_precision="ieee")
            sk = tl.dot(qp, tl.trans(k), input_precision="ieee")
        logits = sc * c_scale + sk * k_scale  # [BLOCK_H, BLOCK_N], base-2 units
        logits = tl.where(live[None, :], logits, float("-inf"))
        # Reductions through tl.reduce with the standard combine functions: tl.max / tl.sum are jit functions,
        # which a kernel built with InterpretedFunction (no TRITON_INTERPRET) cannot call; tl.reduce it patches.
        # m_new is finite: every tile holds at least one live token.
        m_new = tl.maximum(m_i, tl.reduce(logits, 1, tl.standard._elementwise_max))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(logits - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        if DOT_BF16:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), c)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        m_i = m_new

    has = l_i > 0.0
    o = acc * (ckv_scale / tl.where(has, l_i, 1.0))[:, None]
    o = tl.where(has[:, None], o, 0.0)
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    if DIRECT:
        if DOT_BF16:
            ob = o.to(tl.bfloat16)
        else:  # the interpreter truncates float32 -> bfloat16: round to nearest even by integer ops
            u = o.to(tl.uint32, bitcast=True)
            ob = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            ob = tl.where(o != o, float("nan"), ob).to(tl.bfloat16)
        tl.store(out_ptr + b.to(tl.int64) * stride_o_b + heads[:, None] * stride_o_h + dc[None, :],
                 ob, mask=hmask[:, None])
        if WRITE_LSE:
            tl.store(lse_ptr + b * H + heads, lse2 * 0.6931471805599453, mask=hmask)
    else:
        row = (b * num_splits + s).to(tl.int64) * H + heads  # partials laid out [B, S, H, DC]
        tl.store(part_o_ptr + row[:, None] * DC + dc[None, :], o, mask=hmask[:, None])
        tl.store(part_lse_ptr + row, lse2, mask=hmask)


def _mla_combine_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, lse_ptr, H, num_splits, stride_o_b, stride_o_h,
    DC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr,
    RNE_BY_BITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    base = b.to(tl.int64) * num_splits * H + h  # row of split 0
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        m = tl.maximum(m, tl.load(part_lse_ptr + base + ss * H, mask=ss < num_splits, other=float("-inf")))
    m_all = tl.reduce(m, 0, tl.standard._elementwise_max)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    wsum = tl.full([BLOCK_S], 0.0, tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        ok = ss < num_splits
        lse = tl.load(part_lse_ptr + base + ss * H, mask=ok, other=float("-inf"))
        w = tl.exp2(lse - m_safe)  # 0 for empty splits
        w = tl.where(ok & (lse > float("-inf")), w, 0.0)
        o = tl.load(part_o_ptr + (base + ss * H)[:, None] * DC + d[None, :], mask=(ok & (w > 0.0))[:, None],
                    other=0.0)
        acc += tl.reduce(w[:, None] * o, 0, tl.standard._sum_combine)
        wsum += w
    total = tl.reduce(wsum, 0, tl.standard._sum_combine)
    res = tl.where(total > 0.0, acc / tl.where(total > 0.0, total, 1.0), 0.0)
    if RNE_BY_BITS:  # the interpreter truncates float32 -> bfloat16: round to nearest even by integer ops
        u = res.to(tl.uint32, bitcast=True)
        rb = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        rb = tl.where(res != res, float("nan"), rb).to(tl.bfloat16)
    else:
        rb = res.to(tl.bfloat16)
    tl.store(out_ptr + b.to(tl.int64) * stride_o_b + h * stride_o_h + d, rb)
    if WRITE_LSE:
        if tl.program_id(2) == 0:
            lse_out = tl.where(total > 0.0, (m_safe + tl.log2(tl.where(total > 0.0, total, 1.0))) * 0.6931471805599453,
                               float("-inf"))
            tl.store(lse_ptr + b * H + h, lse_out)


#: The compiled kernels of the latest CUDA launch (for resource reports: ``n_regs``, ``n_spills``, ``metadata.shared``).
LAST_COMPILED: dict[str, object] = {}


@functools.cache
def _kernel(name: str, interpreted: bool):
    fn = {"split": _mla_split_kernel, "combine": _mla_combine_kernel}[name]
    if interpreted:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    return triton.jit(fn)


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch shape of the split kernel (``block_h`` heads x ``block_n`` tokens per step) and the combine."""

    block_h: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    combine_block_d: int = 128
    combine_block_s: int = 16
    combine_warps: int = 4


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def default_config(heads: int, dc: int, device: torch.device) -> MLADecodeConfig:
    """The first version's launch shape (untuned): 16..64 heads per program, 32 tokens per step on a GPU;
    in the interpreter, large tiles (its cost is per program and per operation, not per element)."""
    block_h = min(max(16, triton.next_power_of_2(heads)), 64)
    if device.type == "cpu":
        return MLADecodeConfig(block_h=block_h, block_n=64, num_warps=1, num_stages=1,
                               combine_block_d=dc, combine_block_s=16, combine_warps=1)
    return MLADecodeConfig(block_h=block_h, block_n=32 if block_h <= 32 else 16,
                           num_warps=4 if block_h <= 16 else 8, num_stages=2,
                           combine_block_d=min(128, dc))


def default_num_splits(batch: int, heads: int, max_len: int, device: torch.device,
                       config: MLADecodeConfig | None = None) -> int:
    """Splits per request: enough programs for about two per multiprocessor, at most 128 splits, and at least
    128 tokens per split (on CPU: at most 3 splits, enough to exercise the combine)."""
    if max_len <= 0:
        return 1
    if device.type == "cpu":
        return max(1, min(3, triton.cdiv(max_len, 64)))
    cfg = config or default_config(heads, 512, device)
    head_blocks = triton.cdiv(heads, cfg.block_h)
    want = triton.cdiv(2 * _sms(device), batch * head_blocks)
    return max(1, min(want, 128, triton.cdiv(max_len, 128)))


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

def _fail(kind: type[Exception], text: str):
    raise kind(f"mla_decode_fp8: {text}")


def _as_rows(name: str, cache: torch.Tensor) -> torch.Tensor:
    """A ``[slots, D]`` view of a ``[slots, D]`` or ``[slots, 1, D]`` cache (no copy)."""
    if cache.dim() == 3:
        if cache.shape[1] != 1:
            _fail(ValueError, f"{name} has shape {tuple(cache.shape)}: only page size 1 is supported; pass "
                  "cache.view(-1, 1, D) (or its strided pool view) and token indices page * page_size + offset.")
        cache = cache[:, 0, :]
    elif cache.dim() != 2:
        _fail(ValueError, f"{name} has shape {tuple(cache.shape)}; expected [slots, D] or [slots, 1, D].")
    if cache.shape[0] < 1:
        _fail(ValueError, f"{name} has no slots (shape {tuple(cache.shape)}).")
    if cache.stride(-1) != 1:
        _fail(ValueError, f"{name} has strides {cache.stride()}: the values of a row must be contiguous "
              "(last stride 1); a row stride of 576 (a view of one [slots, 1, 576] pool) is fine.")
    return cache


def _scale(name: str, scale, device: torch.device) -> tuple[torch.Tensor | None, float]:
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
            _fail(ValueError, f"{name} must be a Python number or a one-element float32 tensor on {device}; got "
                  f"{scale.dtype} {tuple(scale.shape)} on {scale.device}.")
        return scale.reshape(1), 1.0
    if isinstance(scale, bool) or not isinstance(scale, Real):
        _fail(TypeError, f"{name} must be a number or a one-element float32 tensor, got {type(scale).__name__}.")
    if not math.isfinite(float(scale)):
        _fail(ValueError, f"{name}={scale} is not finite.")
    return None, float(scale)


def _validate(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, out, check_range):
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache),
                    ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
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
            _fail(TypeError, f"{name} has dtype {t.dtype}; it must be {KV_DTYPE} (the FP8 KV cache). For a BF16 "
                  "cache use a BF16 MLA kernel (FlashInfer).")
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        if t.dtype not in INDEX_DTYPES:
            _fail(TypeError, f"{name} has dtype {t.dtype}; it must be int32 or int64.")
        if t.dim() != 1 or not t.is_contiguous():
            _fail(ValueError, f"{name} must be a contiguous 1-D tensor; got shape {tuple(t.shape)} strides {t.stride()}.")
    if q_nope.shape[:2] != q_pe.shape[:2]:
        _fail(ValueError, f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} must have the same batch and heads.")
    ckv = _as_rows("ckv_cache", ckv_cache)
    kpe = _as_rows("kpe_cache", kpe_cache)
    if ckv.shape[0] != kpe.shape[0]:
        _fail(ValueError, f"ckv_cache has {ckv.shape[0]} slots but kpe_cache has {kpe.shape[0]}.")
    batch, heads, dc = q_nope.shape
    dr = q_pe.shape[-1]
    if ckv.shape[-1] != dc or kpe.shape[-1] != dr:
        _fail(ValueError, f"latent widths disagree: q_nope {dc} vs ckv_cache {ckv.shape[-1]}, q_pe {dr} vs "
              f"kpe_cache {kpe.shape[-1]}.")
    for name, d in (("kv_lora_rank (q_nope/ckv width)", dc), ("rope width (q_pe/kpe width)", dr)):
        if d < 16 or d & (d - 1):
            _fail(ValueError, f"{name} is {d}; it must be a power of two >= 16 (512 and 64 for DeepSeek/GLM MLA).")
    if batch < 1 or heads < 1:
        _fail(ValueError, f"q_nope has shape {tuple(q_nope.shape)}: batch and heads must be at least 1.")
    devices = {t.device for t in (q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices)}
    if len(devices) != 1:
        _fail(ValueError, f"all tensors must be on one device; got {sorted(map(str, devices))}.")
    device = q_nope.device
    if device.type not in ("cuda", "cpu"):
        _fail(ValueError, f"tensors are on {device}; it runs on CUDA (compiled) or CPU (Triton interpreter).")
    if kv_indptr.numel() != batch + 1:
        _fail(ValueError, f"kv_indptr has {kv_indptr.numel()} entries; expected batch + 1 = {batch + 1}.")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, Real) or not math.isfinite(float(sm_scale)):
        _fail(TypeError, f"sm_scale must be a finite Python number, got {sm_scale!r}.")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != Q_DTYPE or tuple(out.shape) != (batch, heads, dc) \
                or out.device != device or out.stride(-1) != 1:
            _fail(ValueError, f"out must be a {Q_DTYPE} tensor of shape {(batch, heads, dc)} on {device} with a "
                  f"contiguous last dim; got {getattr(out, 'dtype', type(out).__name__)} "
                  f"{tuple(getattr(out, 'shape', ()))} on {getattr(out, 'device', '?')} strides "
                  f"{out.stride() if isinstance(out, torch.Tensor) else '?'}.")
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                _fail(ValueError, f"out shares memory with {name}.")
    max_len = None
    if check_range:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            _fail(RuntimeError, "input checks read kv_indptr/kv_indices on the host, which a CUDA graph capture "
                  "cannot do: pass check_range=False (and num_splits) inside the capture.")
        ptr = kv_indptr.tolist()
        if ptr[0] != 0 or any(b < a for a, b in zip(ptr, ptr[1:])):
            _fail(ValueError, f"kv_indptr must start at 0 and never decrease; got {ptr[:6]}{'...' if len(ptr) > 6 else ''}.")
        if ptr[-1] > kv_indices.numel():
            _fail(ValueError, f"kv_indptr ends at {ptr[-1]} but kv_indices has only {kv_indices.numel()} entries.")
        if ptr[-1] > 2**31 - 1:
            _fail(ValueError, f"kv_indptr ends at {ptr[-1]}: more than 2^31 - 1 tokens in one batch.")
        if ptr[-1]:
            lo, hi = torch.aminmax(kv_indices[: ptr[-1]])
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= ckv.shape[0]:
                bad = lo if lo < 0 else hi
                _fail(IndexError, f"kv_indices holds {bad}, outside the cache's {ckv.shape[0]} slots (0..{ckv.shape[0] - 1}).")
        max_len = max(b - a for a, b in zip(ptr, ptr[1:]))
    return ckv, kpe, max_len


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------

def mla_decode_fp8(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
                   kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float, *,
                   ckv_scale: float | torch.Tensor = 1.0, kpe_scale: float | torch.Tensor = 1.0,
                   out: torch.Tensor | None = None, return_lse: bool = False, num_splits: int | None = None,
                   check_range: bool = True, config: MLADecodeConfig | None = None):
    """MLA decode attention straight from an FP8 latent cache; returns ``out`` ``[B, H, Dc]`` BF16 (and the
    natural-log LSE ``[B, H]`` float32 with ``return_lse``). See the module docstring for the semantics.

    ``num_splits``: KV splits per request (flash-decoding); default: :func:`default_num_splits`.
    ``check_range=True`` validates ``kv_indptr``/``kv_indices`` on the host before the launch (a device sync);
    ``False`` skips that (needed inside CUDA-graph capture; then pass ``num_splits`` too, or the default is
    sized from ``len(kv_indices) / B``). ``config`` overrides the launch shape (:class:`MLADecodeConfig`).
    """
    ckv, kpe, max_len = _validate(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, out,
                                  check_range)
    device = q_nope.device
    batch, heads, dc = q_nope.shape
    dr = q_pe.shape[-1]
    c_t, c_v = _scale("ckv_scale", ckv_scale, device)
    k_t, k_v = _scale("kpe_scale", kpe_scale, device)
    if (c_t is None) != (k_t is None):  # one mode for both: a tensor for the number
        if c_t is None:
            c_t = torch.full((1,), c_v, dtype=torch.float32, device=device)
        else:
            k_t = torch.full((1,), k_v, dtype=torch.float32, device=device)
    from_ptr = c_t is not None
    cfg = config or default_config(heads, dc, device)
    if cfg.block_h < 16 or cfg.block_h & (cfg.block_h - 1) or cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1):
        _fail(ValueError, f"config {cfg}: block_h and block_n must be powers of two >= 16.")
    if num_splits is None:
        if max_len is None:
            max_len = triton.cdiv(kv_indices.numel(), batch)
        num_splits = default_num_splits(batch, heads, max_len, device, cfg)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        _fail(ValueError, f"num_splits must be a positive int, got {num_splits!r}.")
    if kv_indices.numel() == 0:  # a valid pointer for the (never executed) index loads
        kv_indices = torch.zeros(1, dtype=torch.int32, device=device)
    if out is None:
        out = torch.empty(batch, heads, dc, dtype=Q_DTYPE, device=device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=device) if return_lse else None
    interpreted = device.type == "cpu"
    direct = num_splits == 1
    if direct:
        part_o = part_lse = out  # unused
    else:
        part_o = torch.empty(batch, num_splits, heads, dc, dtype=torch.float32, device=device)
        part_lse = torch.empty(batch, num_splits, heads, dtype=torch.float32, device=device)
    lse_arg = lse if lse is not None else part_lse
    grid = (batch, num_splits, triton.cdiv(heads, cfg.block_h))
    handle = _kernel("split", interpreted)[grid](
        q_nope, q_pe, ckv, kpe, kv_indptr, kv_indices,
        c_t if from_ptr else ckv, k_t if from_ptr else kpe, c_v, k_v, float(sm_scale) * LOG2E,
        part_o, part_lse, out, lse_arg,
        heads, num_splits,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), ckv.stride(0), kpe.stride(0),
        out.stride(0), out.stride(1),
        DC=dc, DR=dr, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        SCALE_FROM_PTR=from_ptr, DIRECT=direct, WRITE_LSE=return_lse, DOT_BF16=not interpreted,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not interpreted:
        LAST_COMPILED["split"] = handle
    if not direct:
        block_d = min(cfg.combine_block_d, dc)
        handle = _kernel("combine", interpreted)[(batch, heads, dc // block_d)](
            part_o, part_lse, out, lse_arg, heads, num_splits, out.stride(0), out.stride(1),
            DC=dc, BLOCK_D=block_d, BLOCK_S=cfg.combine_block_s, WRITE_LSE=return_lse,
            RNE_BY_BITS=interpreted, num_warps=cfg.combine_warps,
        )
        if not interpreted:
            LAST_COMPILED["combine"] = handle
    return (out, lse) if return_lse else out
