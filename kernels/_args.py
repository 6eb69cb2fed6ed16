"""Argument checks at the top of the fused decode's public functions (dispatcher, launcher, plan): a bad argument
is a sentence naming the function, not a traceback from deep inside. Each raises through the caller's ``fail``
(:func:`kvwall.kernels._common.fail`).

- :func:`scale_number`: the rule for a scale given as a Python number (a real number, finite as float32);
- :func:`require_tensors` / :func:`check_batch_shapes` / :func:`positive_int` / :func:`check_device`;
- :func:`bounded_int`, :func:`index_tensor`, :func:`sm_scale_number` and :func:`check_plan_args` (the plans' shared
  checks, run before any device access or allocation), with the bounds :data:`MAX_TOKENS`, :data:`MAX_HEADS`,
  :data:`MAX_PAGE_SIZE`, :data:`MAX_PROGRAMS` and :data:`MAX_GRID_Y`.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from kvwall.kernels._common import Fail

__all__ = [
    "FLOAT32_MAX",
    "scale_number",
    "positive_int",
    "check_device",
    "require_tensors",
    "check_batch_shapes",
    "bounded_int",
    "index_tensor",
    "sm_scale_number",
    "check_plan_args",
    "MAX_TOKENS",
    "MAX_HEADS",
    "MAX_PAGE_SIZE",
    "MAX_PROGRAMS",
    "MAX_GRID_Y",
    "INDEX_DTYPES",
    "below_float32_normal",
]

#: The largest finite float32: the kernels take their scales as float32.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
#: The most tokens a request (and entries a page table) may hold: the kernels' token positions are 32-bit.
MAX_TOKENS = 2**31 - 1
#: The most query heads a plan takes (MLA models run 16-128 a GPU); a request's rows are q_len (<= 8) x heads.
MAX_HEADS = 4096
#: The most tokens a page may hold (FlashInfer's and SGLang's pages hold 1-64).
MAX_PAGE_SIZE = 1 << 16
#: The most programs (CTAs) a plan may aim at, at once: far more than any GPU holds.
MAX_PROGRAMS = 1 << 20
#: A CUDA grid's second and third dimensions: the work items (or splits) of one launch.
MAX_GRID_Y = 65535
INDEX_DTYPES = (torch.int32, torch.int64)
LOG2E = 1.4426950408889634


def scale_number(name: str, value: object, fail_: Fail) -> float:
    """A scale given as a Python number: a real number (not a bool), finite, as a float. The one rule of every
    kernel's number scales (a tensor scale is read in the kernel, so its value is the caller's to keep finite)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        fail_(
            TypeError,
            f"{name} must be a number or a one-element float32 tensor, got {type(value).__name__}; "
            "give a number such as 1.0.",
        )
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
        fail_(
            RuntimeError,
            f"device {dev}: this machine has no CUDA GPU (or this torch has no CUDA); pass "
            "device='cpu' to run in Triton's interpreter.",
        )
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        fail_(ValueError, f"device {dev}: this machine has {torch.cuda.device_count()} CUDA device(s).")
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev


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
            fail_(
                ValueError,
                f"{name} has shape {tuple(t.shape)}: an empty batch; a call needs at least one "
                "request (skip the call for an empty batch).",
            )


def bounded_int(
    name: str, value: object, fail_: Fail, *, least: int = 1, most: int | None = None, hint: str = ""
) -> int:
    """``value`` if it is an int (not a bool) in ``least .. most``; refused with ``hint`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least or (most is not None and value > most):
        most_said = "" if most is None else f" (and at most {most})"
        fail_(
            ValueError,
            f"{name} must be a whole number >= {least}, got {value!r}{most_said}{'; ' + hint if hint else ''}.",
        )
    return value


def index_tensor(name: str, t: object, fail_: Fail, *, contiguous: bool = False) -> torch.Tensor:
    """``t`` if it is a 1-D int32 / int64 tensor (contiguous where asked) on a device the kernels run on."""
    if not isinstance(t, torch.Tensor):
        fail_(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__} (a 1-D int32 or int64 tensor).")
    if t.dtype not in INDEX_DTYPES or t.dim() != 1 or (contiguous and not t.is_contiguous()):
        fail_(
            ValueError,
            f"{name} must be a {'contiguous ' if contiguous else ''}1-D int32 or int64 tensor; got "
            f"{t.dtype} of shape {tuple(t.shape)}.",
        )
    if t.device.type not in ("cuda", "cpu"):
        fail_(ValueError, f"{name} is on {t.device}; the kernels run on CUDA (compiled) or CPU (Triton interpreter).")
    return t


def sm_scale_number(value: object, fail_: Fail) -> float:
    """``sm_scale``: a real number (not a bool), finite, with ``sm_scale * log2(e)`` a finite float32."""
    if isinstance(value, bool) or not isinstance(value, Real):
        fail_(
            TypeError,
            f"sm_scale must be a finite Python number, got {type(value).__name__}; the usual value is "
            "1/sqrt(576) for MLA.",
        )
    if not math.isfinite(float(value)) or abs(float(value)) * LOG2E > FLOAT32_MAX:
        fail_(
            ValueError,
            f"sm_scale={value!r} is not finite, or too large: |sm_scale| must be at most "
            f"{FLOAT32_MAX / LOG2E:.3g} (sm_scale * log2(e) must be a float32); the usual value is 1/sqrt(576).",
        )
    return float(value)


def check_plan_args(
    fail_: Fail,
    kv_indptr: object,
    kv_len: object,
    *,
    heads: object,
    page_size: object,
    device: object,
    programs: object = None,
    min_chunk: object = None,
    max_heads: int = MAX_HEADS,
) -> torch.device:
    """The checks every decode plan runs first, before it reads a tensor or allocates: ``kv_indptr`` (and ``kv_len``
    where given) 1-D int32 / int64 tensors on CUDA or the CPU; ``heads`` 1 .. ``max_heads``; ``page_size`` 1 ..
    :data:`MAX_PAGE_SIZE`; ``programs`` / ``min_chunk`` (optional) positive and bounded; ``device`` (default
    ``kv_indptr``'s) one the kernels run on here. Returns the device."""
    index_tensor("kv_indptr", kv_indptr, fail_)
    if kv_len is not None:
        index_tensor("kv_len", kv_len, fail_)
    bounded_int("heads", heads, fail_, most=max_heads)
    bounded_int("page_size", page_size, fail_, most=MAX_PAGE_SIZE)
    if programs is not None:
        bounded_int("programs", programs, fail_, most=MAX_PROGRAMS, hint="programs is how many CTAs to aim at at once")
    if min_chunk is not None:
        bounded_int("min_chunk", min_chunk, fail_, most=MAX_TOKENS)
    assert isinstance(kv_indptr, torch.Tensor)
    return check_device(device if device is not None else kv_indptr.device, fail_)


def below_float32_normal(value: float) -> bool:
    """A non-zero number below float32's smallest normal (2^-126): Triton's interpreter takes such a Python float
    argument as a float64 (a compiled kernel takes every float argument as a float32), so the interpreted launches
    pass it in a one-element float32 tensor instead."""
    return 0.0 < abs(value) < 2.0**-126
