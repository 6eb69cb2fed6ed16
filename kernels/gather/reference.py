"""Plain-torch references for the gather-then-cast kernels, and a seeded input generator.

The references spell out the specification the fast kernels must meet bit for bit:
``out[i] = pool[kv_indices[i]]`` converted to BF16 (times ``scale``, rounded once from float32),
for the ``kv_indptr[-1]`` real rows; rows past them are left as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["gather_cast_reference", "GatherInputs", "make_gather_inputs", "fp8_bytes", "POISON_BITS", "bits"]

#: What tests pre-fill output buffers with: a BF16 NaN pattern no conversion ever produces.
POISON_BITS = 0x7F81


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw 16-bit patterns of a BF16 tensor (bit-exact comparison, NaN payloads included)."""
    return t.view(torch.int16)


def gather_cast_reference(
    pool: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference gather-then-cast (any device torch supports; no validation beyond torch's own)."""
    n_real = int(kv_indptr[-1]) if kv_indptr is not None else kv_indices.numel()
    n_real = min(n_real, kv_indices.numel())
    rows = pool.index_select(0, kv_indices[:n_real].long())
    if scale is None:
        converted = rows.to(torch.bfloat16)
    else:
        s = scale.reshape(()).float() if isinstance(scale, torch.Tensor) else torch.tensor(scale, dtype=torch.float32)
        converted = (rows.float() * s.to(rows.device)).to(torch.bfloat16)
    if out is None:
        out = torch.empty((kv_indices.numel(), *pool.shape[1:]), dtype=torch.bfloat16, device=pool.device)
    out[:n_real] = converted
    return out


def fp8_bytes(shape: Sequence[int], *, generator: torch.Generator, nan: bool = False) -> torch.Tensor:
    """Uniformly random FP8 (e4m3fn) bit patterns: every normal, subnormal and both zeros.

    ``nan=True`` keeps the two NaN patterns (0x7F, 0xFF); ``nan=False`` replaces them with ±448, for
    checks whose reference has no NaN to compare with (a scale that must be rounded, say).
    """
    raw = torch.randint(0, 256, tuple(shape), generator=generator, dtype=torch.uint8)
    if not nan:
        raw[raw == 0x7F] = 0x7E
        raw[raw == 0xFF] = 0xFE
    return raw.view(torch.float8_e4m3fn)


@dataclass
class GatherInputs:
    pool: torch.Tensor  # float8_e4m3fn, (num_slots, D), (num_slots, 1, D) or (num_pages, page_size, D)
    kv_indices: torch.Tensor  # capacity entries; the first kv_indptr[-1] are real
    kv_indptr: torch.Tensor  # batch + 1 entries
    context_lens: list[int]

    @property
    def real_rows(self) -> int:
        return int(self.kv_indptr[-1])


def make_gather_inputs(
    *,
    num_slots: int,
    dim: int,
    context_lens: Sequence[int],
    seed: int,
    page_size: int = 1,
    layout: str = "sglang",
    index_dtype: torch.dtype = torch.int32,
    capacity: int | None = None,
    pattern: str = "random",
    nan: bool = False,
    device: torch.device | str = "cpu",
) -> GatherInputs:
    """A seeded pool and page table.

    ``layout``: "flat" ``(num_slots, D)``, "sglang" ``(num_slots, 1, D)`` (page size 1) or "paged"
    ``(num_slots, page_size, D)`` (``num_slots`` pages). ``pattern``: "random" (unsorted, with
    repeats), "unique" (a random permutation's prefix), "sorted", "runs" (contiguous runs in random
    order, as an allocator leaves them) or "same" (every entry the same slot). ``capacity``: length
    of ``kv_indices`` (>= the real rows); entries past the real rows are garbage (out-of-range
    values), so a kernel that reads them would fail loudly.
    """
    gen = torch.Generator().manual_seed(seed)
    if layout == "flat":
        shape = (num_slots, dim)
    elif layout == "sglang":
        shape = (num_slots, 1, dim)
    elif layout == "paged":
        shape = (num_slots, page_size, dim)
    else:
        raise ValueError(f"layout={layout!r}: use 'flat', 'sglang' or 'paged'.")
    pool = fp8_bytes(shape, generator=gen, nan=nan)
    n = int(sum(context_lens))
    if pattern == "random":
        idx = torch.randint(0, num_slots, (n,), generator=gen)
    elif pattern == "unique":
        if n > num_slots:
            raise ValueError(f"pattern='unique' needs n={n} <= num_slots={num_slots}.")
        idx = torch.randperm(num_slots, generator=gen)[:n]
    elif pattern == "sorted":
        idx = torch.randint(0, num_slots, (n,), generator=gen).sort().values
    elif pattern == "runs":
        starts = torch.randint(0, num_slots, (n // 8 + 1,), generator=gen)
        idx = torch.cat([(s + torch.arange(8)) % num_slots for s in starts.tolist()])[:n]
    elif pattern == "same":
        idx = torch.full((n,), int(torch.randint(0, num_slots, (1,), generator=gen)))
    else:
        raise ValueError(f"pattern={pattern!r} is not one of random/unique/sorted/runs/same.")
    capacity = n if capacity is None else capacity
    if capacity < n:
        raise ValueError(f"capacity={capacity} is smaller than the {n} real rows.")
    garbage = torch.randint(num_slots, num_slots + 1000, (capacity - n,), generator=gen)
    kv_indices = torch.cat([idx, garbage]).to(index_dtype)
    kv_indptr = torch.zeros(len(context_lens) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.tensor(list(context_lens), dtype=torch.int64).cumsum(0)
    return GatherInputs(pool.to(device), kv_indices.to(device), kv_indptr.to(device), list(context_lens))
