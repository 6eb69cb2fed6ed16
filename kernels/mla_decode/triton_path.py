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
  (request, token chunk) items of about equal size, longest first (:mod:`kvwall.kernels.mla_decode.work_list`), with
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
- **Combine kernel** (:mod:`.combine`, shared with the wgmma paths), grid
  ``(requests with more than one chunk, H, 512 / combine_block_d)``: merges each request's partials (however many chunks
  it has) by their LSEs (flash-decoding); chunks with no tokens carry ``lse = -inf`` and weight 0.
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
before it is multiplied, so the logit scale overflows only where the logits themselves would. ``out``: its own memory
(one that overlaps itself or shares bytes with an input is refused).

NaN: an FP8 NaN in a token a request reads makes that request's output and LSE NaN (every head), on the GPU and
in the interpreter alike; NaN in a slot no request reads has no effect.

**Unchecked calls** (``check_range=False``, the contract :func:`kvwall.kernels.gather.kernel.gather_cast`
shares): the kernels never read outside the caches, ``kv_indices``, ``kv_indptr`` or ``kv_len``, and never write
outside ``out``; a request holding an out-of-range index gets NaN output (every head, LSE NaN), and
``kv_indptr`` / ``kv_len`` entries past the buffers are clamped to them.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton

from kvwall.kernels._args import MAX_GRID_Y, MAX_HEADS, MAX_TOKENS, bounded_int, check_plan_args
from kvwall.kernels._common import Fail, check_output, fail, sm_count
from kvwall.kernels.mla_decode.checks import LOG2E, MAX_Q_LEN, Q_DTYPE, parse_scale, validate_call
from kvwall.kernels.mla_decode.combine import LAST_COMPILED, combine_kernel, combine_shape, launch_combine
from kvwall.kernels.mla_decode.launch_shape import (
    MLADecodeConfig,
    default_config,
    default_num_splits,
    programs_wanted,
    split_constexprs,
)
from kvwall.kernels.mla_decode.plan import MLADecodePlan, device_ints
from kvwall.kernels.mla_decode.triton_kernel import kernel_for
from kvwall.kernels.mla_decode.work_list import build_work_list

__all__ = ["mla_decode_fp8", "plan_mla_decode_triton", "launch_planned"]

_plan_fail: Fail = functools.partial(fail, "plan_mla_decode_triton")
_fail: Fail = functools.partial(fail, "mla_decode_fp8")


# ----------------------------------------------------------------------------------------------
# The Triton path's plan (the wgmma paths build on it)
# ----------------------------------------------------------------------------------------------


def plan_mla_decode_triton(
    kv_indptr: torch.Tensor,
    kv_len: torch.Tensor | None = None,
    *,
    heads: int,
    kv_lora_rank: int = 512,
    page_size: int = 1,
    device: torch.device | None = None,
    config: MLADecodeConfig | None = None,
    programs: int | None = None,
    min_chunk: int | None = None,
) -> MLADecodePlan:
    """The work list for a batch (FlashInfer's ``plan()``): lengths from ``kv_indptr`` (page size 1) or ``kv_len``
    (paged caches), read on the host (one synchronization if they are on the GPU). ``programs``: split-kernel
    programs to aim for at once (default :func:`programs_wanted`); ``min_chunk``: fewest tokens a chunk may hold
    (default one tile)."""
    # heads counts a request's rows here (the front door passes q_len x heads)
    device = check_plan_args(
        _plan_fail,
        kv_indptr,
        kv_len,
        heads=heads,
        page_size=page_size,
        device=device,
        programs=programs,
        min_chunk=min_chunk,
        max_heads=MAX_Q_LEN * MAX_HEADS,
    )
    if (
        isinstance(kv_lora_rank, bool)
        or not isinstance(kv_lora_rank, int)
        or kv_lora_rank < 64
        or kv_lora_rank & (kv_lora_rank - 1)
    ):
        _plan_fail(
            ValueError, f"kv_lora_rank must be a power of two >= 64 (512 for DeepSeek/GLM), got {kv_lora_rank!r}."
        )
    if config is not None and not isinstance(config, MLADecodeConfig):
        _plan_fail(
            TypeError, f"config must be an MLADecodeConfig (or None for the tuned shape), got {type(config).__name__}."
        )
    ptr = [int(x) for x in kv_indptr.tolist()]
    if len(ptr) < 2 or ptr[0] != 0 or any(b < a for a, b in zip(ptr, ptr[1:])) or ptr[-1] > MAX_TOKENS:
        _plan_fail(
            ValueError,
            f"kv_indptr must have batch + 1 >= 2 entries, start at 0, never decrease and end at "
            f"most at 2^31 - 1; got {ptr[:6]}{'...' if len(ptr) > 6 else ''} ending at {ptr[-1]}.",
        )
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
                _plan_fail(
                    ValueError, f"kv_len[{i}] = {n} does not fit request {i}'s {b - a} pages of {page_size} tokens."
                )
    max_len = max(lengths)
    cfg = config or default_config(heads, kv_lora_rank, device, max_len)
    head_blocks = triton.cdiv(heads, cfg.block_h)
    if device.type == "cpu" and programs is None:  # the interpreter: at most 3 chunks a request, enough to combine
        wl = build_work_list(
            lengths,
            block_n=cfg.block_n,
            items_wanted=1,
            max_chunk=triton.cdiv(triton.cdiv(max(max_len, 1), 3), cfg.block_n) * cfg.block_n,
        )
    else:
        wanted = programs or programs_wanted(heads, max_len, device, cfg)
        wl = build_work_list(
            lengths, block_n=cfg.block_n, items_wanted=max(1, triton.cdiv(wanted, head_blocks)), min_chunk=min_chunk
        )
    if len(wl.items) > MAX_GRID_Y:
        _plan_fail(
            ValueError,
            f"the work list has {len(wl.items)} items (batch {batch}), more than the {MAX_GRID_Y} a "
            "launch's grid holds; split the batch, or ask for fewer programs.",
        )
    rows = max(wl.partial_rows, 1)
    return MLADecodePlan(
        batch,
        heads,
        kv_lora_rank,
        page_size,
        device,
        cfg,
        wl,
        device_ints(wl.items, device).reshape(-1, 4),
        device_ints(list(wl.combine) or [0], device),
        device_ints(wl.part_indptr, device),
        torch.empty(rows, heads, kv_lora_rank, dtype=torch.float32, device=device),
        torch.empty(rows, heads, dtype=torch.float32, device=device),
    )


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def mla_decode_fp8(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    *,
    ckv_scale: float | torch.Tensor = 1.0,
    kpe_scale: float | torch.Tensor = 1.0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    kv_len: torch.Tensor | None = None,
    num_splits: int | None = None,
    check_range: bool = True,
    config: MLADecodeConfig | None = None,
    plan: MLADecodePlan | None = None,
    q_len: int = 1,
):
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
        bounded_int(
            "num_splits",
            num_splits,
            _fail,
            most=MAX_GRID_Y,
            hint="KV splits per request (a launch's grid holds at most 65535; a handful is the useful range)",
        )
    if config is not None and not isinstance(config, MLADecodeConfig):
        _fail(
            TypeError, f"config must be an MLADecodeConfig (or None for the tuned shape), got {type(config).__name__}."
        )
    bounded_int("q_len", q_len, _fail, most=MAX_Q_LEN, hint="query tokens per request")
    ckv, kpe, page_size, max_len = validate_call(
        q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, out, check_range, kv_len
    )
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
        check_output(
            out,
            {
                "q_nope": q_nope,
                "q_pe": q_pe,
                "ckv_cache": ckv_cache,
                "kpe_cache": kpe_cache,
                "kv_indptr": kv_indptr,
                "kv_indices": kv_indices,
                "kv_len": kv_len,
                "ckv_scale": c_t,
                "kpe_scale": k_t,
            },
            _fail,
        )
    if max_len is None:  # unchecked call: lengths unknown on the host; size by the index buffer
        max_len = triton.cdiv(kv_indices.numel() * page_size, batch)
    cfg = config or (plan.config if isinstance(plan, MLADecodePlan) else default_config(heads, dc, device, max_len))
    if cfg.block_h < 16 or cfg.block_h & (cfg.block_h - 1) or cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1):
        _fail(ValueError, f"config {cfg}: block_h and block_n must be powers of two >= 16.")
    cfg = config_for_rows(cfg, ckv, kpe)
    if plan is not None:
        if num_splits is not None:
            _fail(ValueError, "pass either plan or num_splits: a plan has its own chunks.")
        if type(plan) is not MLADecodePlan:  # a subclass is another path's plan (the wgmma path's WgmmaPlan)
            _fail(
                TypeError, f"plan must come from plan_mla_decode_triton (the Triton path), got {type(plan).__name__}."
            )
        want = (batch, heads, dc, page_size, device)
        have = (plan.batch, plan.heads, plan.kv_lora_rank, plan.page_size, plan.device)
        if have != want:
            _fail(
                ValueError,
                f"the plan was made for (batch, heads, kv_lora_rank, page_size, device) = {have}; this "
                f"call has {want}.",
            )
    elif num_splits is None and check_range:
        plan = plan_mla_decode_triton(
            kv_indptr, kv_len, heads=heads, kv_lora_rank=dc, page_size=page_size, device=device, config=cfg
        )
    elif num_splits is None:
        num_splits = default_num_splits(batch, heads, max_len, device, cfg)
    if plan is None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        _fail(ValueError, f"num_splits must be a positive int, got {num_splits!r}.")
    if out is None:
        out = torch.empty(batch, heads, dc, dtype=Q_DTYPE, device=device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=device) if return_lse else None
    if plan is not None:
        launch_planned(
            plan,
            cfg,
            q_nope,
            q_pe,
            ckv,
            kpe,
            kv_indptr,
            kv_indices,
            kv_len,
            (c_t, c_v),
            (k_t, k_v),
            sm_scale,
            out,
            lse,
            q_len=q_len,
        )
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
    handle = kernel_for("split", interpreted)[(triton.cdiv(heads, cfg.block_h), num_splits, batch)](
        q_nope,
        q_pe,
        ckv,
        kpe,
        kv_indptr,
        kv_indices,
        kv_len if kv_len is not None else kv_indptr,
        c_t if from_ptr else ckv,
        k_t if from_ptr else kpe,
        c_v,
        k_v,
        float(sm_scale) * LOG2E,
        part_o,
        part_lse,
        out,
        lse_arg,
        kv_indptr,
        heads,
        num_splits,
        1,
        heads,
        num_indices,
        ckv.shape[0] // page_size,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        ckv.stride(0),
        kpe.stride(0),
        out.stride(0),
        out.stride(1),
        **split_constexprs(
            cfg,
            dc=dc,
            dr=dr,
            page=page_size,
            worklist=False,
            direct=direct,
            write_lse=return_lse,
            scale_from_ptr=from_ptr,
            on_gpu=not interpreted,
        ),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if not interpreted:
        LAST_COMPILED["split"] = handle
    if not direct:
        block_d, block_s, warps = combine_shape(
            cfg,
            heads=heads,
            kv_lora_rank=dc,
            combined=batch,
            max_chunks=num_splits,
            sms=1 if interpreted else sm_count(out.device),
        )
        handle = combine_kernel(interpreted)[(batch, heads, dc // block_d)](
            part_o,
            part_lse,
            out,
            lse_arg,
            heads,
            num_splits,
            out.stride(0),
            out.stride(1),
            kv_indptr,
            kv_indptr,
            DC=dc,
            BLOCK_D=block_d,
            BLOCK_S=block_s,
            WRITE_LSE=return_lse,
            RNE_BY_BITS=interpreted,
            WORKLIST=False,
            num_warps=warps,
        )
        if not interpreted:
            LAST_COMPILED["combine"] = handle
    return (out, lse) if return_lse else out


def config_for_rows(cfg: MLADecodeConfig, ckv: torch.Tensor, kpe: torch.Tensor) -> MLADecodeConfig:
    """``cfg`` without its 16-bit pairs where a cache's rows have an odd stride or byte offset (a pair would be a
    misaligned 16-bit read on the GPU); the same result either way."""
    if cfg.pairs and (ckv.stride(0) % 2 or kpe.stride(0) % 2 or ckv.data_ptr() % 2 or kpe.data_ptr() % 2):
        return dataclasses.replace(cfg, pairs=False)
    return cfg


def launch_planned(
    plan: MLADecodePlan,
    cfg: MLADecodeConfig,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_len: torch.Tensor | None,
    ckv_scale: tuple[torch.Tensor | None, float],
    kpe_scale: tuple[torch.Tensor | None, float],
    sm_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    q_len: int = 1,
) -> None:
    """The split and combine launches of a planned call, nothing checked (the caller has): ``ckv`` / ``kpe`` the
    caches' ``[slots, D]`` row views, ``q_nope`` / ``q_pe`` / ``out`` ``[batch, rows, D]`` with ``rows = q_len x
    heads`` (a request's query tokens folded into the rows, the causal mask over them with ``q_len > 1``), the
    scales ``(tensor or None, number)`` as :func:`parse_scale` gives them. What :func:`mla_decode_fp8` runs with a
    plan, and what the front door (:func:`kvwall.kernels.mla_decode`) runs on the Triton path. The one thing it
    adjusts: ``cfg``'s 16-bit pairs are dropped for rows they cannot read (:func:`config_for_rows`)."""
    cfg = config_for_rows(cfg, ckv, kpe)
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
    handle = kernel_for("split", interpreted)[(triton.cdiv(rows, cfg.block_h), plan.items, 1)](
        q_nope,
        q_pe,
        ckv,
        kpe,
        kv_indptr,
        kv_indices,
        kv_len if kv_len is not None else kv_indptr,
        c_t if from_ptr else ckv,
        k_t if from_ptr else kpe,
        c_v,
        k_v,
        float(sm_scale) * LOG2E,
        plan.part_o,
        plan.part_lse,
        out,
        lse if lse is not None else plan.part_lse,
        plan.work,
        rows,
        0,
        q_len,
        rows // q_len,
        num_indices,
        ckv.shape[0] // page_size,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        ckv.stride(0),
        kpe.stride(0),
        out.stride(0),
        out.stride(1),
        **split_constexprs(
            cfg,
            dc=dc,
            dr=q_pe.shape[-1],
            page=page_size,
            worklist=True,
            write_lse=lse is not None,
            scale_from_ptr=from_ptr,
            on_gpu=not interpreted,
            causal=q_len > 1,
        ),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if not interpreted:
        LAST_COMPILED["split"] = handle
    launch_combine(plan, out, lse)
