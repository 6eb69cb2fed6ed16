"""The combine of the fused FP8 MLA decode (flash-decoding): merges the float32 partials of every request that a plan
cut into more than one chunk by their LSEs, into the BF16 output. One Triton kernel, shared by every path: the Triton
path's split kernel and the wgmma paths' CUDA split kernels write the same partials and call :func:`launch_combine`.

Grid ``(requests with more than one chunk, H, 512 / BLOCK_D)``; chunks with no tokens carry ``lse = -inf`` and weight
0; a NaN LSE makes the request's output NaN. Its launch shape comes from the work (:func:`combine_shape`)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

from kvwall.kernels._common import build_kernel, round_bf16_by_bits, sm_count

if TYPE_CHECKING:
    from kvwall.kernels.mla_decode.plan import MLADecodePlan
    from kvwall.kernels.mla_decode.launch_shape import MLADecodeConfig

__all__ = ["LAST_COMPILED", "COMBINE_WIDE_ROWS_PER_SM", "combine_kernel", "combine_shape", "launch_combine"]


def _mla_combine_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    H,
    num_splits,
    stride_o_b,
    stride_o_h,
    combine_req_ptr,
    part_indptr_ptr,  # WORKLIST: the requests with more than one chunk, and their partial rows
    DC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    RNE_BY_BITS: tl.constexpr,
    WORKLIST: tl.constexpr,
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
        o = tl.load(part_o_ptr + (base + ss * H)[:, None] * DC + d[None, :], mask=(ok & (w > 0.0))[:, None], other=0.0)
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
            lse_out = tl.where(
                total > 0.0, (m_safe + tl.log2(tl.where(total > 0.0, total, 1.0))) * 0.6931471805599453, float("-inf")
            )
            tl.store(lse_ptr + b * H + h, tl.where(poisoned, float("nan"), lse_out))


#: The compiled kernels of the latest CUDA launch (for resource reports: ``n_regs``, ``n_spills``, ``metadata.shared``).
LAST_COMPILED: dict[str, object] = {}


@functools.cache
def combine_kernel(interpreted: bool):
    """The combine kernel, compiled (``triton.jit``) or for Triton's interpreter (CPU tensors)."""
    return build_kernel(_mla_combine_kernel, interpreted)


#: (request, head) rows to merge per multiprocessor from which a combine program takes a whole 512-wide row: below
#: it, 32 columns a program keep the multiprocessors busy. Measured on the H200 after the wgmma paths (2026-12-01,
#: ``kernels/mla_decode/designs/2026-12-01-combine-shape.md``): with 416 and more
#: rows (16 heads x 26 requests up to 128 heads x 29) whole rows were 1.3-3.8x faster; with 16 and 112 rows 32
#: columns were 1.4-2.7x faster.
COMBINE_WIDE_ROWS_PER_SM = 2


def combine_shape(
    config: MLADecodeConfig, *, heads: int, kv_lora_rank: int, combined: int, max_chunks: int, sms: int
) -> tuple[int, int, int]:
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
    return v == 1, v % 16 == 0, -(2**31) <= v < 2**31


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
    block_d, block_s, warps = combine_shape(
        cfg,
        heads=heads,
        kv_lora_rank=dc,
        combined=combined,
        max_chunks=plan.work_list.max_chunks,
        sms=1 if interpreted else sm_count(out.device),
    )
    grid = (combined, heads, dc // block_d)
    lse_arg = lse if lse is not None else plan.part_lse
    args = (
        plan.part_o,
        plan.part_lse,
        out,
        lse_arg,
        heads,
        0,
        out.stride(0),
        out.stride(1),
        plan.combine_requests,
        plan.part_indptr,
    )
    constexprs = dict(
        DC=dc, BLOCK_D=block_d, BLOCK_S=block_s, WRITE_LSE=lse is not None, RNE_BY_BITS=interpreted, WORKLIST=True
    )
    if interpreted:
        combine_kernel(True)[grid](*args, **constexprs, num_warps=warps)
        return
    key = (
        out.device.index,
        warps,
        *constexprs.values(),
        *(a.data_ptr() % 16 == 0 for a in args[:4]),
        *(_int_class(v) for v in args[4:8]),
        args[8].data_ptr() % 16 == 0,
        args[9].data_ptr() % 16 == 0,
    )
    handle = _COMBINE_COMPILED.get(key)
    if handle is None:
        handle = combine_kernel(False)[grid](*args, **constexprs, num_warps=warps)
        if _FAST_LAUNCH and all(hasattr(handle, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
            _COMBINE_COMPILED[key] = handle  # (another Triton's compiled kernel: every launch through the JIT)
        LAST_COMPILED["combine"] = handle
        return
    stream = torch._C._cuda_getCurrentRawStream(out.device.index)  # torch.cuda.current_stream's, without its wrapper
    full = (*args, *constexprs.values())
    handle.run(
        *grid,
        stream,
        handle.function,
        handle.packed_metadata,
        handle.launch_metadata(grid, stream, *full),
        triton.knobs.runtime.launch_enter_hook,
        triton.knobs.runtime.launch_exit_hook,
        *full,
    )
    LAST_COMPILED["combine"] = handle
