"""What the kernels share: building a Triton kernel for the GPU or for Triton's interpreter, the Triton
helpers both kernels call, the host-side checks of page tables and outputs, and the GPU facts they read.

- :func:`build_kernel`: a compiled kernel for CUDA tensors, an interpreted one for CPU tensors (whatever
  ``TRITON_INTERPRET`` says, so import order does not matter). The interpreter cannot call ``@triton.jit``
  helpers, so the interpreted build resolves helper names to their plain-Python implementations.
- Triton helpers: :data:`round_bf16_by_bits` (float32 -> BF16, nearest even, by integer ops) and
  :data:`keep_fp8_nan` (the interpreter reads e4m3's NaN patterns as ±480; its build puts the NaN back, the
  compiled build is the identity).
- Host checks, each raising through a caller's ``fail`` (so the message names the caller's function):
  :func:`check_kv_indptr`, :func:`check_indices_in_range`, :func:`refuse_graph_capture`, :func:`check_output`
  (refuses an output that overlaps itself or shares bytes with an input).
- :func:`needs_int64`: whether an offset a launch can form passes 32 bits.
- GPU facts: :func:`sm_count`, :func:`gpu_name`; :func:`read_tuned_table` reads one GPU's entry of a tuned table.
- :func:`sanitizer_args` and :func:`report_checks`: the command line of the sanitizer programs
  (``python -m kvwall.kernels.<kernel>.sanitize``) and what they print and return.
"""

from __future__ import annotations

import argparse
import functools
import json
import types
from pathlib import Path
from typing import Callable, Iterable, NoReturn, Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = [
    "Fail",
    "fail",
    "build_kernel",
    "round_bf16_by_bits",
    "keep_fp8_nan",
    "INTERPRETED_HELPERS",
    "check_kv_indptr",
    "check_indices_in_range",
    "refuse_graph_capture",
    "check_output",
    "overlaps_itself",
    "needs_int64",
    "sm_count",
    "gpu_name",
    "read_tuned_table",
    "sanitizer_args",
    "report_checks",
]

#: ``fail(kind, text)`` raises ``kind(f"<function>: {text}")``; each kernel module binds its own.
Fail = Callable[[type[Exception], str], NoReturn]


def fail(owner: str, kind: type[Exception], text: str) -> NoReturn:
    """Raise ``kind`` with a message that starts with the public function's name."""
    raise kind(f"{owner}: {text}")


# ----------------------------------------------------------------------------------------------
# Triton helpers and kernel builds
# ----------------------------------------------------------------------------------------------


def _round_bf16_by_bits_impl(f):
    """float32 -> bfloat16 rounded to nearest even by integer ops, NaN kept NaN. Triton's interpreter truncates
    float32 -> bfloat16 instead of rounding; spelled out, the same arithmetic runs (tested) on both."""
    u = f.to(tl.uint32, bitcast=True)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(f != f, float("nan"), r).to(tl.bfloat16)


def _keep_fp8_nan_compiled(x8, y):
    """Compiled: the hardware conversion already maps e4m3's NaN to NaN."""
    return y


def _keep_fp8_nan_interpreted(x8, y):
    """Interpreted: ``y`` (converted from the e4m3 values ``x8``) with NaN wherever ``x8`` is e4m3's NaN
    (0x7F, 0xFF), which Triton's interpreter converts to ±480."""
    u = x8.to(tl.uint8, bitcast=True)
    return tl.where((u & 0x7F) == 0x7F, float("nan"), y).to(y.dtype)


round_bf16_by_bits = triton.jit(_round_bf16_by_bits_impl)
keep_fp8_nan = triton.jit(_keep_fp8_nan_compiled)
#: Plain implementations of the helpers above, for interpreted builds (see :func:`build_kernel`).
INTERPRETED_HELPERS: dict[str, Callable] = {
    "round_bf16_by_bits": _round_bf16_by_bits_impl,
    "keep_fp8_nan": _keep_fp8_nan_interpreted,
}


def build_kernel(fn: Callable, interpreted: bool, helpers: dict[str, Callable] | None = None):
    """``fn`` as a launchable kernel: ``triton.jit`` for CUDA tensors; for CPU tensors an ``InterpretedFunction``
    of the same code whose global names in ``helpers`` (and :data:`INTERPRETED_HELPERS`) resolve to those plain
    functions, helpers calling helpers included. Callers cache the result."""
    if not interpreted:
        return triton.jit(fn)
    plain = dict(fn.__globals__)

    def rebind(f: Callable) -> Callable:
        return types.FunctionType(f.__code__, plain, f.__name__, f.__defaults__, f.__closure__)

    plain.update({name: rebind(impl) for name, impl in {**INTERPRETED_HELPERS, **(helpers or {})}.items()})
    return InterpretedFunction(rebind(fn))


def needs_int64(largest_offset: int) -> bool:
    """Whether an element offset a launch can form (or a count it loops to) does not fit a signed 32-bit int."""
    return largest_offset >= 2**31


# ----------------------------------------------------------------------------------------------
# Host checks
# ----------------------------------------------------------------------------------------------


def refuse_graph_capture(device: torch.device, fail_: Fail) -> None:
    """A checked call reads the page table on the host, which CUDA-graph capture forbids: say what to do."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        fail_(
            RuntimeError,
            "check_range=True reads kv_indptr/kv_indices on the host (a synchronization), which "
            "CUDA-graph capture forbids; pass check_range=False for the captured call (out-of-range indices then "
            "give NaN rows).",
        )


def check_kv_indptr(kv_indptr: torch.Tensor, num_indices: int, fail_: Fail) -> list[int]:
    """``kv_indptr`` on the host: it must start at 0, never decrease and end at most at ``num_indices``."""
    ptr = kv_indptr.tolist()
    if ptr[0] != 0 or any(b < a for a, b in zip(ptr, ptr[1:])):
        fail_(
            ValueError, f"kv_indptr must start at 0 and never decrease; got {ptr[:6]}{'...' if len(ptr) > 6 else ''}."
        )
    if ptr[-1] > num_indices:
        fail_(ValueError, f"kv_indptr ends at {ptr[-1]} but kv_indices has only {num_indices} entries (the capacity).")
    return ptr


def check_indices_in_range(kv_indices: torch.Tensor, units: int, what: str, where: str, fail_: Fail) -> None:
    """Every entry of ``kv_indices`` (the real ones: pass the slice) names one of ``units`` slots or pages."""
    if kv_indices.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(kv_indices))
    if lo < 0 or hi >= units:
        fail_(
            IndexError, f"kv_indices holds {lo if lo < 0 else hi}, outside {where}'s {units} {what} (0..{units - 1})."
        )


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (an ``expand``ed or otherwise zero- or short-strided view).
    Sufficient test: sorted by stride, each dimension's stride must pass everything the smaller ones reach."""
    reach = 0
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def check_output(out: torch.Tensor, inputs: dict[str, torch.Tensor | None], fail_: Fail) -> None:
    """Refuse an ``out`` whose elements overlap each other, or whose bytes overlap an input's: the kernel would
    write rows over rows, or over what it is still reading."""
    if overlaps_itself(out):
        fail_(
            ValueError,
            f"out (shape {tuple(out.shape)}, strides {out.stride()}) overlaps itself, e.g. an "
            "expand()ed tensor: its rows would overwrite each other. Pass a tensor whose every element has its "
            "own memory (torch.empty(...)).",
        )
    lo, hi = _byte_span(out)
    for name, t in inputs.items():
        if t is None or t.device != out.device:
            continue
        a, b = _byte_span(t)
        if a < hi and lo < b:
            fail_(
                ValueError,
                f"out shares memory with {name}: the kernel would overwrite what it reads. Pass an "
                "out of its own (torch.empty(...)).",
            )


# ----------------------------------------------------------------------------------------------
# GPU facts and tuned tables
# ----------------------------------------------------------------------------------------------


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return _sm_count(_index(device))


def gpu_name(device: torch.device) -> str:
    """The GPU model as ``torch.cuda.get_device_name`` says it: the key of the tuned tables."""
    return _gpu_name(_index(device))


def read_tuned_table(path: Path, gpu: str) -> dict:
    """One GPU's entry of a tuned table (``{gpu name: entry}`` JSON); ``{}`` when the file or the entry is missing
    or the file is not JSON (the launchers then use their defaults)."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entry = table.get(gpu) if isinstance(table, dict) else None
    return entry if isinstance(entry, dict) else {}


# ----------------------------------------------------------------------------------------------
# Sanitizer programs
# ----------------------------------------------------------------------------------------------


def report_checks(checks: Iterable[tuple[str, Callable[[], bool]]]) -> int:
    """Run each named check, print ``name ok`` or ``name WRONG`` as it finishes, then the list of wrong ones;
    return the exit status (1 if any was wrong)."""
    wrong = []
    for name, check in checks:
        ok = bool(check())
        print(f"{name:48s} {'ok' if ok else 'WRONG'}", flush=True)
        wrong += [] if ok else [name]
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    print("wrong results:", ", ".join(wrong) if wrong else "none", flush=True)
    return 1 if wrong else 0


def sanitizer_args(
    argv: Sequence[str] | None, prog: str, description: str, case_names: Sequence[str], default: Sequence[str]
) -> tuple[torch.device, list[str]]:
    """The sanitizer programs' command line: ``--device`` (default ``cuda``: what ``compute-sanitizer`` watches;
    ``cpu`` runs the same checks in Triton's interpreter) and ``--cases`` (names from the case table, default
    ``default``). Returns (device, chosen case names)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (Triton's interpreter)")
    parser.add_argument(
        "--cases",
        nargs="+",
        default=list(default),
        metavar="NAME",
        help=f"case names from the table (default: {', '.join(default)})",
    )
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except (TypeError, RuntimeError):
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        parser.error(
            f"--device {args.device}: not a device these kernels run on; give --device cuda (default, what "
            "compute-sanitizer watches) or --device cpu (Triton's interpreter)"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device {args.device}: this machine has no CUDA GPU (or this torch has no CUDA); run with "
            "--device cpu for the same checks in Triton's interpreter"
        )
    unknown = [n for n in args.cases if n not in case_names]
    if unknown:
        parser.error(f"no case named {', '.join(map(repr, unknown))}; the table has: {', '.join(case_names)}")
    return device, list(args.cases)
