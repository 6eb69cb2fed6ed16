"""The book's stopwatches, one per kind of time, honest on both worlds.

- :func:`bench_ms` -- device time of one call. On a GPU it *is* ``triton.testing.do_bench`` (warm-up, a 256 MB
  buffer zeroed between runs so L2 is cold, CUDA events, the median); on a CPU the median of
  ``time.perf_counter`` deltas.
- :func:`graph_ms` -- device time of calls captured in a CUDA graph and replayed (no host in the loop).
  ``triton.testing.do_bench_cudagraph`` does not fit the book's three uses: it neither flushes L2 between the
  calls *inside* one replay (the fused-decode benchmark captures ``[flush, call]`` pairs and subtracts a graph of
  flushes alone), nor replays a graph captured once over several rotating inputs, nor times a graph whose body is a
  whole decode step a fixed number of times. :func:`graph_ms` covers all three with one capture routine.
- :func:`host_us_per_call` -- what the host pays to enqueue a call (back-to-back calls, no synchronization).
  ``torch.utils.benchmark.Timer`` synchronizes around its measurements, which is the opposite of what this
  stopwatch measures.
- :class:`PhaseClock` -- events at phase boundaries of a decode step (the host's clock noted beside each mark).
- :func:`copy_bandwidth_gbps` and :func:`matmul_tflops` -- the roofline's two ceilings, measured in the same run
  as what they bound.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Callable, Sequence

import torch
import triton.testing

__all__ = [
    "bench_ms",
    "graph_ms",
    "host_us_per_call",
    "synchronize",
    "release_memory",
    "PhaseClock",
    "copy_bandwidth_gbps",
    "matmul_tflops",
]

#: How :func:`graph_ms` reduces its replays: the median of ``replays`` event-timed replays, the best of them, or
#: ``triton.testing.do_bench`` over the replay (L2 flushed between replays, median over ``rep_ms``).
GRAPH_REDUCTIONS = ("median", "min", "do_bench")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """Collect garbage and hand the caching allocator's free blocks back, between measurements that each need
    much of the device's memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def bench_ms(
    fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 25, rep_ms: float = 100, min_reps: int = 3
) -> float:
    """Median time of ``fn`` in milliseconds (``triton.testing.do_bench`` on a GPU)."""
    if device.type == "cuda":
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


def _capture(body: Callable[[], object], repeat: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            body()
    return graph


def _replays_ms(
    graph: torch.cuda.CUDAGraph, device: torch.device, replays: int, reduce: str, warmup_ms: float, rep_ms: float
) -> float:
    if reduce == "do_bench":
        return bench_ms(graph.replay, device, warmup_ms=warmup_ms, rep_ms=rep_ms)
    graph.replay()  # first replay: uploads the graph
    torch.cuda.synchronize(device)
    times = []
    for _ in range(replays):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return min(times) if reduce == "min" else statistics.median(times)


def graph_ms(
    calls: Sequence[Callable[[], object]],
    device: torch.device,
    *,
    repeat: int = 1,
    flush: Callable[[], object] | None = None,
    replays: int = 5,
    reduce: str = "median",
    warmup: int = 1,
    warmup_ms: float = 25,
    rep_ms: float = 100,
) -> float:
    """Device milliseconds per call, from CUDA-graph replays.

    ``calls`` are warmed up ``warmup`` times each on a side stream (as capture wants), then captured back to back,
    the whole sequence ``repeat`` times, in one graph; each replay's time is divided by ``repeat * len(calls)``.
    ``reduce`` (:data:`GRAPH_REDUCTIONS`) says how replays become one number. With ``flush`` (e.g. zeroing a
    buffer larger than L2), every call is preceded by ``flush()`` inside the graph, and a second graph of the
    flushes alone is timed the same way and subtracted: the call's time with a cold L2, never below 0.
    Raises whatever capture raises (a call a graph cannot hold)."""
    if device.type != "cuda":
        raise RuntimeError(f"CUDA graphs need an NVIDIA GPU; the device is {device}.")
    if reduce not in GRAPH_REDUCTIONS:
        raise ValueError(f"reduce={reduce!r} is not one of {GRAPH_REDUCTIONS}.")
    if not calls or repeat < 1 or replays < 1:
        raise ValueError(
            f"graph_ms needs at least one call, repeat >= 1 and replays >= 1 (got {len(calls)} calls, "
            f"repeat={repeat}, replays={replays})."
        )
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # compile, load and allocate before capture
        for _ in range(warmup):
            for call in calls:
                call()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)

    def per_call(body: Callable[[], object]) -> float:
        graph = _capture(body, repeat)
        try:
            return _replays_ms(graph, device, replays, reduce, warmup_ms, rep_ms) / (repeat * len(calls))
        finally:
            del graph

    def sequence() -> None:
        for call in calls:
            if flush is not None:
                flush()
            call()

    if flush is None:
        return per_call(sequence)

    def flushes() -> None:
        for _ in calls:
            flush()

    return max(per_call(sequence) - per_call(flushes), 0.0)


def host_us_per_call(fn: Callable[[], object], device: torch.device, calls: int = 200) -> float:
    """Host microseconds per call when ``calls`` calls are only enqueued, back to back, after one warm-up call and a
    synchronization: the Python wrappers, checks, allocations and launches the CPU pays (when it exceeds the
    device time, an uncaptured call is host-bound)."""
    fn()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    synchronize(device)
    return us


class PhaseClock:
    """Marks phase boundaries; durations read after the work is done (CUDA events on a GPU, the host clock on a
    CPU). The host's clock is noted at every mark too, so a phase that lasts longer on the device than its kernels
    can be traced to the host (:meth:`host_intervals_ms`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._marks: list[tuple[str, object, float]] = []

    def mark(self, label: str) -> None:
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._marks.append((label, event, time.perf_counter()))

    def _since(self, a: tuple[str, object, float], b: tuple[str, object, float]) -> float:
        if self.device.type == "cuda":
            return float(a[1].elapsed_time(b[1]))  # type: ignore[union-attr]
        return (b[2] - a[2]) * 1e3

    def intervals_ms(self) -> list[tuple[str, float, float]]:
        """``(label, start_ms, duration_ms)`` for each mark but the last, times from the first mark."""
        synchronize(self.device)
        if len(self._marks) < 2:
            return []
        first = self._marks[0]
        return [(a[0], self._since(first, a), self._since(a, b)) for a, b in zip(self._marks, self._marks[1:])]

    def host_intervals_ms(self) -> list[tuple[str, float]]:
        """``(label, host ms from this mark to the next)`` for each mark but the last."""
        return [(a[0], (b[2] - a[2]) * 1e3) for a, b in zip(self._marks, self._marks[1:])]


def copy_bandwidth_gbps(device: torch.device, nbytes: int) -> tuple[float, float]:
    """A plain same-dtype copy of ``nbytes`` (the SM copy kernel, timed by :func:`bench_ms`, never in a graph where
    it becomes a copy-engine memcpy): ``(ms, GB/s counting bytes read + written)``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return ms, 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(device: torch.device, n: int = 8192) -> float:
    """Dense BF16 matmul rate (TFLOP/s) of an ``n x n x n`` product on a GPU: the mean of
    ``triton.testing.do_bench`` (50 ms warm-up, 300 ms of runs, L2 flushed between runs)."""
    if device.type != "cuda":
        raise RuntimeError(f"matmul_tflops measures a GPU's tensor cores; the device is {device}.")
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = float(triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="mean"))
    if not math.isfinite(ms) or ms <= 0:
        raise RuntimeError(f"the {n}^3 BF16 matmul timed at {ms} ms on {device}: no rate can be derived.")
    return 2 * n**3 / (ms * 1e-3) / 1e12
