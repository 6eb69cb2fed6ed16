"""The gather-then-cast validation suite, shared by the CPU tests, the GPU tests and the recorded GPU run.

Each :class:`GatherCase` describes seeded inputs (``kvwall.kernels.gather.reference.make_gather_inputs``);
:func:`check_case` runs an implementation on them into a *poisoned* output buffer and compares bit
for bit with the torch reference: the real rows must match (NaN where the reference is NaN), the
rows past ``kv_indptr[-1]`` must still hold the poison.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from kvwall.kernels.gather.reference import POISON_BITS, bits, gather_cast_reference, make_gather_inputs

__all__ = ["GatherCase", "VALIDATION_CASES", "check_case", "compare_rows"]

GatherFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class GatherCase:
    name: str
    num_slots: int
    dim: int
    context_lens: tuple[int, ...]
    layout: str = "sglang"
    page_size: int = 1
    index_dtype: str = "int32"
    pattern: str = "random"
    capacity: int | None = None  # None: exactly the real rows, no kv_indptr passed
    use_indptr: bool = False
    indptr_dtype: str = "int32"
    scale: float | None = None
    scale_as_tensor: bool = False
    seed: int = 0
    tags: tuple[str, ...] = field(default_factory=tuple)

    def inputs(self, device: torch.device | str, *, nan: bool = False):
        return make_gather_inputs(
            num_slots=self.num_slots,
            dim=self.dim,
            context_lens=self.context_lens,
            seed=self.seed,
            page_size=self.page_size,
            layout=self.layout,
            index_dtype=getattr(torch, self.index_dtype),
            capacity=self.capacity,
            pattern=self.pattern,
            nan=nan,
            device=device,
        )


#: Small, awkward shapes: odd D, both index dtypes, page sizes, repeats, unsorted, empty requests,
#: mixed lengths, capacity past the real rows, scales. Sized for Triton's interpreter.
VALIDATION_CASES: tuple[GatherCase, ...] = (
    GatherCase("mla_sglang_int32", 1000, 576, (517,)),
    GatherCase("mla_flat_int64_unique", 999, 576, (300,), layout="flat", index_dtype="int64", pattern="unique"),
    GatherCase("odd_dim_33_repeats", 97, 33, (211,), layout="flat"),
    GatherCase("dim_1", 10, 1, (7,), layout="flat", index_dtype="int64"),
    GatherCase("dim_1000_sorted", 50, 1000, (40,), pattern="sorted", index_dtype="int64"),
    GatherCase("dim_70_runs", 300, 70, (129,), pattern="runs"),
    GatherCase("all_same_slot", 64, 576, (33,), pattern="same"),
    GatherCase("paged_16", 40, 576, (13,), layout="paged", page_size=16),
    GatherCase(
        "paged_3_odd_dim_mixed",
        30,
        70,
        (11, 0, 5),
        layout="paged",
        page_size=3,
        use_indptr=True,
        capacity=20,
        index_dtype="int64",
    ),
    GatherCase(
        "batch_mixed_lengths_capacity",
        700,
        576,
        (1, 37, 0, 200, 5),
        capacity=300,
        use_indptr=True,
        index_dtype="int64",
        indptr_dtype="int64",
    ),
    GatherCase("capacity_over_real", 500, 576, (100,), capacity=256, use_indptr=True),
    GatherCase("only_empty_requests", 20, 576, (0, 0), capacity=16, use_indptr=True),
    GatherCase("no_indices", 20, 576, ()),
    GatherCase("scale_float", 200, 576, (150,), scale=0.37),
    GatherCase(
        "scale_tensor_capacity", 200, 100, (60, 3), scale=3.5e-3, scale_as_tensor=True, capacity=80, use_indptr=True
    ),
)


def compare_rows(out: torch.Tensor, expected: torch.Tensor, n_real: int) -> dict[str, int]:
    """Bit mismatches in the real rows (NaN matches NaN) and poisoned rows that were overwritten."""
    got, want = out[:n_real], expected[:n_real]
    same = bits(got) == bits(want)
    both_nan = torch.isnan(got) & torch.isnan(want)
    mismatched = int((~(same | both_nan)).sum())
    tail = bits(out[n_real:])
    overwritten = int((tail != POISON_BITS).sum())
    return {"mismatched_values": mismatched, "overwritten_poison": overwritten}


def check_case(fn: GatherFn, case: GatherCase, device: torch.device | str, *, nan: bool = False) -> dict:
    """Run ``fn`` on ``case`` into a poisoned buffer; a row for tables and asserts (``ok``)."""
    inp = case.inputs(device, nan=nan)
    capacity = inp.kv_indices.numel()
    out = torch.empty((capacity, *inp.pool.shape[1:]), dtype=torch.bfloat16, device=device)
    bits(out).fill_(POISON_BITS)
    scale = case.scale
    if scale is not None and case.scale_as_tensor:
        scale = torch.tensor([scale], dtype=torch.float32, device=device)
    indptr = inp.kv_indptr.to(getattr(torch, case.indptr_dtype)) if case.use_indptr else None
    result = fn(inp.pool, inp.kv_indices, indptr, out=out, scale=scale)
    if result.data_ptr() != out.data_ptr():
        raise AssertionError(f"{case.name}: the implementation did not return the out buffer it was given.")
    n_real = inp.real_rows if case.use_indptr else capacity
    expected = gather_cast_reference(inp.pool, inp.kv_indices, indptr, scale=scale)
    counts = compare_rows(out, expected, n_real)
    return {
        "case": case.name,
        "device": str(torch.device(device).type),
        "dim": case.dim,
        "page_size": case.page_size,
        "index_dtype": case.index_dtype,
        "real_rows": n_real,
        "capacity": capacity,
        "nan_inputs": nan,
        **counts,
        "ok": counts["mismatched_values"] == 0 and counts["overwritten_poison"] == 0,
    }
