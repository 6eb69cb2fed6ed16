"""``fused_decode_bench`` (GPU): heads x context x batch, every strategy of the peer table
(:data:`~kvwall.experiments.fused_decode.strategies.STRATEGIES`) timed in CUDA graphs with L2 flushed
(:func:`kvwall.measure.timing.graph_ms`), host µs per call beside it, against the roofline of the same run
(:func:`kvwall.model.roofline.roofline_us`; copy bandwidth and BF16 matmul rate measured first), every output
checked against float64 first. Batch 1 is one request of ``context`` tokens; larger batches are mixed lengths
summing to ``context * batch / 4`` tokens (capped at ``max_total_tokens``, 2M): a quarter of ``batch`` full-length
requests' worth of KV. All requests read random slots (with repeats) of one 495,000-slot FP8 pool; the paged
strategies (FlashMLA, ``ours_page64``) read the same number of tokens per request on random pages of 64 of it.

The full grid leaves out the entries that force one path (``triton``, ``wgmma``, ``wgmma_tokens``):
``fused_decode_paths`` times them on the same grid, page 1 and 64, right before this run (``strategies=`` takes any
entry of the table).

Device time at full scale: **188 s** measured on the H200 for the 48 grid points (2026-12-01, a trial run of this
code, not recorded) without SGLang installed (its 48 rows were import errors): the ceilings and FlashInfer's JIT
prebuild 27 s, the first point 73 s (every kernel's first build), then ~1.5-3.5 s a point (11 rows). With SGLang
(~+30 s) and the 4 fixed-cost points (64 tokens, batch 1: ~+8 s), **about 225 s**. Cut against the recording of
2026-11-30 (198 s for 3 head counts): SGLang's fixed-split sweep (``sglang_split_sweep=[]``, ~60 s at this grid; no
report reads it) and the forced paths (timed by ``fused_decode_paths`` on the same grid).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch

from kvwall.measure.accuracy import finite_or_none, relative_error
from kvwall.measure.failures import error_text, traceback_tail
from kvwall.measure.timing import (
    bench_ms,
    copy_bandwidth_gbps,
    graph_ms,
    host_us_per_call,
    matmul_tflops,
    release_memory,
    synchronize,
)
from kvwall.model.attention import flashinfer_version, prebuild_flashinfer_mla
from kvwall.model.geometry import GLM5
from kvwall.model.roofline import decode_flops, kv_read_bytes, qo_bytes, roofline_us
from kvwall.peers.flashmla import load_flash_mla
from kvwall.peers.sglang import load_sglang
from kvwall.results import Result, collect_provenance
from kvwall.experiments.fused_decode.strategies import (
    FORCED_PATHS,
    OURS,
    STRATEGIES,
    BenchPoint,
    BuildContext,
    build_strategy,
    make_point,
    reference_f64,
)
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "BENCH_STRATEGIES", "run_fused_decode_bench", "bench_point_rows", "time_call"]

#: What the full grid times: every entry of the peer table but the forced paths (``fused_decode_paths`` has them).
BENCH_STRATEGIES: list[str] = [name for name in STRATEGIES if name not in FORCED_PATHS]

D = GLM5.kv_dim
FP8 = torch.float8_e4m3fn

HOST_US_MEANS = (
    "host µs per call: wall-clock time of N back-to-back calls from Python (no CUDA graph, no "
    "synchronization between them) divided by N, after a warm-up call and a sync; it includes the "
    "Python wrappers, argument checks, allocations, and every kernel launch of the call (for "
    "full_cast_bf16 the cast too, for gather_cast_bf16 the gather-cast's plan and launch); FlashInfer's "
    "plan() is not included (done once per point, reported as plan_ms). When it exceeds `us`, an eager "
    "(uncaptured) call is host-bound."
)
ACTIVE_BYTES_MEANS = (
    "tokens x (576 + 4): each token's FP8 latent (512 ckv + 64 kpe bytes) and its int32 page-table "
    "index, read once (kvwall.model.roofline.kv_read_bytes, page size 1); BF16 queries and outputs "
    "left out (qo_bytes: batch x heads x (576 + 512) x 2, in each row)"
)
ROOFLINE_MEANS = (
    "max(active_bytes / copy GB/s, 2 x heads x tokens x (576 + 512) FLOPs / BF16 matmul TFLOP/s), both "
    "ceilings measured at the start of this run (copy counts read + write bytes)"
)
US_MEANS = (
    "device µs per call: CUDA graphs of reps x [flush 256 MB, call] minus reps x [flush], best of rounds "
    "replays (kvwall.measure.timing.graph_ms); FlashInfer plan(), SGLang's split choice and FlashMLA's "
    "scheduler metadata outside the graph"
)


def time_call(
    fn: Callable[[], object], flush: Callable[[], object], device: torch.device, reps: int, rounds: int
) -> tuple[float, str, str | None]:
    """(µs, how it was timed, why not in a graph): CUDA graphs when the call can be captured, else CUDA events
    (``do_bench`` of [flush, call] minus ``do_bench`` of [flush])."""
    try:
        us = graph_ms([fn], device, repeat=reps, flush=flush, replays=rounds, reduce="min", warmup=2) * 1e3
        return us, "cuda_graph", None
    except Exception as exc:  # noqa: BLE001 - a call a graph cannot hold is still timed, and labelled
        why = error_text(exc, 300)
        synchronize(device)
    ms = bench_ms(lambda: (flush(), fn()), device)
    flush_ms = bench_ms(flush, device)
    return max(ms - flush_ms, 0.0) * 1e3, "cuda_events", why


def _sglang_sweep(
    fixed_splits: Callable[[int], Callable[[], object]],
    device: torch.device,
    splits: list[int],
    flush: Callable[[], object],
    reps: int,
    rounds: int,
) -> dict[str, Any]:
    """SGLang's kernel with every request on ``S`` splits (``max_kv_splits = S``), for each S: µs, and the best."""
    sweep: dict[str, float | str] = {}
    for s in splits:
        try:
            sweep[str(s)] = time_call(fixed_splits(s), flush, device, reps, rounds)[0]
        except Exception as exc:  # noqa: BLE001
            sweep[str(s)] = error_text(exc, 200)
        release_memory(device)
    good = {k: v for k, v in sweep.items() if isinstance(v, float)}
    best = min(good, key=good.get) if good else None
    return {
        "sweep_us": sweep,
        "best_fixed_splits": int(best) if best else None,
        "best_fixed_us": good[best] if best else None,
    }


def bench_point_rows(
    pt: BenchPoint,
    pool: torch.Tensor,
    device: torch.device,
    strategies,
    flush,
    *,
    copy_gbps: float,
    bf16_tflops: float,
    reps: int,
    rounds: int,
    host_calls: int,
    ctx: BuildContext,
    sglang_split_sweep: list[int],
    timer: Callable[..., tuple[float, str, str | None]] = time_call,
) -> list[dict]:
    """One ``bench`` row per strategy at one point. Each strategy is built (outside the timing), run once (its output
    compared with float64 attention on the same tokens, ``rel_err_f64``, and with ours on the same layout,
    ``rel_diff_vs_ours``), timed by ``timer``, its host µs measured (none with ``host_calls`` 0), and freed; any
    exception on the way becomes the row's ``error`` (with the traceback's tail), never a crash. ``strategies``: names
    of :data:`~kvwall.experiments.fused_decode.strategies.STRATEGIES`, or ``(name, page_size)`` pairs."""
    h, n = pt.heads, pt.tokens
    roof = roofline_us(h, n, copy_gbps, bf16_tflops)
    ours_out: dict[int, torch.Tensor] = {}
    refs: dict[bool, torch.Tensor] = {}
    rows = []
    for entry in strategies:
        name, page = (entry, None) if isinstance(entry, str) else entry
        row: dict[str, Any] = {
            "section": "bench",
            "strategy": name,
            "heads": h,
            "context": pt.context,
            "batch": pt.batch,
            "tokens": n,
            "len_min": min(pt.lens),
            "len_max": max(pt.lens),
            "active_bytes": kv_read_bytes(n),
            "qo_bytes": qo_bytes(pt.batch, h),
            "flops": decode_flops(h, n),
            "roofline_us": roof,
            "timing": "not timed",
            "us": None,
            "host_us": None,
            "gbps": None,
            "tflops": None,
            "pct_roofline": None,
        }
        if name in STRATEGIES:
            row["page_size"] = page or STRATEGIES[name].page_size
        fn = fixed_splits = None
        try:
            fn, info = build_strategy(name, pt, pool, dataclasses.replace(ctx, page_size=page))
            fixed_splits = info.pop("_fixed_splits", None)
            row.update(info)
            got = fn()
            synchronize(device)
            paged = info["page_size"] != 1  # FlashMLA's layout: other (paged) slots, the same for every paged row
            if paged not in refs:
                refs[paged] = reference_f64(pt, pool, paged)
            row["rel_err_f64"] = finite_or_none(relative_error(got, refs[paged]))
            if name == OURS.get(info["page_size"]):
                ours_out[info["page_size"]] = got.clone()
            elif info["page_size"] in ours_out:
                row["rel_diff_vs_ours"] = finite_or_none(relative_error(got, ours_out[info["page_size"]]))
            us, how, why = timer(fn, flush, device, reps, rounds)
            row.update(us=us, timing=how, **({"graph_error": why} if why else {}))
            row["host_us"] = host_us_per_call(fn, device, host_calls) if host_calls else None
            if us > 0:
                row.update(
                    gbps=kv_read_bytes(n) / us / 1e3, tflops=decode_flops(h, n) / us / 1e6, pct_roofline=roof / us * 100
                )
            if fixed_splits is not None and sglang_split_sweep:
                row.update(_sglang_sweep(fixed_splits, device, list(sglang_split_sweep), flush, reps, rounds))
        except Exception as exc:  # noqa: BLE001 - one failing strategy is a row with an error
            row.update(error=error_text(exc, 600), traceback_tail=traceback_tail())
        finally:
            fn = fixed_splits = None
            release_memory(device)
        rows.append(row)
    return rows


def _peers_header(strategies) -> dict[str, Any]:
    sg = load_sglang() if any("sglang" in STRATEGIES[s].needs for s in strategies) else {}
    fm = load_flash_mla() if any("flash_mla" in STRATEGIES[s].needs for s in strategies) else {}
    return {
        "sglang": {k: v for k, v in sg.items() if isinstance(v, (str, int, float))},
        "flash_mla": {k: v for k, v in fm.items() if isinstance(v, (str, int, float, bool))},
    }


def run_fused_decode_bench(
    device: torch.device,
    *,
    heads: list[int],
    contexts: list[int],
    batches: list[int],
    pool_slots: int = 495_000,
    max_total_tokens: int = 2_000_000,
    strategies: tuple[str, ...] | list[str] = tuple(BENCH_STRATEGIES),
    reps: int = 10,
    rounds: int = 3,
    host_calls: int = 20,
    flush_mb: int = 256,
    cast_backend: str = "fa3",
    sglang_max_context: int = 131_072,
    sglang_split_sweep: tuple[int, ...] | list[int] = (),
    floor_contexts: tuple[int, ...] | list[int] = (),
    seed: int = 0,
) -> Result:
    """See the module docstring. ``floor_contexts``: batch-1 points beside the grid, every head count and strategy,
    whose time is each kernel's fixed cost (a request of 64 tokens is one tile). Rows: one ``ceilings`` header (copy
    GB/s, BF16 TFLOP/s, GPU, how ``us`` and ``host_us`` are measured, what was JIT-built, where SGLang and FlashMLA came
    from), then ``bench`` rows, one per (heads, context, batch, strategy)."""
    if device.type != "cuda":
        raise RuntimeError(
            "fused_decode_bench times CUDA kernels in CUDA graphs: it needs an NVIDIA GPU. On a CPU, "
            "the chapter shows the recorded run (and fused_decode_validation runs live)."
        )
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        raise ValueError(f"unknown strategies {sorted(unknown)}; known: {list(STRATEGIES)}.")
    t_start = time.perf_counter()
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    copy_bytes = 1 << 30
    copy_ms, copy_gbps = copy_bandwidth_gbps(device, copy_bytes)
    tflops = matmul_tflops(device)
    uses_flashinfer = any("flashinfer" in STRATEGIES[s].needs for s in strategies)
    rows: list[dict] = [
        {
            "section": "ceilings",
            "gpu": torch.cuda.get_device_name(device),
            "sms": sm_count,
            "copy_gbps": copy_gbps,
            "copy_ms": copy_ms,
            "copy_bytes": copy_bytes,
            "bf16_tflops": tflops,
            "flashinfer": flashinfer_version(),
            "flashinfer_prebuild": prebuild_flashinfer_mla(device) if uses_flashinfer else {},
            **_peers_header(strategies),
            "us_means": US_MEANS,
            "host_us_means": HOST_US_MEANS,
            "active_bytes_means": ACTIVE_BYTES_MEANS,
            "roofline_means": ROOFLINE_MEANS,
            "seconds_to_here": round(time.perf_counter() - t_start, 1),
        }
    ]
    ctx = BuildContext(cast_backend=cast_backend, sglang_max_context=sglang_max_context, sm_count=sm_count)
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = (torch.randn(pool_slots, 1, D, generator=gen, device=device) * 0.7).to(FP8)
    scratch = torch.empty(flush_mb << 20, dtype=torch.uint8, device=device)
    points = [(h, c, 1) for h in heads for c in floor_contexts if c not in contexts]
    points += [(h, c, b) for h in heads for c in contexts for b in batches]
    for h, context, batch in points:
        pt = make_point(
            h, context, batch, pool_slots=pool_slots, max_total=max_total_tokens, gen=gen, seed=seed, device=device
        )
        rows += bench_point_rows(
            pt,
            pool,
            device,
            strategies,
            scratch.zero_,
            copy_gbps=copy_gbps,
            bf16_tflops=tflops,
            reps=reps,
            rounds=rounds,
            host_calls=host_calls,
            ctx=ctx,
            sglang_split_sweep=list(sglang_split_sweep),
        )
        del pt
        release_memory(device)
    rows[0]["seconds_total"] = round(time.perf_counter() - t_start, 1)
    params = dict(
        heads=list(heads),
        contexts=list(contexts),
        batches=list(batches),
        pool_slots=pool_slots,
        max_total_tokens=max_total_tokens,
        strategies=list(strategies),
        reps=reps,
        rounds=rounds,
        host_calls=host_calls,
        flush_mb=flush_mb,
        cast_backend=cast_backend,
        sglang_max_context=sglang_max_context,
        sglang_split_sweep=list(sglang_split_sweep),
        floor_contexts=list(floor_contexts),
        seed=seed,
    )
    return Result("fused_decode_bench", params, rows, collect_provenance(device, __name__))


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "fused_decode_bench",
        run_fused_decode_bench,
        full=dict(
            heads=[16, 64, 128],
            contexts=[4096, 32_768, 131_072],
            batches=[1, 8, 32, 64],
            pool_slots=495_000,
            max_total_tokens=2_000_000,
            strategies=list(BENCH_STRATEGIES),
            reps=10,
            rounds=3,
            host_calls=20,
            flush_mb=256,
            cast_backend="fa3",
            sglang_max_context=131_072,
            sglang_split_sweep=[],
            floor_contexts=[64],
            seed=0,
        ),
        small=dict(
            heads=[16, 64],
            contexts=[4096],
            batches=[1, 8],
            pool_slots=50_000,
            max_total_tokens=2_000_000,
            strategies=list(BENCH_STRATEGIES),
            reps=3,
            rounds=2,
            host_calls=5,
            flush_mb=256,
            cast_backend="fa3",
            sglang_max_context=131_072,
            sglang_split_sweep=[16],
            floor_contexts=[64],
            seed=0,
        ),
        about="ours vs the peer table (full cast, index/gather cast, FlashInfer FP8/BF16, SGLang Triton, "
        "FlashMLA dense BF16/FP8): µs vs roofline, every output against float64",
        requires=("cuda", "flashinfer"),
    ),
]
