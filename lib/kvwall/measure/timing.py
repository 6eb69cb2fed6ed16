"""Timing that is honest on both worlds: CUDA events on a GPU, the host clock on a CPU.

On a GPU, :func:`bench_ms` is ``triton.testing.do_bench`` (warm-up, L2 flushed between runs,
median of many runs, CUDA events). On a CPU it runs the function a few times and takes the
median of ``time.perf_counter`` deltas.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

__all__ = ["bench_ms", "synchronize", "PhaseClock", "copy_bandwidth_gbps"]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_ms(fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 25,
             rep_ms: float = 100, min_reps: int = 3) -> float:
    """Median time of ``fn`` in milliseconds."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()  # warm-up
    times: list[float] = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < min_reps or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if len(times) >= 1000:
            break
    return statistics.median(times)


class PhaseClock:
    """Marks phase boundaries; durations read after the work is done (events on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._marks: list[tuple[str, object]] = []

    def mark(self, label: str) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append((label, ev))
        else:
            self._marks.append((label, time.perf_counter()))

    def intervals_ms(self) -> list[tuple[str, float, float]]:
        """``(label, start_ms, duration_ms)`` for each mark but the last, times from the first mark."""
        synchronize(self.device)
        if len(self._marks) < 2:
            return []
        t0 = self._marks[0][1]

        def since(a: object, b: object) -> float:
            if self.device.type == "cuda":
                return float(a.elapsed_time(b))  # type: ignore[attr-defined]
            return (float(b) - float(a)) * 1e3  # type: ignore[arg-type]

        out = []
        for (label, a), (_, b) in zip(self._marks, self._marks[1:]):
            out.append((label, since(t0, a), since(a, b)))
        return out


def copy_bandwidth_gbps(device: torch.device, nbytes: int) -> tuple[float, float]:
    """A plain same-dtype copy of ``nbytes``: ``(ms, GB/s counting bytes read + written)``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return ms, 2 * nbytes / (ms * 1e-3) / 1e9
