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

import gc
import statistics
import time
from typing import Any, Callable

import torch

from kvwall.kernels.gather import sanitize as sanitized_program
from kvwall.kernels.gather.cases import VALIDATION_CASES, GatherCase, check_case, compare_rows
from kvwall.kernels.gather.cuda import gather_cast_cuda, nvcc_compile_check
from kvwall.kernels.gather.kernel import DEFAULT_CONFIGS, _device_configs, full_cast, gather_cast
from kvwall.kernels.gather.reference import POISON_BITS, bits, gather_cast_reference, make_gather_inputs
from kvwall.kernels.mla_decode.reference import mla_decode_reference, split_latent_cache
from kvwall.measure.accuracy import relative_error
from kvwall.measure.failures import error_text
from kvwall.measure.profiler import count_syncs
from kvwall.measure.sanitizer import memcheck_row
from kvwall.measure.timing import PhaseClock, bench_ms, copy_bandwidth_gbps, graph_ms, host_us_per_call, synchronize
from kvwall.model.attention import make_mla_decode
from kvwall.model.decode_step import PHASES, DecodeStepModel, RestOfLayerStandIn
from kvwall.model.geometry import GLM5
from kvwall.model.pool import TokenPool, make_decode_batch, mixed_lengths, random_kv
from kvwall.model.roofline import full_pool_cast_bytes, gather_cast_bytes
from kvwall.model.strategies import make_strategy
from kvwall.results import Result, collect_provenance
from kvwall.experiments.registry import Experiment

__all__ = [
    "EXPERIMENTS",
    "implementations",
    "run_gather_cast_validation",
    "run_gather_cast_bench",
    "run_gather_cast_profile",
]


def _result(name: str, device: torch.device, params: dict[str, Any], rows: list[dict]) -> Result:
    """The result, stamped with this module's provenance (its import closure is what the numbers depend on)."""
    return Result(name, params, rows, collect_provenance(device, __name__))


def implementations(device: torch.device) -> dict[str, Callable[..., torch.Tensor]]:
    """The gather-cast implementations that run on ``device``."""
    impls: dict[str, Callable[..., torch.Tensor]] = {"triton": gather_cast}
    if device.type == "cuda":
        impls["cuda"] = gather_cast_cuda
    return impls


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
    for trial, (lens, scale) in enumerate(
        [([5, 300, 0, 1000], 1.0), ([4000, 1, 1, 90], 0.125), ([0, 0, 0, 0], 2.0), ([1024, 1024, 1024, 1024], 3.3e-3)]
    ):
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
        rows.append(
            {
                "section": "graph",
                "impl": impl,
                "trial": trial,
                "real_rows": n,
                "capacity": capacity,
                "scale": scale,
                **counts,
                "ok": counts["mismatched_values"] == 0 and counts["overwritten_poison"] == 0,
            }
        )
    return rows


_BAD_INPUTS: list[tuple[str, Callable[[dict], dict], type]] = [
    ("pool dtype bf16", lambda a: {**a, "pool": a["pool"].to(torch.bfloat16)}, TypeError),
    ("pool on the wrong device", lambda a: {**a, "pool": a["pool"].cpu()}, ValueError),
    ("index dtype int16", lambda a: {**a, "kv_indices": a["kv_indices"].to(torch.int16)}, TypeError),
    ("pool last dim not contiguous", lambda a: {**a, "pool": a["pool"].transpose(0, 2)}, ValueError),
    ("out too small", lambda a: {**a, "out": a["out"][:-1]}, ValueError),
    ("index out of range", lambda a: {**a, "kv_indices": a["kv_indices"] + a["pool"].shape[0]}, IndexError),
    (
        "kv_indptr past the capacity",
        lambda a: {**a, "kv_indptr": torch.cat([a["kv_indptr"][:-1], a["kv_indptr"][-1:] + 10_000])},
        ValueError,
    ),
]


def _error_rows(device: torch.device, impl: str, fn) -> list[dict]:
    inp = make_gather_inputs(num_slots=100, dim=GLM5.kv_dim, context_lens=[20, 30], seed=3, device=device)
    base = {
        "pool": inp.pool,
        "kv_indices": inp.kv_indices,
        "kv_indptr": inp.kv_indptr,
        "out": torch.empty((50, 1, GLM5.kv_dim), dtype=torch.bfloat16, device=device),
    }
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
        rows.append(
            {
                "section": "errors",
                "impl": impl,
                "input": what,
                "expected": kind.__name__,
                "raised": raised,
                "message": message[:240],
                "out_untouched": untouched,
                "ok": raised == kind.__name__ and untouched,
            }
        )
    return rows


def run_gather_cast_validation(
    device: torch.device,
    *,
    full_scale_slots: int,
    full_scale_rows: int,
    sanitizer: bool,
    sanitizer_timeout_s: int = 300,
    seed: int = 0,
) -> Result:
    rows: list[dict] = []
    on_gpu = device.type == "cuda"
    for impl, fn in implementations(device).items():
        for nan in (False, True) if on_gpu else (False,):
            for case in VALIDATION_CASES:
                rows.append({"section": "cases", "impl": impl, **check_case(fn, case, device, nan=nan)})
        if full_scale_rows:
            for index_dtype, lens, capacity in (
                ("int32", (full_scale_rows,), None),
                ("int64", tuple(mixed_lengths(full_scale_rows, 32, seed=seed)), full_scale_rows + 4096),
            ):
                case = GatherCase(
                    f"{full_scale_slots:,}-slot pool, {len(lens)} request(s), {full_scale_rows:,} rows",
                    full_scale_slots,
                    GLM5.kv_dim,
                    lens,
                    index_dtype=index_dtype,
                    capacity=capacity,
                    use_indptr=capacity is not None,
                    seed=seed + 1,
                )
                rows.append({"section": "cases", "impl": impl, **check_case(fn, case, device, nan=on_gpu)})
        if on_gpu:
            rows += _graph_rows(device, impl, fn, seed=seed)
            rows += _error_rows(device, impl, fn)
    pool = make_gather_inputs(
        num_slots=3001, dim=GLM5.kv_dim, context_lens=[1], seed=seed, nan=on_gpu, device=device
    ).pool
    got, want = full_cast(pool), pool.to(torch.bfloat16)
    mismatched = int((~((bits(got) == bits(want)) | (torch.isnan(got) & torch.isnan(want)))).sum())
    rows.append(
        {"section": "full_cast", "shape": list(pool.shape), "mismatched_values": mismatched, "ok": mismatched == 0}
    )
    try:
        report = nvcc_compile_check("sm_90")
        rows.append({"section": "nvcc", "ok": report.ok, "summary": report.summary(), "registers": report.registers})
    except FileNotFoundError as exc:
        rows.append({"section": "nvcc", "ok": None, "summary": str(exc), "registers": {}})
    if on_gpu and sanitizer:
        rows.append(memcheck_row(sanitized_program.__name__, sanitizer_timeout_s))
    params = {
        "full_scale_slots": full_scale_slots,
        "full_scale_rows": full_scale_rows,
        "sanitizer": sanitizer,
        "sanitizer_timeout_s": sanitizer_timeout_s,
        "seed": seed,
    }
    return _result("gather_cast_validation", device, params, rows)


# ---------------------------------------------------------------------------------------------------------
# Benchmark
# ---------------------------------------------------------------------------------------------------------


def run_gather_cast_bench(
    device: torch.device,
    *,
    pool_tokens: int,
    sizes: list[int],
    graph_max_n: int,
    graph_sets: int,
    batch: int,
    seed: int = 0,
) -> Result:
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
        name = torch.cuda.get_device_name(device)
        configs, small_rows = _device_configs(name)
        rows.append(
            {
                "section": "config",
                "gpu": name,
                "tuned": configs is not DEFAULT_CONFIGS,
                "small_rows": small_rows,
                **{f"{k}_config": v.as_dict() for k, v in configs.items()},
                **{f"{k}_label": v.label() for k, v in configs.items()},
            }
        )

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
            nbytes = gather_cast_bytes(n)
            out = torch.empty((capacity, 1, d), dtype=torch.bfloat16, device=device)
            cases = {
                name: (lambda fn=fn: fn(pool, idx, indptr, out=out, check_range=False)) for name, fn in impls.items()
            }
            idx_long = idx.long()
            cases["PyTorch index_select().to(bf16)"] = torch_op(idx_long)
            for name, call in cases.items():
                ms = bench_ms(call, device)
                row = {
                    "section": "sweep",
                    "layout": layout,
                    "impl": name,
                    "n": n,
                    "bytes": nbytes,
                    "ms": ms,
                    "gbps": nbytes / (ms * 1e-3) / 1e9,
                    "of_copy": nbytes / (ms * 1e-3) / 1e9 / copy_gbps,
                }
                rows.append(row)
            if on_gpu and n <= graph_max_n and layout.startswith("batch 1"):
                sets = [
                    (
                        torch.randint(1, pool_tokens + 1, (n,), generator=gen, dtype=torch.int32).to(device),
                        torch.empty((n, 1, d), dtype=torch.bfloat16, device=device),
                    )
                    for _ in range(graph_sets)
                ]
                for name, fn in impls.items():
                    ms = graph_ms(
                        [lambda fn=fn, i=i, o=o: fn(pool, i, None, out=o, check_range=False) for i, o in sets],
                        device,
                        reduce="do_bench",
                    )
                    rows.append(
                        {
                            "section": "graph",
                            "impl": name,
                            "n": n,
                            "ms": ms,
                            "bytes": nbytes,
                            "gbps": nbytes / (ms * 1e-3) / 1e9,
                            "calls_per_graph": graph_sets,
                        }
                    )
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
            rows.append(
                {
                    "section": "launch",
                    "impl": name,
                    "device_ms": bench_ms(call, device),
                    "graph_ms": graph_ms([call] * 20, device, reduce="do_bench"),
                    "host_us_per_call": host_us_per_call(call, device),
                    "host_us_checked": host_us_per_call(lambda fn=fn: fn(pool, idx, empty, out=out), device),
                }
            )
        rows.append(
            {
                "section": "launch",
                "impl": "PyTorch index_select().to(bf16)",
                "device_ms": None,
                "graph_ms": None,
                "host_us_per_call": host_us_per_call(torch_op(idx.long()[:1]), device),
            }
        )

    # The whole pool: PyTorch's cast against the vectorized full_cast.
    full_bytes = full_pool_cast_bytes(GLM5, pool_tokens + 1)["total"]
    casts = {"PyTorch pool.to(bf16)": lambda: pool.to(torch.bfloat16)}
    if on_gpu:
        casts["full_cast (Triton)"] = lambda: full_cast(pool)
    for name, call in casts.items():
        ms = bench_ms(call, device)
        rows.append(
            {
                "section": "full_pool",
                "impl": name,
                "pool_tokens": pool_tokens,
                "bytes": full_bytes,
                "ms": ms,
                "gbps": full_bytes / (ms * 1e-3) / 1e9,
                "of_copy": full_bytes / (ms * 1e-3) / 1e9 / copy_gbps,
            }
        )
    params = {
        "pool_tokens": pool_tokens,
        "sizes": list(sizes),
        "graph_max_n": graph_max_n,
        "graph_sets": graph_sets,
        "batch": batch,
        "seed": seed,
    }
    return _result("gather_cast_bench", device, params, rows)


# ---------------------------------------------------------------------------------------------------------
# The decode step, after
# ---------------------------------------------------------------------------------------------------------


def _unmarked_steps(model: DecodeStepModel, device: torch.device, steps: int) -> tuple[float, float]:
    """Steps with no phase marks: (median host ms to enqueue one, median device ms between marks around it).

    When the host's enqueue time reaches the device time, the step is host-bound: the GPU idles
    between kernels and the phase clocks charge that idle time to whichever phase was waiting."""
    host, dev = [], []
    for _ in range(steps):
        synchronize(device)
        clock = PhaseClock(device)
        clock.mark("step")
        model.step()
        clock.mark("end")
        dev.append(clock.intervals_ms()[0][2])
        host.append(clock.host_intervals_ms()[0][1])
    return statistics.median(host), statistics.median(dev)


def _graph_ms(body: Callable[[], object], device: torch.device) -> tuple[float | None, str | None]:
    """``body`` captured once in a CUDA graph (no warm-up call: the step has run), the median of 5 replays
    (:func:`kvwall.measure.timing.graph_ms`), or why a graph could not hold it."""
    if device.type != "cuda":
        return None, "no CUDA graphs on a CPU"
    try:
        return graph_ms([body], device, warmup=0, replays=5), None
    except Exception as exc:  # noqa: BLE001 - recorded: which strategies a graph can hold is a finding
        torch.cuda.synchronize(device)
        return None, error_text(exc, 200)


class _HostAndDeviceClock(PhaseClock):
    """Chapter 1's phase clock (an event at every phase boundary, the host's clock beside each) that also notes the
    garbage collector's passes, so a phase that measures longer on the device than its kernels can be traced to
    the host: if the GPU ran dry, the device interval follows the host's."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.gc: list[tuple[str, int, float]] = []

    def _gc_callback(self, phase: str, info: dict) -> None:
        self.gc.append((phase, int(info.get("generation", -1)), time.perf_counter()))

    def step(self, model: DecodeStepModel) -> dict:
        gc.callbacks.append(self._gc_callback)
        try:
            for layer in range(model.pool.num_layers):
                model._layer(layer, self)  # pylint: disable=protected-access  # the step's own layer loop
            self.mark("end:end")
        finally:
            gc.callbacks.remove(self._gc_callback)
        phases: dict[str, float] = {p: 0.0 for p in PHASES}
        kv_free_layers = []
        for label, _, ms in self.intervals_ms():
            phase = label.split(":", 1)[1]
            phases[phase] += ms
            if phase == PHASES[3]:
                kv_free_layers.append(ms)
        host_gaps = [ms for _, ms in self.host_intervals_ms()]
        gc_ms, gc_gen2, starts = 0.0, 0, {}
        for phase, gen, t in self.gc:
            if phase == "start":
                starts[gen] = t
            elif gen in starts:
                gc_ms += (t - starts.pop(gen)) * 1e3
                gc_gen2 += gen == 2
        return {
            "step_ms": sum(phases.values()),
            "phases": phases,
            "host_ms": sum(host_gaps),
            "max_host_gap_ms": max(host_gaps),
            "host_gaps_over_1ms": sum(g > 1.0 for g in host_gaps),
            "host_ms_in_gaps_over_1ms": sum((g for g in host_gaps if g > 1.0), 0.0),
            "kv_free_max_us": max(kv_free_layers) * 1e3,
            "kv_free_layers_over_10us": sum(v > 0.010 for v in kv_free_layers),
            "gc_passes": sum(1 for ph, _, _ in self.gc if ph == "stop"),
            "gc_gen2": gc_gen2,
            "gc_ms": gc_ms,
        }


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


def run_gather_cast_profile(
    device: torch.device,
    *,
    pool_tokens: int,
    layers: int,
    tensor_parallel: int,
    context_lens: list[int],
    timed_steps: int,
    strategies: list[str],
    capacity: int,
    capacity_sweep: list[int],
    seed: int = 0,
) -> Result:
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
            ref = mla_decode_reference(
                model.q_nope,
                model.q_pe,
                *split_latent_cache(pool.key_buffer(0), geometry.kv_lora_rank),
                batch.kv_indptr,
                batch.kv_indices,
                geometry.sm_scale,
                compute_dtype=torch.float64,
            )
        rel_err = relative_error(out, ref)
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
                rows.append(
                    {
                        "section": "marked_steps",
                        "strategy": kind,
                        "gc_off": gc_off,
                        "step": i,
                        **{k: v for k, v in m.items() if k != "phases"},
                        "kv_free_ms": m["phases"][PHASES[3]],
                        "kv_strategy_ms": m["phases"][PHASES[1]],
                        "attention_ms": m["phases"][PHASES[2]],
                    }
                )
        host_ms, eager_ms = _unmarked_steps(model, device, timed_steps)
        syncs = count_syncs(model.step, device)
        n_layers = pool.num_layers
        host_prepare = host_us_per_call(
            lambda: strategy.prepare_kv(pool, 0, torch.bfloat16),  # noqa: F821
            device,
            20 if kind == "full_pool_cast" else 100,
        )
        host_attention = host_us_per_call(lambda: attention(model.q_nope, model.q_pe, ckv, kpe), device, 100)  # noqa: F821
        graph_step, graph_error = _graph_ms(model.step, device)
        graph_phases: dict[str, float | None] = {}
        if graph_step is not None:
            slots, new_kv = batch.new_token_slots, model.new_kv
            bodies = {
                PHASES[0]: lambda: [pool.write_new_tokens(layer, slots, new_kv) for layer in range(n_layers)],
                PHASES[1]: lambda: [strategy.prepare_kv(pool, layer, torch.bfloat16) for layer in range(n_layers)],  # noqa: F821
                PHASES[2]: lambda: [attention(model.q_nope, model.q_pe, ckv, kpe) for _ in range(n_layers)],  # noqa: F821
                PHASES[4]: lambda: [standin() for _ in range(n_layers)],
            }
            for phase, body in bodies.items():
                graph_phases[phase], _ = _graph_ms(body, device)
                rows.append(
                    {"section": "graph_breakdown", "strategy": kind, "phase": phase, "ms_per_step": graph_phases[phase]}
                )
        del ckv, kpe
        rows.append(
            {
                "section": "strategies",
                "strategy": kind,
                "name": strategy.name,
                "attention": attention.name,
                "rel_err_vs_float64": rel_err,
                "step_ms": statistics.median(totals),
                "step_ms_min": totals[0],
                "step_ms_max": totals[-1],
                "kv_strategy_ms_per_step": phase_ms["kv_strategy"],
                "layers": layers,
                "capacity": getattr(strategy, "capacity", None),
                "unmarked_step_ms": eager_ms,
                "host_enqueue_ms": host_ms,
                "host_us_per_layer": host_ms / n_layers * 1e3,
                "host_us_prepare_kv": host_prepare,
                "host_us_attention": host_attention,
                "syncs_per_step": syncs,
                "graph_step_ms": graph_step,
                "graph_error": graph_error,
                "graph_kv_ms_per_step": graph_phases.get(PHASES[1]),
                "graph_phase_sum_ms": (
                    sum(graph_phases.values())
                    if graph_phases and all(v is not None for v in graph_phases.values())
                    else None
                ),
            }
        )
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
            events_ms = bench_ms(lambda: strategy.prepare_kv(pool, 0, torch.bfloat16), device)  # noqa: F821
            cap_graph_ms, _ = _graph_ms(
                lambda: [strategy.prepare_kv(pool, layer, torch.bfloat16) for layer in range(cap_layers)],  # noqa: F821
                device,
            )
            host = host_us_per_call(lambda: strategy.prepare_kv(pool, 0, torch.bfloat16), device, 50)  # noqa: F821
            rows.append(
                {
                    "section": "capacity",
                    "strategy": kind,
                    "capacity": cap,
                    "ms_per_layer": cap_graph_ms / cap_layers if cap_graph_ms is not None else events_ms,
                    "ms_per_layer_events": events_ms,
                    "ms_per_layer_graph": cap_graph_ms / cap_layers if cap_graph_ms is not None else None,
                    "host_us_per_call": host,
                    "real_tokens": batch.total_tokens,
                }
            )
            del strategy
    strat_rows = [r for r in rows if r.get("section") == "strategies"]
    before = next((r for r in strat_rows if r["strategy"] == "full_pool_cast"), None)
    if before is not None:
        for r in strat_rows:
            graph = r["graph_step_ms"] is not None and before["graph_step_ms"] is not None
            rows.append(
                {
                    "section": "gain",
                    "strategy": r["strategy"],
                    "step_ms": r["step_ms"],
                    "time_saved": 1 - r["step_ms"] / before["step_ms"],
                    "speedup": before["step_ms"] / r["step_ms"],
                    "graph_step_ms": r["graph_step_ms"],
                    "graph_time_saved": 1 - r["graph_step_ms"] / before["graph_step_ms"] if graph else None,
                    "graph_speedup": before["graph_step_ms"] / r["graph_step_ms"] if graph else None,
                }
            )
    params = dict(
        pool_tokens=pool_tokens,
        layers=layers,
        tensor_parallel=tensor_parallel,
        context_lens=list(context_lens),
        timed_steps=timed_steps,
        strategies=list(strategies),
        capacity=capacity,
        capacity_sweep=list(capacity_sweep),
        seed=seed,
    )
    return _result("gather_cast_profile", device, params, rows)


_POW2_SIZES = [1024 << k for k in range(10)]  # 1K ... 512K

EXPERIMENTS: list[Experiment] = [
    Experiment(
        "gather_cast_validation",
        run_gather_cast_validation,
        full=dict(full_scale_slots=495_001, full_scale_rows=131_072, sanitizer=True, sanitizer_timeout_s=150),
        small=dict(full_scale_slots=0, full_scale_rows=0, sanitizer=False),
        about="gather_cast (Triton, CUDA C++) bit-exact vs reference; CUDA graphs; memcheck",
        requires=("cuda", "nvcc", "compute-sanitizer"),
    ),
    Experiment(
        "gather_cast_bench",
        run_gather_cast_bench,
        full=dict(pool_tokens=495_000, sizes=_POW2_SIZES, graph_max_n=65_536, graph_sets=16, batch=32),
        small=dict(pool_tokens=50_000, sizes=[1024, 4096, 16_384], graph_max_n=0, graph_sets=0, batch=8),
        about="gather-cast GB/s vs n against PyTorch and the copy ceiling; full_cast; launch floor",
        requires=("cuda",),
    ),
    Experiment(
        "gather_cast_profile",
        run_gather_cast_profile,
        full=dict(
            pool_tokens=495_000,
            layers=78,
            tensor_parallel=4,
            context_lens=[8192],
            timed_steps=5,
            strategies=[
                "full_pool_cast",
                "index_then_cast",
                "index_then_cast_capacity",
                "gather_cast",
                "gather_cast_capacity",
                "gather_cast_cuda",
                "gather_cast_cuda_capacity",
            ],
            capacity=131_072,
            capacity_sweep=[8192, 32_768, 131_072, 262_144, 495_000],
        ),
        small=dict(
            pool_tokens=50_000,
            layers=4,
            tensor_parallel=4,
            context_lens=[2048],
            timed_steps=3,
            strategies=["full_pool_cast", "index_then_cast", "index_then_cast_capacity"],
            capacity=16_384,
            capacity_sweep=[2048, 8192, 16_384, 50_000],
        ),
        about="chapter 1's decode step after: gather-then-cast strategies beside the whole-pool cast",
        requires=("cuda", "flashinfer"),
    ),
]
