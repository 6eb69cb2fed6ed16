"""How the book compares an output with its reference: relative error in float64, numbers JSON can hold, and
bit-level equality of BF16 outputs.

The accuracy rule of chapter 5 (flash-attention's): a fast kernel's :func:`relative_error` against a float64
reference must be at most a small multiple of the same-precision (BF16) path's.
"""

from __future__ import annotations

import math

import torch

__all__ = ["relative_error", "finite_or_none", "bf16_bits", "same_bits"]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` computed in float64 (0 when both are 0, infinity when only ``want`` is)."""
    want = want.double()
    diff = float((got.double() - want).norm())
    norm = float(want.norm())
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def finite_or_none(x: float | None) -> float | None:
    """A number a JSON result can hold: None for None, NaN and infinities."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit tensor's bits as int16 (a view): NaNs and signed zeros compare by their bits."""
    if t.element_size() != 2:
        raise TypeError(f"bf16_bits takes a 16-bit tensor (bfloat16 or float16), got {t.dtype}.")
    return t.view(torch.int16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two 16-bit outputs are identical bit for bit (NaN payloads included)."""
    return bool(torch.equal(bf16_bits(a), bf16_bits(b)))
