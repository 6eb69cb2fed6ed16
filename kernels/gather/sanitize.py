"""What ``compute-sanitizer --tool memcheck`` runs: both gather-cast kernels and ``full_cast`` on small cases.

``python -m kvwall.kernels.gather.sanitize`` (on a GPU) runs the validation cases whose shapes stress the
edges (odd D, pages, capacity past the real rows with garbage indices there, empty requests), FP8 NaNs
included, on the Triton kernel and the CUDA twin, ``check_range=False`` with out-of-range indices (the
kernel must write NaN, not read outside the pool), and ``full_cast``; it exits 1 if any result is wrong.
The recorded validation keeps the tool's output. ``--cases NAME ...`` chooses cases; ``--device cpu``
runs the Triton checks in the interpreter (the CUDA twin needs a GPU). Run it with
``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so that every tensor is its own allocation.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

import torch

from kvwall.kernels._common import report_checks, sanitizer_args
from kvwall.kernels.gather.cases import VALIDATION_CASES, check_case
from kvwall.kernels.gather.cuda import gather_cast_cuda
from kvwall.kernels.gather.kernel import full_cast, gather_cast
from kvwall.kernels.gather.reference import bits, make_gather_inputs

SANITIZED_CASES = (
    "odd_dim_33_repeats",
    "dim_1",
    "paged_3_odd_dim_mixed",
    "batch_mixed_lengths_capacity",
    "capacity_over_real",
    "only_empty_requests",
    "scale_tensor_capacity",
    "mla_sglang_int32",
)


def unchecked_out_of_range_gives_nan(fn: Callable[..., torch.Tensor], device: torch.device) -> bool:
    """Every third index out of range, unchecked: exactly those rows NaN."""
    inp = make_gather_inputs(num_slots=50, dim=576, context_lens=[40], seed=5, device=device)
    bad = inp.kv_indices.clone()
    bad[::3] = 10_000
    out = fn(inp.pool, bad, None, check_range=False)
    nan_rows = torch.isnan(out.float()).all(dim=-1).flatten()
    expect = torch.zeros_like(nan_rows)
    expect[::3] = True
    return bool((nan_rows == expect).all())


def full_cast_bit_exact(device: torch.device) -> bool:
    pool = make_gather_inputs(num_slots=1001, dim=577, context_lens=[1], seed=6, nan=True, device=device).pool
    got, want = full_cast(pool), pool.to(torch.bfloat16)
    return bool(((bits(got) == bits(want)) | (torch.isnan(got) & torch.isnan(want))).all())


def checks(device: torch.device, names: Sequence[str]) -> list[tuple[str, Callable[[], bool]]]:
    """The named checks :func:`main` runs, per implementation (the CUDA twin only on a GPU)."""
    impls = {"triton": gather_cast, **({"cuda": gather_cast_cuda} if device.type == "cuda" else {})}
    out: list[tuple[str, Callable[[], bool]]] = []
    for impl, fn in impls.items():
        out += [
            (f"{impl} {c.name}", lambda fn=fn, c=c: check_case(fn, c, device, nan=True)["ok"])
            for c in VALIDATION_CASES
            if c.name in names
        ]
        out.append(
            (f"{impl} unchecked out-of-range -> NaN rows", lambda fn=fn: unchecked_out_of_range_gives_nan(fn, device))
        )
    out.append(("triton full_cast 1001 x 577", lambda: full_cast_bit_exact(device)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    device, chosen = sanitizer_args(
        argv,
        "python -m kvwall.kernels.gather.sanitize",
        __doc__.splitlines()[0],
        [c.name for c in VALIDATION_CASES],
        SANITIZED_CASES,
    )
    return report_checks(checks(device, chosen))


if __name__ == "__main__":
    sys.exit(main())
