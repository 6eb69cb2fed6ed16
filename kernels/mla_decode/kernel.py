"""The Triton path of the fused FP8 MLA decode attention: reads the FP8 latent cache once, converts it in registers,
never writes BF16 KV anywhere.

For request ``b`` with tokens ``t`` (page size 1: slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``) and head ``h``::

    logits[h, t] = sm_scale * (q_nope[b, h] . ckv[t] * ckv_scale + q_pe[b, h] . kpe[t] * kpe_scale)
    out[b, h]    = softmax_t(logits[h]) @ (ckv * ckv_scale)

the semantics of FlashInfer's MLA ``run(..., ckv_scale=, kpe_scale=)``. The optional log-sum-exp is the
**natural-log** LSE of the scaled logits (as :func:`kvwall.kernels.mla_decode_reference` returns it; FlashInfer's
is base 2: multiply ours by ``1/ln 2``). A request with no tokens gets ``out = 0`` and ``lse = -inf``.

Design (chapter 5 gives the reason for each choice and the measurements):

- **Plan** (:func:`plan_mla_decode_triton`, once per decode step, reused by every layer): the batch as a work list of
  (request, token chunk) items of about equal size, longest first (:mod:`kvwall.kernels.mla_decode.plan`), with
  the float32 partial buffers; a planned call launches grid ``(head_blocks, items)`` and never synchronizes (CUDA-
  graph capturable). A request's last chunk runs to its length at run time, so a plan made for shorter requests
  stays correct. Without a plan, a checked call plans for itself; an unchecked one, or one given ``num_splits``,
  runs the uniform launch, grid ``(head_blocks, num_splits, B)``: every request in the same number of splits.
- **Split kernel**: a program owns a block of up to 64 heads (``block_h``), one request and one contiguous chunk
  of its tokens, so each token's latent is read from HBM once per chunk for all those heads (MLA shares the latent
  across heads). It walks its chunk in tiles of ``block_n`` tokens: gathers ``[block_n, 512]`` FP8 ``ckv`` and
  ``[block_n, 64]`` ``kpe`` rows through ``kv_indices``, converts them to float16 in registers
  (``cvt.rn.f16x2.e4m3x2``, exact), computes the scores ``q_nope @ ckv^T + q_pe @ kpe^T`` on tensor cores with the
  heads as the MMA's M side, runs the online softmax in base 2 and accumulates ``p @ ckv`` (the latent serves as K
  and as V; ``p`` rounded to float16 for the second dot, as flash attention does). The 512-wide latent goes in
  four 128-wide chunks with four accumulators. ``pairs=True`` (the 16-head shapes) reads the tile as 16-bit
  elements, each a pair of neighbouring FP8 columns converted by one ``cvt``, the dots split into even and odd
  columns (no one-byte shared-memory loads). The second dot reads the tile with the first one's load, which the
  compiler merges into one: one copy of the tile in shared memory serves both dots. Each chunk writes a
  normalized float32 partial ``[H, 512]`` and its base-2 LSE, or, when it is its request's only chunk, the BF16
  output directly.
- **Queries** go to float16 scaled per head by a power of two that puts the largest |q| in [2^12, 2^15) (no
  overflow, no lost bits), the scale folded back into the logit scale.
- **Combine kernel**, grid ``(requests with more than one chunk, H, 512 / combine_block_d)``: merges each
  request's partials (however many chunks it has) by their LSEs (flash-decoding); chunks with no tokens carry
  ``lse = -inf`` and weight 0.
- **Launch shape** (:class:`MLADecodeConfig`) and **programs at once** (the plan's sizing) come from
  ``tuned.json`` (written by ``python -m kvwall.tuning.fused --write``; only shapes that do not spill registers),
  the entry nearest to the GPU model, head count and context (:func:`tuned_entry`); without an entry, the first
  of :data:`FALLBACK_SHAPES` that fits the device's shared memory per block, is not trap-only and does not spill
  (:func:`fallback_config`), and programs from its compiled occupancy (:func:`programs_wanted`). The options no
  tuned entry selected are gone (``kernels/mla_decode/NOTES.md``, "Retired", has their measurements).
- **Rows past a split's end repeat its last token**, so the tile loads are unmasked and stay in bounds.
- On CPU tensors the kernels run in Triton's interpreter (built here, whatever ``TRITON_INTERPRET`` says), with
  exact float32 dots (the interpreter's 16-bit ``tl.dot`` is unreliable) and float32 ``p``; the FP8 conversion
  is done by bit moves there, then NaN put back. On CUDA they are compiled.

Inputs: ``q_nope [B, H, Dc]`` and ``q_pe [B, H, Dr]`` BF16 (last stride 1); ``ckv_cache [slots, Dc]`` and
``kpe_cache [slots, Dr]`` FP8 e4m3, or ``[slots, 1, D]``, rows of any stride with the last stride 1, so the views
``pool[:, 0, :512]`` and ``pool[:, 0, 512:]`` of one SGLang ``[slots, 1, 576]`` pool work without a copy (offsets
are 64-bit); or paged ``[pages, page_size, D]`` caches with ``kv_len`` (then ``kv_indptr``/``kv_indices`` count
pages, as FlashInfer's ``plan()`` takes them). ``Dc`` and ``Dr`` powers of two (512 and 64 for DeepSeek/GLM).
Scales: Python numbers (finite as float32; the rule :func:`kvwall.kernels._args.scale_number` that
``gather_cast`` shares) or one-element float32 tensors on the cache's device (read in the kernel, so a captured
CUDA graph replays with whatever they hold). ``sm_scale``: a finite number of magnitude at most 2.36e38
(``sm_scale * log2(e)`` is taken as a float32); the powers of two that scale the queries are folded into it
before it is multiplied, so the logit scale overflows only where the logits themselves would. ``out``: its own memory (one that overlaps itself or shares bytes
with an input is refused).

NaN: an FP8 NaN in a token a request reads makes that request's output and LSE NaN (every head), on the GPU and
in the interpreter alike; NaN in a slot no request reads has no effect.

**Unchecked calls** (``check_range=False``, the contract :func:`kvwall.kernels.gather.kernel.gather_cast`
shares): the kernels never read outside the caches, ``kv_indices``, ``kv_indptr`` or ``kv_len``, and never write
outside ``out``; a request holding an out-of-range index gets NaN output (every head, LSE NaN), and
``kv_indptr`` / ``kv_len`` entries past the buffers are clamped to them.
"""

from __future__ import annotations

import functools
import math
import re
import subprocess
import tempfile
import dataclasses
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Any, Sequence

import torch
import triton
import triton.language as tl

from kvwall.kernels.mla_decode.plan import WorkList, build_work_list
from kvwall.kernels._args import (FLOAT32_MAX, MAX_GRID_Y, MAX_HEADS, MAX_TOKENS, below_float32_normal, bounded_int,
                                  check_device, check_plan_args, positive_int, require_tensors, scale_number)
from kvwall.kernels._common import (Fail, build_kernel, check_indices_in_range, check_kv_indptr, check_output, fail,
                                    gpu_name, keep_fp8_nan, read_tuned_table, refuse_graph_capture,
                                    round_bf16_by_bits, sm_count)

__all__ = ["mla_decode_fp8", "plan_mla_decode_triton", "launch_planned", "device_ints", "MLADecodePlan", "MLADecodeConfig", "default_config",
           "default_num_splits", "programs_wanted", "blocks_per_sm", "tuned_entry", "fallback_config",
           "fallback_shapes", "FALLBACK_SHAPES", "split_constexprs", "kernel_signature", "compile_offline",
           "split_resources", "SplitResources", "is_trap_only", "cubin_resources", "TUNED_CONFIG_FILE", "LAST_COMPILED",
           "validate_call", "parse_scale", "launch_combine", "combine_shape", "COMBINE_WIDE_ROWS_PER_SM"]

_plan_fail: Fail = functools.partial(fail, "plan_mla_decode_triton")

Q_DTYPE = torch.bfloat16
KV_DTYPE = torch.float8_e4m3fn
INDEX_DTYPES = (torch.int32, torch.int64)
LOG2E = 1.4426950408889634
#: The most query tokens a request may bring (the front door's MAX_Q_LEN): a plan's rows are at most this x MAX_HEADS.
MAX_Q_LEN = 8


def _fp8_as_f16_impl(x8, ON_GPU: tl.constexpr):
    """FP8 e4m3 -> float16 dot operands. On the GPU the hardware ``cvt.rn.f16x2.e4m3x2`` (exact, scale 1, NaN stays
    NaN). In the interpreter by moving bits -- the sign to bit 15, the 7 exponent-and-mantissa bits to bits 7..13 --
    which gives float16 values of exactly 2^-8 x the FP8 value (the bias is 7 in e4m3 and 15 in float16, and the two
    formats' subnormal steps line up; ``KV_MUL`` folds the 2^8 back), e4m3's NaN pattern put back to NaN."""
    if ON_GPU:
        r = x8.to(tl.float16)
    else:
        u = x8.to(tl.uint8, bitcast=True).to(tl.uint16)
        r = keep_fp8_nan(x8, (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.float16, bitcast=True))
    return r


def _pow2_impl(k):
    """2^k for integer-valued float32 ``k`` in [-126, 127], exactly (built from the exponent bits)."""
    return ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


def _q_operand_impl(row_ptr, off, WIDTH: tl.constexpr, hmask, qmul, ON_GPU: tl.constexpr):
    """Columns ``off .. off + WIDTH`` of the queries, scaled per head by ``qmul``, as a ``[BLOCK_H, WIDTH]``
    float16 dot operand (float32 in the interpreter, holding the same float16 values)."""
    q = tl.load(row_ptr + off + tl.arange(0, WIDTH)[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    q = (q * qmul[:, None]).to(tl.float16)
    if not ON_GPU:
        q = q.to(tl.float32)
    return q


def _dot_impl(a, b, acc, ON_GPU: tl.constexpr):
    """A tensor-core dot on the GPU; exact float32 products in the interpreter (whose 16-bit dot is unreliable)."""
    if ON_GPU:
        r = tl.dot(a, b, acc)
    else:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return r


def _store_bf16_impl(ptrs, o, hmask, ON_GPU: tl.constexpr):
    if ON_GPU:
        ob = o.to(tl.bfloat16)
    else:  # the interpreter truncates float32 -> bfloat16: round to nearest even by integer ops
        ob = round_bf16_by_bits(o)
    tl.store(ptrs, ob, mask=hmask[:, None])


def _write_out_impl(o_rows, lse_ptrs, acc0, acc1, acc2, acc3, norm, lse2, hmask, DCH: tl.constexpr,
                    WRITE_LSE: tl.constexpr, ON_GPU: tl.constexpr):
    """A request's finished output (BF16) and natural-log LSE, from the four accumulators."""
    _store_bf16(o_rows + 0 * DCH, acc0 * norm, hmask, ON_GPU)
    _store_bf16(o_rows + 1 * DCH, acc1 * norm, hmask, ON_GPU)
    _store_bf16(o_rows + 2 * DCH, acc2 * norm, hmask, ON_GPU)
    _store_bf16(o_rows + 3 * DCH, acc3 * norm, hmask, ON_GPU)
    if WRITE_LSE:
        tl.store(lse_ptrs, lse2 * 0.6931471805599453, mask=hmask)


def _write_partial_impl(o_rows, lse_ptrs, acc0, acc1, acc2, acc3, norm, lse2, hmask, DCH: tl.constexpr):
    """A chunk's normalized float32 partial output and base-2 LSE, for the combine."""
    tl.store(o_rows + 0 * DCH, acc0 * norm, mask=hmask[:, None])
    tl.store(o_rows + 1 * DCH, acc1 * norm, mask=hmask[:, None])
    tl.store(o_rows + 2 * DCH, acc2 * norm, mask=hmask[:, None])
    tl.store(o_rows + 3 * DCH, acc3 * norm, mask=hmask[:, None])
    tl.store(lse_ptrs, lse2, mask=hmask)


def _fp8_pairs_impl(x16, ON_GPU: tl.constexpr):
    """Two FP8 e4m3 values packed in each 16-bit element (the even-indexed one in the low byte) -> the even and
    the odd ones as float16 tensors of ``x16``'s shape. The GPU converts a pair with one ``cvt.rn.f16x2.e4m3x2``
    (exact, scale 1) and the tile stays in 16-bit elements all the way from shared memory (no byte loads, no
    byte packing); the interpreter moves bits (values 2^-8 x the FP8 ones, as ``_fp8_as_f16`` does there)."""
    if ON_GPU:
        lo, hi = tl.inline_asm_elementwise(
            asm="{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
            constraints="=h,=h,h", args=[x16], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        u = x16.to(tl.uint16, bitcast=True)
        lo = _fp8_as_f16((u & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True), False)
        hi = _fp8_as_f16((u >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True), False)
    return lo, hi


def _q_half_impl(row_ptr, off, WIDTH: tl.constexpr, hmask, qmul, ON_GPU: tl.constexpr):
    """The even (``off`` even) or odd (``off`` odd) columns of query columns ``off - off % 2 .. + 2 WIDTH``, scaled
    per head, as a ``[BLOCK_H, WIDTH]`` float16 dot operand (float32 in the interpreter)."""
    q = tl.load(row_ptr + off + 2 * tl.arange(0, WIDTH)[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    q = (q * qmul[:, None]).to(tl.float16)
    if not ON_GPU:
        q = q.to(tl.float32)
    return q


def _pairs_loop_impl(ckv_ptr, kpe_ptr, indices_ptr, start, lo, hi, num_units, stride_ckv, stride_kpe,
                     qn_row, qp_row, hmask, qmul, row_c, row_k, row_end,
                     BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DCH: tl.constexpr, DR: tl.constexpr,
                     PAGE: tl.constexpr, ON_GPU: tl.constexpr, CAUSAL: tl.constexpr):
    """The token loop with the tile read as 16-bit pairs of FP8 values: every latent chunk splits into its even
    and odd columns (:func:`_fp8_pairs`), the queries likewise (once, here), so the scores are
    ``sum_c q_even_c . ckv_even_c + q_odd_c . ckv_odd_c`` and the output's even and odd columns accumulate
    apart (``p @ ckv_even_c``, ``p @ ckv_odd_c``), interleaved back once at the end. Returns what the main loop
    leaves: running max, sum, the four [heads, 128] accumulators, per-row out-of-range flags."""
    HC: tl.constexpr = DCH // 2
    HR: tl.constexpr = DR // 2
    ckv16 = ckv_ptr.to(tl.pointer_type(tl.uint16))
    kpe16 = kpe_ptr.to(tl.pointer_type(tl.uint16))
    jc = tl.arange(0, HC)
    jr = tl.arange(0, HR)
    qe0 = _q_half(qn_row, 0 * DCH, HC, hmask, qmul, ON_GPU)
    qo0 = _q_half(qn_row, 0 * DCH + 1, HC, hmask, qmul, ON_GPU)
    qe1 = _q_half(qn_row, 1 * DCH, HC, hmask, qmul, ON_GPU)
    qo1 = _q_half(qn_row, 1 * DCH + 1, HC, hmask, qmul, ON_GPU)
    qe2 = _q_half(qn_row, 2 * DCH, HC, hmask, qmul, ON_GPU)
    qo2 = _q_half(qn_row, 2 * DCH + 1, HC, hmask, qmul, ON_GPU)
    qe3 = _q_half(qn_row, 3 * DCH, HC, hmask, qmul, ON_GPU)
    qo3 = _q_half(qn_row, 3 * DCH + 1, HC, hmask, qmul, ON_GPU)
    qer = _q_half(qp_row, 0, HR, hmask, qmul, ON_GPU)
    qor = _q_half(qp_row, 1, HR, hmask, qmul, ON_GPU)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    bad_seen = tl.full([BLOCK_N], 0, tl.int32)
    e0 = tl.full([BLOCK_H, HC], 0.0, tl.float32)
    o0 = tl.full([BLOCK_H, HC], 0.0, tl.float32)
    e1 = tl.full([BLOCK_H, HC], 0.0, tl.float32)
    o1 = tl.full([BLOCK_H, HC], 0.0, tl.float32)
    e2 = tl.full([BLOCK_H, HC], 0.0, tl.float32)
    o2 = tl.full([BLOCK_H, HC], 0.0, tl.float32)
    e3 = tl.full([BLOCK_H, HC], 0.0, tl.float32)
    o3 = tl.full([BLOCK_H, HC], 0.0, tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < hi
        t = tl.minimum(n, hi - 1)
        if PAGE == 1:
            raw = tl.load(indices_ptr + start + t)
            bad = (raw < 0) | (raw >= num_units)
            slot = tl.where(bad, 0, raw).to(tl.int64)
        else:
            raw = tl.load(indices_ptr + start + t // PAGE)
            bad = (raw < 0) | (raw >= num_units)
            slot = tl.where(bad, 0, raw).to(tl.int64) * PAGE + t % PAGE
        row = ckv16 + slot[:, None] * (stride_ckv // 2) + jc[None, :]  # [BLOCK_N, HC] pairs of one chunk
        ke, ko = _fp8_pairs(tl.load(row + 0 * HC), ON_GPU)
        s_c = _dot(qe0, tl.trans(ke), None, ON_GPU)
        s_c = _dot(qo0, tl.trans(ko), s_c, ON_GPU)
        ke, ko = _fp8_pairs(tl.load(row + 1 * HC), ON_GPU)
        s_c = _dot(qe1, tl.trans(ke), s_c, ON_GPU)
        s_c = _dot(qo1, tl.trans(ko), s_c, ON_GPU)
        ke, ko = _fp8_pairs(tl.load(row + 2 * HC), ON_GPU)
        s_c = _dot(qe2, tl.trans(ke), s_c, ON_GPU)
        s_c = _dot(qo2, tl.trans(ko), s_c, ON_GPU)
        ke, ko = _fp8_pairs(tl.load(row + 3 * HC), ON_GPU)
        s_c = _dot(qe3, tl.trans(ke), s_c, ON_GPU)
        s_c = _dot(qo3, tl.trans(ko), s_c, ON_GPU)
        re_, ro = _fp8_pairs(tl.load(kpe16 + slot[:, None] * (stride_kpe // 2) + jr[None, :]), ON_GPU)
        s_r = _dot(qer, tl.trans(re_), None, ON_GPU)
        s_r = _dot(qor, tl.trans(ro), s_r, ON_GPU)
        logits = s_c * row_c[:, None] + s_r * row_k[:, None]
        bad_seen = bad_seen | bad.to(tl.int32)
        logits = tl.where(live[None, :], logits, float("-inf"))
        if CAUSAL:  # a row that has seen no token yet keeps max -inf; its offsets are taken from 0 (p = 0)
            logits = tl.where(n[None, :] < row_end[:, None], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(logits, 1, tl.standard._elementwise_max))
        if CAUSAL:
            m_off = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_off = m_new
        alpha = tl.exp2(m_i - m_off)
        p = tl.exp2(logits - m_off[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        if ON_GPU:
            pv = p.to(tl.float16)
        else:
            pv = p
        ve, vo = _fp8_pairs(tl.load(row + 0 * HC), ON_GPU)
        e0 = _dot(pv, ve, e0 * alpha[:, None], ON_GPU)
        o0 = _dot(pv, vo, o0 * alpha[:, None], ON_GPU)
        ve, vo = _fp8_pairs(tl.load(row + 1 * HC), ON_GPU)
        e1 = _dot(pv, ve, e1 * alpha[:, None], ON_GPU)
        o1 = _dot(pv, vo, o1 * alpha[:, None], ON_GPU)
        ve, vo = _fp8_pairs(tl.load(row + 2 * HC), ON_GPU)
        e2 = _dot(pv, ve, e2 * alpha[:, None], ON_GPU)
        o2 = _dot(pv, vo, o2 * alpha[:, None], ON_GPU)
        ve, vo = _fp8_pairs(tl.load(row + 3 * HC), ON_GPU)
        e3 = _dot(pv, ve, e3 * alpha[:, None], ON_GPU)
        o3 = _dot(pv, vo, o3 * alpha[:, None], ON_GPU)
        m_i = m_new
    acc0 = tl.reshape(tl.join(e0, o0), [BLOCK_H, DCH])  # columns 2j (even) and 2j + 1 (odd), interleaved
    acc1 = tl.reshape(tl.join(e1, o1), [BLOCK_H, DCH])
    acc2 = tl.reshape(tl.join(e2, o2), [BLOCK_H, DCH])
    acc3 = tl.reshape(tl.join(e3, o3), [BLOCK_H, DCH])
    return m_i, l_i, acc0, acc1, acc2, acc3, bad_seen


# The split kernel calls these; compiled kernels need them jitted, interpreted ones call the plain functions.
_HELPERS = {"_fp8_as_f16": _fp8_as_f16_impl, "_pow2": _pow2_impl, "_q_operand": _q_operand_impl,
            "_dot": _dot_impl, "_store_bf16": _store_bf16_impl, "_write_out": _write_out_impl,
            "_write_partial": _write_partial_impl, "_fp8_pairs": _fp8_pairs_impl, "_q_half": _q_half_impl,
            "_pairs_loop": _pairs_loop_impl}
_fp8_as_f16 = triton.jit(_fp8_as_f16_impl)
_pow2 = triton.jit(_pow2_impl)
_q_operand = triton.jit(_q_operand_impl)
_dot = triton.jit(_dot_impl)
_store_bf16 = triton.jit(_store_bf16_impl)
_write_out = triton.jit(_write_out_impl)
_write_partial = triton.jit(_write_partial_impl)
_fp8_pairs = triton.jit(_fp8_pairs_impl)
_q_half = triton.jit(_q_half_impl)
_pairs_loop = triton.jit(_pairs_loop_impl)


def _mla_split_kernel(
    qn_ptr, qp_ptr, ckv_ptr, kpe_ptr, indptr_ptr, indices_ptr, kvlen_ptr,
    ckv_scale_ptr, kpe_scale_ptr, ckv_scale_val, kpe_scale_val, qk_scale,  # qk_scale = sm_scale * log2(e)
    part_o_ptr, part_lse_ptr, out_ptr, lse_ptr,
    work_ptr,  # WORKLIST: the plan's items, int32 [items, 4] rows (request, first token, end token, partial row)
    H, num_splits,
    q_len, heads_per_token,  # CAUSAL: H = q_len x heads_per_token rows a request, row r is query token r // heads_per_token
    num_indices,  # len(kv_indices): kv_indptr entries are clamped to it (unchecked calls read nothing past it)
    num_units,  # slots (PAGE == 1) or pages in the cache: an index outside 0..num_units-1 makes the request NaN
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_ckv, stride_kpe,
    stride_o_b, stride_o_h,
    DC: tl.constexpr, DCH: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, SCALE_FROM_PTR: tl.constexpr, DIRECT: tl.constexpr, WRITE_LSE: tl.constexpr,
    ON_GPU: tl.constexpr, KV_MUL: tl.constexpr, WORKLIST: tl.constexpr,
    PAIRS: tl.constexpr, CAUSAL: tl.constexpr,
):
    hb = tl.program_id(0)  # head blocks vary fastest: programs sharing a split run together and share it in L2
    if WORKLIST:  # one item of the plan: a request and a chunk of its tokens
        wrow = work_ptr + tl.program_id(1) * 4
        b = tl.load(wrow)
        item_lo = tl.load(wrow + 1)
        item_hi = tl.load(wrow + 2)  # 2^31 - 1 for a request's last chunk: up to the length it has at run time
        prow = tl.load(wrow + 3)  # partial row, or -1: the request's only chunk, written straight to out
        s = 0
    else:
        s = tl.program_id(1)
        b = tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dc = tl.arange(0, DC)
    dch = tl.arange(0, DCH)
    dr = tl.arange(0, DR)

    # Clamped to the buffers: a checked call changes nothing here, an unchecked one reads nothing outside them.
    # Clamped in the loaded width (int64 entries too), then narrowed: the clamped values fit 32 bits.
    start = tl.minimum(tl.maximum(tl.load(indptr_ptr + b), 0), num_indices).to(tl.int32)
    stop = tl.minimum(tl.maximum(tl.load(indptr_ptr + b + 1), start), num_indices).to(tl.int32)
    if PAGE == 1:
        length = stop - start
    else:
        length = tl.minimum(tl.maximum(tl.load(kvlen_ptr + b), 0), (stop - start) * PAGE).to(tl.int32)
    # cdiv spelled out: tl.cdiv is a jit function, which a kernel built with InterpretedFunction cannot call
    if WORKLIST:
        lo = tl.minimum(tl.maximum(item_lo, 0), length)  # token positions within the request
        hi = tl.minimum(tl.maximum(item_hi, lo), length)
    else:
        per_split = ((length + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = s * per_split
        hi = tl.minimum(lo + per_split, length)

    if CAUSAL:  # query token j of the request (row r: j = r // heads_per_token) sees its first length - (q_len - 1 - j)
        row_end = length - (q_len - 1 - heads // heads_per_token)
    else:
        row_end = tl.full([BLOCK_H], 0, tl.int32) + length

    if SCALE_FROM_PTR:
        ckv_scale = tl.load(ckv_scale_ptr).to(tl.float32)
        kpe_scale = tl.load(kpe_scale_ptr).to(tl.float32)
    else:
        ckv_scale = ckv_scale_val
        kpe_scale = kpe_scale_val

    # Queries -> float16 dot operands, each head scaled by a power of two 2^e so its largest |q| lies in
    # [2^12, 2^15): no overflow, no lost bits (bf16's 8 significant bits fit in fp16's 11); 2^-e is folded into
    # the logit scale, with KV_MUL (2^8 for the interpreter's bit move) of the FP8 -> float16 conversion.
    qn_row = qn_ptr + b.to(tl.int64) * stride_qn_b + heads[:, None] * stride_qn_h
    qp_row = qp_ptr + b.to(tl.int64) * stride_qp_b + heads[:, None] * stride_qp_h
    qn = tl.load(qn_row + dc[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    qp = tl.load(qp_row + dr[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.reduce(tl.abs(qn), 1, tl.standard._elementwise_max),
                      tl.reduce(tl.abs(qp), 1, tl.standard._elementwise_max))
    # (a head of zeros -- or a padding row -- takes 2^13 too: any power scales zero to zero, and 2^0 would leave the
    # logit scale 2^13 times larger than any real head's, overflowing for an sm_scale the reference takes)
    e = 13.0 - tl.floor(tl.log2(tl.where(amax > 0.0, amax, 1.0)))
    e = tl.minimum(tl.maximum(e, -120.0), 120.0)
    qmul = _pow2(e)
    # The powers of two first (exact): the scale times KV_MUL alone could overflow where the logit scale does not.
    row_c = ckv_scale * (qk_scale * (KV_MUL * _pow2(-e)))  # [BLOCK_H] logit scale of q_nope . ckv
    row_k = kpe_scale * (qk_scale * (KV_MUL * _pow2(-e)))
    q0 = _q_operand(qn_row, 0 * DCH, DCH, hmask, qmul, ON_GPU)  # [BLOCK_H, DCH] each
    q1 = _q_operand(qn_row, 1 * DCH, DCH, hmask, qmul, ON_GPU)
    q2 = _q_operand(qn_row, 2 * DCH, DCH, hmask, qmul, ON_GPU)
    q3 = _q_operand(qn_row, 3 * DCH, DCH, hmask, qmul, ON_GPU)
    qr = _q_operand(qp_row, 0, DR, hmask, qmul, ON_GPU)

    # Per tile of BLOCK_N tokens: scores [heads, tokens] = q_nope @ ckv^T + q_pe @ kpe^T, online softmax, and
    # out [heads, 512] += p @ ckv -- the latent serves as K and as V. The 512-wide latent goes in four
    # 128-wide chunks (four dots each way, four accumulators): whole-tile operands would spill. The tile is loaded
    # for the scores and again, the same load, for p @ ckv: the compiler merges the two, so Triton's pipeliner
    # streams one copy of the tile into shared memory with cp.async and both dots read it. (A second load with its
    # own cache hint, `.ca`, streamed two copies, twice the shared memory; retired 2026-12-02, see NOTES.md.)
    if PAIRS:
        # The tile read as 16-bit pairs of FP8 values (even and odd latent columns apart): 16-bit loads from
        # shared memory and one conversion per pair, where FP8 elements cost a byte load each.
        m_i, l_i, acc0, acc1, acc2, acc3, bad_seen = _pairs_loop(
            ckv_ptr, kpe_ptr, indices_ptr, start, lo, hi, num_units, stride_ckv, stride_kpe, qn_row, qp_row, hmask,
            qmul, row_c, row_k, row_end, BLOCK_H, BLOCK_N, DCH, DR, PAGE, ON_GPU, CAUSAL)
    else:
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        bad_seen = tl.full([BLOCK_N], 0, tl.int32)  # per tile column: did an index fall outside the cache?
        l_i = tl.full([BLOCK_H], 0.0, tl.float32)
        acc0 = tl.full([BLOCK_H, DCH], 0.0, tl.float32)
        acc1 = tl.full([BLOCK_H, DCH], 0.0, tl.float32)
        acc2 = tl.full([BLOCK_H, DCH], 0.0, tl.float32)
        acc3 = tl.full([BLOCK_H, DCH], 0.0, tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            live = n < hi
            # Rows past the split's end repeat its last token: every load stays unmasked and in bounds, and what
            # they read is dropped (-inf logits, p = 0) -- no stray slot's NaN can leak in through 0 x NaN.
            # An index outside the cache (possible in unchecked calls) reads slot 0 instead; the split ends NaN.
            t = tl.minimum(n, hi - 1)
            # Checked in the index's own width, before widening: in 64 bits the check cost 2-5 % of the kernel's time.
            if PAGE == 1:
                raw = tl.load(indices_ptr + start + t)
                bad = (raw < 0) | (raw >= num_units)
                slot = tl.where(bad, 0, raw).to(tl.int64)
            else:
                raw = tl.load(indices_ptr + start + t // PAGE)
                bad = (raw < 0) | (raw >= num_units)
                slot = tl.where(bad, 0, raw).to(tl.int64) * PAGE + t % PAGE
            row = ckv_ptr + slot[:, None] * stride_ckv + dch[None, :]
            kr = tl.load(kpe_ptr + slot[:, None] * stride_kpe + dr[None, :])
            s_c = _dot(q0, tl.trans(_fp8_as_f16(tl.load(row + 0 * DCH), ON_GPU)), None, ON_GPU)
            s_c = _dot(q1, tl.trans(_fp8_as_f16(tl.load(row + 1 * DCH), ON_GPU)), s_c, ON_GPU)
            s_c = _dot(q2, tl.trans(_fp8_as_f16(tl.load(row + 2 * DCH), ON_GPU)), s_c, ON_GPU)
            s_c = _dot(q3, tl.trans(_fp8_as_f16(tl.load(row + 3 * DCH), ON_GPU)), s_c, ON_GPU)
            s_r = _dot(qr, tl.trans(_fp8_as_f16(kr, ON_GPU)), None, ON_GPU)
            logits = s_c * row_c[:, None] + s_r * row_k[:, None]  # [BLOCK_H, BLOCK_N], base-2 units
            bad_seen = bad_seen | bad.to(tl.int32)
            logits = tl.where(live[None, :], logits, float("-inf"))
            # Reductions through tl.reduce with the standard combine functions: tl.max / tl.sum are jit functions,
            # which a kernel built with InterpretedFunction (no TRITON_INTERPRET) cannot call; tl.reduce it patches.
            # m_new is finite: every tile holds at least one live token -- except, with the causal mask over a
            # request's draft tokens, for a row that sees none of this tile (its max stays -inf: offsets from 0).
            if CAUSAL:
                logits = tl.where(n[None, :] < row_end[:, None], logits, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(logits, 1, tl.standard._elementwise_max))
            if CAUSAL:  # a row that has seen no token yet keeps max -inf; its offsets are taken from 0 (p = 0)
                m_off = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_off = m_new
            alpha = tl.exp2(m_i - m_off)
            p = tl.exp2(logits - m_off[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            if ON_GPU:
                pv = p.to(tl.float16)  # rounded to the operand type, as flash attention does
            else:
                pv = p  # float32 p: the interpreter checks everything but the GPU's float16 rounding of p
            acc0 = _dot(pv, _fp8_as_f16(tl.load(row + 0 * DCH), ON_GPU),
                        acc0 * alpha[:, None], ON_GPU)
            acc1 = _dot(pv, _fp8_as_f16(tl.load(row + 1 * DCH), ON_GPU),
                        acc1 * alpha[:, None], ON_GPU)
            acc2 = _dot(pv, _fp8_as_f16(tl.load(row + 2 * DCH), ON_GPU),
                        acc2 * alpha[:, None], ON_GPU)
            acc3 = _dot(pv, _fp8_as_f16(tl.load(row + 3 * DCH), ON_GPU),
                        acc3 * alpha[:, None], ON_GPU)
            m_i = m_new

    # l_i is 0 for a split with no tokens, >= 1 otherwise; NaN if a logit was (an FP8 NaN) or if an index was out
    # of range: then out and LSE are NaN.
    l_i = tl.where(tl.reduce(bad_seen, 0, tl.standard._elementwise_max) > 0, float("nan"), l_i)
    empty = l_i == 0.0
    if ON_GPU:  # (KV_MUL is 1 here)
        norm = tl.where(empty, 0.0, ckv_scale * KV_MUL / tl.where(empty, 1.0, l_i))[:, None]  # [BLOCK_H, 1]
    else:  # the interpreter's 2^8 goes on the accumulators (exact): in the norm, ckv_scale x 2^8 overflows from 1.3e36
        norm = tl.where(empty, 0.0, ckv_scale / tl.where(empty, 1.0, l_i))[:, None]
        acc0 = acc0 * KV_MUL
        acc1 = acc1 * KV_MUL
        acc2 = acc2 * KV_MUL
        acc3 = acc3 * KV_MUL
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    if WORKLIST:
        to_out = prow < 0  # the request's only chunk
        part_row = tl.maximum(prow, 0)
    else:
        to_out = DIRECT
        part_row = b * num_splits + s  # partials laid out [B, S, H, DC]
    if to_out:
        _write_out(out_ptr + b.to(tl.int64) * stride_o_b + heads[:, None] * stride_o_h + dch[None, :],
                   lse_ptr + b * H + heads, acc0, acc1, acc2, acc3, norm, lse2, hmask, DCH, WRITE_LSE, ON_GPU)
    else:
        rows = part_row.to(tl.int64) * H + heads
        _write_partial(part_o_ptr + rows[:, None] * DC + dch[None, :], part_lse_ptr + rows, acc0, acc1, acc2, acc3,
                       norm, lse2, hmask, DCH)


def _mla_combine_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, lse_ptr, H, num_splits, stride_o_b, stride_o_h,
    combine_req_ptr, part_indptr_ptr,  # WORKLIST: the requests with more than one chunk, and their partial rows
    DC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr,
    RNE_BY_BITS: tl.constexpr, WORKLIST: tl.constexpr,
):
    if WORKLIST:  # program i merges request combine_req[i]'s chunks: partial rows part_indptr[i] .. [i + 1]
        i = tl.program_id(0)
        b = tl.load(combine_req_ptr + i)
        first = tl.load(part_indptr_ptr + i)
        num_splits = tl.load(part_indptr_ptr + i + 1) - first
    else:  # request b's splits: rows b * num_splits ..
        b = tl.program_id(0)
        first = b * num_splits
    h = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    base = first.to(tl.int64) * H + h  # row of the first split
    # A split whose LSE is NaN (a NaN logit) makes the result NaN; the maximum is taken over the others (the GPU's
    # maximum ignores NaN, the interpreter's propagates it: excluded explicitly, both agree).
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(part_lse_ptr + base + ss * H, mask=ss < num_splits, other=float("-inf"))
        m = tl.maximum(m, tl.where(lse != lse, float("-inf"), lse))
    m_all = tl.reduce(m, 0, tl.standard._elementwise_max)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    wsum = tl.full([BLOCK_S], 0.0, tl.float32)
    nans = tl.full([BLOCK_S], 0.0, tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        ss = s0 + tl.arange(0, BLOCK_S)
        ok = ss < num_splits
        lse = tl.load(part_lse_ptr + base + ss * H, mask=ok, other=float("-inf"))
        w = tl.exp2(lse - m_safe)  # 0 for empty splits
        w = tl.where(ok & (lse > float("-inf")), w, 0.0)  # 0 for NaN too: counted apart
        nans += tl.where(lse != lse, 1.0, 0.0)
        o = tl.load(part_o_ptr + (base + ss * H)[:, None] * DC + d[None, :], mask=(ok & (w > 0.0))[:, None],
                    other=0.0)
        acc += tl.reduce(w[:, None] * o, 0, tl.standard._sum_combine)
        wsum += w
    total = tl.reduce(wsum, 0, tl.standard._sum_combine)
    poisoned = tl.reduce(nans, 0, tl.standard._sum_combine) > 0.0
    res = tl.where(total > 0.0, acc / tl.where(total > 0.0, total, 1.0), 0.0)
    res = tl.where(poisoned, float("nan"), res)
    if RNE_BY_BITS:  # the interpreter truncates float32 -> bfloat16: round to nearest even by integer ops
        rb = round_bf16_by_bits(res)
    else:
        rb = res.to(tl.bfloat16)
    tl.store(out_ptr + b.to(tl.int64) * stride_o_b + h * stride_o_h + d, rb)
    if WRITE_LSE:
        if tl.program_id(2) == 0:
            lse_out = tl.where(total > 0.0, (m_safe + tl.log2(tl.where(total > 0.0, total, 1.0))) * 0.6931471805599453,
                               float("-inf"))
            tl.store(lse_ptr + b * H + h, tl.where(poisoned, float("nan"), lse_out))


#: The compiled kernels of the latest CUDA launch (for resource reports: ``n_regs``, ``n_spills``, ``metadata.shared``).
LAST_COMPILED: dict[str, object] = {}


@functools.cache
def _kernel(name: str, interpreted: bool):
    fn = {"split": _mla_split_kernel, "combine": _mla_combine_kernel}[name]
    return build_kernel(fn, interpreted, _HELPERS)


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch shape of the split kernel (``block_h`` heads x ``block_n`` tokens per step, its warps and
    software-pipeline stages; ``pairs``: the tile read as 16-bit pairs of FP8 values) and of the combine
    (``combine_block_d`` latent columns per program; ``combine_block_s`` splits per step and ``combine_warps``;
    0 = sized from the work by :func:`combine_shape`)."""

    block_h: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    pairs: bool = False
    combine_block_d: int = 0
    combine_block_s: int = 0
    combine_warps: int = 0


#: Tuned launch shapes per GPU model, head count and context (written by ``python -m kvwall.tuning.fused --write``).
TUNED_CONFIG_FILE = Path(__file__).with_name("tuned.json")


def tuned_entry(heads: int, max_len: int | None, gpu: str, *, path: Path | None = None) -> dict | None:
    """The entry of the tuned table (``path``, default :data:`TUNED_CONFIG_FILE`) for GPU model ``gpu`` (as
    ``torch.cuda.get_device_name`` says it) nearest to (heads, context): the smallest tuned head count >= heads
    (else the largest), and the context nearest to ``max_len`` in log scale. Returns ``{"heads": tuned head
    count, "config": {...MLADecodeConfig fields}, "splits": ...}``, or None when the table has no entry for
    ``gpu``."""
    table = read_tuned_table(path or TUNED_CONFIG_FILE, gpu)
    counts = sorted(int(h) for h in table if h.isdigit())
    if not counts:
        return None
    h = next((c for c in counts if c >= heads), counts[-1])
    by_ctx = table[str(h)]
    n = max(1, max_len or 1)
    ctx = min(by_ctx, key=lambda c: abs(math.log(int(c) / n)))
    return {"heads": h, **by_ctx[ctx]}


@functools.cache
def _device_entry(gpu: str, heads: int, max_len: int | None) -> dict | None:
    return tuned_entry(heads, max_len, gpu)


def _entry_for(heads: int, max_len: int | None, device: torch.device) -> dict | None:
    return _device_entry(gpu_name(device), heads, max_len) if device.type == "cuda" else None


#: Launch shapes a GPU missing from the tuned table may get, best first, for up to 16 heads and for more: the
#: launcher takes the first whose compiled shared memory fits the device's per-block limit and that is not a
#: trap-only kernel (:func:`fallback_config`). The later ones exist for SM120's 99 KB blocks and SM100's 512
#: tensor-memory columns.
FALLBACK_SHAPES: dict[str, tuple[MLADecodeConfig, ...]] = {
    "up to 16 heads": (MLADecodeConfig(16, 64, 4, 3, pairs=True), MLADecodeConfig(16, 64, 4, 2),
                       MLADecodeConfig(16, 64, 4, 1)),
    "more than 16 heads": (MLADecodeConfig(64, 32, 8, 3), MLADecodeConfig(32, 64, 8, 3),
                           MLADecodeConfig(32, 32, 8, 2), MLADecodeConfig(16, 64, 4, 1)),
}


def fallback_shapes(heads: int) -> tuple[MLADecodeConfig, ...]:
    return FALLBACK_SHAPES["up to 16 heads" if heads <= 16 else "more than 16 heads"]


def split_constexprs(cfg: MLADecodeConfig, *, dc: int = 512, dr: int = 64, page: int = 1, worklist: bool = True,
                     direct: bool = False, write_lse: bool = False, scale_from_ptr: bool = False,
                     on_gpu: bool = True, causal: bool = False) -> dict:
    """The split kernel's compile-time parameters for a launch with ``cfg`` (what the launcher passes)."""
    return dict(DC=dc, DCH=dc // 4, DR=dr, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, PAGE=page,
                SCALE_FROM_PTR=scale_from_ptr, DIRECT=direct and not worklist, WRITE_LSE=write_lse, ON_GPU=on_gpu,
                KV_MUL=1.0 if on_gpu else 256.0, WORKLIST=worklist, PAIRS=cfg.pairs, CAUSAL=causal)


_POINTER_TYPES = {"qn_ptr": "*bf16", "qp_ptr": "*bf16", "out_ptr": "*bf16", "ckv_ptr": "*fp8e4nv",
                  "kpe_ptr": "*fp8e4nv", "indptr_ptr": "*i32", "indices_ptr": "*i32", "kvlen_ptr": "*i32",
                  "work_ptr": "*i32", "combine_req_ptr": "*i32", "part_indptr_ptr": "*i32"}
_FLOAT_ARGS = ("ckv_scale_val", "kpe_scale_val", "qk_scale")


def kernel_signature(name: str, constexprs: dict) -> dict[str, str]:
    """Argument types of kernel ``name`` ("split" or "combine") for an offline compile: int32 indices, BF16 queries
    and output, FP8 caches, float32 scales and partials."""
    fn = _kernel(name, False)
    sig = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            sig[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            sig[arg] = _POINTER_TYPES.get(arg, "*fp32")
        else:
            sig[arg] = "fp32" if arg in _FLOAT_ARGS else "i32"
    return sig


def compile_offline(name: str, constexprs: dict, num_warps: int, num_stages: int, cap: int):
    """Kernel ``name`` compiled for compute capability ``cap`` without launching it (no GPU of that kind needed:
    Triton's ``triton.compile`` with its bundled ptxas). Raises what the compiler raises."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = kernel_signature(name, constexprs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if sig[k].startswith("*") or "stride" in k}
    return triton.compile(ASTSource(fn=_kernel(name, False), signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", cap, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def is_trap_only(compiled) -> bool:
    """Where Triton gives up on a layout (e.g. more tensor-memory columns than SM100's 512) it emits a kernel that
    only traps: it compiles, and fails at launch."""
    ptx = compiled.asm.get("ptx", "")
    return "trap;" in ptx and sum(1 for line in ptx.splitlines() if line.strip().endswith(";")) < 50


def cubin_resources(asm: dict) -> tuple[int | None, int | None]:
    """(registers per thread, local-memory bytes per thread) of a compiled kernel's cubin, read with the
    ``cuobjdump`` Triton ships beside its ptxas; (None, None) where it is missing or cannot read the cubin. The local
    memory is the stack frame plus any ``.local`` data (``STACK`` + ``LOCAL``): what the driver reports as the
    kernel's local size. Triton kernels declare no local arrays and call no functions, so it is register spills."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin = asm.get("cubin")
    if not tool.is_file() or not cubin:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, timeout=60).stdout
    regs = re.search(r"REG:(\d+)", out)
    local = [int(n) for n in re.findall(r"(?:STACK|LOCAL):(\d+)", out)]
    return (int(regs.group(1)) if regs else None), (sum(local) if local else None)


@dataclass(frozen=True)
class SplitResources:
    """What the compiler gave one launch shape on one architecture: shared memory per block, registers per thread
    and spilled (local-memory) bytes per thread (None when they cannot be read), and whether the kernel only
    traps."""

    shared: int
    regs: int | None
    trap_only: bool
    spills: int | None = None


@functools.cache
def split_resources(cfg: MLADecodeConfig, cap: int) -> SplitResources:
    """:class:`SplitResources` of the split kernel (work-list launch) with ``cfg`` compiled for ``cap`` (registers
    and spills from the cubin; on the GPU of that capability, from loading the binary where cuobjdump is
    missing)."""
    compiled = compile_offline("split", split_constexprs(cfg), cfg.num_warps, cfg.num_stages, cap)
    regs, spills = cubin_resources(compiled.asm)
    if regs is None and torch.cuda.is_available() and torch.cuda.get_device_capability() == divmod(cap, 10):
        compiled._init_handles()
        regs, spills = int(compiled.n_regs), int(compiled.n_spills) * 4
    return SplitResources(int(compiled.metadata.shared), regs, is_trap_only(compiled), spills)


def _device_limits(device: torch.device) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(device)
    return props.major * 10 + props.minor, int(props.shared_memory_per_block_optin)


def fallback_config(heads: int, cap: int, shared_limit: int) -> MLADecodeConfig:
    """The first of :data:`FALLBACK_SHAPES` for ``heads`` that compiles for ``cap`` within ``shared_limit`` bytes of
    shared memory per block, is not trap-only and does not spill registers (where the spills can be read); the
    last one if none is."""
    shapes = fallback_shapes(heads)
    for cfg in shapes:
        try:
            res = split_resources(cfg, cap)
        except Exception:  # noqa: BLE001 - a shape the compiler refuses is skipped
            continue
        if res.shared <= shared_limit and not res.trap_only and not res.spills:
            return cfg
    return shapes[-1]


def default_config(heads: int, dc: int, device: torch.device, max_len: int | None = None) -> MLADecodeConfig:
    """The launch shape: the tuned one for this GPU, head count and context if the table has it; else the first of
    :data:`FALLBACK_SHAPES` that fits this device (:func:`fallback_config`: shared memory within the device's real
    per-block limit, not a trap-only kernel). In the interpreter, large tiles (its cost is per program and per
    operation, not per element)."""
    if device.type == "cpu":
        block_h = min(max(16, triton.next_power_of_2(heads)), 64)
        return MLADecodeConfig(block_h=block_h, block_n=64, num_warps=1, num_stages=1,
                               combine_block_d=dc, combine_block_s=16, combine_warps=1)
    entry = _entry_for(heads, max_len, device)
    if entry is not None:
        return MLADecodeConfig(**{k: v for k, v in entry["config"].items() if not k.startswith("combine_")})
    if device.type != "cuda":  # e.g. "meta": the first preference, unfiltered
        return fallback_shapes(heads)[0]
    return fallback_config(heads, *_device_limits(device))


def blocks_per_sm(cfg: MLADecodeConfig, device: torch.device) -> int:
    """Split-kernel programs with ``cfg`` one multiprocessor of ``device`` holds at once: the least of what its
    shared memory (per SM, 1 KB reserved per block), registers and thread slots allow, from the compiled kernel."""
    props = torch.cuda.get_device_properties(device)
    res = split_resources(cfg, props.major * 10 + props.minor)
    threads = 32 * cfg.num_warps
    by_smem = int(props.shared_memory_per_multiprocessor) // (res.shared + 1024)
    by_threads = int(props.max_threads_per_multi_processor) // threads
    by_regs = int(props.regs_per_multiprocessor) // (-(-res.regs // 8) * 8 * threads) if res.regs else by_threads
    return max(1, min(by_smem, by_regs, by_threads))


def programs_wanted(heads: int, max_len: int, device: torch.device, config: MLADecodeConfig | None = None) -> int:
    """Split-kernel programs to launch at once on ``device``: the tuned count (the tuned batch-1 run's splits x head
    blocks) where the table has one, else one full wave at the compiled kernel's occupancy (:func:`blocks_per_sm`
    x multiprocessors)."""
    entry = _entry_for(heads, max_len, device)
    if entry is not None and entry.get("splits"):
        return entry["splits"] * triton.cdiv(entry["heads"], entry["config"]["block_h"])
    cfg = config or default_config(heads, 512, device, max_len)
    return blocks_per_sm(cfg, device) * sm_count(device)


def default_num_splits(batch: int, heads: int, max_len: int, device: torch.device,
                       config: MLADecodeConfig | None = None) -> int:
    """Splits per request of the uniform launch (no plan): :func:`programs_wanted` shared among the batch, never
    more splits than ``block_n`` tiles. On CPU: at most 3 splits (enough to exercise the combine)."""
    if max_len <= 0:
        return 1
    if device.type == "cpu":
        return max(1, min(3, triton.cdiv(max_len, 64)))
    cfg = config or default_config(heads, 512, device, max_len)
    want = triton.cdiv(programs_wanted(heads, max_len, device, cfg), batch * triton.cdiv(heads, cfg.block_h))
    return max(1, min(want, triton.cdiv(max_len, cfg.block_n)))


# ----------------------------------------------------------------------------------------------
# The plan: a work list for a batch, reused by every layer of a step
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MLADecodePlan:
    """A batch's work list on the device (:mod:`kvwall.kernels.mla_decode.plan`), the launch shape it was cut for,
    and the float32 partial buffers of the requests with more than one chunk. Made once per decode step by
    :func:`plan_mla_decode_triton`; every layer's :func:`mla_decode_fp8` call with ``plan=`` reuses it, and such a call
    never synchronizes (CUDA-graph capturable)."""

    batch: int
    heads: int
    kv_lora_rank: int
    page_size: int
    device: torch.device
    config: MLADecodeConfig
    work_list: WorkList
    work: torch.Tensor  # int32 [items, 4]
    combine_requests: torch.Tensor  # int32 [requests with > 1 chunk] (at least one entry)
    part_indptr: torch.Tensor  # int32 [that + 1]
    part_o: torch.Tensor  # float32 [partial rows, heads, kv_lora_rank]
    part_lse: torch.Tensor  # float32 [partial rows, heads]

    @property
    def items(self) -> int:
        return len(self.work_list.items)


def device_ints(values: Sequence, device: torch.device) -> torch.Tensor:
    """``values`` as an int32 tensor on ``device``, copied from pinned host memory without waiting (a copy from
    pageable memory would wait for the work already queued on the stream: a plan made while the previous step runs
    must not stall the host). The caching host allocator keeps the pinned block until the copy is done."""
    t = torch.tensor(values, dtype=torch.int32)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def plan_mla_decode_triton(kv_indptr: torch.Tensor, kv_len: torch.Tensor | None = None, *, heads: int,
                    kv_lora_rank: int = 512, page_size: int = 1, device: torch.device | None = None,
                    config: MLADecodeConfig | None = None, programs: int | None = None,
                    min_chunk: int | None = None) -> MLADecodePlan:
    """The work list for a batch (FlashInfer's ``plan()``): lengths from ``kv_indptr`` (page size 1) or ``kv_len``
    (paged caches), read on the host (one synchronization if they are on the GPU). ``programs``: split-kernel
    programs to aim for at once (default :func:`programs_wanted`); ``min_chunk``: fewest tokens a chunk may hold
    (default one tile)."""
    # heads counts a request's rows here (the front door passes q_len x heads)
    device = check_plan_args(_plan_fail, kv_indptr, kv_len, heads=heads, page_size=page_size, device=device,
                             programs=programs, min_chunk=min_chunk, max_heads=MAX_Q_LEN * MAX_HEADS)
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int) or kv_lora_rank < 64 \
            or kv_lora_rank & (kv_lora_rank - 1):
        _plan_fail(ValueError, f"kv_lora_rank must be a power of two >= 64 (512 for DeepSeek/GLM), got "
                   f"{kv_lora_rank!r}.")
    if config is not None and not isinstance(config, MLADecodeConfig):
        _plan_fail(TypeError, f"config must be an MLADecodeConfig (or None for the tuned shape), got "
                   f"{type(config).__name__}.")
    ptr = [int(x) for x in kv_indptr.tolist()]
    if len(ptr) < 2 or ptr[0] != 0 or any(b < a for a, b in zip(ptr, ptr[1:])) or ptr[-1] > MAX_TOKENS:
        _plan_fail(ValueError, f"kv_indptr must have batch + 1 >= 2 entries, start at 0, never decrease and end at "
                   f"most at 2^31 - 1; got {ptr[:6]}{'...' if len(ptr) > 6 else ''} ending at {ptr[-1]}.")
    batch = len(ptr) - 1
    if page_size == 1:
        if kv_len is not None:
            _plan_fail(ValueError, "kv_len is for paged caches (page_size > 1).")
        lengths = [b - a for a, b in zip(ptr, ptr[1:])]
    else:
        if kv_len is None or kv_len.numel() != batch:
            _plan_fail(ValueError, f"a paged cache (page_size {page_size}) needs kv_len with batch = {batch} entries.")
        lengths = [int(x) for x in kv_len.tolist()]
        for i, (n, a, b) in enumerate(zip(lengths, ptr, ptr[1:])):
            if n < 0 or n > (b - a) * page_size or n > MAX_TOKENS:
                _plan_fail(ValueError, f"kv_len[{i}] = {n} does not fit request {i}'s {b - a} pages of {page_size} "
                           f"tokens.")
    max_len = max(lengths)
    cfg = config or default_config(heads, kv_lora_rank, device, max_len)
    head_blocks = triton.cdiv(heads, cfg.block_h)
    if device.type == "cpu" and programs is None:  # the interpreter: at most 3 chunks a request, enough to combine
        wl = build_work_list(lengths, block_n=cfg.block_n, items_wanted=1,
                             max_chunk=triton.cdiv(triton.cdiv(max(max_len, 1), 3), cfg.block_n) * cfg.block_n)
    else:
        wanted = programs or programs_wanted(heads, max_len, device, cfg)
        wl = build_work_list(lengths, block_n=cfg.block_n, items_wanted=max(1, triton.cdiv(wanted, head_blocks)),
                             min_chunk=min_chunk)
    if len(wl.items) > MAX_GRID_Y:
        _plan_fail(ValueError, f"the work list has {len(wl.items)} items (batch {batch}), more than the {MAX_GRID_Y} a "
                   "launch's grid holds; split the batch, or ask for fewer programs.")
    rows = max(wl.partial_rows, 1)
    return MLADecodePlan(batch, heads, kv_lora_rank, page_size, device, cfg, wl,
                         device_ints(wl.items, device).reshape(-1, 4), device_ints(list(wl.combine) or [0], device),
                         device_ints(wl.part_indptr, device),
                         torch.empty(rows, heads, kv_lora_rank, dtype=torch.float32, device=device),
                         torch.empty(rows, heads, dtype=torch.float32, device=device))


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------

_fail: Fail = functools.partial(fail, "mla_decode_fp8")


def _as_rows(name: str, cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A ``[pages * page_size, D]`` row view (no copy) of a ``[slots, D]`` or ``[pages, page_size, D]`` cache,
    and the page size."""
    if cache.dim() == 3:
        pages, page_size, d = cache.shape
        if pages >= 1 and page_size > 1 and cache.stride(0) != page_size * cache.stride(1):
            _fail(ValueError, f"{name} has shape {tuple(cache.shape)} and strides {cache.stride()}: the tokens of "
                  "consecutive pages must be evenly spaced (page stride = page_size x token stride), as in one "
                  "[pages, page_size, 576] pool.")
        if cache.stride(-1) != 1:
            _fail(ValueError, f"{name} has strides {cache.stride()}: the values of a row must be contiguous "
                  "(last stride 1); a row stride of 576 (a view of one [slots, 1, 576] pool) is fine.")
        rows = cache.as_strided((pages * page_size, d), (cache.stride(1) if page_size > 1 else cache.stride(0), 1))
    elif cache.dim() == 2:
        rows, page_size = cache, 1
    else:
        _fail(ValueError, f"{name} has shape {tuple(cache.shape)}; expected [slots, D] or [pages, page_size, D].")
    if rows.shape[0] < 1:
        _fail(ValueError, f"{name} has no slots (shape {tuple(cache.shape)}).")
    if rows.stride(-1) != 1:
        _fail(ValueError, f"{name} has strides {cache.stride()}: the values of a row must be contiguous "
              "(last stride 1); a row stride of 576 (a view of one [slots, 1, 576] pool) is fine.")
    return rows, page_size


def parse_scale(name: str, scale, device: torch.device) -> tuple[torch.Tensor | None, float]:
    """A ``ckv_scale`` / ``kpe_scale`` argument as ``(tensor, 1.0)`` (a one-element float32 tensor on ``device``, read
    in the kernel) or ``(None, number)``; anything else is refused, naming ``name``."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
            _fail(ValueError, f"{name} must be a Python number or a one-element float32 tensor on {device}; got "
                  f"{scale.dtype} {tuple(scale.shape)} on {scale.device}.")
        return scale.reshape(1), 1.0
    value = scale_number(name, scale, _fail)
    if device.type == "cpu" and below_float32_normal(value):  # the interpreter would take it as a float64
        return torch.tensor([value], dtype=torch.float32), 1.0
    return None, value


def validate_call(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, out, check_range, kv_len
                  ) -> tuple[torch.Tensor, torch.Tensor, int, int | None]:
    """Every check of a :func:`mla_decode_fp8` call (both paths run it), each failure raised before any launch:
    dtypes, shapes, strides, devices, ``out``, and with ``check_range`` the index buffers against the cache (host
    reads; refused inside CUDA-graph capture). Returns the caches' ``[slots, D]`` row views, the page size and the
    longest request in tokens (None for an unchecked call)."""
    named = [("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache),
             ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)] + ([("kv_len", kv_len)] if kv_len is not None else [])
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
            _fail(TypeError, f"{name} has dtype {t.dtype}; it must be {KV_DTYPE} (the FP8 KV cache). For a BF16 "
                  "cache use a BF16 MLA kernel (FlashInfer).")
    for name, t in named[4:]:
        if t.dtype not in INDEX_DTYPES:
            _fail(TypeError, f"{name} has dtype {t.dtype}; it must be int32 or int64.")
        if t.dim() != 1 or not t.is_contiguous():
            _fail(ValueError, f"{name} must be a contiguous 1-D tensor; got shape {tuple(t.shape)} strides {t.stride()}.")
    if q_nope.shape[:2] != q_pe.shape[:2]:
        _fail(ValueError, f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} must have the same batch and heads.")
    ckv, page_size = _as_rows("ckv_cache", ckv_cache)
    kpe, kpe_page = _as_rows("kpe_cache", kpe_cache)
    if page_size != kpe_page:
        _fail(ValueError, f"ckv_cache pages hold {page_size} tokens but kpe_cache pages hold {kpe_page}.")
    if ckv.shape[0] != kpe.shape[0]:
        _fail(ValueError, f"ckv_cache has {ckv.shape[0]} slots but kpe_cache has {kpe.shape[0]}.")
    batch, heads, dc = q_nope.shape
    dr = q_pe.shape[-1]
    if ckv.shape[-1] != dc or kpe.shape[-1] != dr:
        _fail(ValueError, f"latent widths disagree: q_nope {dc} vs ckv_cache {ckv.shape[-1]}, q_pe {dr} vs "
              f"kpe_cache {kpe.shape[-1]}.")
    for name, d, least in (("kv_lora_rank (q_nope/ckv width)", dc, 64), ("rope width (q_pe/kpe width)", dr, 16)):
        if d < least or d & (d - 1):
            _fail(ValueError, f"{name} is {d}; it must be a power of two >= {least} (512 and 64 for DeepSeek/GLM "
                  "MLA; the latent is processed in four chunks of at least 16).")
    if batch < 1 or heads < 1:
        _fail(ValueError, f"q_nope has shape {tuple(q_nope.shape)}: batch and heads must be at least 1.")
    if page_size > 1 and kv_len is None:
        _fail(ValueError, f"the caches have {page_size}-token pages: pass kv_len (tokens per request), as "
              "FlashInfer's plan() takes kv_len_arr; kv_indptr/kv_indices then count pages.")
    if page_size == 1 and kv_len is not None:
        _fail(ValueError, "kv_len is for paged caches (page size > 1); with one token per page the lengths are "
              "kv_indptr's differences.")
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
        _fail(ValueError, f"sm_scale={sm_scale!r} is too large: |sm_scale| must be at most {FLOAT32_MAX / LOG2E:.3g} "
              "(sm_scale * log2(e) must be a float32); the usual value is 1/sqrt(head dim), 1/sqrt(576) for MLA.")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != Q_DTYPE or tuple(out.shape) != (batch, heads, dc) \
                or out.device != device or out.stride(-1) != 1:
            _fail(ValueError, f"out must be a {Q_DTYPE} tensor of shape {(batch, heads, dc)} on {device} with a "
                  f"contiguous last dim; got {getattr(out, 'dtype', type(out).__name__)} "
                  f"{tuple(getattr(out, 'shape', ()))} on {getattr(out, 'device', '?')} strides "
                  f"{out.stride() if isinstance(out, torch.Tensor) else '?'}.")
    if kv_indices.numel() > 2**31 - 1:
        _fail(ValueError, f"kv_indices has {kv_indices.numel()} entries: more than 2^31 - 1 in one batch; split it.")
    max_len = None
    if check_range:
        refuse_graph_capture(device, _fail)
        ptr = check_kv_indptr(kv_indptr, kv_indices.numel(), _fail)
        check_indices_in_range(kv_indices[: ptr[-1]], ckv.shape[0] // page_size,
                               "slots" if page_size == 1 else "pages", "the cache", _fail)
        pages = [b - a for a, b in zip(ptr, ptr[1:])]
        if kv_len is None:
            max_len = max(pages)
        else:
            lens = kv_len.tolist()
            for i, (n, p) in enumerate(zip(lens, pages)):
                if n < 0 or n > p * page_size:
                    _fail(ValueError, f"kv_len[{i}] = {n} does not fit request {i}'s {p} pages of {page_size} "
                          f"tokens (0..{p * page_size}).")
            max_len = max(lens)
    return ckv, kpe, page_size, max_len


#: (request, head) rows to merge per multiprocessor from which a combine program takes a whole 512-wide row: below
#: it, 32 columns a program keep the multiprocessors busy. Measured on the H200 after the wgmma paths (2026-12-01,
#: ``notes/issue22_combine/README.md``; ``kernels/mla_decode/NOTES.md``, generations 7 and 8): with 416 and more
#: rows (16 heads x 26 requests up to 128 heads x 29) whole rows were 1.3-3.8x faster; with 16 and 112 rows 32
#: columns were 1.4-2.7x faster.
COMBINE_WIDE_ROWS_PER_SM = 2


def combine_shape(config: MLADecodeConfig, *, heads: int, kv_lora_rank: int, combined: int, max_chunks: int,
                  sms: int) -> tuple[int, int, int]:
    """The combine kernel's ``(BLOCK_D, BLOCK_S, warps)`` for ``combined`` requests of up to ``max_chunks`` chunks:
    the config's fields where set (non-zero); else whole rows (``BLOCK_D = kv_lora_rank``, up to 16 chunks a step,
    8 warps from 16 on) when there are at least :data:`COMBINE_WIDE_ROWS_PER_SM` (request, head) rows per
    multiprocessor, otherwise 32 columns with every chunk in one step (up to 512; 8 warps from 8,192 values)."""
    rows = combined * heads
    wide = rows >= COMBINE_WIDE_ROWS_PER_SM * sms
    block_d = min(config.combine_block_d or (kv_lora_rank if wide else 32), kv_lora_rank)
    chunks = triton.next_power_of_2(max(1, max_chunks))
    block_s = config.combine_block_s or (min(chunks, 16) if wide else min(chunks, 512))
    warps = config.combine_warps or ((8 if block_s >= 16 else 4) if wide else (8 if block_s * block_d >= 8192 else 4))
    return block_d, block_s, warps


def _int_class(v: int) -> tuple[bool, bool, bool]:
    """What Triton specializes an int argument on (== 1, divisible by 16, fits 32 bits), and then some."""
    return v == 1, v % 16 == 0, -2**31 <= v < 2**31


#: Compiled combine kernels by everything their compilation depended on (:func:`launch_combine`'s fast launch).
_COMBINE_COMPILED: dict[tuple, Any] = {}
#: The launch hooks the fast launch passes on, as Triton's JIT does (Triton 3.4 on: ``triton.knobs``).
_FAST_LAUNCH = hasattr(triton, "knobs") and hasattr(getattr(triton.knobs, "runtime", None), "launch_enter_hook")


def launch_combine(plan: MLADecodePlan, out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """The combine kernel for a planned call whose split kernel has written ``plan``'s partials: merges the chunks of
    every request with more than one into ``out`` (and ``lse`` where given); nothing to do when no request was cut.
    The wgmma path's split kernel writes the same partials and calls this.

    On a GPU the first launch of each compilation goes through Triton's JIT; the later ones call the compiled kernel
    directly (what the JIT's launch does after its cache lookup), keyed by every value the JIT specializes on (each
    pointer's 16-byte alignment, each int's class) and the constexprs: Triton's per-launch argument binding cost
    more host time than the rest of ours' call (issue 34)."""
    combined = len(plan.work_list.combine)
    if not combined:
        return
    cfg, heads, dc = plan.config, plan.heads, plan.kv_lora_rank
    interpreted = out.device.type == "cpu"
    block_d, block_s, warps = combine_shape(cfg, heads=heads, kv_lora_rank=dc, combined=combined,
                                            max_chunks=plan.work_list.max_chunks,
                                            sms=1 if interpreted else sm_count(out.device))
    grid = (combined, heads, dc // block_d)
    lse_arg = lse if lse is not None else plan.part_lse
    args = (plan.part_o, plan.part_lse, out, lse_arg, heads, 0, out.stride(0), out.stride(1), plan.combine_requests,
            plan.part_indptr)
    constexprs = dict(DC=dc, BLOCK_D=block_d, BLOCK_S=block_s, WRITE_LSE=lse is not None, RNE_BY_BITS=interpreted,
                      WORKLIST=True)
    if interpreted:
        _kernel("combine", True)[grid](*args, **constexprs, num_warps=warps)
        return
    key = (out.device.index, warps, *constexprs.values(), *(a.data_ptr() % 16 == 0 for a in args[:4]),
           *(_int_class(v) for v in args[4:8]), args[8].data_ptr() % 16 == 0, args[9].data_ptr() % 16 == 0)
    handle = _COMBINE_COMPILED.get(key)
    if handle is None:
        handle = _kernel("combine", False)[grid](*args, **constexprs, num_warps=warps)
        if _FAST_LAUNCH and all(hasattr(handle, a) for a in ("run", "function", "packed_metadata",
                                                              "launch_metadata")):
            _COMBINE_COMPILED[key] = handle  # (another Triton's compiled kernel: every launch through the JIT)
        LAST_COMPILED["combine"] = handle
        return
    stream = torch._C._cuda_getCurrentRawStream(out.device.index)  # torch.cuda.current_stream's, without its wrapper
    full = (*args, *constexprs.values())
    handle.run(*grid, stream, handle.function, handle.packed_metadata, handle.launch_metadata(grid, stream, *full),
               triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook, *full)
    LAST_COMPILED["combine"] = handle


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------

def mla_decode_fp8(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
                   kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float, *,
                   ckv_scale: float | torch.Tensor = 1.0, kpe_scale: float | torch.Tensor = 1.0,
                   out: torch.Tensor | None = None, return_lse: bool = False, kv_len: torch.Tensor | None = None,
                   num_splits: int | None = None, check_range: bool = True, config: MLADecodeConfig | None = None,
                   plan: MLADecodePlan | None = None, q_len: int = 1):
    """MLA decode attention straight from an FP8 latent cache; returns ``out`` ``[B, H, Dc]`` BF16 (and the
    natural-log LSE ``[B, H]`` float32 with ``return_lse``). See the module docstring for the semantics.

    Paged caches (``[pages, page_size, D]``, page size > 1): ``kv_indptr``/``kv_indices`` list pages and
    ``kv_len`` ``[B]`` gives each request's tokens (its last page may be partly filled).
    ``num_splits``: KV splits per request (flash-decoding); default: :func:`default_num_splits`.
    ``check_range=True`` validates ``kv_indptr``/``kv_indices``/``kv_len`` on the host before the launch (a
    device sync); ``False`` skips that (needed inside CUDA-graph capture; then pass ``num_splits`` too, or the
    default is sized from ``len(kv_indices) / B``), under the unchecked-call contract of the module docstring:
    an out-of-range index makes its request's output NaN, and nothing outside the buffers is read or written.
    ``config`` overrides the launch shape (:class:`MLADecodeConfig`).

    ``plan`` (:func:`plan_mla_decode_triton`, made once per step): run the plan's work list -- every request cut into
    chunks of about equal size, so a mixed batch is balanced -- with its partial buffers; no host synchronization
    (with ``check_range=False``, CUDA-graph capturable), and a plan made for shorter requests stays correct (a
    request's last chunk runs to its length at run time). Without a plan a checked call plans for itself; an
    unchecked one, or one given ``num_splits``, splits every request into the same number of parts. The plan's
    launch shape (``plan.config``) is used unless ``config`` is given.

    ``q_len`` (with a plan): each request's ``q_len`` query tokens folded into the heads -- ``q_nope`` ``[B, q_len x
    heads, Dc]``, row ``r`` query token ``r // heads`` -- with the causal mask over them: token ``j`` sees the first
    ``length - (q_len - 1 - j)`` tokens (MTP / EAGLE target-verify). The front door (:func:`kvwall.kernels.mla_decode`)
    folds SGLang's ``[B x q_len, heads, Dc]`` for its caller.
    """
    if num_splits is not None:
        bounded_int("num_splits", num_splits, _fail, most=MAX_GRID_Y,
                    hint="KV splits per request (a launch's grid holds at most 65535; a handful is the useful range)")
    if config is not None and not isinstance(config, MLADecodeConfig):
        _fail(TypeError, f"config must be an MLADecodeConfig (or None for the tuned shape), got {type(config).__name__}.")
    bounded_int("q_len", q_len, _fail, most=MAX_Q_LEN, hint="query tokens per request")
    ckv, kpe, page_size, max_len = validate_call(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale,
                                             out, check_range, kv_len)
    device = q_nope.device
    batch, heads, dc = q_nope.shape
    dr = q_pe.shape[-1]
    c_t, c_v = parse_scale("ckv_scale", ckv_scale, device)
    k_t, k_v = parse_scale("kpe_scale", kpe_scale, device)
    if (c_t is None) != (k_t is None):  # one mode for both: a tensor for the number
        if c_t is None:
            c_t = torch.full((1,), c_v, dtype=torch.float32, device=device)
        else:
            k_t = torch.full((1,), k_v, dtype=torch.float32, device=device)
    from_ptr = c_t is not None
    if out is not None:
        check_output(out, {"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache, "kpe_cache": kpe_cache,
                           "kv_indptr": kv_indptr, "kv_indices": kv_indices, "kv_len": kv_len, "ckv_scale": c_t,
                           "kpe_scale": k_t}, _fail)
    if max_len is None:  # unchecked call: lengths unknown on the host; size by the index buffer
        max_len = triton.cdiv(kv_indices.numel() * page_size, batch)
    cfg = config or (plan.config if isinstance(plan, MLADecodePlan) else default_config(heads, dc, device, max_len))
    if cfg.block_h < 16 or cfg.block_h & (cfg.block_h - 1) or cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1):
        _fail(ValueError, f"config {cfg}: block_h and block_n must be powers of two >= 16.")
    if cfg.pairs and (ckv.stride(0) % 2 or kpe.stride(0) % 2 or ckv.data_ptr() % 2 or kpe.data_ptr() % 2):
        cfg = dataclasses.replace(cfg, pairs=False)  # odd row strides or offsets: no 16-bit pairs, same result
    if plan is not None:
        if num_splits is not None:
            _fail(ValueError, "pass either plan or num_splits: a plan has its own chunks.")
        if type(plan) is not MLADecodePlan:  # a subclass is another path's plan (the wgmma path's WgmmaPlan)
            _fail(TypeError, f"plan must come from plan_mla_decode_triton (the Triton path), got {type(plan).__name__}.")
        want = (batch, heads, dc, page_size, device)
        have = (plan.batch, plan.heads, plan.kv_lora_rank, plan.page_size, plan.device)
        if have != want:
            _fail(ValueError, f"the plan was made for (batch, heads, kv_lora_rank, page_size, device) = {have}; this "
                  f"call has {want}.")
    elif num_splits is None and check_range:
        plan = plan_mla_decode_triton(kv_indptr, kv_len, heads=heads, kv_lora_rank=dc, page_size=page_size, device=device,
                               config=cfg)
    elif num_splits is None:
        num_splits = default_num_splits(batch, heads, max_len, device, cfg)
    if plan is None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        _fail(ValueError, f"num_splits must be a positive int, got {num_splits!r}.")
    if out is None:
        out = torch.empty(batch, heads, dc, dtype=Q_DTYPE, device=device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=device) if return_lse else None
    if plan is not None:
        launch_planned(plan, cfg, q_nope, q_pe, ckv, kpe, kv_indptr, kv_indices, kv_len, (c_t, c_v), (k_t, k_v),
                       sm_scale, out, lse, q_len=q_len)
        return (out, lse) if return_lse else out
    if q_len != 1:
        _fail(ValueError, f"q_len={q_len} needs a plan (plan_mla_decode_triton(..., q_len=...)).")
    num_indices = kv_indices.numel()
    if num_indices == 0:  # a valid pointer for the (never executed) index loads
        kv_indices = torch.zeros(1, dtype=torch.int32, device=device)
    interpreted = device.type == "cpu"
    direct = num_splits == 1
    if direct:
        part_o = part_lse = out  # unused
    else:
        part_o = torch.empty(batch, num_splits, heads, dc, dtype=torch.float32, device=device)
        part_lse = torch.empty(batch, num_splits, heads, dtype=torch.float32, device=device)
    lse_arg = lse if lse is not None else part_lse
    from_ptr = c_t is not None
    handle = _kernel("split", interpreted)[(triton.cdiv(heads, cfg.block_h), num_splits, batch)](
        q_nope, q_pe, ckv, kpe, kv_indptr, kv_indices, kv_len if kv_len is not None else kv_indptr,
        c_t if from_ptr else ckv, k_t if from_ptr else kpe, c_v, k_v, float(sm_scale) * LOG2E,
        part_o, part_lse, out, lse_arg, kv_indptr,
        heads, num_splits, 1, heads, num_indices, ckv.shape[0] // page_size,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), ckv.stride(0), kpe.stride(0),
        out.stride(0), out.stride(1),
        **split_constexprs(cfg, dc=dc, dr=dr, page=page_size, worklist=False, direct=direct,
                           write_lse=return_lse, scale_from_ptr=from_ptr, on_gpu=not interpreted),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not interpreted:
        LAST_COMPILED["split"] = handle
    if not direct:
        block_d, block_s, warps = combine_shape(cfg, heads=heads, kv_lora_rank=dc, combined=batch,
                                                max_chunks=num_splits, sms=1 if interpreted else sm_count(out.device))
        handle = _kernel("combine", interpreted)[(batch, heads, dc // block_d)](
            part_o, part_lse, out, lse_arg, heads, num_splits, out.stride(0), out.stride(1), kv_indptr, kv_indptr,
            DC=dc, BLOCK_D=block_d, BLOCK_S=block_s, WRITE_LSE=return_lse,
            RNE_BY_BITS=interpreted, WORKLIST=False, num_warps=warps,
        )
        if not interpreted:
            LAST_COMPILED["combine"] = handle
    return (out, lse) if return_lse else out


def launch_planned(plan: MLADecodePlan, cfg: MLADecodeConfig, q_nope: torch.Tensor, q_pe: torch.Tensor,
                   ckv: torch.Tensor, kpe: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                   kv_len: torch.Tensor | None, ckv_scale: tuple[torch.Tensor | None, float],
                   kpe_scale: tuple[torch.Tensor | None, float], sm_scale: float, out: torch.Tensor,
                   lse: torch.Tensor | None, *, q_len: int = 1) -> None:
    """The split and combine launches of a planned call, nothing checked (the caller has): ``ckv`` / ``kpe`` the
    caches' ``[slots, D]`` row views, ``q_nope`` / ``q_pe`` / ``out`` ``[batch, rows, D]`` with ``rows = q_len x
    heads`` (a request's query tokens folded into the rows, the causal mask over them with ``q_len > 1``), the
    scales ``(tensor or None, number)`` as :func:`parse_scale` gives them. What :func:`mla_decode_fp8` runs with a
    plan, and what the front door (:func:`kvwall.kernels.mla_decode`) runs on the Triton path."""
    (c_t, c_v), (k_t, k_v) = ckv_scale, kpe_scale
    if (c_t is None) != (k_t is None):  # one mode for both: a tensor for the number
        if c_t is None:
            c_t = torch.full((1,), c_v, dtype=torch.float32, device=out.device)
        else:
            k_t = torch.full((1,), k_v, dtype=torch.float32, device=out.device)
    from_ptr = c_t is not None
    rows, dc = q_nope.shape[1], q_nope.shape[2]
    num_indices = kv_indices.numel()
    if num_indices == 0:  # a valid pointer for the (never executed) index loads
        kv_indices = torch.zeros(1, dtype=torch.int32, device=out.device)
    interpreted = out.device.type == "cpu"
    page_size = plan.page_size
    handle = _kernel("split", interpreted)[(triton.cdiv(rows, cfg.block_h), plan.items, 1)](
        q_nope, q_pe, ckv, kpe, kv_indptr, kv_indices, kv_len if kv_len is not None else kv_indptr,
        c_t if from_ptr else ckv, k_t if from_ptr else kpe, c_v, k_v, float(sm_scale) * LOG2E,
        plan.part_o, plan.part_lse, out, lse if lse is not None else plan.part_lse, plan.work,
        rows, 0, q_len, rows // q_len, num_indices, ckv.shape[0] // page_size,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), ckv.stride(0), kpe.stride(0),
        out.stride(0), out.stride(1),
        **split_constexprs(cfg, dc=dc, dr=q_pe.shape[-1], page=page_size, worklist=True,
                           write_lse=lse is not None, scale_from_ptr=from_ptr, on_gpu=not interpreted,
                           causal=q_len > 1),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not interpreted:
        LAST_COMPILED["split"] = handle
    launch_combine(plan, out, lse)
