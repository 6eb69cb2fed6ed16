"""The fused FP8 MLA decode validation table, shared by the CPU tests, the GPU tests, the sanitizer and the
recorded run (chapter 5's ``fused_decode_validation``).

Each :class:`DecodeCase` names seeded inputs (:func:`kvwall.kernels.mla_decode.reference.make_mla_inputs`:
head count, request lengths, cache layout, scales, index dtype, forced splits, page size); :func:`check_case`
runs an implementation with ``mla_decode_fp8``'s signature on them and compares with the float64 reference on
the dequantized cache: finite outputs, zeros and ``lse = -inf`` for empty requests, a relative error within
``tol`` and the LSE within ``lse_atol``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvwall.kernels.mla_decode.reference import MLAInputs, make_mla_inputs, nonempty_requests, reference64

__all__ = [
    "DecodeCase",
    "validation_cases",
    "CaseInputs",
    "make_case_inputs",
    "check_case",
    "LAYOUTS",
    "SCALES",
    "PAGED_SCALES",
    "SPLITS",
    "SM_SCALE",
    "SMALL_CASES",
    "SANITIZED_CASES",
    "WGMMA_SANITIZED_CASES",
]

#: GLM-5's softmax scale: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim).
SM_SCALE = 1.0 / math.sqrt(192 + 64)
#: Page-size-1 layouts the table rotates through (the paged layout has its own length sets).
LAYOUTS = ("pool_view", "contiguous", "pool_view_3d")
#: (ckv_scale, kpe_scale): kpe_scale / ckv_scale is a power of two in each, so that a BF16 path's inputs can stay
#: exact (the query's rope part times the ratio); ckv_scale itself is not.
SCALES = ((1.0, 1.0), (0.37, 0.74), (2.5, 0.625))
PAGED_SCALES = (1.5, 0.75)
#: Split counts forced in turn (None: the launcher's default); 1 takes the kernel's direct path (no combine).
SPLITS = (None, 1, None, 7)

#: What the kernel is called with (the name chapter 5's experiment knows the inputs by).
CaseInputs = MLAInputs
MLAFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class DecodeCase:
    name: str
    heads: int
    lens: tuple[int, ...]
    layout: str
    ckv_scale: float
    kpe_scale: float
    index_dtype: str
    num_splits: int | None
    seed: int
    page_size: int = 1


def _short(lens: Sequence[int]) -> str:
    lens = list(lens)
    return "[" + ",".join(map(str, lens)) + "]" if len(lens) <= 8 else f"[{len(lens)} requests, {sum(lens)} tokens]"


def validation_cases(
    heads: list[int], length_sets: list[list[int]], paged_length_sets: list[list[int]], page_size: int, seed: int = 0
) -> list[DecodeCase]:
    """The case table: every head count x every length set, layouts / scales / index dtypes / forced splits
    rotating with different periods (so nine consecutive cases cover every layout x scale pair), and every
    head count x every paged length set (page ``page_size``, ``kv_len``)."""
    cases = []
    k = 0
    for h in heads:
        for lens in length_sets:
            layout = LAYOUTS[k % len(LAYOUTS)]
            cs, ks = SCALES[(k // len(LAYOUTS)) % len(SCALES)]
            dtype = "int64" if k % 2 else "int32"
            splits = SPLITS[k % len(SPLITS)]
            cases.append(
                DecodeCase(
                    f"h{h} {layout} lens={_short(lens)} scales=({cs}, {ks}) {dtype} splits={splits}",
                    h,
                    tuple(lens),
                    layout,
                    cs,
                    ks,
                    dtype,
                    splits,
                    seed + k,
                )
            )
            k += 1
        for lens in paged_length_sets:
            cs, ks = PAGED_SCALES
            cases.append(
                DecodeCase(
                    f"h{h} paged{page_size} lens={_short(lens)} scales=({cs}, {ks}) int32",
                    h,
                    tuple(lens),
                    "paged",
                    cs,
                    ks,
                    "int32",
                    None,
                    seed + k,
                    page_size,
                )
            )
            k += 1
    return cases


def make_case_inputs(case: DecodeCase, device: torch.device, pool_slots: int) -> CaseInputs:
    """Fresh seeded inputs for ``case``: BF16 queries ~ N(0, 0.5^2), an FP8 pool ~ N(0, 0.7^2) of at least
    ``pool_slots`` slots, random slots (repeats allowed)."""
    return make_mla_inputs(
        case.lens,
        case.heads,
        seed=case.seed,
        layout=case.layout,
        page_size=case.page_size,
        index_dtype=getattr(torch, case.index_dtype),
        pool_slots=pool_slots,
        device=device,
    )


#: Small, awkward cases for Triton's interpreter (chapter 5's small scale): 1, 3 and 16 heads, one-token and
#: odd lengths, empty requests in mixed batches, an all-empty batch, every layout, scale and forced split count,
#: and 64-token pages with a partial last page. Run with ``pool_slots=4096``.
SMALL_CASES: tuple[DecodeCase, ...] = tuple(
    validation_cases(
        heads=[1, 3, 16],
        length_sets=[[1], [7], [0, 7, 130, 1, 33], [65, 0, 129, 2], [333], [0, 0]],
        paged_length_sets=[[1, 0, 63, 64, 65, 200]],
        page_size=64,
    )
)

#: What ``compute-sanitizer`` runs (:mod:`kvwall.kernels.mla_decode.sanitize`): small cases that reach every edge
#: (empty requests, one token, tile and split boundaries, garbage past kv_indptr[-1], the direct path, many empty
#: splits, pages with a partial last page, 128 heads). Run with ``pool_slots=2000``.
SANITIZED_CASES: tuple[DecodeCase, ...] = (
    DecodeCase("h16 pool_view", 16, (0, 1, 65, 300), "pool_view", 0.37, 0.74, "int32", None, 1),
    DecodeCase("h3 contiguous spare", 3, (7, 0, 129), "contiguous", 1.0, 1.0, "int64", 40, 2),
    DecodeCase("h64 3d direct", 64, (33, 200), "pool_view_3d", 2.5, 0.625, "int32", 1, 3),
    DecodeCase("h128 pool_view", 128, (500, 1), "pool_view", 1.0, 1.0, "int32", 5, 4),
    DecodeCase("h16 paged64", 16, (1, 0, 63, 64, 65, 200), "paged", 1.5, 0.75, "int32", 3, 5, 64),
    DecodeCase("h1 all empty", 1, (0, 0), "pool_view", 1.0, 1.0, "int32", None, 6),
)

#: What ``compute-sanitizer`` runs on each wgmma path (the dispatcher's name -> its cases), at the heads per CTA it
#: is built for -- the wgmma path's 64, the tokens-on-M wgmma path's 16 and 32: odd lengths, one token and an empty
#: request in each batch, page 1 (every page-1 layout) and page 64 with a partial last page (and a request of whole
#: pages), into NaN-poisoned outputs (:func:`check_case`). The wgmma paths plan their own splits (``num_splits``
#: None). Run with ``pool_slots=2000``.
WGMMA_SANITIZED_CASES: dict[str, tuple[DecodeCase, ...]] = {
    "wgmma": (
        DecodeCase("wgmma h64 pool_view", 64, (0, 1, 65, 300), "pool_view", 0.37, 0.74, "int32", None, 11),
        DecodeCase("wgmma h64 paged64", 64, (1, 0, 63, 64, 65, 200), "paged", 1.5, 0.75, "int64", None, 12, 64),
    ),
    "wgmma_tokens": (
        DecodeCase("wgmma_tokens h16 pool_view_3d", 16, (0, 1, 65, 300), "pool_view_3d", 2.5, 0.625, "int64", None, 13),
        DecodeCase("wgmma_tokens h16 paged64", 16, (1, 0, 63, 64, 65, 200), "paged", 1.5, 0.75, "int32", None, 14, 64),
        DecodeCase("wgmma_tokens h32 contiguous", 32, (7, 0, 129, 1), "contiguous", 1.0, 1.0, "int32", None, 15),
        DecodeCase("wgmma_tokens h32 paged64", 32, (0, 200, 65, 1, 128), "paged", 1.5, 0.75, "int64", None, 16, 64),
    ),
}


def check_case(
    fn: MLAFn,
    case: DecodeCase,
    device: torch.device | str,
    pool_slots: int,
    *,
    tol: float = 1e-2,
    lse_atol: float = 2e-3,
    config: object | None = None,
) -> dict:
    """Run ``fn`` (``mla_decode_fp8``'s signature, ``return_lse=True``) on ``case`` into a NaN-poisoned ``out``; a
    row for tables and asserts: ``rel_err`` against the float64 reference and ``ok``."""
    device = torch.device(device)
    inp = make_case_inputs(case, device, pool_slots)
    batch = len(case.lens)
    out = torch.full((batch, case.heads, inp.q_nope.shape[-1]), float("nan"), dtype=torch.bfloat16, device=device)
    extra = {} if config is None else {"config": config}
    got, lse = fn(
        inp.q_nope,
        inp.q_pe,
        inp.ckv_cache,
        inp.kpe_cache,
        inp.kv_indptr,
        inp.kv_indices,
        SM_SCALE,
        ckv_scale=case.ckv_scale,
        kpe_scale=case.kpe_scale,
        out=out,
        return_lse=True,
        kv_len=inp.kv_len,
        num_splits=case.num_splits,
        **extra,
    )
    keep = nonempty_requests(case.lens)
    empties = [i for i in range(batch) if i not in keep]
    row = {
        "case": case.name,
        "device": device.type,
        "heads": case.heads,
        "lens": list(case.lens),
        "returned_out": got is out,
        "finite": bool(torch.isfinite(got).all()),
        "empty_out_zero": bool((got[empties] == 0).all() and torch.isneginf(lse[empties]).all()),
        "rel_err": None,
        "lse_max_err": None,
    }
    if keep:
        want, want_lse = reference64(inp, keep, case.ckv_scale, case.kpe_scale, SM_SCALE, return_lse=True)
        row["rel_err"] = float((got[keep].double() - want).norm() / want.norm())  # want: random, never 0
        row["lse_max_err"] = float((lse[keep].double() - want_lse).abs().max())
    row["ok"] = bool(
        row["returned_out"]
        and row["finite"]
        and row["empty_out_zero"]
        and (not keep or (row["rel_err"] <= tol and row["lse_max_err"] <= lse_atol))
    )
    return row
