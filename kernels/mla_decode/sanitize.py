"""What ``compute-sanitizer --tool memcheck`` runs for the fused FP8 MLA decode kernel.

``python -m kvwall.kernels.mla_decode.sanitize`` (on a GPU) runs the table's sanitized cases
(:data:`kvwall.kernels.mla_decode.cases.SANITIZED_CASES`: empty requests, one token, tile and split
boundaries, garbage past ``kv_indptr[-1]``, the direct path, many empty splits, a partial last page,
128 heads), each against the float64 reference, then unchecked calls (``check_range=False``) with
out-of-range indices, which must give NaN rows without a read outside the cache; it exits 1 if any
result is wrong. ``--cases NAME ...`` chooses cases; ``--device cpu`` runs the same checks in Triton's
interpreter. Run it with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so that every tensor is its own allocation.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Sequence

import torch

from kvwall.kernels._common import report_checks, sanitizer_args
from kvwall.kernels.mla_decode.cases import SANITIZED_CASES, check_case
from kvwall.kernels.mla_decode.kernel import mla_decode_fp8
from kvwall.kernels.mla_decode.reference import make_mla_inputs

#: The pool each sanitized case reads: small, so an out-of-bounds read lands outside the allocation.
POOL_SLOTS = 2_000


def unchecked_out_of_range_gives_nan(device: torch.device, layout: str) -> bool:
    """An unchecked call whose request 1 holds out-of-range indices (huge and negative): that request's output
    is NaN, the others' are the checked call's, bit for bit."""
    page = 16 if layout == "paged" else 1
    inp = make_mla_inputs([30, 50, 9], 16, seed=41, layout=layout, page_size=page, pool_slots=POOL_SLOTS,
                          device=device)
    call = dict(kv_len=inp.kv_len, num_splits=3)
    good = mla_decode_fp8(inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, 0.1,
                          **call)
    ptr = inp.kv_indptr.tolist()
    bad = inp.kv_indices.clone()
    bad[ptr[1]] = 10**9
    bad[ptr[2] - 1] = -7
    bad = dataclasses.replace(inp, kv_indices=bad)
    out = mla_decode_fp8(bad.q_nope, bad.q_pe, bad.ckv_cache, bad.kpe_cache, bad.kv_indptr, bad.kv_indices, 0.1,
                         check_range=False, **call)
    return bool(torch.isnan(out[1]).all()) and torch.equal(out[[0, 2]], good[[0, 2]])


def checks(device: torch.device, names: Sequence[str]) -> list[tuple[str, Callable[[], bool]]]:
    """The named checks :func:`main` runs: the chosen cases, then the unchecked calls."""
    by_name = {c.name: c for c in SANITIZED_CASES}
    out: list[tuple[str, Callable[[], bool]]] = [
        (name, lambda c=by_name[name]: check_case(mla_decode_fp8, c, device, POOL_SLOTS)["ok"]) for name in names]
    out += [(f"unchecked out-of-range -> NaN rows ({layout})",
             lambda layout=layout: unchecked_out_of_range_gives_nan(device, layout))
            for layout in ("pool_view", "paged")]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    names = [c.name for c in SANITIZED_CASES]
    device, chosen = sanitizer_args(argv, "python -m kvwall.kernels.mla_decode.sanitize", __doc__.splitlines()[0],
                                    names, names)
    return report_checks(checks(device, chosen))


if __name__ == "__main__":
    sys.exit(main())
