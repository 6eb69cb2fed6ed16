"""What a caller of ours can rely on besides accuracy, checked for ``fused_decode_validation``.

- :func:`path_contract_rows`: one function, parametrized over ``"triton"``, ``"wgmma"``, ``"wgmma_tokens"`` and
  ``"ours"`` (the dispatcher with its plan): an out-of-range index in an unchecked call makes exactly its request
  NaN; a planned call replayed in a CUDA graph equals the eager call bit for bit (GPU); a checked call with an
  out-of-range index is refused; an unchecked call without a plan is refused (the wgmma paths, which need one); a
  plan of each other path is refused (each forced path); cache rows that are not 16-byte aligned are refused before
  any launch (the wgmma paths) or run -- ours routed to the Triton path -- with the aligned call's result.
- :func:`error_rows`: the Triton path's bad inputs raise before any launch (a poisoned ``out`` stays untouched), and a
  checked call refuses CUDA-graph capture.
- :func:`graph_rows`: the Triton path captured once with static buffers replays correctly with new indices, lengths
  and scales (bit-identical to eager calls), with fixed splits or a plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from kvwall.kernels.mla_decode.cases import CaseInputs, DecodeCase, make_case_inputs
from kvwall.kernels.mla_decode import dispatch
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode import wgmma_tokens as tokens_path
from kvwall.kernels.mla_decode.dispatch import DecodePlan, mla_decode, plan_mla_decode
from kvwall.kernels.mla_decode.launch_shape import default_config, default_num_splits
from kvwall.kernels.mla_decode.triton_path import mla_decode_fp8, plan_mla_decode_triton
from kvwall.kernels.mla_decode.reference import make_mla_inputs, nonempty_requests, reference64
from kvwall.measure.accuracy import bf16_bits, finite_or_none, relative_error, same_bits
from kvwall.measure.failures import error_text
from kvwall.measure.timing import synchronize
from kvwall.model.geometry import GLM5
from kvwall.model.step_paths import KERNEL_NAMES

__all__ = [
    "error_rows",
    "graph_rows",
    "GRAPH_TRIALS",
    "CONTRACT_PATHS",
    "path_contract_rows",
    "path_refusal",
    "ours_call",
]

DC, DR = GLM5.kv_lora_rank, GLM5.qk_rope_head_dim
D = DC + DR
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
SM_SCALE = GLM5.sm_scale


def _bad_inputs(device: torch.device):
    """(what, kwargs change, expected exception) -- each must raise before any launch."""
    case = DecodeCase("errors", 2, (3, 5), "pool_view", 1.0, 1.0, "int32", None, 10)
    inp = make_case_inputs(case, device, 64)
    ok = dict(
        q_nope=inp.q_nope,
        q_pe=inp.q_pe,
        ckv_cache=inp.ckv_cache,
        kpe_cache=inp.kpe_cache,
        kv_indptr=inp.kv_indptr,
        kv_indices=inp.kv_indices,
    )
    paged = (torch.randn(32, 2, D, device=device) * 0.5).to(FP8)
    other = "cpu" if device.type == "cuda" else "meta"
    i32 = dict(dtype=torch.int32, device=device)
    cases = [
        ("cache dtype bf16", dict(ckv_cache=inp.ckv_cache.to(BF16)), TypeError),
        ("q_nope float32", dict(q_nope=inp.q_nope.float()), TypeError),
        ("kv_indices float32", dict(kv_indices=inp.kv_indices.float()), TypeError),
        ("q_pe heads differ", dict(q_pe=inp.q_pe[:, :1]), ValueError),
        ("index one past the pool", dict(kv_indices=torch.tensor([0, 1, 2, 3, 4, 5, 6, 64], **i32)), IndexError),
        ("negative index", dict(kv_indices=torch.tensor([0, -1, 2, 3, 4, 5, 6, 7], **i32)), IndexError),
        ("kv_indptr decreasing", dict(kv_indptr=torch.tensor([0, 5, 3], **i32)), ValueError),
        ("kv_indptr past kv_indices", dict(kv_indptr=torch.tensor([0, 3, 99], **i32)), ValueError),
        (
            "paged: kv_len past its pages",
            dict(
                ckv_cache=paged[..., :DC],
                kpe_cache=paged[..., DC:],
                kv_indices=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], **i32),
                kv_len=torch.tensor([3, 17], **i32),
            ),
            ValueError,
        ),
        (
            "paged: page index out of range",
            dict(
                ckv_cache=paged[..., :DC],
                kpe_cache=paged[..., DC:],
                kv_indices=torch.tensor([0, 1, 2, 3, 4, 5, 6, 32], **i32),
                kv_len=torch.tensor([3, 5], **i32),
            ),
            IndexError,
        ),
        ("tensors on two devices", dict(kv_indptr=inp.kv_indptr.to(other)), ValueError),
        (
            "out of the wrong shape",
            dict(out=torch.full((2, 3, DC), float("nan"), dtype=BF16, device=device)),
            ValueError,
        ),
        ("out aliases q_nope", dict(out=inp.q_nope), ValueError),
        ("num_splits 0", dict(num_splits=0), ValueError),
        ("scale tensor float64", dict(ckv_scale=torch.ones(1, dtype=torch.float64, device=device)), ValueError),
        ("sm_scale NaN", dict(sm_scale=float("nan")), TypeError),
    ]
    return ok, cases


def _error_row(what: str, expected: str, raised: str, message: str, untouched: bool) -> dict[str, Any]:
    return {
        "section": "errors",
        "input": what,
        "expected": expected,
        "raised": raised,
        "message": message[:300],
        "out_untouched": untouched,
        "passed": raised == expected and untouched,
    }


def error_rows(device: torch.device) -> list[dict]:
    """One ``errors`` row per bad input (and, on a GPU, a checked call inside graph capture)."""
    ok, cases = _bad_inputs(device)
    rows = []
    for what, change, kind in cases:
        args = {
            **ok,
            "sm_scale": SM_SCALE,
            "out": torch.full((2, 2, DC), float("nan"), dtype=BF16, device=device),
            **change,
        }
        out = args["out"]
        before = bf16_bits(out).clone()
        raised, message = "nothing", ""
        try:
            mla_decode_fp8(
                args.pop("q_nope"),
                args.pop("q_pe"),
                args.pop("ckv_cache"),
                args.pop("kpe_cache"),
                args.pop("kv_indptr"),
                args.pop("kv_indices"),
                args.pop("sm_scale"),
                **args,
            )
            synchronize(device)
        except Exception as exc:  # noqa: BLE001 - the row records what was raised
            raised, message = type(exc).__name__, str(exc)
        rows.append(_error_row(what, kind.__name__, raised, message, bool(torch.equal(bf16_bits(out), before))))
    if device.type == "cuda":  # a checked call (host reads of kv_indptr/kv_indices) inside graph capture
        out = torch.full((2, 2, DC), float("nan"), dtype=BF16, device=device)
        before = bf16_bits(out).clone()
        mla_decode_fp8(**ok, sm_scale=SM_SCALE, num_splits=2, check_range=False)
        synchronize(device)
        raised, message = "nothing", ""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                mla_decode_fp8(**ok, sm_scale=SM_SCALE, out=out, num_splits=2)
        except Exception as exc:  # noqa: BLE001
            raised, message = type(exc).__name__, str(exc)
        del graph
        synchronize(device)
        rows.append(
            _error_row(
                "checked call inside CUDA-graph capture",
                "RuntimeError",
                raised,
                message,
                bool(torch.equal(bf16_bits(out), before)),
            )
        )
    return rows


#: Graph trials: (request lengths, ckv_scale, kpe_scale); the capture saw the first.
GRAPH_TRIALS = [
    ([100, 3000, 0, 5], 1.0, 1.0),
    ([0, 8000, 1, 4097], 1.5, 0.75),
    ([4000, 4000, 4000, 4000], 0.37, 0.74),
    ([0, 0, 0, 0], 2.0, 2.0),
    ([16_384, 0, 0, 0], 0.5, 0.25),
    ([1, 1, 1, 1], 1.0, 1.0),
]


def graph_rows(device: torch.device, heads: int, *, seed: int, planned: bool = False) -> list[dict]:
    """Capture one call with static buffers (capacity-sized ``kv_indices``, scales as tensors, fixed splits -- or,
    ``planned``, the plan made for the first trial's lengths -- ``check_range=False``), then replay it with new
    indices, lengths and scales: each replay against the float64 reference and bit for bit against an eager
    (checked) call with the same inputs and the same splits or plan. A plan made for other lengths stays correct:
    every request's last chunk runs to the length it has at replay."""
    slots, capacity, batch = 100_000, 16_384, 4
    g = torch.Generator(device=device).manual_seed(seed)
    pool = (torch.randn(slots, 1, D, generator=g, device=device) * 0.7).to(FP8)
    ckv, kpe = pool[:, 0, :DC], pool[:, 0, DC:]
    q_nope = (torch.randn(batch, heads, DC, generator=g, device=device) * 0.5).to(BF16)
    q_pe = (torch.randn(batch, heads, DR, generator=g, device=device) * 0.5).to(BF16)
    idx_buf = torch.zeros(capacity, dtype=torch.int32, device=device)
    ptr_buf = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    cs_t = torch.ones(1, dtype=torch.float32, device=device)
    ks_t = torch.ones(1, dtype=torch.float32, device=device)
    out = torch.empty(batch, heads, DC, dtype=BF16, device=device)
    cfg = default_config(heads, DC, device, capacity)
    rows = []

    def load(lens, cs, ks):
        n = sum(lens)
        idx_buf.fill_(slots + 7)  # garbage past the real rows: the kernel must not read it
        if n:
            idx_buf[:n] = torch.randint(0, slots, (n,), generator=g, device=device, dtype=torch.int32)
        ptr_buf.copy_(torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32))
        cs_t.fill_(cs)
        ks_t.fill_(ks)

    try:
        load(*GRAPH_TRIALS[0])
        if planned:
            plan = plan_mla_decode_triton(ptr_buf, heads=heads, config=cfg)
            splits, launch = None, dict(plan=plan)
        else:
            splits = default_num_splits(batch, heads, capacity, device, cfg)
            launch = dict(num_splits=splits)
        kw = dict(ckv_scale=cs_t, kpe_scale=ks_t, out=out, check_range=False, config=cfg, **launch)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compile and load before the capture
            mla_decode_fp8(q_nope, q_pe, ckv, kpe, ptr_buf, idx_buf, SM_SCALE, **kw)
        torch.cuda.current_stream(device).wait_stream(side)
        synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mla_decode_fp8(q_nope, q_pe, ckv, kpe, ptr_buf, idx_buf, SM_SCALE, **kw)
    except Exception as exc:  # noqa: BLE001
        return [
            {
                "section": "graph",
                "heads": heads,
                "trial": None,
                "planned": planned,
                "error": error_text(exc),
                "passed": False,
            }
        ]
    for trial, (lens, cs, ks) in enumerate(GRAPH_TRIALS):
        row: dict[str, Any] = {
            "section": "graph",
            "heads": heads,
            "trial": trial,
            "lens": lens,
            "ckv_scale": cs,
            "kpe_scale": ks,
            "num_splits": splits,
            "planned": planned,
            "work_items": launch["plan"].items if planned else None,
            "config": dataclasses.asdict(cfg),
            "capacity": capacity,
            "rel_err": None,
            "passed": False,
        }
        try:
            load(lens, cs, ks)
            out.fill_(float("nan"))
            graph.replay()
            synchronize(device)
            keep = nonempty_requests(lens)
            empties = [i for i in range(batch) if i not in keep]
            eager = mla_decode_fp8(
                q_nope, q_pe, ckv, kpe, ptr_buf, idx_buf, SM_SCALE, ckv_scale=cs_t, kpe_scale=ks_t, config=cfg, **launch
            )  # checked; same variant, config, splits or plan: same bits
            row["equal_to_eager"] = same_bits(out, eager)
            row["empty_out_zero"] = bool((out[empties] == 0).all()) if empties else True
            row["finite"] = bool(torch.isfinite(out).all())
            if keep:
                ptr = ptr_buf.tolist()
                inp = CaseInputs(
                    q_nope,
                    q_pe,
                    ckv,
                    kpe,
                    ptr_buf,
                    idx_buf,
                    None,
                    ckv,
                    kpe,
                    ckv,
                    kpe,
                    [idx_buf[ptr[i] : ptr[i + 1]].long() for i in range(batch)],
                )
                row["rel_err"] = finite_or_none(relative_error(out[keep], reference64(inp, keep, cs, ks, SM_SCALE)))
            row["passed"] = bool(
                row["equal_to_eager"]
                and row["empty_out_zero"]
                and row["finite"]
                and (not keep or (row["rel_err"] is not None and row["rel_err"] <= 1e-2))
            )
        except Exception as exc:  # noqa: BLE001
            row["error"] = error_text(exc)
        rows.append(row)
    del graph
    return rows


# ----------------------------------------------------------------------------------------------
# The contracts every path keeps: one function, parametrized over the paths
# ----------------------------------------------------------------------------------------------

#: What :func:`path_contract_rows` and the case table run: each of ours' paths forced, and ours.
CONTRACT_PATHS = (*dispatch.KERNEL_PATHS, "ours")
#: The paths on the Hopper kernels: they need a plan for an unchecked call and refuse misaligned rows.
WGMMA_PATHS = ("wgmma", "wgmma_tokens")


def ours_call(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    *,
    plan: Any = None,
    kv_len: torch.Tensor | None = None,
    check_range: bool = True,
    path: str = "auto",
    **run: Any,
):
    """Ours -- :func:`~kvwall.kernels.plan_mla_decode` then :func:`~kvwall.kernels.mla_decode` -- in the per-path
    calls' argument order, so one contract body runs every path: the plan is made here from the call's page table
    (with the caches: the page table is checked against them) unless one is given; ``run``: the call's keywords.
    Ours checks the page table when it plans; its call never reads back: ``check_range`` says whether a page table
    other than the plan's is planned again (checked) or run on the plan's work list (unchecked)."""
    if isinstance(plan, DecodePlan) and (plan.kv_indices is not kv_indices or plan.kv_indptr is not kv_indptr):
        # another page table than the plan's: a checked call plans it again (ours checks at plan time), an
        # unchecked one runs the plan on it (as a graph replays with refilled buffers)
        plan = (
            None
            if check_range
            else dataclasses.replace(plan, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len=kv_len)
        )
    if plan is None:
        paged = ckv_cache.dim() == 3 and ckv_cache.shape[1] > 1
        plan = plan_mla_decode(
            kv_indptr,
            kv_indices,
            heads=q_nope.shape[1],
            sm_scale=sm_scale,
            kv_len=kv_len,
            page_size=ckv_cache.shape[1] if paged else 1,
            path=path,
            ckv_cache=ckv_cache,
            kpe_cache=kpe_cache,
        )
    return mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, plan, **run)


def path_refusal(path: str, device: torch.device) -> str | None:
    """Why ``path`` cannot run on ``device`` (None: it can; both wgmma paths refuse what the wgmma path refuses)."""
    if path not in CONTRACT_PATHS:
        raise ValueError(f"unknown path {path!r}; known: {CONTRACT_PATHS}.")
    return wgmma_path.wgmma_refusal(device) if path in WGMMA_PATHS else None


def _planned(path: str, inp, heads: int, device: torch.device) -> tuple[Any, Callable[..., Any], str | None]:
    """(the step's plan, the call that takes it, the dispatcher's reason for ours) for ``path`` on ``inp``."""
    del device  # the inputs' own (with its index: a plan is checked against the call's device)
    device = inp.q_nope.device
    if path == "triton":
        plan = plan_mla_decode_triton(inp.kv_indptr, heads=heads, device=device)
        return plan, mla_decode_fp8, None
    if path == "wgmma":
        return (
            wgmma_path.plan_mla_decode_wgmma(inp.kv_indptr, heads=heads, device=device),
            wgmma_path.mla_decode_fp8_wgmma,
            None,
        )
    if path == "wgmma_tokens":
        return (
            tokens_path.plan_mla_decode_wgmma_tokens(inp.kv_indptr, heads=heads, device=device),
            tokens_path.mla_decode_fp8_wgmma_tokens,
            None,
        )
    plan = plan_mla_decode(
        inp.kv_indptr, inp.kv_indices, heads=heads, sm_scale=SM_SCALE, ckv_cache=inp.ckv_cache, kpe_cache=inp.kpe_cache
    )
    return plan, ours_call, plan.why


def _row(path: str, check: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"section": "contract", "path": path, "check": check, "ok": bool(ok), "detail": detail[:300]}


def _refused(path: str, check: str, call: Callable[[], Any], *words: str) -> dict[str, Any]:
    """A row: ``call`` must raise before any launch, its message naming one of ``words``."""
    try:
        call()
        return _row(path, check, False, "no error raised")
    except Exception as exc:  # noqa: BLE001 - the error is what is checked
        text = f"{type(exc).__name__}: {exc}"
        return _row(path, check, any(w in text for w in words) and "launch failed" not in text, text)


def _misaligned(inp) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's rows copied into rows one byte off 16-byte alignment (577-byte stride, odd offset)."""
    ckv, kpe = inp.ckv_cache, inp.kpe_cache
    slots = ckv.shape[0]
    raw = torch.empty(slots * 577 + 16, dtype=torch.uint8, device=ckv.device)
    odd = raw[1 : 1 + slots * 577].view(slots, 577)
    odd[:, :DC].copy_(ckv.reshape(slots, DC).view(torch.uint8))
    odd[:, DC:D].copy_(kpe.reshape(slots, DR).view(torch.uint8))
    rows = odd.view(FP8)
    return rows[:, :DC], rows[:, DC:D]


def path_contract_rows(
    device: torch.device, path: str, *, heads: int, lens: list[int], seed: int = 3
) -> list[dict[str, Any]]:
    """One ``contract`` row per check that applies to ``path`` (see the module docstring); a check that crashes is a
    failed row, the others still run. ``lens``: the requests (at least three, the second longer than 10 tokens)."""
    if len(lens) < 3 or lens[1] <= 10:
        raise ValueError(f"path_contract_rows needs three or more requests, the second over 10 tokens; got {lens}.")
    why = path_refusal(path, device)
    if why:
        return [_row(path, "the path runs here", False, why)]
    rows: list[dict[str, Any]] = []
    inp = make_mla_inputs(lens, heads, seed=seed, layout="pool_view", pool_slots=100_000, device=device)
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr)
    try:
        plan, call, _ = _planned(path, inp, heads, device)
    except Exception as exc:  # noqa: BLE001
        return [_row(path, "the step's plan is made", False, error_text(exc, 300))]

    def check(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        try:
            rows.append(fn())
        except Exception as exc:  # noqa: BLE001 - a check that crashes is a failed row
            rows.append(_row(path, name, False, error_text(exc, 300)))

    def nan_isolation() -> dict[str, Any]:
        idx = inp.kv_indices.clone()
        idx[lens[0] + 10] = 10**8  # request 1's eleventh token
        out = call(*args, idx, SM_SCALE, check_range=False, plan=plan)
        synchronize(device)
        nan_rows = [bool(out[b].isnan().all()) for b in range(len(lens))]
        want = [b == 1 for b in range(len(lens))]
        return _row(
            path, "an unchecked out-of-range index makes only its request NaN", nan_rows == want, f"NaN rows {nan_rows}"
        )

    def graph_replay() -> dict[str, Any]:
        eager = call(*args, inp.kv_indices, SM_SCALE, check_range=False, plan=plan)
        graphed = torch.empty_like(eager)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            call(*args, inp.kv_indices, SM_SCALE, check_range=False, plan=plan, out=graphed)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(*args, inp.kv_indices, SM_SCALE, check_range=False, plan=plan, out=graphed)
        graphed.fill_(float("nan"))
        graph.replay()
        synchronize(device)
        return _row(
            path,
            "a planned call replayed in a CUDA graph equals the eager call",
            torch.equal(graphed, eager),
            "bitwise comparison after a NaN-poisoned out",
        )

    def checked_out_of_range() -> dict[str, Any]:
        bad = inp.kv_indices.clone()
        bad[5] = -1
        return _refused(
            path,
            "a checked call with an out-of-range index is refused",
            lambda: call(*args, bad, SM_SCALE, plan=plan),
            "outside",
            "range",
            "negative",
        )

    def misaligned_rows() -> dict[str, Any]:
        c_odd, k_odd = _misaligned(inp)
        name = "cache rows not 16-byte aligned are refused before the launch"
        if path in WGMMA_PATHS:
            return _refused(
                path,
                name,
                lambda: call(inp.q_nope, inp.q_pe, c_odd, k_odd, inp.kv_indptr, inp.kv_indices, SM_SCALE),
                "align",
                "16-byte",
            )
        aligned = call(*args, inp.kv_indices, SM_SCALE, plan=plan)
        if path == "ours":
            odd = plan_mla_decode(
                inp.kv_indptr, inp.kv_indices, heads=heads, sm_scale=SM_SCALE, ckv_cache=c_odd, kpe_cache=k_odd
            )
            got = mla_decode(inp.q_nope, inp.q_pe, c_odd, k_odd, odd)
            synchronize(device)
            err = relative_error(got, aligned)
            return _row(
                path,
                "cache rows not 16-byte aligned run on the Triton path, as the aligned call",
                odd.path == "triton" and err <= 1e-3,
                f"path {odd.path} ({odd.why}); relative difference {err:.2e}",
            )
        got = mla_decode_fp8(inp.q_nope, inp.q_pe, c_odd, k_odd, inp.kv_indptr, inp.kv_indices, SM_SCALE, plan=plan)
        synchronize(device)
        err = relative_error(got, aligned)
        return _row(
            path,
            "cache rows not 16-byte aligned run, as the aligned call",
            err <= 1e-3,
            f"relative difference {err:.2e}",
        )

    check("nan isolation", nan_isolation)
    if device.type == "cuda":
        check("graph replay", graph_replay)
    check("checked out-of-range", checked_out_of_range)
    if path in WGMMA_PATHS:
        check(
            "unchecked without a plan",
            lambda: _refused(
                path,
                "an unchecked call without a plan is refused",
                lambda: call(*args, inp.kv_indices, SM_SCALE, check_range=False),
                "plan",
            ),
        )
    for other in (p for p in dispatch.KERNEL_PATHS if path in dispatch.KERNEL_PATHS and p != path):
        other_plan = {
            "triton": plan_mla_decode_triton,
            "wgmma": wgmma_path.plan_mla_decode_wgmma,
            "wgmma_tokens": tokens_path.plan_mla_decode_wgmma_tokens,
        }[other]
        check(
            f"{other} plan",
            lambda other=other, other_plan=other_plan: _refused(
                path,
                f"a plan of the {KERNEL_NAMES[other]} is refused",
                lambda: call(
                    *args,
                    inp.kv_indices,
                    SM_SCALE,
                    plan=other_plan(inp.kv_indptr, heads=heads, device=inp.q_nope.device),
                ),
                "plan",
            ),
        )
    check("misaligned rows", misaligned_rows)
    return rows
