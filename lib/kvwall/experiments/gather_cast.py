"""Chapter 4's experiments: validate the gather-then-cast kernels, benchmark them, and re-run the step.

* ``gather_cast_validation``: the shared case table (:mod:`kvwall.kernels.gather.cases`) bit-exact against
  the torch reference, for every implementation the device has (Triton in the interpreter on a CPU;
  Triton and the CUDA C++ twin on a GPU, there also with FP8 NaNs in the pool and at full scale);
  on a GPU also CUDA-graph capture then replay with changed ``kv_indices``/``kv_indptr``/scale, errors
  raised before launch, and ``compute-sanitizer --tool memcheck`` over both kernels (its output kept).
* ``gather_cast_bench``: GB/s against n for batch 1 (random slots) and batch 32 (mixed lengths,
  allocator-like runs, ``kv_indptr`` + capacity), against PyTorch ``index_select().to()`` and the
  device-to-device copy measured in the same run; CUDA-graph timing for small n; the launch floor;
  ``full_cast`` against PyTorch's whole-pool cast.
* ``gather_cast_profile``: chapter 1's decode-step model with each strategy of
  :mod:`kvwall.model.strategies` (the whole-pool cast re-measured in the same run), and the cost
  of an index-then-cast over graph-sized capacities.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import gc
import sys
import time
import warnings
from typing import Any, Callable

import torch

from kvwall.kernels import (full_cast, gather_cast, gather_cast_cuda, gather_cast_reference, make_gather_inputs,
                            mla_decode_reference, nvcc_compile_check, split_latent_cache)
from kvwall.kernels.gather.reference import POISON_BITS, bits

from kvwall.model.attention import make_mla_decode
from kvwall.model.decode_step import PHASES, DecodeStepModel, RestOfLayerStandIn
from kvwall.kernels.gather.cases import VALIDATION_CASES, GatherCase, check_case, compare_rows
from kvwall.model.strategies import make_strategy
from kvwall.model.geometry import GLM5
from kvwall.model.pool import TokenPool, make_decode_batch, mixed_lengths, random_kv
from kvwall.results import Result, collect_provenance
from kvwall.measure.timing import bench_ms, copy_bandwidth_gbps, synchronize
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "implementations", "gather_bytes", "run_gather_cast_validation", "run_gather_cast_bench",
           "run_gather_cast_profile"]

SOURCES = ("kernels/gather/kernel.py", "kernels/gather/tuned.json", "kernels/gather/gather_cast.cu", "kernels/gather/cuda.py", "kernels/gather/reference.py",
           "kernels/gather/cases.py", "lib/kvwall/model/gather_strategies.py", "kernels/gather/sanitize.py",
           "lib/kvwall/measure/timing.py", "lib/kvwall/experiments/gather_cast.py")
PROFILE_SOURCES = SOURCES + ("kernels/mla_decode/reference.py", "lib/kvwall/model/pool.py", "lib/kvwall/model/strategies.py",
                             "lib/kvwall/model/attention.py", "lib/kvwall/model/decode_step.py")


def _result(name: str, device: torch.device, params: dict[str, Any], rows: list[dict], sources=SOURCES) -> Result:
    return Result(name, params, rows, collect_provenance(device, sources))


def implementations(device: torch.device) -> dict[str, Callable[..., torch.Tensor]]:
    """The gather-cast implementations that run on ``device``."""
    impls: dict[str, Callable[..., torch.Tensor]] = {"triton": gather_cast}
    if device.type == "cuda":
        impls["cuda"] = gather_cast_cuda
    return impls


def gather_bytes(n: int, dim: int = GLM5.kv_dim, index_bytes: int = 4) -> int:
    """Fewest bytes a gather-cast of ``n`` rows moves: FP8 read + BF16 written + the indices read."""
    return n * dim * (1 + 2) + n * index_bytes


# ---------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------

def _graph_rows(device: torch.device, impl: str, fn, *, seed: int) -> list[dict]:
    """Capture one call with static buffers, then replay it with new indices, lengths and scale."""
    d, capacity, batch, slots = GLM5.kv_dim, 4096, 4, 20_000
    gen = torch.Generator().manual_seed(seed)
    pool = make_gather_inputs(num_slots=slots, dim=d, context_lens=[1], seed=seed, nan=True, device=device).pool
    idx_buf = torch.zeros(capacity, dtype=torch.int32, device=device)
    indptr_buf = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    scale_buf = torch.ones(1, dtype=torch.float32, device=device)
    out = torch.empty((capacity, 1, d), dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # compile / load before capture
        fn(pool, idx_buf, indptr_buf, out=out, scale=scale_buf, check_range=False)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(pool, idx_buf, indptr_buf, out=out, scale=scale_buf, check_range=False)
    rows = []
    for trial, (lens, scale) in enumerate([([5, 300, 0, 1000], 1.0), ([4000, 1, 1, 90], 0.125),
                                           ([0, 0, 0, 0], 2.0), ([1024, 1024, 1024, 1024], 3.3e-3)]):
        n = sum(lens)
        idx = torch.randint(0, slots, (capacity,), generator=gen, dtype=torch.int32)
        idx[n:] = slots + 7  # garbage past the real rows: the kernel must not read it
        ptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        idx_buf.copy_(idx)
        indptr_buf.copy_(ptr)
        scale_buf.fill_(scale)
        bits(out).fill_(POISON_BITS)
        graph.replay()
        torch.cuda.synchronize(device)
        expected = gather_cast_reference(pool, idx_buf, indptr_buf, scale=scale_buf)
        counts = compare_rows(out, expected, n)
        rows.append({"section": "graph", "impl": impl, "trial": trial, "real_rows": n, "capacity": capacity,
                     "scale": scale, **counts,
                     "ok": counts["mismatched_values"] == 0 and counts["overwritten_poison"] == 0})
    return rows


_BAD_INPUTS: list[tuple[str, Callable[[dict], dict], type]] = [
    ("pool dtype bf16", lambda a: {**a, "pool": a["pool"].to(torch.bfloat16)}, TypeError),
    ("pool on the wrong device", lambda a: {**a, "pool": a["pool"].cpu()}, ValueError),
    ("index dtype int16", lambda a: {**a, "kv_indices": a["kv_indices"].to(torch.int16)}, TypeError),
    ("pool last dim not contiguous", lambda a: {**a, "pool": a["pool"].transpose(0, 2)}, ValueError),
    ("out too small", lambda a: {**a, "out": a["out"][:-1]}, ValueError),
    ("index out of range", lambda a: {**a, "kv_indices": a["kv_indices"] + a["pool"].shape[0]}, IndexError),
    ("kv_indptr past the capacity",
     lambda a: {**a, "kv_indptr": torch.cat([a["kv_indptr"][:-1], a["kv_indptr"][-1:] + 10_000])}, ValueError),
]


def _error_rows(device: torch.device, impl: str, fn) -> list[dict]:
    inp = make_gather_inputs(num_slots=100, dim=GLM5.kv_dim, context_lens=[20, 30], seed=3, device=device)
    base = {"pool": inp.pool, "kv_indices": inp.kv_indices, "kv_indptr": inp.kv_indptr,
            "out": torch.empty((50, 1, GLM5.kv_dim), dtype=torch.bfloat16, device=device)}
    rows = []
    for what, edit, kind in _BAD_INPUTS:
        args = edit(base)
        bits(args["out"]).fill_(POISON_BITS)
        try:
            fn(args["pool"], args["kv_indices"], args["kv_indptr"], out=args["out"])
            raised, message = "nothing", ""
        except Exception as exc:  # noqa: BLE001 - the row records what was raised
            raised, message = type(exc).__name__, str(exc)
        untouched = bool((bits(args["out"]) == POISON_BITS).all()) if args["out"].device == inp.pool.device else True
        rows.append({"section": "errors", "impl": impl, "input": what, "expected": kind.__name__, "raised": raised,
                     "message": message[:240], "out_untouched": untouched,
                     "ok": raised == kind.__name__ and untouched})
    return rows


def _sanitizer_rows(timeout_s: int) -> list[dict]:
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return [{"section": "sanitizer", "tool": "memcheck", "ran": False, "returncode": None,
                 "summary": "compute-sanitizer not found on PATH", "output_tail": ""}]
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}  # exact allocation bounds for memcheck
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-m", "kvwall.kernels.gather.sanitize"]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
        code = None
    summary = re.findall(r"ERROR SUMMARY: .*", output)
    return [{"section": "sanitizer", "tool": "memcheck", "ran": True, "returncode": code,
             "seconds": round(time.time() - t0, 1), "summary": summary[-1] if summary else "(no summary line)",
             "command": " ".join(cmd[:-3] + ["python3", "-m", "kvwall.kernels.gather.sanitize"]),
             "output_tail": "\n".join(output.strip().splitlines()[-40:])}]


def run_gather_cast_validation(device: torch.device, *, full_scale_slots: int, full_scale_rows: int,
                               sanitizer: bool, sanitizer_timeout_s: int = 300, seed: int = 0) -> Result:
    rows: list[dict] = []
    on_gpu = device.type == "cuda"
    for impl, fn in implementations(device).items():
        for nan in ((False, True) if on_gpu else (False,)):
            for case in VALIDATION_CASES:
                rows.append({"section": "cases", "impl": impl, **check_case(fn, case, device, nan=nan)})
        if full_scale_rows:
            for index_dtype, lens, capacity in (("int32", (full_scale_rows,), None),
                                                ("int64", tuple(mixed_lengths(full_scale_rows, 32, seed=seed)),
                                                 full_scale_rows + 4096)):
                case = GatherCase(f"{full_scale_slots:,}-slot pool, {len(lens)} request(s), {full_scale_rows:,} rows",
                                  full_scale_slots, GLM5.kv_dim, lens, index_dtype=index_dtype, capacity=capacity,
                                  use_indptr=capacity is not None, seed=seed + 1)
                rows.append({"section": "cases", "impl": impl, **check_case(fn, case, device, nan=on_gpu)})
        if on_gpu:
            rows += _graph_rows(device, impl, fn, seed=seed)
            rows += _error_rows(device, impl, fn)
    pool = make_gather_inputs(num_slots=3001, dim=GLM5.kv_dim, context_lens=[1], seed=seed, nan=on_gpu,
                              device=device).pool
    got, want = full_cast(pool), pool.to(torch.bfloat16)
    mismatched = int((~((bits(got) == bits(want)) | (torch.isnan(got) & torch.isnan(want)))).sum())
    rows.append({"section": "full_cast", "shape": list(pool.shape), "mismatched_values": mismatched,
                 "ok": mismatched == 0})
    try:
        report = nvcc_compile_check("sm_90")
        rows.append({"section": "nvcc", "ok": report.ok, "summary": report.summary(), "registers": report.registers})
    except FileNotFoundError as exc:
        rows.append({"section": "nvcc", "ok": None, "summary": str(exc), "registers": {}})
    if on_gpu and sanitizer:
        rows += _sanitizer_rows(sanitizer_timeout_s)
    params = {"full_scale_slots": full_scale_slots, "full_scale_rows": full_scale_rows, "sanitizer": sanitizer,
              "sanitizer_timeout_s": sanitizer_timeout_s, "seed": seed}
    return _result("gather_cast_validation", device, params, rows)


# ---------------------------------------------------------------------------------------------------------
# Benchmark
# ---------------------------------------------------------------------------------------------------------

def _graph_ms_per_call(calls: list[Callable[[], object]], device: torch.device) -> float:
    """Capture ``calls`` back to back in one CUDA graph; the median replay time divided by their number."""
    for c in calls:
        c()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return bench_ms(graph.replay, device) / len(calls)


def _host_us_per_call(fn: Callable[[], object], device: torch.device, calls: int = 200) -> float:
    """Host time per call when the calls are only enqueued (the launch cost the CPU pays)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return host


def run_gather_cast_bench(device: torch.device, *, pool_tokens: int, sizes: list[int], graph_max_n: int,
                          graph_sets: int, batch: int, seed: int = 0) -> Result:
    d = GLM5.kv_dim
    on_gpu = device.type == "cuda"
    gen = torch.Generator().manual_seed(seed)
    pool = random_kv((pool_tokens + 1, 1, d), generator=gen, device=device)
    rows: list[dict] = []
    copy_ms, copy_gbps = copy_bandwidth_gbps(device, pool_tokens * d * 3 // 2)
    rows.append({"section": "copy", "bytes": pool_tokens * d * 3, "ms": copy_ms, "gbps": copy_gbps})

    impls: dict[str, Callable[..., torch.Tensor]] = {}
    if on_gpu:  # the interpreter's speed means nothing: on a CPU only PyTorch is timed
        impls = {"gather_cast (Triton)": gather_cast, "gather_cast (CUDA C++)": gather_cast_cuda}
        import importlib

        gc_mod = importlib.import_module("kvwall.kernels.gather.kernel")
        name = torch.cuda.get_device_name(device)
        configs, small_rows = gc_mod._device_configs(name)
        rows.append({"section": "config", "gpu": name, "tuned": configs is not gc_mod.DEFAULT_CONFIGS,
                     "small_rows": small_rows, **{f"{k}_config": v.as_dict() for k, v in configs.items()},
                     **{f"{k}_label": v.label() for k, v in configs.items()}})

    def torch_op(idx):
        return lambda: pool.index_select(0, idx).to(torch.bfloat16)

    for n in sizes:
        for layout in ("batch 1, random slots", f"batch {batch}, mixed lengths"):
            if layout.startswith("batch 1"):  # uniformly random slots (with replacement: n may exceed the pool)
                idx = torch.randint(1, pool_tokens + 1, (n,), generator=gen, dtype=torch.int32).to(device)
                indptr, capacity = None, n
            else:  # allocator-like runs (chapter 1's free-list model), cut into mixed request lengths
                lens = mixed_lengths(n, batch, seed=seed + n)
                runs = make_decode_batch([min(n, pool_tokens)], pool_tokens + 1, seed=seed + n).kv_indices
                idx = runs.repeat(-(-n // runs.numel()))[:n].to(device)
                indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
                capacity = n
            nbytes = gather_bytes(n, d, 4)
            out = torch.empty((capacity, 1, d), dtype=torch.bfloat16, device=device)
            cases = {name: (lambda fn=fn: fn(pool, idx, indptr, out=out, check_range=False))
                     for name, fn in impls.items()}
            idx_long = idx.long()
            cases["PyTorch index_select().to(bf16)"] = torch_op(idx_long)
            for name, call in cases.items():
                ms = bench_ms(call, device)
                row = {"section": "sweep", "layout": layout, "impl": name, "n": n, "bytes": nbytes, "ms": ms,
                       "gbps": nbytes / (ms * 1e-3) / 1e9, "of_copy": nbytes / (ms * 1e-3) / 1e9 / copy_gbps}
                rows.append(row)
            if on_gpu and n <= graph_max_n and layout.startswith("batch 1"):
                sets = [(torch.randint(1, pool_tokens + 1, (n,), generator=gen, dtype=torch.int32).to(device),
                         torch.empty((n, 1, d), dtype=torch.bfloat16, device=device)) for _ in range(graph_sets)]
                for name, fn in impls.items():
                    ms = _graph_ms_per_call([lambda fn=fn, i=i, o=o: fn(pool, i, None, out=o, check_range=False)
                                             for i, o in sets], device)
                    rows.append({"section": "graph", "impl": name, "n": n, "ms": ms, "bytes": nbytes,
                                 "gbps": nbytes / (ms * 1e-3) / 1e9, "calls_per_graph": graph_sets})
                del sets
            del out

    # The launch floor: a capacity-sized launch with zero real rows (the kernel reads kv_indptr and exits),
    # its device time with events and in a graph, and what the host pays per call.
    if on_gpu:
        idx = torch.zeros(4096, dtype=torch.int32, device=device)
        empty = torch.zeros(2, dtype=torch.int32, device=device)
        out = torch.empty((4096, 1, d), dtype=torch.bfloat16, device=device)
        for name, fn in impls.items():
            call = lambda fn=fn: fn(pool, idx, empty, out=out, check_range=False)  # noqa: E731
            rows.append({"section": "launch", "impl": name, "device_ms": bench_ms(call, device),
                         "graph_ms": _graph_ms_per_call([call] * 20, device),
                         "host_us_per_call": _host_us_per_call(call, device),
                         "host_us_checked": _host_us_per_call(lambda fn=fn: fn(pool, idx, empty, out=out), device)})
        rows.append({"section": "launch", "impl": "PyTorch index_select().to(bf16)", "device_ms": None,
                     "graph_ms": None, "host_us_per_call": _host_us_per_call(torch_op(idx.long()[:1]), device)})

    # The whole pool: PyTorch's cast against the vectorized full_cast.
    full_bytes = (pool_tokens + 1) * d * 3
    casts = {"PyTorch pool.to(bf16)": lambda: pool.to(torch.bfloat16)}
    if on_gpu:
        casts["full_cast (Triton)"] = lambda: full_cast(pool)
    for name, call in casts.items():
        ms = bench_ms(call, device)
        rows.append({"section": "full_pool", "impl": name, "pool_tokens": pool_tokens, "bytes": full_bytes, "ms": ms,
                     "gbps": full_bytes / (ms * 1e-3) / 1e9, "of_copy": full_bytes / (ms * 1e-3) / 1e9 / copy_gbps})
    params = {"pool_tokens": pool_tokens, "sizes": list(sizes), "graph_max_n": graph_max_n, "graph_sets": graph_sets,
              "batch": batch, "seed": seed}
    return _result("gather_cast_bench", device, params, rows)


# ---------------------------------------------------------------------------------------------------------
# The decode step, after
# ---------------------------------------------------------------------------------------------------------

def _median(values: list[float]) -> float:
    return statistics.median(values)


def _unmarked_steps(model: DecodeStepModel, device: torch.device, steps: int) -> tuple[float, float]:
    """Steps with no phase marks: (median host ms to enqueue one, median device ms with events around it).

    When the host's enqueue time reaches the device time, the step is host-bound: the GPU idles
    between kernels and the phase clocks charge that idle time to whichever phase was waiting."""
    host, dev = [], []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        model.step()
        host.append((time.perf_counter() - t0) * 1e3)
        if device.type == "cuda":
            stop.record()
            torch.cuda.synchronize(device)
            dev.append(start.elapsed_time(stop))
        else:
            dev.append(host[-1])
    return _median(host), _median(dev)


def _graph_ms(body: Callable[[], object], device: torch.device, replays: int = 5) -> tuple[float | None, str | None]:
    """Capture ``body`` once in a CUDA graph; the median device ms of ``replays`` replays (or the error)."""
    if device.type != "cuda":
        return None, "no CUDA graphs on a CPU"
    try:
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        graph.replay()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(replays):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            stop.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(stop))
        del graph
        return _median(times), None
    except Exception as exc:  # noqa: BLE001 - recorded: which strategies a graph can hold is a finding
        torch.cuda.synchronize(device)
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def _syncs_in(fn: Callable[[], object], device: torch.device) -> int | None:
    """How many synchronizing torch operations ``fn`` performs (``torch.cuda.set_sync_debug_mode('warn')``)."""
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


def _host_us(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    """Host microseconds per call when calls are only enqueued (no synchronization between them)."""
    fn()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    synchronize(device)
    return us


class _HostAndDeviceClock:
    """Chapter 1's phase clock (an event at every phase boundary) that also notes the host's clock at each mark
    and the garbage collector's passes, so a phase that measures longer on the device than its kernels can be
    traced to the host: if the GPU ran dry, the device interval follows the host's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list[tuple[str, object, float]] = []
        self.gc: list[tuple[str, int, float]] = []

    def mark(self, label: str) -> None:
        ev = None
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.marks.append((label, ev, time.perf_counter()))

    def _gc_callback(self, phase: str, info: dict) -> None:
        self.gc.append((phase, int(info.get("generation", -1)), time.perf_counter()))

    def step(self, model: DecodeStepModel) -> dict:
        gc.callbacks.append(self._gc_callback)
        try:
            for layer in range(model.pool.num_layers):
                model._layer(layer, self)
            self.mark("end:end")
        finally:
            gc.callbacks.remove(self._gc_callback)
        synchronize(self.device)
        phases: dict[str, float] = {p: 0.0 for p in PHASES}
        host_gaps = []
        kv_free_layers = []
        for (label, a, ha), (_, b, hb) in zip(self.marks, self.marks[1:]):
            phase = label.split(":", 1)[1]
            ms = float(a.elapsed_time(b)) if a is not None else (hb - ha) * 1e3
            phases[phase] += ms
            host_gaps.append((hb - ha) * 1e3)
            if phase == PHASES[3]:
                kv_free_layers.append(ms)
        gc_ms, gc_gen2, starts = 0.0, 0, {}
        for phase, gen, t in self.gc:
            if phase == "start":
                starts[gen] = t
            elif gen in starts:
                gc_ms += (t - starts.pop(gen)) * 1e3
                gc_gen2 += gen == 2
        host_total = (self.marks[-1][2] - self.marks[0][2]) * 1e3
        return {"step_ms": sum(phases.values()), "phases": phases, "host_ms": host_total,
                "max_host_gap_ms": max(host_gaps), "host_gaps_over_1ms": sum(g > 1.0 for g in host_gaps),
                "host_ms_in_gaps_over_1ms": sum(g for g in host_gaps if g > 1.0),
                "kv_free_max_us": max(kv_free_layers) * 1e3, "kv_free_layers_over_10us": sum(v > 0.010 for v in kv_free_layers),
                "gc_passes": sum(1 for ph, _, _ in self.gc if ph == "stop"), "gc_gen2": gc_gen2, "gc_ms": gc_ms}


def _marked_steps(model: DecodeStepModel, device: torch.device, steps: int, *, gc_off: bool = False) -> list[dict]:
    out = []
    enabled = gc.isenabled()
    if gc_off:
        gc.disable()
    try:
        for _ in range(steps):
            out.append(_HostAndDeviceClock(device).step(model))
    finally:
        if gc_off and enabled:
            gc.enable()
    return out


def run_gather_cast_profile(device: torch.device, *, pool_tokens: int, layers: int, tensor_parallel: int,
                            context_lens: list[int], timed_steps: int, strategies: list[str], capacity: int,
                            capacity_sweep: list[int], seed: int = 0) -> Result:
    """Chapter 1's step with each strategy; every attention output checked against float64 first.

    Each strategy's step is measured three ways: with a clock on every phase (events between phases,
    as chapter 1), unmarked (host enqueue time and device time of the whole step), and, on a GPU,
    captured in a CUDA graph and replayed (device time alone, no host in the loop: what a
    graph-captured server pays), whole and phase by phase (each phase's 78 layers in a graph of its
    own). Synchronizing torch calls per step are counted with ``torch.cuda.set_sync_debug_mode``."""
    geometry = GLM5.with_tensor_parallel(tensor_parallel)
    pool = TokenPool.random(geometry, pool_tokens + 1, layers, device=device, seed=seed)
    batch = make_decode_batch(context_lens, pool.num_slots, seed=seed, device=device)
    standin = RestOfLayerStandIn.from_original(GLM5.num_layers, device)
    rows: list[dict] = []
    ref = None
    for kind in strategies:
        strategy = make_strategy(kind, batch, pool, capacity)
        attn_batch = strategy.attention_batch(batch) if hasattr(strategy, "attention_batch") else batch
        attention = make_mla_decode("auto", geometry, attn_batch)
        model = DecodeStepModel(pool, batch, strategy, attention, standin, seed=seed)
        model.step()  # warm-up: JIT, allocator
        ckv, kpe = strategy.prepare_kv(pool, 0, torch.bfloat16)
        out = attention(model.q_nope, model.q_pe, ckv, kpe).double()
        if ref is None:
            ref = mla_decode_reference(model.q_nope, model.q_pe,
                                       *split_latent_cache(pool.key_buffer(0), geometry.kv_lora_rank),
                                       batch.kv_indptr, batch.kv_indices, geometry.sm_scale,
                                       compute_dtype=torch.float64)
        rel_err = float((out - ref).norm() / ref.norm())
        if not rel_err < 2e-2:
            raise RuntimeError(f"{strategy.name} + {attention.name}: relative error {rel_err:.3g} against float64.")
        marked = _marked_steps(model, device, timed_steps)
        totals = sorted(m["step_ms"] for m in marked)
        phase_ms = {p: statistics.median(m["phases"][p] for m in marked) for p in PHASES}
        rows += [{"section": "breakdown", "strategy": kind, "phase": p, "ms_per_step": v} for p, v in phase_ms.items()]
        # Where a marked step's extra time comes from: the host's clock at every mark, GC passes, and the same
        # marked steps with the garbage collector off.
        for gc_off, runs in ((False, marked), (True, _marked_steps(model, device, timed_steps, gc_off=True))):
            for i, m in enumerate(runs):
                rows.append({"section": "marked_steps", "strategy": kind, "gc_off": gc_off, "step": i,
                             **{k: v for k, v in m.items() if k != "phases"},
                             "kv_free_ms": m["phases"][PHASES[3]], "kv_strategy_ms": m["phases"][PHASES[1]],
                             "attention_ms": m["phases"][PHASES[2]]})
        host_ms, eager_ms = _unmarked_steps(model, device, timed_steps)
        syncs = _syncs_in(model.step, device)
        n_layers = pool.num_layers
        host_prepare = _host_us(lambda: strategy.prepare_kv(pool, 0, torch.bfloat16), device,
                                20 if kind == "full_pool_cast" else 100)
        host_attention = _host_us(lambda: attention(model.q_nope, model.q_pe, ckv, kpe), device, 100)
        graph_step, graph_error = _graph_ms(model.step, device)
        graph_phases: dict[str, float | None] = {}
        if graph_step is not None:
            slots, new_kv = batch.new_token_slots, model.new_kv
            bodies = {
                PHASES[0]: lambda: [pool.write_new_tokens(layer, slots, new_kv) for layer in range(n_layers)],
                PHASES[1]: lambda: [strategy.prepare_kv(pool, layer, torch.bfloat16) for layer in range(n_layers)],
                PHASES[2]: lambda: [attention(model.q_nope, model.q_pe, ckv, kpe) for _ in range(n_layers)],
                PHASES[4]: lambda: [standin() for _ in range(n_layers)],
            }
            for phase, body in bodies.items():
                graph_phases[phase], _ = _graph_ms(body, device)
                rows.append({"section": "graph_breakdown", "strategy": kind, "phase": phase,
                             "ms_per_step": graph_phases[phase]})
        del ckv, kpe
        rows.append({"section": "strategies", "strategy": kind, "name": strategy.name, "attention": attention.name,
                     "rel_err_vs_float64": rel_err, "step_ms": statistics.median(totals),
                     "step_ms_min": totals[0], "step_ms_max": totals[-1],
                     "kv_strategy_ms_per_step": phase_ms["kv_strategy"], "layers": layers,
                     "capacity": getattr(strategy, "capacity", None),
                     "unmarked_step_ms": eager_ms, "host_enqueue_ms": host_ms,
                     "host_us_per_layer": host_ms / n_layers * 1e3,
                     "host_us_prepare_kv": host_prepare, "host_us_attention": host_attention,
                     "syncs_per_step": syncs, "graph_step_ms": graph_step, "graph_error": graph_error,
                     "graph_kv_ms_per_step": graph_phases.get(PHASES[1]),
                     "graph_phase_sum_ms": (sum(graph_phases.values()) if graph_phases and
                                            all(v is not None for v in graph_phases.values()) else None)})
        del model, strategy, attention
    # One layer's KV preparation over graph-sized capacities (the real length stays the batch's): timed in a CUDA
    # graph of 20 calls over 20 layers (device time, no host in the loop), with do_bench's per-call events beside
    # it (which include the host's launch time whenever the host, not the GPU, is the slower side).
    cap_layers = min(20, pool.num_layers)
    for cap in capacity_sweep:
        if cap < batch.total_tokens:
            continue
        for kind in ("index_then_cast_capacity", "gather_cast_capacity"):
            if kind.startswith("gather") and device.type != "cuda":
                continue
            strategy = make_strategy(kind, batch, pool, cap)
            events_ms = bench_ms(lambda: strategy.prepare_kv(pool, 0, torch.bfloat16), device)
            graph_ms, _ = _graph_ms(lambda: [strategy.prepare_kv(pool, layer, torch.bfloat16)
                                             for layer in range(cap_layers)], device)
            host = _host_us(lambda: strategy.prepare_kv(pool, 0, torch.bfloat16), device, 50)
            rows.append({"section": "capacity", "strategy": kind, "capacity": cap,
                         "ms_per_layer": graph_ms / cap_layers if graph_ms is not None else events_ms,
                         "ms_per_layer_events": events_ms,
                         "ms_per_layer_graph": graph_ms / cap_layers if graph_ms is not None else None,
                         "host_us_per_call": host, "real_tokens": batch.total_tokens})
            del strategy
    strat_rows = [r for r in rows if r.get("section") == "strategies"]
    before = next((r for r in strat_rows if r["strategy"] == "full_pool_cast"), None)
    if before is not None:
        for r in strat_rows:
            graph = (r["graph_step_ms"] is not None and before["graph_step_ms"] is not None)
            rows.append({"section": "gain", "strategy": r["strategy"], "step_ms": r["step_ms"],
                         "time_saved": 1 - r["step_ms"] / before["step_ms"],
                         "speedup": before["step_ms"] / r["step_ms"],
                         "graph_step_ms": r["graph_step_ms"],
                         "graph_time_saved": 1 - r["graph_step_ms"] / before["graph_step_ms"] if graph else None,
                         "graph_speedup": before["graph_step_ms"] / r["graph_step_ms"] if graph else None})
    params = dict(pool_tokens=pool_tokens, layers=layers, tensor_parallel=tensor_parallel,
                  context_lens=list(context_lens), timed_steps=timed_steps, strategies=list(strategies),
                  capacity=capacity, capacity_sweep=list(capacity_sweep), seed=seed)
    return _result("gather_cast_profile", device, params, rows, PROFILE_SOURCES)


_POW2_SIZES = [1024 << k for k in range(10)]  # 1K ... 512K

EXPERIMENTS: list[Experiment] = [
    Experiment("gather_cast_validation", run_gather_cast_validation,
               full=dict(full_scale_slots=495_001, full_scale_rows=131_072, sanitizer=True, sanitizer_timeout_s=150),
               small=dict(full_scale_slots=0, full_scale_rows=0, sanitizer=False),
               about="gather_cast (Triton, CUDA C++) bit-exact vs reference; CUDA graphs; memcheck"),
    Experiment("gather_cast_bench", run_gather_cast_bench,
               full=dict(pool_tokens=495_000, sizes=_POW2_SIZES, graph_max_n=65_536, graph_sets=16, batch=32),
               small=dict(pool_tokens=50_000, sizes=[1024, 4096, 16_384], graph_max_n=0, graph_sets=0, batch=8),
               about="gather-cast GB/s vs n against PyTorch and the copy ceiling; full_cast; launch floor"),
    Experiment("gather_cast_profile", run_gather_cast_profile,
               full=dict(pool_tokens=495_000, layers=78, tensor_parallel=4, context_lens=[8192], timed_steps=5,
                         strategies=["full_pool_cast", "index_then_cast", "index_then_cast_capacity", "gather_cast",
                                     "gather_cast_capacity", "gather_cast_cuda", "gather_cast_cuda_capacity"],
                         capacity=131_072, capacity_sweep=[8192, 32_768, 131_072, 262_144, 495_000]),
               small=dict(pool_tokens=50_000, layers=4, tensor_parallel=4, context_lens=[2048], timed_steps=3,
                          strategies=["full_pool_cast", "index_then_cast", "index_then_cast_capacity"],
                          capacity=16_384, capacity_sweep=[2048, 8192, 16_384, 50_000]),
               about="chapter 1's decode step after: gather-then-cast strategies beside the whole-pool cast"),
]
