"""``path_sweep`` (GPU): one layer's KV path + attention per call, timed in CUDA graphs with L2 flushed (chapter 5's
timer, :func:`kvwall.experiments.fused_decode.bench.time_call`), along four axes: context (batch 1, 16 heads), pool
size (the whole-pool cast only: nothing else reads the pool's size), batch (mixed lengths), heads per GPU. Every path
is an entry of chapter 5's peer table (:data:`~kvwall.experiments.fused_decode.strategies.STRATEGIES`) built with a
FlashInfer backend (:data:`SWEEP_PATHS`): chapter 6's paths, FlashInfer fa2 twins of the BF16 paths (what SM120
would run: fa3 is SM90-only) and FlashMLA dense BF16 / FP8 (page 64). ``ours`` runs the path the dispatcher picks
at each point (each row says which, ``kernel_path``, and why, ``path_why``); ``triton`` times the Triton path alone,
the one the dispatcher runs on a GPU without a measured table, so the cost model can carry it to GPUs we did not
measure. These rows are what the cost model (:mod:`kvwall.model.cost`) is fitted on and validated against.

Device time at full scale: **124 s** measured on the H200 (2026-12-01, a trial run of this code, not recorded; 139 s
on 2026-11-30 with the same 12 paths and points).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from kvwall.measure.failures import error_text
from kvwall.measure.timing import copy_bandwidth_gbps, matmul_tflops, release_memory, synchronize
from kvwall.model.attention import flashinfer_version, prebuild_flashinfer_mla
from kvwall.model.geometry import GLM5
from kvwall.peers.flashmla import load_flash_mla
from kvwall.results import Result, collect_provenance
from kvwall.experiments.fused_decode.bench import time_call
from kvwall.experiments.fused_decode.strategies import STRATEGIES, BenchPoint, BuildContext, build_strategy, make_point
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "SWEEP_PATHS", "POOL_BOUND", "run_path_sweep", "sweep_points", "build_sweep_path"]

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
D, DC = GLM5.kv_dim, GLM5.kv_lora_rank

#: Sweep path (the cost model's name, :data:`kvwall.model.cost.PATHS`) -> (its entry of the peer table, the
#: FlashInfer backend of its BF16 attention; "-": none).
SWEEP_PATHS: dict[str, tuple[str, str]] = {
    "full_pool_cast": ("full_cast_bf16", "fa3"),
    "full_pool_cast_fa2": ("full_cast_bf16", "fa2"),
    "index_then_cast": ("index_then_cast", "fa3"),
    "gather_cast": ("gather_cast_bf16", "fa3"),
    "gather_cast_fa2": ("gather_cast_bf16", "fa2"),
    "ours": ("ours", "-"),
    "triton": ("triton", "-"),
    "flashinfer_fp8": ("flashinfer_fp8_fa3", "fa3"),
    "bf16_cache": ("flashinfer_bf16_precast", "fa3"),
    "bf16_cache_fa2": ("flashinfer_bf16_precast", "fa2"),
    "flashmla_bf16": ("flashmla_dense_bf16", "-"),
    "flashmla_fp8": ("flashmla_dense_fp8", "-"),
}
assert {s for s, _ in SWEEP_PATHS.values()} <= set(STRATEGIES), "every sweep path is an entry of the peer table"
#: The only paths whose time depends on the pool's size (they read all of it).
POOL_BOUND = ("full_pool_cast", "full_pool_cast_fa2")


def build_sweep_path(
    path: str, pt: BenchPoint, pool: torch.Tensor, sm_count: int
) -> tuple[Callable[[], Any], dict[str, Any]]:
    """(the call, the row's fields) of sweep path ``path`` at ``pt``: its peer-table entry, built with its backend."""
    strategy, backend = SWEEP_PATHS[path]
    ctx = BuildContext(cast_backend=backend if backend != "-" else "fa3", sglang_max_context=0, sm_count=sm_count)
    fn, info = build_strategy(strategy, pt, pool, ctx)
    return fn, {"strategy": strategy, **info}


def sweep_points(
    contexts: list[int],
    pools: list[int],
    batches: list[int],
    heads: list[int],
    *,
    pool_tokens: int,
    batch_context: int,
    head_points: list[list[int]],
) -> list[dict[str, Any]]:
    """The sweep's points, each ``{axis, heads, context, batch, pool_tokens}``: contexts at batch 1 / 16 heads;
    pool sizes at batch 1 / 16 heads / 8K tokens; batches of mixed lengths (``batch_context`` tokens a request on
    average x 1/4, as chapter 5's bench) at 16 heads; heads at each ``[batch, context]`` of ``head_points``."""
    pts = [dict(axis="context", heads=16, context=c, batch=1, pool_tokens=pool_tokens) for c in contexts]
    pts += [dict(axis="pool", heads=16, context=8192, batch=1, pool_tokens=p) for p in pools]
    pts += [dict(axis="batch", heads=16, context=batch_context, batch=b, pool_tokens=pool_tokens) for b in batches]
    pts += [
        dict(axis="heads", heads=h, context=c, batch=b, pool_tokens=pool_tokens) for b, c in head_points for h in heads
    ]
    return pts


def run_path_sweep(
    device: torch.device,
    *,
    contexts: list[int],
    pools: list[int],
    batches: list[int],
    heads: list[int],
    head_points: list[list[int]],
    pool_tokens: int = 495_000,
    batch_context: int = 16_384,
    paths: list[str] | None = None,
    reps: int = 10,
    rounds: int = 3,
    flush_mb: int = 256,
    seed: int = 0,
) -> Result:
    """Rows: one ``ceilings`` header (copy GB/s, BF16 TFLOP/s, versions), then one ``point`` row per (point, path):
    µs per layer, or the ``error`` that stopped it. On the ``pool`` axis only :data:`POOL_BOUND` paths run."""
    if device.type != "cuda":
        raise RuntimeError(
            "path_sweep times CUDA kernels in CUDA graphs: it needs an NVIDIA GPU. On a CPU, chapter 6 "
            "shows the recorded sweep and fits the cost model on it."
        )
    paths = list(SWEEP_PATHS) if paths is None else list(paths)
    unknown = set(paths) - set(SWEEP_PATHS)
    if unknown:
        raise ValueError(f"unknown paths {sorted(unknown)}; known: {sorted(SWEEP_PATHS)}.")
    t0 = time.perf_counter()
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    copy_ms, copy_gbps = copy_bandwidth_gbps(device, 1 << 30)
    fm = load_flash_mla()
    rows: list[dict] = [
        {
            "section": "ceilings",
            "gpu": torch.cuda.get_device_name(device),
            "sms": sm_count,
            "copy_gbps": copy_gbps,
            "copy_ms": copy_ms,
            "bf16_tflops": matmul_tflops(device),
            "flashinfer": flashinfer_version(),
            "flash_mla": str(fm.get("version", fm.get("error"))),
            "flashinfer_prebuild": prebuild_flashinfer_mla(device),
        }
    ]
    gen = torch.Generator(device=device).manual_seed(seed)
    scratch = torch.empty(flush_mb << 20, dtype=torch.uint8, device=device)
    pools_by_size: dict[int, torch.Tensor] = {}
    points = sweep_points(
        contexts, pools, batches, heads, pool_tokens=pool_tokens, batch_context=batch_context, head_points=head_points
    )
    for p in points:
        size = p["pool_tokens"]
        if size not in pools_by_size:
            pools_by_size.clear()
            release_memory(device)
            pools_by_size[size] = (torch.randn(size, 1, D, generator=gen, device=device) * 0.7).to(FP8)
        pool = pools_by_size[size]
        pt = make_point(
            p["heads"], p["context"], p["batch"], pool_slots=size, max_total=size - 1, gen=gen, seed=seed, device=device
        )
        for path in POOL_BOUND if p["axis"] == "pool" else paths:
            if path not in paths:
                continue
            row: dict[str, Any] = {
                "section": "point",
                **p,
                "path": path,
                "tokens": pt.tokens,
                "len_max": max(pt.lens),
                "us": None,
            }
            try:
                fn, info = build_sweep_path(path, pt, pool, sm_count)
                row.update({k: v for k, v in info.items() if isinstance(v, (str, int, float, bool)) or v is None})
                fn()
                synchronize(device)
                us, how, why = time_call(fn, scratch.zero_, device, reps, rounds)
                row.update(us=us, timing=how, **({"graph_error": why} if why else {}))
            except Exception as exc:  # noqa: BLE001 - a path that cannot run a point is a row with its error
                row["error"] = error_text(exc, 400)
            finally:
                fn = None  # drop the call's buffers before the next path
                release_memory(device)
            rows.append(row)
    rows[0]["seconds_total"] = round(time.perf_counter() - t0, 1)
    params = dict(
        contexts=list(contexts),
        pools=list(pools),
        batches=list(batches),
        heads=list(heads),
        head_points=[list(x) for x in head_points],
        pool_tokens=pool_tokens,
        batch_context=batch_context,
        paths=paths,
        reps=reps,
        rounds=rounds,
        flush_mb=flush_mb,
        seed=seed,
    )
    return Result("path_sweep", params, rows, collect_provenance(device, __name__))


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "path_sweep",
        run_path_sweep,
        full=dict(
            contexts=[1024, 2048, 4096, 8192, 16_384, 32_768, 65_536, 131_072, 262_144],
            pools=[65_536, 131_072, 262_144, 495_000, 1_048_576],
            batches=[1, 4, 16, 32, 64],
            heads=[8, 16, 32, 64, 128],
            head_points=[[1, 32_768], [16, 16_384]],
            pool_tokens=495_000,
            batch_context=16_384,
            paths=list(SWEEP_PATHS),
            reps=10,
            rounds=3,
            flush_mb=256,
            seed=0,
        ),
        small=dict(
            contexts=[1024, 4096],
            pools=[16_384, 65_536],
            batches=[1, 4],
            heads=[16, 64],
            head_points=[[1, 4096]],
            pool_tokens=65_536,
            batch_context=4096,
            paths=list(SWEEP_PATHS),
            reps=3,
            rounds=2,
            flush_mb=64,
            seed=0,
        ),
        about="one layer of each path (and FlashMLA) along context, pool, batch and heads; CUDA graphs",
        requires=("cuda", "flashinfer"),
    ),
]
