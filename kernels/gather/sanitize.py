"""What ``compute-sanitizer --tool memcheck`` runs: both gather-cast kernels and ``full_cast`` on small cases.

``python -m kvwall.kernels.gather.sanitize`` (on a GPU) runs the validation cases whose shapes stress the
edges (odd D, pages, capacity past the real rows with garbage indices there, empty requests),
``check_range=False`` with out-of-range indices (the kernel must write NaN, not read outside the
pool), and exits non-zero if any result is wrong. The recorded validation keeps the tool's output.
Run it with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so that every tensor is its own allocation.
"""

from __future__ import annotations

import sys

import torch

from kvwall.kernels import full_cast, gather_cast, gather_cast_cuda, make_gather_inputs

from kvwall.kernels.gather.cases import VALIDATION_CASES, check_case

SANITIZED_CASES = ("odd_dim_33_repeats", "dim_1", "paged_3_odd_dim_mixed", "batch_mixed_lengths_capacity",
                   "capacity_over_real", "only_empty_requests", "scale_tensor_capacity", "mla_sglang_int32")


def main() -> int:
    device = torch.device("cuda")
    failures = []
    for impl, fn in (("triton", gather_cast), ("cuda", gather_cast_cuda)):
        for case in VALIDATION_CASES:
            if case.name in SANITIZED_CASES:
                row = check_case(fn, case, device, nan=True)
                print(f"{impl:6s} {case.name:32s} {'ok' if row['ok'] else 'WRONG'}", flush=True)
                failures += [] if row["ok"] else [f"{impl}:{case.name}"]
        inp = make_gather_inputs(num_slots=50, dim=576, context_lens=[40], seed=5, device=device)
        bad = inp.kv_indices.clone()
        bad[::3] = 10_000  # out of range, unchecked
        out = fn(inp.pool, bad, None, check_range=False)
        nan_rows = torch.isnan(out.float()).all(dim=-1).flatten()
        expect = torch.zeros_like(nan_rows)
        expect[::3] = True
        ok = bool((nan_rows == expect).all())
        print(f"{impl:6s} {'unchecked out-of-range -> NaN rows':32s} {'ok' if ok else 'WRONG'}", flush=True)
        failures += [] if ok else [f"{impl}:unchecked"]
    pool = make_gather_inputs(num_slots=1001, dim=577, context_lens=[1], seed=6, device=device).pool
    ok = torch.equal(full_cast(pool).view(torch.int16), pool.to(torch.bfloat16).view(torch.int16))
    print(f"{'triton':6s} {'full_cast 1001 x 577':32s} {'ok' if ok else 'WRONG'}", flush=True)
    failures += [] if ok else ["full_cast"]
    torch.cuda.synchronize()
    print("wrong results:", ", ".join(failures) if failures else "none")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
