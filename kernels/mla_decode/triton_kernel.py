"""The Triton path's device code: the split-KV kernel (``_mla_split_kernel``) and the helpers it calls, compiled
with ``triton.jit`` for CUDA tensors or run by Triton's interpreter for CPU tensors (:func:`kernel_for`). What it
computes and why each choice was made: :mod:`.triton_path` (its launcher and plan) and chapter 5; the combine kernel
that merges its partials lives in :mod:`.combine`."""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from kvwall.kernels._common import build_kernel, keep_fp8_nan, round_bf16_by_bits
from kvwall.kernels.mla_decode.combine import combine_kernel

__all__ = ["kernel_for"]


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


def _write_out_impl(
    o_rows,
    lse_ptrs,
    acc0,
    acc1,
    acc2,
    acc3,
    norm,
    lse2,
    hmask,
    DCH: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    ON_GPU: tl.constexpr,
):
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
            constraints="=h,=h,h",
            args=[x16],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
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


def _pairs_loop_impl(
    ckv_ptr,
    kpe_ptr,
    indices_ptr,
    start,
    lo,
    hi,
    num_units,
    stride_ckv,
    stride_kpe,
    qn_row,
    qp_row,
    hmask,
    qmul,
    row_c,
    row_k,
    row_end,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DCH: tl.constexpr,
    DR: tl.constexpr,
    PAGE: tl.constexpr,
    ON_GPU: tl.constexpr,
    CAUSAL: tl.constexpr,
):
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
_HELPERS = {
    "_fp8_as_f16": _fp8_as_f16_impl,
    "_pow2": _pow2_impl,
    "_q_operand": _q_operand_impl,
    "_dot": _dot_impl,
    "_store_bf16": _store_bf16_impl,
    "_write_out": _write_out_impl,
    "_write_partial": _write_partial_impl,
    "_fp8_pairs": _fp8_pairs_impl,
    "_q_half": _q_half_impl,
    "_pairs_loop": _pairs_loop_impl,
}
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
    qn_ptr,
    qp_ptr,
    ckv_ptr,
    kpe_ptr,
    indptr_ptr,
    indices_ptr,
    kvlen_ptr,
    ckv_scale_ptr,
    kpe_scale_ptr,
    ckv_scale_val,
    kpe_scale_val,
    qk_scale,  # qk_scale = sm_scale * log2(e)
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    work_ptr,  # WORKLIST: the plan's items, int32 [items, 4] rows (request, first token, end token, partial row)
    H,
    num_splits,
    q_len,
    heads_per_token,  # CAUSAL: H = q_len x heads_per_token rows a request, row r is query token r // heads_per_token
    num_indices,  # len(kv_indices): kv_indptr entries are clamped to it (unchecked calls read nothing past it)
    num_units,  # slots (PAGE == 1) or pages in the cache: an index outside 0..num_units-1 makes the request NaN
    stride_qn_b,
    stride_qn_h,
    stride_qp_b,
    stride_qp_h,
    stride_ckv,
    stride_kpe,
    stride_o_b,
    stride_o_h,
    DC: tl.constexpr,
    DCH: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    SCALE_FROM_PTR: tl.constexpr,
    DIRECT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    ON_GPU: tl.constexpr,
    KV_MUL: tl.constexpr,
    WORKLIST: tl.constexpr,
    PAIRS: tl.constexpr,
    CAUSAL: tl.constexpr,
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
    amax = tl.maximum(
        tl.reduce(tl.abs(qn), 1, tl.standard._elementwise_max), tl.reduce(tl.abs(qp), 1, tl.standard._elementwise_max)
    )
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
            ckv_ptr,
            kpe_ptr,
            indices_ptr,
            start,
            lo,
            hi,
            num_units,
            stride_ckv,
            stride_kpe,
            qn_row,
            qp_row,
            hmask,
            qmul,
            row_c,
            row_k,
            row_end,
            BLOCK_H,
            BLOCK_N,
            DCH,
            DR,
            PAGE,
            ON_GPU,
            CAUSAL,
        )
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
            acc0 = _dot(pv, _fp8_as_f16(tl.load(row + 0 * DCH), ON_GPU), acc0 * alpha[:, None], ON_GPU)
            acc1 = _dot(pv, _fp8_as_f16(tl.load(row + 1 * DCH), ON_GPU), acc1 * alpha[:, None], ON_GPU)
            acc2 = _dot(pv, _fp8_as_f16(tl.load(row + 2 * DCH), ON_GPU), acc2 * alpha[:, None], ON_GPU)
            acc3 = _dot(pv, _fp8_as_f16(tl.load(row + 3 * DCH), ON_GPU), acc3 * alpha[:, None], ON_GPU)
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
        _write_out(
            out_ptr + b.to(tl.int64) * stride_o_b + heads[:, None] * stride_o_h + dch[None, :],
            lse_ptr + b * H + heads,
            acc0,
            acc1,
            acc2,
            acc3,
            norm,
            lse2,
            hmask,
            DCH,
            WRITE_LSE,
            ON_GPU,
        )
    else:
        rows = part_row.to(tl.int64) * H + heads
        _write_partial(
            part_o_ptr + rows[:, None] * DC + dch[None, :],
            part_lse_ptr + rows,
            acc0,
            acc1,
            acc2,
            acc3,
            norm,
            lse2,
            hmask,
            DCH,
        )


@functools.cache
def kernel_for(name: str, interpreted: bool):
    """Kernel ``name``: "split" (this module's) or "combine" (:mod:`.combine`'s, shared by every path)."""
    if name == "combine":
        return combine_kernel(interpreted)
    return build_kernel({"split": _mla_split_kernel}[name], interpreted, _HELPERS)
