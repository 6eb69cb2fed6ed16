"""Argument checks at the top of the fused decode's public functions (dispatcher, launcher, plan): a bad argument
is a sentence naming the function, not a traceback from deep inside. Each raises through the caller's ``fail``
(:func:`kvwall.kernels._common.fail`).

- :func:`scale_number`: the rule for a scale given as a Python number (a real number, finite as float32);
- :func:`require_tensors` / :func:`check_batch_shapes` / :func:`positive_int` / :func:`check_device`.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from kvwall.kernels._common import Fail

__all__ = ["FLOAT32_MAX", "scale_number", "positive_int", "check_device", "require_tensors", "check_batch_shapes"]

#: The largest finite float32: the kernels take their scales as float32.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def scale_number(name: str, value: object, fail_: Fail) -> float:
    """A scale given as a Python number: a real number (not a bool), finite, as a float. The one rule of every
    kernel's number scales (a tensor scale is read in the kernel, so its value is the caller's to keep finite)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        fail_(TypeError, f"{name} must be a number or a one-element float32 tensor, got {type(value).__name__}; "
              "give a number such as 1.0.")
    if not math.isfinite(float(value)) or abs(float(value)) > FLOAT32_MAX:
        fail_(ValueError, f"{name}={value} is not finite (as float32); give a finite number, e.g. 1.0.")
    return float(value)


def positive_int(name: str, value: object, fail_: Fail) -> int:
    """``value`` if it is an int (not a bool) of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fail_(ValueError, f"{name} must be a whole number >= 1, got {value!r}.")
    return value


def check_device(device: object, fail_: Fail) -> torch.device:
    """``device`` as a torch.device the kernels run on: a CUDA device where CUDA is available, or the CPU."""
    try:
        dev = torch.device(device)  # type: ignore[arg-type]
    except (TypeError, RuntimeError) as exc:
        fail_(ValueError, f"device={device!r} is not a device ({exc}); give 'cuda', 'cuda:N' or 'cpu'.")
    if dev.type not in ("cuda", "cpu"):
        fail_(ValueError, f"device {dev} is not one the kernels run on: CUDA (compiled) or CPU (Triton interpreter).")
    if dev.type == "cuda" and not torch.cuda.is_available():
        fail_(RuntimeError, f"device {dev}: this machine has no CUDA GPU (or this torch has no CUDA); pass "
              "device='cpu' to run in Triton's interpreter.")
    return dev


def require_tensors(named: dict[str, object], fail_: Fail) -> None:
    """Each of ``named`` is a torch.Tensor."""
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            fail_(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}.")


def check_batch_shapes(tensors: dict[str, object], dims: int, fail_: Fail, *, layout: str) -> None:
    """Each of ``tensors`` is a torch.Tensor (:func:`require_tensors`) of ``dims`` dimensions, the first (the batch)
    at least 1."""
    require_tensors(tensors, fail_)
    for name, t in tensors.items():
        assert isinstance(t, torch.Tensor)
        if t.dim() != dims:
            fail_(ValueError, f"{name} has shape {tuple(t.shape)}; expected {layout}.")
        if t.shape[0] < 1:
            fail_(ValueError, f"{name} has shape {tuple(t.shape)}: an empty batch; a call needs at least one "
                  "request (skip the call for an empty batch).")
