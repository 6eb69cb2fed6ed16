"""The kernels' edges, as a hostile user finds them (issue 37, "Trust, round three"): one table per public entry point
of ``kvwall.kernels`` (and the paths' plans), each row a trial and its expected outcome.

A row is ``(name, thunk, expect)``: ``expect`` is ``OK`` (the thunk runs and returns True: its answer matches the
float64 / torch reference, or the documented clamp) or ``(exception type, words)``: a refusal of our own -- raised
from the kernels' source (not from inside torch or Triton), of that type, its message naming the argument by
``words``. :func:`outcome` sorts a trial into correct / refused / silent wrong / raw traceback / hang (a trial gets
:data:`TRIAL_SECONDS`); ``python tests/test_kernel_edges.py`` prints the counts per entry point. CPU only (Triton's
interpreter), small shapes: the whole module runs in well under a minute.
"""

from __future__ import annotations

import math
import signal
import sys
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import kvwall.kernels as kk
from kvwall.kernels import (
    compact_kv_indices,
    full_cast,
    gather_cast,
    gather_cast_cuda,
    gather_cast_reference,
    mla_decode,
    mla_decode_fp8,
    mla_decode_reference,
    plan_gather,
    plan_mla_decode,
    split_latent_cache,
)
from kvwall.kernels.gather.reference import bits, fp8_bytes
from kvwall.kernels.mla_decode.hopper import plan_hopper
from kvwall.kernels.mla_decode.triton_path import plan_mla_decode_triton
from kvwall.kernels.mla_decode.reference import make_mla_inputs, reference64
from kvwall.kernels.mla_decode.wgmma import WgmmaPlan, plan_mla_decode_wgmma
from kvwall.kernels.mla_decode.wgmma_tokens import plan_mla_decode_wgmma_tokens

OK = "ok"
TRIAL_SECONDS = 30
KERNELS_DIR = Path(kk.__file__).resolve().parent
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
BIG = 2**57
I64_MAX = 2**63 - 1
NO_CUDA = not torch.cuda.is_available()


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang


def outcome(thunk, expect=OK) -> tuple[str, str]:
    """``(class, detail)``: "correct" (ran and checked True), "refused" (an exception of ours naming the argument),
    "silent wrong" (ran, wrong answer -- or ran where a refusal was expected), "raw traceback" (an exception from
    inside torch / Triton / Python, or ours without the argument's name), "hang" (past :data:`TRIAL_SECONDS`)."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TRIAL_SECONDS)
    try:
        ok = thunk()
    except _Hang:
        return "hang", f"over {TRIAL_SECONDS} s"
    except Exception as exc:  # noqa: BLE001 -- the classification is the point
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        ours = Path(frame.filename).resolve().is_relative_to(KERNELS_DIR) and isinstance(
            exc, (ValueError, TypeError, IndexError, RuntimeError)
        )
        words = expect[1] if isinstance(expect, tuple) else None
        named = words is None or words.lower() in str(exc).lower()
        detail = f"{type(exc).__name__}: {str(exc)[:160]} [{Path(frame.filename).name}:{frame.lineno}]"
        if ours and named:
            return "refused", detail
        return "raw traceback", detail
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return ("correct" if ok is True else "silent wrong"), f"returned {ok!r}"[:200]


def check_row(thunk, expect) -> None:
    kind, detail = outcome(thunk, expect)
    if expect == OK:
        assert kind == "correct", detail
    else:
        assert kind == "refused", detail
        assert detail.startswith(expect[0].__name__ + ":"), detail


# ----------------------------------------------------------------------------------------------
# gather_cast / gather_cast_cuda / plan_gather
# ----------------------------------------------------------------------------------------------


def _gather_inputs(page_size: int = 1, n: int = 6, slots: int = 12, dim: int = 64, index_dtype=torch.int32):
    g = torch.Generator().manual_seed(3)
    pool = fp8_bytes((slots, page_size, dim) if page_size > 1 else (slots, dim), generator=g)
    idx = torch.randint(0, slots, (n,), generator=g).to(index_dtype)
    return pool, idx


def _gather_matches(pool, idx, indptr_end: int | None, *, scale=None, check_range=False, nan_rows=()) -> bool:
    """gather_cast's rows up to the clamped end match the reference bit for bit (NaN rows where an index is out of
    range); the rows past it are untouched."""
    out = torch.full((idx.numel(), *pool.shape[1:]), 7.0, dtype=BF16)
    ptr = None if indptr_end is None else torch.tensor([0, indptr_end], dtype=torch.int64)
    gather_cast(pool, idx, ptr, out=out, scale=scale, check_range=check_range)
    n = idx.numel() if indptr_end is None else min(max(indptr_end, 0), idx.numel())
    good = [i for i in range(n) if i not in nan_rows]
    want = gather_cast_reference(pool, idx[good], scale=scale) if good else None
    same = want is None or torch.equal(bits(out[good]), bits(want))
    nans = all(bool(out[i].isnan().all()) for i in nan_rows)
    return same and nans and bool((out[n:] == 7.0).all())


def _gather_rows():
    pool, idx = _gather_inputs()
    paged, pidx = _gather_inputs(page_size=64, n=3, slots=4, dim=16, index_dtype=torch.int64)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return [
        # types
        ("pool list", lambda: gather_cast(pool.tolist(), idx), (TypeError, "pool")),
        ("pool numpy", lambda: gather_cast(np.zeros((4, 8), np.uint8), idx), (TypeError, "pool")),
        ("pool bf16", lambda: gather_cast(pool.to(BF16), idx), (TypeError, "pool")),
        ("pool 1-D", lambda: gather_cast(pool.flatten(), idx), (ValueError, "pool")),
        ("pool on meta", lambda: gather_cast(pool.to("meta"), idx.to("meta")), (ValueError, "pool")),
        ("kv_indices list", lambda: gather_cast(pool, idx.tolist()), (TypeError, "kv_indices")),
        ("kv_indices float", lambda: gather_cast(pool, idx.float()), (TypeError, "kv_indices")),
        ("kv_indices 2-D", lambda: gather_cast(pool, idx.view(2, 3)), (ValueError, "kv_indices")),
        ("kv_indices strided", lambda: gather_cast(pool, idx.repeat(2)[::2]), (ValueError, "kv_indices")),
        ("kv_indptr list", lambda: gather_cast(pool, idx, [0, 6]), (TypeError, "kv_indptr")),
        ("kv_indptr float", lambda: gather_cast(pool, idx, torch.tensor([0.0, 6.0])), (TypeError, "kv_indptr")),
        ("kv_indptr empty", lambda: gather_cast(pool, idx, i32([])), (ValueError, "kv_indptr")),
        ("kv_indptr 2-D", lambda: gather_cast(pool, idx, i32([[0, 6]])), (ValueError, "kv_indptr")),
        ("kv_indptr on meta", lambda: gather_cast(pool, idx, i32([0, 6]).to("meta")), (ValueError, "kv_indptr")),
        ("out list", lambda: gather_cast(pool, idx, out=[0] * 6), (TypeError, "out")),
        ("out too small", lambda: gather_cast(pool, idx, out=torch.empty(2, 64, dtype=BF16)), (ValueError, "out")),
        ("out float32", lambda: gather_cast(pool, idx, out=torch.empty(6, 64)), (TypeError, "out")),
        # page tables, checked
        ("indptr decreasing", lambda: gather_cast(pool, idx, i32([0, 4, 2])), (ValueError, "kv_indptr")),
        ("indptr past capacity", lambda: gather_cast(pool, idx, i32([0, 7])), (ValueError, "kv_indptr")),
        ("indptr end 2^31-1", lambda: gather_cast(pool, idx, i32([0, 2**31 - 1])), (ValueError, "kv_indptr")),
        ("indptr end 2^57", lambda: gather_cast(pool, idx, torch.tensor([0, BIG])), (ValueError, "kv_indptr")),
        ("index negative", lambda: gather_cast(pool, i32([0, -1])), (IndexError, "kv_indices")),
        ("index = pool", lambda: gather_cast(pool, i32([0, 12])), (IndexError, "kv_indices")),
        ("empty kv_indices", lambda: gather_cast(pool, i32([])).shape == (0, 64), OK),
        ("empty batch indptr [0]", lambda: _gather_matches(pool, idx[:0], 0, check_range=True), OK),
        # page tables, unchecked: clamped as documented
        ("unchecked end 2^31-1", lambda: _gather_matches(pool, idx, 2**31 - 1), OK),
        ("unchecked end 2^57", lambda: _gather_matches(pool, idx, BIG), OK),
        ("unchecked end 2^63-1", lambda: _gather_matches(pool, idx, I64_MAX), OK),
        ("unchecked end negative", lambda: _gather_matches(pool, idx, -5), OK),
        ("unchecked end -2^63", lambda: _gather_matches(pool, idx, -(2**63)), OK),
        ("unchecked paged end 2^57", lambda: _gather_matches(paged, pidx, BIG), OK),
        ("unchecked paged end 2^63-1", lambda: _gather_matches(paged, pidx, I64_MAX), OK),
        ("unchecked paged end 2^61", lambda: _gather_matches(paged, pidx, 2**61), OK),
        (
            "unchecked index out of range",
            lambda: _gather_matches(pool, torch.cat([idx[:3], i32([99, -7]), idx[5:]]), None, nan_rows=(3, 4)),
            OK,
        ),
        # scales
        ("scale 0", lambda: _gather_matches(pool, idx, None, scale=0.0), OK),
        ("scale negative", lambda: _gather_matches(pool, idx, None, scale=-3.5), OK),
        ("scale 1e36", lambda: _gather_matches(pool, idx, None, scale=1e36), OK),
        ("scale 3e38", lambda: _gather_matches(pool, idx, None, scale=3e38), OK),
        ("scale subnormal", lambda: _gather_matches(pool, idx, None, scale=1e-40), OK),
        ("scale numpy float32", lambda: _gather_matches(pool, idx, None, scale=np.float32(0.5)), OK),
        ("scale tensor 3e38", lambda: _gather_matches(pool, idx, None, scale=torch.tensor([3e38])), OK),
        ("scale inf", lambda: gather_cast(pool, idx, scale=math.inf), (ValueError, "scale")),
        ("scale nan", lambda: gather_cast(pool, idx, scale=math.nan), (ValueError, "scale")),
        ("scale 1e39", lambda: gather_cast(pool, idx, scale=1e39), (ValueError, "scale")),
        ("scale bool", lambda: gather_cast(pool, idx, scale=True), (TypeError, "scale")),
        ("scale str", lambda: gather_cast(pool, idx, scale="2"), (TypeError, "scale")),
        ("scale None-like list", lambda: gather_cast(pool, idx, scale=[1.0]), (TypeError, "scale")),
        (
            "scale tensor float64",
            lambda: gather_cast(pool, idx, scale=torch.tensor([2.0], dtype=torch.float64)),
            (TypeError, "scale"),
        ),
        ("scale tensor 2 values", lambda: gather_cast(pool, idx, scale=torch.ones(2)), (TypeError, "scale")),
        (
            "scale tensor on meta",
            lambda: gather_cast(pool, idx, scale=torch.ones(1, device="meta")),
            (ValueError, "scale"),
        ),
        # the CUDA twin and the plan share the checks
        ("cuda twin on CPU", lambda: gather_cast_cuda(pool, idx), (RuntimeError, "gather_cast_cuda")),
        ("cuda twin pool list", lambda: gather_cast_cuda(pool.tolist(), idx), (TypeError, "pool")),
        ("plan kv_indptr list", lambda: plan_gather(pool, idx, [0, 6]), (TypeError, "kv_indptr")),
        ("plan scale inf", lambda: plan_gather(pool, idx, scale=math.inf), (ValueError, "scale")),
    ]


# ----------------------------------------------------------------------------------------------
# full_cast / compact_kv_indices
# ----------------------------------------------------------------------------------------------


def _full_rows():
    pool, _ = _gather_inputs()
    return [
        ("pool list", lambda: full_cast(pool.tolist()), (TypeError, "pool")),
        ("pool bf16", lambda: full_cast(pool.to(BF16)), (TypeError, "pool")),
        ("pool strided", lambda: full_cast(pool[:, ::2]), (ValueError, "pool")),
        ("pool on meta", lambda: full_cast(pool.to("meta")), (ValueError, "pool")),
        ("out list", lambda: full_cast(pool, out=[]), (TypeError, "out")),
        ("out wrong shape", lambda: full_cast(pool, out=torch.empty(3, dtype=BF16)), (ValueError, "out")),
        ("block 0", lambda: full_cast(pool, block=0), (ValueError, "block")),
        ("block 3", lambda: full_cast(pool, block=3), (ValueError, "block")),
        ("block True", lambda: full_cast(pool, block=True), (ValueError, "block")),
        ("block 2^21", lambda: full_cast(pool, block=2**21), (ValueError, "block")),
        ("block str", lambda: full_cast(pool, block="64"), (ValueError, "block")),
        ("empty pool", lambda: full_cast(pool[:0]).shape == (0, 64), OK),
        ("pool", lambda: torch.equal(bits(full_cast(pool)), bits(pool.to(BF16))), OK),
    ]


def _compact_rows():
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return [
        ("indptr list", lambda: compact_kv_indices([0, 3]), (ValueError, "kv_indptr")),
        ("indptr numpy", lambda: compact_kv_indices(np.array([0, 3])), (ValueError, "kv_indptr")),
        ("indptr float", lambda: compact_kv_indices(torch.tensor([0.0, 2.5])), (TypeError, "kv_indptr")),
        ("indptr empty", lambda: compact_kv_indices(i64([])), (ValueError, "kv_indptr")),
        ("indptr 2-D", lambda: compact_kv_indices(i64([[0, 3]])), (ValueError, "kv_indptr")),
        ("indptr on meta", lambda: compact_kv_indices(i64([0, 3]).to("meta")), (ValueError, "kv_indptr")),
        ("end negative", lambda: compact_kv_indices(i64([0, -3])), (ValueError, "kv_indptr")),
        ("decreasing", lambda: compact_kv_indices(i64([0, 5, 3])), (ValueError, "kv_indptr")),
        ("end 2^31", lambda: compact_kv_indices(i64([0, 2**31])), (ValueError, "kv_indptr")),
        ("end 2^57", lambda: compact_kv_indices(i64([0, BIG])), (ValueError, "kv_indptr")),
        ("end 2^63-1", lambda: compact_kv_indices(i64([0, I64_MAX])), (ValueError, "kv_indptr")),
        ("dtype float32", lambda: compact_kv_indices(i64([0, 3]), torch.float32), (TypeError, "dtype")),
        ("dtype str", lambda: compact_kv_indices(i64([0, 3]), "int32"), (TypeError, "dtype")),
        ("end 0", lambda: compact_kv_indices(i64([0, 0])).numel() == 0, OK),
        ("end 5 int64", lambda: torch.equal(compact_kv_indices(i64([0, 2, 5]), torch.int64), torch.arange(5)), OK),
        (
            "end 5 int32",
            lambda: compact_kv_indices(torch.tensor([0, 5], dtype=torch.int32)).tolist() == list(range(5)),
            OK,
        ),
    ]


# ----------------------------------------------------------------------------------------------
# The decode: its plans (front door and paths) and its calls
# ----------------------------------------------------------------------------------------------

HEADS = 4
SM = 1 / 576**0.5


def _mla(lens=(5, 9), layout="pool_view", page_size=1, index_dtype=torch.int32):
    return make_mla_inputs(
        list(lens), HEADS, seed=11, layout=layout, page_size=page_size, pool_slots=64, index_dtype=index_dtype
    )


def _close(out: torch.Tensor, want: torch.Tensor) -> bool:
    """Finite where the float64 answer is finite (and representable in BF16), within BF16 and FP8-product error."""
    want = want.to(torch.float64)
    out = out.to(torch.float64)
    if not torch.isfinite(want).all() or want.abs().max() >= float(torch.finfo(BF16).max):
        return False
    if not torch.isfinite(out).all():
        return False
    scale = want.abs().max().item()
    return bool(((out - want).abs() <= 2e-2 * scale + 2.0**-133).all())  # (+ one BF16 subnormal step)


def _decode_matches(
    ckv_scale=1.0, kpe_scale=1.0, sm_scale=SM, *, front=True, tensor_scale=False, num_splits=None, lens=(5, 9)
) -> bool:
    inp = _mla(lens)
    cs, ks = ckv_scale, kpe_scale
    if tensor_scale:
        cs, ks = torch.tensor([ckv_scale]), torch.tensor([kpe_scale])
    if front:
        plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=HEADS, sm_scale=sm_scale)
        out = mla_decode(inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, plan, ckv_scale=cs, kpe_scale=ks)
    else:
        out = mla_decode_fp8(
            inp.q_nope,
            inp.q_pe,
            inp.ckv_cache,
            inp.kpe_cache,
            inp.kv_indptr,
            inp.kv_indices,
            sm_scale,
            ckv_scale=cs,
            kpe_scale=ks,
            num_splits=num_splits,
        )
    keep = [i for i, n in enumerate(lens) if n]
    want = reference64(inp, keep, ckv_scale, kpe_scale, sm_scale)
    return _close(out[keep], want) and bool((out[[i for i, n in enumerate(lens) if not n]] == 0).all())


def _plan_front_rows():
    inp = _mla()
    ptr, idx = inp.kv_indptr, inp.kv_indices
    pg = _mla(layout="paged", page_size=4)

    def plan(**kw):
        args = dict(heads=HEADS, sm_scale=SM)
        args.update(kw)
        return plan_mla_decode(args.pop("kv_indptr", ptr), args.pop("kv_indices", idx), **args)

    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return [
        ("kv_indptr list", lambda: plan(kv_indptr=[0, 5, 14]), (TypeError, "kv_indptr")),
        ("kv_indptr numpy", lambda: plan(kv_indptr=np.array([0, 5, 14])), (TypeError, "kv_indptr")),
        ("kv_indptr float", lambda: plan(kv_indptr=ptr.float()), (TypeError, "kv_indptr")),
        ("kv_indptr on meta", lambda: plan(kv_indptr=ptr.to("meta"), kv_indices=idx.to("meta")), (ValueError, "meta")),
        ("kv_indices None", lambda: plan(kv_indices=None), (TypeError, "kv_indices")),
        (
            "kv_len list (paged)",
            lambda: plan(kv_indptr=pg.kv_indptr, kv_indices=pg.kv_indices, page_size=4, kv_len=[5, 9]),
            (TypeError, "kv_len"),
        ),
        ("heads str", lambda: plan(heads="16"), (ValueError, "heads")),
        ("heads bool", lambda: plan(heads=True), (ValueError, "heads")),
        ("heads float", lambda: plan(heads=16.0), (ValueError, "heads")),
        ("heads 0", lambda: plan(heads=0), (ValueError, "heads")),
        ("heads 10^9", lambda: plan(heads=10**9), (ValueError, "heads")),
        ("q_len 9", lambda: plan(q_len=9), (ValueError, "q_len")),
        ("q_len str", lambda: plan(q_len="2"), (ValueError, "q_len")),
        ("page_size 0", lambda: plan(page_size=0), (ValueError, "page_size")),
        (
            "page_size huge",
            lambda: plan(kv_indptr=pg.kv_indptr, kv_indices=pg.kv_indices, kv_len=pg.kv_len, page_size=2**40),
            (ValueError, "page_size"),
        ),
        ("sm_scale inf", lambda: plan(sm_scale=math.inf), (ValueError, "sm_scale")),
        ("sm_scale -inf", lambda: plan(sm_scale=-math.inf), (ValueError, "sm_scale")),
        ("sm_scale nan", lambda: plan(sm_scale=math.nan), (ValueError, "sm_scale")),
        ("sm_scale 1e39", lambda: plan(sm_scale=1e39), (ValueError, "sm_scale")),
        ("sm_scale str", lambda: plan(sm_scale="0.1"), (TypeError, "sm_scale")),
        ("sm_scale tensor", lambda: plan(sm_scale=torch.tensor(0.1)), (TypeError, "sm_scale")),
        ("path xyz", lambda: plan(path="xyz"), (ValueError, "path")),
        ("path wgmma on CPU", lambda: plan(path="wgmma"), (ValueError, "wgmma")),
        ("config wrong type", lambda: plan(path="triton", config={"block_h": 16}), (TypeError, "config")),
        ("rope_dim str", lambda: plan(rope_dim="64"), (ValueError, "rope_dim")),
        ("kv_lora_rank 100", lambda: plan(kv_lora_rank=100), (ValueError, "kv_lora_rank")),
        ("ckv_cache list", lambda: plan(ckv_cache=[1, 2]), (TypeError, "ckv_cache")),
        ("lengths negative", lambda: plan(lengths=[-1, 9]), (ValueError, "lengths")),
        ("lengths float", lambda: plan(lengths=[5.5, 9]), (TypeError, "lengths")),
        ("lengths str", lambda: plan(lengths="59"), (ValueError, "lengths")),
        ("lengths past kv_indices", lambda: plan(lengths=[5, 2**40]), (ValueError, "lengths")),
        (
            "lengths 2^57 (int64 table)",
            lambda: plan(kv_indptr=i64([0, 5, BIG]), lengths=[5, BIG]),
            (ValueError, "lengths"),
        ),
        ("graph_max_len str", lambda: plan(graph_max_len="256"), (ValueError, "graph_max_len")),
        ("graph_max_len negative", lambda: plan(graph_max_len=-4), (ValueError, "graph_max_len")),
        ("graph_max_len below lengths", lambda: plan(graph_max_len=4), (ValueError, "graph_max_len")),
        ("graph_max_len 2^40", lambda: plan(graph_max_len=2**40), (ValueError, "graph_max_len")),
        (
            "indptr decreasing",
            lambda: plan(kv_indptr=torch.tensor([0, 9, 5], dtype=torch.int32)),
            (ValueError, "kv_indptr"),
        ),
        ("indptr end 2^57", lambda: plan(kv_indptr=i64([0, 5, BIG])), (ValueError, "kv_indptr")),
        ("indptr end 2^63-1", lambda: plan(kv_indptr=i64([0, 5, I64_MAX])), (ValueError, "kv_indptr")),
        (
            "index out of range",
            lambda: plan(kv_indices=torch.tensor([0] * 13 + [10**6], dtype=torch.int32), ckv_cache=inp.ckv_cache),
            (IndexError, "kv_indices"),
        ),
        ("empty batch", lambda: plan(kv_indptr=ptr[:1]), (ValueError, "kv_indptr")),
        ("sm_scale 0", lambda: _decode_matches(sm_scale=0.0), OK),
        ("sm_scale negative", lambda: _decode_matches(sm_scale=-0.3), OK),
        ("empty request", lambda: _decode_matches(lens=(0, 9)), OK),
    ]


def _run_rows():
    inp = _mla()
    plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=HEADS, sm_scale=SM)

    def run(**kw):
        args = dict(q_nope=inp.q_nope, q_pe=inp.q_pe, ckv_cache=inp.ckv_cache, kpe_cache=inp.kpe_cache, plan=plan)
        args.update(kw)
        return mla_decode(
            args.pop("q_nope"), args.pop("q_pe"), args.pop("ckv_cache"), args.pop("kpe_cache"), args.pop("plan"), **args
        )

    return [
        ("plan None", lambda: run(plan=None), (TypeError, "plan")),
        ("q_nope list", lambda: run(q_nope=inp.q_nope.tolist()), (ValueError, "q_nope")),
        ("q_nope float32", lambda: run(q_nope=inp.q_nope.float()), (ValueError, "q_nope")),
        ("q_pe wrong heads", lambda: run(q_pe=inp.q_pe[:, :2]), (ValueError, "q_pe")),
        ("ckv_cache bf16", lambda: run(ckv_cache=inp.ckv_cache.to(BF16)), (TypeError, "ckv_cache")),
        ("kpe_cache numpy", lambda: run(kpe_cache=np.zeros((4, 64))), (TypeError, "kpe_cache")),
        ("ckv_cache 4-D", lambda: run(ckv_cache=inp.ckv_cache[None, None]), (ValueError, "ckv_cache")),
        ("ckv_scale inf", lambda: run(ckv_scale=math.inf), (ValueError, "ckv_scale")),
        ("ckv_scale nan", lambda: run(ckv_scale=math.nan), (ValueError, "ckv_scale")),
        ("ckv_scale 1e39", lambda: run(ckv_scale=1e39), (ValueError, "ckv_scale")),
        ("kpe_scale bool", lambda: run(kpe_scale=False), (TypeError, "kpe_scale")),
        (
            "ckv_scale tensor float64",
            lambda: run(ckv_scale=torch.tensor([1.0], dtype=torch.float64)),
            (ValueError, "ckv_scale"),
        ),
        ("ckv_scale tensor on meta", lambda: run(ckv_scale=torch.ones(1, device="meta")), (ValueError, "ckv_scale")),
        ("out wrong shape", lambda: run(out=torch.empty(2, HEADS, 64, dtype=BF16)), (ValueError, "out")),
        ("out = q_nope", lambda: run(out=inp.q_nope), (ValueError, "out")),
        # finite, representable answers come out finite
        ("ckv_scale 0", lambda: _decode_matches(ckv_scale=0.0), OK),
        ("ckv_scale negative", lambda: _decode_matches(ckv_scale=-2.0), OK),
        ("ckv_scale subnormal", lambda: _decode_matches(ckv_scale=1e-40, kpe_scale=1e-40, sm_scale=1.0), OK),
        ("ckv_scale 1e36", lambda: _decode_matches(ckv_scale=1e36, sm_scale=1e-36), OK),
        ("ckv_scale 2e36", lambda: _decode_matches(ckv_scale=2e36, sm_scale=1e-36), OK),
        ("ckv_scale 1e37", lambda: _decode_matches(ckv_scale=1e37, sm_scale=1e-37), OK),
        ("ckv_scale 5e37 tensor", lambda: _decode_matches(ckv_scale=5e37, sm_scale=1e-37, tensor_scale=True), OK),
        ("ckv_scale 1e38 small sm", lambda: _decode_matches(ckv_scale=5e37, sm_scale=1e-40), OK),
        ("kpe_scale 3e38", lambda: _decode_matches(kpe_scale=3e38, sm_scale=1e-38), OK),
        ("sm_scale subnormal", lambda: _decode_matches(kpe_scale=1e30, ckv_scale=1e30, sm_scale=1e-39), OK),
    ]


def _fp8_rows():
    inp = _mla()
    pg = _mla(layout="paged", page_size=4, index_dtype=torch.int64)

    def call(sm_scale=SM, **kw):
        a = dict(
            q_nope=inp.q_nope,
            q_pe=inp.q_pe,
            ckv_cache=inp.ckv_cache,
            kpe_cache=inp.kpe_cache,
            kv_indptr=inp.kv_indptr,
            kv_indices=inp.kv_indices,
        )
        a.update(kw)
        return mla_decode_fp8(
            a.pop("q_nope"),
            a.pop("q_pe"),
            a.pop("ckv_cache"),
            a.pop("kpe_cache"),
            a.pop("kv_indptr"),
            a.pop("kv_indices"),
            sm_scale,
            **a,
        )

    def unchecked_clamped(end: int) -> bool:
        """An unchecked paged call whose last kv_indptr entry (int64) lies far past kv_indices: clamped to it."""
        wild = pg.kv_indptr.clone()
        wild[-1] = end
        got = mla_decode_fp8(
            pg.q_nope,
            pg.q_pe,
            pg.ckv_cache,
            pg.kpe_cache,
            wild,
            pg.kv_indices,
            SM,
            kv_len=pg.kv_len,
            check_range=False,
            num_splits=2,
        )
        want = mla_decode_fp8(
            pg.q_nope,
            pg.q_pe,
            pg.ckv_cache,
            pg.kpe_cache,
            pg.kv_indptr,
            pg.kv_indices,
            SM,
            kv_len=pg.kv_len,
            num_splits=2,
        )
        return bool(torch.equal(got, want))

    return [
        ("q_nope list", lambda: call(q_nope=[[0.0]]), (TypeError, "q_nope")),
        ("kv_indptr list", lambda: call(kv_indptr=[0, 5, 14]), (TypeError, "kv_indptr")),
        ("sm_scale inf", lambda: call(sm_scale=math.inf), (TypeError, "sm_scale")),
        ("sm_scale 1e39", lambda: call(sm_scale=1e39), (ValueError, "sm_scale")),
        ("sm_scale str", lambda: call(sm_scale="0.1"), (TypeError, "sm_scale")),
        ("num_splits str", lambda: call(num_splits="2"), (ValueError, "num_splits")),
        ("num_splits bool", lambda: call(num_splits=True), (ValueError, "num_splits")),
        ("num_splits 10^9", lambda: call(num_splits=10**9), (ValueError, "num_splits")),
        ("num_splits 2^40 unchecked", lambda: call(num_splits=2**40, check_range=False), (ValueError, "num_splits")),
        ("config wrong type", lambda: call(config=(16, 64, 4, 1)), (TypeError, "config")),
        ("plan wrong type", lambda: call(plan="plan"), (TypeError, "plan")),
        ("q_len 0", lambda: call(q_len=0), (ValueError, "q_len")),
        ("indptr end 2^57 checked", lambda: call(kv_indptr=torch.tensor([0, 5, BIG])), (ValueError, "kv_indptr")),
        ("unchecked paged end 2^57", lambda: unchecked_clamped(BIG), OK),
        ("unchecked paged end 2^63-1", lambda: unchecked_clamped(I64_MAX), OK),
        (
            "ckv_scale 1e37 uniform splits",
            lambda: _decode_matches(ckv_scale=1e37, sm_scale=1e-37, front=False, num_splits=2),
            OK,
        ),
        (
            "ckv_scale 2e38 one split",
            lambda: _decode_matches(ckv_scale=2e38, sm_scale=1e-40, front=False, num_splits=1, lens=(3, 2)),
            OK,
        ),
    ]


def _path_plan_rows():
    inp = _mla()
    ptr = inp.kv_indptr
    rows = []
    for name, fn in (
        ("triton", plan_mla_decode_triton),
        ("wgmma", plan_mla_decode_wgmma),
        ("wgmma_tokens", plan_mla_decode_wgmma_tokens),
    ):

        def plan(fn=fn, **kw):
            a = dict(kv_indptr=ptr, heads=HEADS)
            a.update(kw)
            return fn(a.pop("kv_indptr"), **a)

        rows += [
            (f"{name}: kv_indptr list", lambda plan=plan: plan(kv_indptr=[0, 5, 14]), (TypeError, "kv_indptr")),
            (f"{name}: kv_indptr numpy", lambda plan=plan: plan(kv_indptr=np.array([0, 5])), (TypeError, "kv_indptr")),
            (f"{name}: kv_indptr float", lambda plan=plan: plan(kv_indptr=ptr.float()), (ValueError, "kv_indptr")),
            (f"{name}: kv_indptr 2-D", lambda plan=plan: plan(kv_indptr=ptr[None]), (ValueError, "kv_indptr")),
            (
                f"{name}: kv_indptr decreasing",
                lambda plan=plan: plan(kv_indptr=torch.tensor([0, 5, 3])),
                (ValueError, "kv_indptr"),
            ),
            (
                f"{name}: kv_indptr end 2^57",
                lambda plan=plan: plan(kv_indptr=torch.tensor([0, BIG])),
                (ValueError, "kv_indptr"),
            ),
            (
                f"{name}: kv_indptr end 2^63-1",
                lambda plan=plan: plan(kv_indptr=torch.tensor([0, 1, I64_MAX])),
                (ValueError, "kv_indptr"),
            ),
            (f"{name}: heads str", lambda plan=plan: plan(heads="16"), (ValueError, "heads")),
            (f"{name}: heads bool", lambda plan=plan: plan(heads=True), (ValueError, "heads")),
            (f"{name}: heads 0", lambda plan=plan: plan(heads=0), (ValueError, "heads")),
            (f"{name}: heads 10^9", lambda plan=plan: plan(heads=10**9), (ValueError, "heads")),
            (f"{name}: page_size 0", lambda plan=plan: plan(page_size=0), (ValueError, "page_size")),
            (f"{name}: programs str", lambda plan=plan: plan(programs="8"), (ValueError, "programs")),
            (f"{name}: programs 10^12", lambda plan=plan: plan(programs=10**12), (ValueError, "programs")),
            (f"{name}: min_chunk -1", lambda plan=plan: plan(min_chunk=-1), (ValueError, "min_chunk")),
            (f"{name}: device cuda", lambda plan=plan: plan(device="cuda"), (RuntimeError, "cuda") if NO_CUDA else OK),
            (f"{name}: device cuda:7", lambda plan=plan: plan(device=torch.device("cuda:7")), (RuntimeError, "cuda")),
            (f"{name}: device xyz", lambda plan=plan: plan(device="xyz"), (ValueError, "device")),
            (f"{name}: device meta", lambda plan=plan: plan(device="meta"), (ValueError, "device")),
            (f"{name}: device 3.5", lambda plan=plan: plan(device=3.5), (ValueError, "device")),
            (f"{name}: kv_indptr on meta", lambda plan=plan: plan(kv_indptr=ptr.to("meta")), (ValueError, "meta")),
            (f"{name}: cpu plan", lambda plan=plan: plan().batch == 2, OK),
        ]
        if name != "triton":
            rows += [
                (f"{name}: q_len 9", lambda plan=plan: plan(q_len=9), (ValueError, "q_len")),
                (f"{name}: waves str", lambda plan=plan: plan(waves="2"), (ValueError, "waves")),
                (f"{name}: waves -1", lambda plan=plan: plan(waves=-1), (ValueError, "waves")),
            ]
    rows += [
        (
            "plan_hopper: kv_indptr list",
            lambda: plan_hopper(
                WgmmaPlan,
                "plan_mla_decode_wgmma",
                [0, 5],
                None,
                heads=4,
                heads_per_cta=lambda r: 64,
                warps=8,
                page_size=1,
                device=None,
                programs=None,
                waves=1,
                min_chunk=None,
                q_len=1,
            ),
            (TypeError, "kv_indptr"),
        ),
        (
            "triton: kv_lora_rank 100",
            lambda: plan_mla_decode_triton(ptr, heads=4, kv_lora_rank=100),
            (ValueError, "kv_lora_rank"),
        ),
        (
            "triton: config wrong type",
            lambda: plan_mla_decode_triton(ptr, heads=4, config="fast"),
            (TypeError, "config"),
        ),
        (
            "triton: kv_len negative",
            lambda: plan_mla_decode_triton(torch.tensor([0, 2]), torch.tensor([-1]), heads=4, page_size=4),
            (ValueError, "kv_len"),
        ),
    ]
    return rows


def _reference_rows():
    inp = _mla()
    pool = torch.zeros(4, 1, 576, dtype=FP8)
    return [
        ("split cache list", lambda: split_latent_cache([[0]], 512), (TypeError, "cache")),
        ("split rank str", lambda: split_latent_cache(pool, "512"), (TypeError, "kv_lora_rank")),
        ("split rank 600", lambda: split_latent_cache(pool, 600), (ValueError, "kv_lora_rank")),
        ("split", lambda: split_latent_cache(pool, 512)[1].shape == (4, 1, 64), OK),
        (
            "reference q list",
            lambda: mla_decode_reference([0], inp.q_pe, inp.tok_ckv, inp.tok_kpe, inp.kv_indptr, inp.kv_indices, SM),
            (TypeError, "q_nope"),
        ),
        (
            "reference kv_indptr list",
            lambda: mla_decode_reference(
                inp.q_nope, inp.q_pe, inp.tok_ckv, inp.tok_kpe, [0, 5, 14], inp.kv_indices, SM
            ),
            (TypeError, "kv_indptr"),
        ),
        (
            "reference index out of range",
            lambda: mla_decode_reference(
                inp.q_nope,
                inp.q_pe,
                inp.tok_ckv,
                inp.tok_kpe,
                inp.kv_indptr,
                torch.full_like(inp.kv_indices, 10**6),
                SM,
            ),
            (IndexError, "kv_indices"),
        ),
        (
            "reference indptr past indices",
            lambda: mla_decode_reference(
                inp.q_nope, inp.q_pe, inp.tok_ckv, inp.tok_kpe, torch.tensor([0, 5, 99]), inp.kv_indices, SM
            ),
            (ValueError, "kv_indptr"),
        ),
    ]


TABLES = {
    "gather_cast": _gather_rows,
    "full_cast": _full_rows,
    "compact_kv_indices": _compact_rows,
    "plan_mla_decode": _plan_front_rows,
    "mla_decode": _run_rows,
    "mla_decode_fp8": _fp8_rows,
    "path plans": _path_plan_rows,
    "reference": _reference_rows,
}


def _row(table, name):
    """The row ``name`` of ``table``, built afresh for its test (a row's inputs are its own)."""
    return next(r for r in TABLES[table]() if r[0] == name)


@pytest.mark.parametrize("table, name", [(t, row[0]) for t, rows in TABLES.items() for row in rows()], ids=lambda v: v)
def test_edges(table, name):
    """One parametrized table per entry point (``TABLES``): each row correct or refused by our own message."""
    check_row(*_row(table, name)[1:])


def main() -> None:
    """Every trial's outcome, and the counts per table."""
    for table, rows in TABLES.items():
        counts: Counter = Counter()
        for name, thunk, expect in rows():
            kind, detail = outcome(thunk, expect)
            good = (kind == "correct") if expect == OK else (kind == "refused")
            counts[kind] += 1
            if not good or "-v" in sys.argv:
                print(f"  {table:18s} {name:34s} {kind:14s} {detail}")
        print(f"{table}: {dict(counts)}", flush=True)


if __name__ == "__main__":
    main()
