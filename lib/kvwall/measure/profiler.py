"""``torch.profiler`` over decode steps, reduced to the tables the book shows.

On a GPU the ranking is by *self CUDA time* (time of the kernels an op launched itself), as the
original trace was read; on a CPU by self CPU time. Times are per step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["profile_ops", "kernel_names", "count_syncs", "CAST_OP"]

#: The op the whole-pool cast shows up as (``Tensor.to`` -> ``aten::_to_copy`` -> ``aten::copy_``).
CAST_OP = "aten::copy_"


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Kineto prints ``USDT: profiler_start/stop`` lines to fd 2 on every session; keep them out
    of the chapters' output. Only the profiler's own start and stop run inside this."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profile_ops(
    run_step: Callable[[], None], device: torch.device, *, steps: int = 3, top: int = 12, labels: tuple[str, ...] = ()
) -> dict[str, list[dict]]:
    """Profile ``steps`` calls of ``run_step`` (after one warm-up call).

    Returns ``{"ops": [...], "kernels": [...]}``: ops (and profile labels) ranked by self time
    per step, and on CUDA the kernels ranked by time per step; each row
    ``{name, calls_per_step, ms_per_step}``. On CUDA, ops are the framework's own (``aten::``
    and profile labels), not CUDA runtime calls; ``labels`` (the ``record_function`` names the
    step uses) are left out of the kernel ranking, where the profiler mirrors them.
    """
    run_step()
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    if on_cuda:
        torch.cuda.synchronize(device)
    prof = profile(activities=activities)
    with _quiet_native_stderr():
        prof.start()
    try:
        for _ in range(steps):
            run_step()
        if on_cuda:
            torch.cuda.synchronize(device)
    finally:
        with _quiet_native_stderr():
            prof.stop()
    ops, kernels = [], []
    for ev in prof.key_averages():
        is_kernel = on_cuda and ev.device_type == torch.autograd.DeviceType.CUDA
        self_us = ev.self_device_time_total if on_cuda else ev.self_cpu_time_total
        if is_kernel:
            if ev.key in labels:
                continue
            kernels.append(
                {"name": ev.key, "calls_per_step": ev.count / steps, "ms_per_step": ev.device_time_total / 1e3 / steps}
            )
        elif self_us > 0 and not (on_cuda and ev.key.startswith(("cuda", "Activity Buffer"))):
            ops.append({"name": ev.key, "calls_per_step": ev.count / steps, "ms_per_step": self_us / 1e3 / steps})
    ops.sort(key=lambda r: -r["ms_per_step"])
    kernels.sort(key=lambda r: -r["ms_per_step"])
    return {"ops": ops[:top], "kernels": kernels[:top]}


def kernel_names(fn: Callable[[], object], device: torch.device) -> list[str]:
    """Names of the CUDA kernels one call of ``fn`` launches (empty on a CPU)."""
    if device.type != "cuda":
        return []
    prof = profile(activities=[ProfilerActivity.CUDA])
    with _quiet_native_stderr():
        prof.start()
    try:
        fn()
        torch.cuda.synchronize(device)
    finally:
        with _quiet_native_stderr():
            prof.stop()
    return [e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]


def count_syncs(fn: Callable[[], object], device: torch.device) -> int | None:
    """How many synchronizing torch operations one call of ``fn`` performs, as
    ``torch.cuda.set_sync_debug_mode("warn")`` reports them (None on a CPU)."""
    if device.type != "cuda":
        return None
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize(device)
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())
