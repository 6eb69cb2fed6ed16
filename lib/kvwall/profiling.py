"""``torch.profiler`` over decode steps, reduced to the tables the book shows.

On a GPU the ranking is by *self CUDA time* (time of the kernels an op launched itself), as the
original trace was read; on a CPU by self CPU time. Times are per step.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["profile_ops", "CAST_OP"]

#: The op the whole-pool cast shows up as (``Tensor.to`` -> ``aten::_to_copy`` -> ``aten::copy_``).
CAST_OP = "aten::copy_"


def profile_ops(run_step: Callable[[], None], device: torch.device, *, steps: int = 3,
                top: int = 12) -> dict[str, list[dict]]:
    """Profile ``steps`` calls of ``run_step`` (after one warm-up call).

    Returns ``{"ops": [...], "kernels": [...]}``: ops (and profile labels) ranked by self time
    per step, and on CUDA the kernels ranked by time per step; each row
    ``{name, calls_per_step, ms_per_step}``.
    """
    run_step()
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    if on_cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run_step()
        if on_cuda:
            torch.cuda.synchronize(device)
    ops, kernels = [], []
    for ev in prof.key_averages():
        is_kernel = on_cuda and ev.device_type == torch.autograd.DeviceType.CUDA
        self_us = ev.self_device_time_total if on_cuda else ev.self_cpu_time_total
        if is_kernel:
            kernels.append({"name": ev.key, "calls_per_step": ev.count / steps,
                            "ms_per_step": ev.device_time_total / 1e3 / steps})
        elif self_us > 0:
            ops.append({"name": ev.key, "calls_per_step": ev.count / steps,
                        "ms_per_step": self_us / 1e3 / steps})
    ops.sort(key=lambda r: -r["ms_per_step"])
    kernels.sort(key=lambda r: -r["ms_per_step"])
    return {"ops": ops[:top], "kernels": kernels[:top]}
