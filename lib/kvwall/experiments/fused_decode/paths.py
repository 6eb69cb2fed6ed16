"""``fused_decode_paths`` (GPU): each of ours' paths forced -- the Triton path (``triton``), the wgmma path
(``wgmma``, Hopper only) and the tokens-on-M wgmma path (``wgmma_tokens``, Hopper only) -- on page-size-1 slots and
on pages of 64, at every point of heads {16, 32, 64, 128} x context {4K, 32K, 128K} x batch {1, 8, 32, 64} plus a
64-token context at batch 1 (each path's fixed cost), timed as ``fused_decode_bench`` times (CUDA graphs, L2
flushed, :func:`.bench.time_call`), each output checked against float64 first. Its ``build`` row has the GPU, nvcc,
each wgmma kernel's build and ptxas resources and the ceilings of the run.

From it, :func:`path_table` derives the dispatcher's measured table, ``kernels/mla_decode/paths.json``
(``{gpu: {"by", "recorded", "capability", "page_size", "points": [[heads, context, batch, path, triton_us,
wgmma_us, wgmma_tokens_us], ...]}}``, the fastest path at each point, page size 1: the layout ours runs in chapters 5
and 6), which
:func:`kvwall.kernels.mla_decode.dispatch.choose_path` reads. ``python -m kvwall record`` writes it right after
recording this experiment (:attr:`Experiment.after_record`, :func:`write_path_table`), before the experiments that
run ours.

Device time at full scale: **80 s** measured on the H200 for two paths (2026-12-01, a trial run of the code before
the tokens-on-M path, not recorded): 52 points x 2 paths x 2 page sizes = 208 rows (about 0.3 s a row, no host
timing), the wgmma build and ptxas check and the ceilings ~13 s. With the third path (312 rows, its build and ptxas
check): **about 105 s** estimated, not yet measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from kvwall.kernels.mla_decode import dispatch
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode import wgmma_tokens as tokens_path
from kvwall.measure.timing import copy_bandwidth_gbps, matmul_tflops, release_memory
from kvwall.model.geometry import GLM5
from kvwall.peers.flashmla import PAGE_SIZE
from kvwall.results import PROJECT_ROOT, Result, collect_provenance, load_result
from kvwall.experiments.fused_decode.bench import bench_point_rows
from kvwall.experiments.fused_decode.strategies import FORCED_PATHS, BuildContext, make_point
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "PATHS_FILE", "run_fused_decode_paths", "path_points", "path_table", "write_path_table",
           "points_of"]

D = GLM5.kv_dim
FP8 = torch.float8_e4m3fn
#: The dispatcher's measured table (read by :func:`kvwall.kernels.mla_decode.dispatch.choose_path`).
PATHS_FILE = Path(dispatch.__file__).with_name("paths.json")
#: What ``paths.json`` entries say made them.
WRITTEN_BY = "fused_decode_paths (python -m kvwall record fused_decode_paths)"


def points_of(heads: list[int], contexts: list[int], batches: list[int],
              floor_contexts: list[int]) -> list[tuple[int, int, int]]:
    """The grid: ``floor_contexts`` at batch 1 (fixed cost), then heads x contexts x batches."""
    points = [(h, c, 1) for h in heads for c in floor_contexts]
    return points + [(h, c, b) for h in heads for c in contexts for b in batches]


def _tokens_build(why: str | None) -> dict[str, Any]:
    """The tokens-on-M wgmma kernel's build (seconds) and, per instantiation (heads per CTA), its shape and ptxas
    resources; or why it does not run here (the wgmma path's refusal: the same checks)."""
    built: dict[str, Any] = {"runs": why is None, "why": why}
    if why is None:
        t0 = time.perf_counter()
        lib = tokens_path.load_mla_decode_wgmma_tokens()
        build_s = time.perf_counter() - t0
        reports = tokens_path.nvcc_compile_check_wgmma_tokens()
        per_cta = {}
        for hn, report in reports.items():
            smem, block_n, threads = tokens_path.kernel_shape(lib, hn)
            per_cta[str(hn)] = dict(smem=smem, block_n=block_n, threads=threads, ptxas_ok=report.ok,
                                    registers=report.registers, stack_bytes=report.stack_bytes,
                                    spill_bytes=report.spill_bytes)
        built.update(arch=wgmma_path.ARCH, build_s=round(build_s, 2), heads_per_cta=list(tokens_path.HEADS_PER_CTA),
                     per_cta=per_cta)
    return built


def _build_row(device: torch.device, copy_ms: float, copy_gbps: float, tflops: float) -> dict[str, Any]:
    """The GPU, each wgmma kernel's build (seconds, ptxas resources) or why it does not run here, the ceilings."""
    why = wgmma_path.wgmma_refusal(device)
    wgmma: dict[str, Any] = {"runs": why is None, "why": why}
    nvcc = None
    if why is None:
        t0 = time.perf_counter()
        wgmma_path.load_mla_decode_wgmma()
        build_s = time.perf_counter() - t0
        report = wgmma_path.nvcc_compile_check_wgmma()
        nvcc = report.nvcc
        wgmma.update(arch=wgmma_path.ARCH, build_s=round(build_s, 2), smem=wgmma_path.SMEM_BYTES,
                     heads_per_cta=wgmma_path.HEADS_PER_CTA, block_n=wgmma_path.BLOCK_N, threads=wgmma_path.THREADS,
                     ptxas_ok=getattr(report, "ok", None), registers=report.registers,
                     stack_bytes=report.stack_bytes, spill_bytes=report.spill_bytes)
    return {"section": "build", "gpu": torch.cuda.get_device_name(device),
            "capability": list(torch.cuda.get_device_capability(device)),
            "sms": torch.cuda.get_device_properties(device).multi_processor_count, "nvcc": nvcc,
            "copy_gbps": copy_gbps, "copy_ms": copy_ms, "bf16_tflops": tflops, "wgmma": wgmma,
            "wgmma_tokens": _tokens_build(why), "seconds_total": None}


def run_fused_decode_paths(device: torch.device, *, heads: list[int], contexts: list[int], batches: list[int],
                           floor_contexts: list[int], page_sizes: list[int], pool_slots: int = 495_000,
                           max_total_tokens: int = 2_000_000, reps: int = 10, rounds: int = 3, flush_mb: int = 256,
                           seed: int = 0) -> Result:
    """See the module docstring. Rows: one ``build``, then ``bench`` rows, one per (point, path, page size), in
    ``fused_decode_bench``'s row format (``strategy`` one of :data:`.strategies.FORCED_PATHS`, ``page_size``)."""
    if device.type != "cuda":
        raise RuntimeError("fused_decode_paths times ours' paths on a GPU (CUDA graphs): it needs an NVIDIA GPU. "
                           "On a CPU the chapter shows the recorded run; the dispatcher reads the paths.json written "
                           "from it.")
    t_start = time.perf_counter()
    copy_ms, copy_gbps = copy_bandwidth_gbps(device, 1 << 30)
    tflops = matmul_tflops(device)
    build = _build_row(device, copy_ms, copy_gbps, tflops)
    rows: list[dict[str, Any]] = [build]
    paths = [p for p in FORCED_PATHS if p not in build or build[p]["runs"]]  # a wgmma path that cannot run: no rows
    timed = [(p, page) for page in page_sizes for p in paths]
    ctx = BuildContext(sm_count=build["sms"])
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = (torch.randn(pool_slots, 1, D, generator=gen, device=device) * 0.7).to(FP8)
    scratch = torch.empty(flush_mb << 20, dtype=torch.uint8, device=device)
    for h, c, b in points_of(heads, contexts, batches, floor_contexts):
        pt = make_point(h, c, b, pool_slots=pool_slots, max_total=max_total_tokens, gen=gen, seed=seed, device=device)
        rows += bench_point_rows(pt, pool, device, timed, scratch.zero_, copy_gbps=copy_gbps, bf16_tflops=tflops,
                                 reps=reps, rounds=rounds, host_calls=0, ctx=ctx, sglang_split_sweep=[])
        del pt
        release_memory(device)
    build["seconds_total"] = round(time.perf_counter() - t_start, 1)
    params = dict(heads=list(heads), contexts=list(contexts), batches=list(batches),
                  floor_contexts=list(floor_contexts), page_sizes=list(page_sizes), pool_slots=pool_slots,
                  max_total_tokens=max_total_tokens, reps=reps, rounds=rounds, flush_mb=flush_mb, seed=seed)
    # paths.json is this run's output (after_record), not its input: every path is timed forced.
    derived = PATHS_FILE.relative_to(PROJECT_ROOT).as_posix()
    return Result("fused_decode_paths", params, rows, collect_provenance(device, __name__, derives=[derived]))


# ---------------------------------------------------------------------------------------------------------
# The dispatcher's table
# ---------------------------------------------------------------------------------------------------------

def path_points(result: Result, page_size: int = 1) -> list[list[Any]]:
    """``[heads, context, batch, path, triton_us, wgmma_us, wgmma_tokens_us]`` per point where the Triton path was
    timed on ``page_size`` (a wgmma path's time None where it was not: a recording made before the tokens-on-M path
    has none of its times); ``path`` is the fastest (:func:`kvwall.kernels.mla_decode.dispatch.path_point`)."""
    by_point: dict[tuple[int, int, int], dict[str, float]] = {}
    for row in result.rows:
        if (row.get("section") == "bench" and row.get("us") and row.get("page_size") == page_size
                and row.get("strategy") in FORCED_PATHS):
            by_point.setdefault((row["heads"], row["context"], row["batch"]), {})[row["strategy"]] = row["us"]
    return [dispatch.path_point(h, ctx, b, us["triton"], us.get("wgmma"), us.get("wgmma_tokens"))
            for (h, ctx, b), us in sorted(by_point.items()) if "triton" in us]


def path_table(result: Result, page_size: int = 1) -> dict[str, Any]:
    """One GPU's entry of ``paths.json`` from a ``fused_decode_paths`` result: ``{gpu: {"by", "recorded",
    "capability", "page_size", "points"}}`` (points of :func:`path_points`, page size 1 by default: ours' layout in
    chapters 5 and 6; the page-64 rows pick the same path at every point of the 2026-11-30 recording but one)."""
    build = next(r for r in result.rows if r.get("section") == "build")
    return {build["gpu"]: {"by": WRITTEN_BY, "recorded": result.caption(), "capability": list(build["capability"]),
                           "page_size": page_size, "points": path_points(result, page_size)}}


def write_path_table(result: Result, path: Path = PATHS_FILE) -> list[Path]:
    """Merge ``result``'s entry into ``path`` (other GPUs' entries stay); returns ``[path]`` (what
    :attr:`Experiment.after_record` returns: the files it wrote). The dispatcher's cached read of the table is
    dropped, so the experiments ``record`` runs after this one in the same process choose by the new table."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table.update(path_table(result))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    tmp.replace(path)
    dispatch.reload_table()
    return [path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvwall.experiments.fused_decode.paths",
                                     description="the dispatcher's table from the recorded fused_decode_paths")
    parser.add_argument("--write", action="store_true", help=f"write {PATHS_FILE.name} from the recorded result")
    args = parser.parse_args(argv)
    result = load_result("fused_decode_paths")
    if args.write:
        print(f"wrote {', '.join(map(str, write_path_table(result)))}")
        return 0
    for gpu, entry in path_table(result).items():
        print(gpu, entry["recorded"])
        for p in entry["points"]:
            print("  ", p)
    return 0


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "fused_decode_paths", run_fused_decode_paths,
        full=dict(heads=[16, 32, 64, 128], contexts=[4096, 32_768, 131_072], batches=[1, 8, 32, 64],
                  floor_contexts=[64], page_sizes=[1, PAGE_SIZE], pool_slots=495_000, max_total_tokens=2_000_000,
                  reps=10, rounds=3, flush_mb=256, seed=0),
        small=dict(heads=[16, 64], contexts=[4096], batches=[1, 8], floor_contexts=[64], page_sizes=[1, PAGE_SIZE],
                   pool_slots=50_000, max_total_tokens=2_000_000, reps=3, rounds=2, flush_mb=256, seed=0),
        about="ours' paths forced (Triton, wgmma, tokens-on-M wgmma), page 1 and 64, over the grid: the dispatcher's "
              "measured table",
        requires=("cuda", "nvcc"),
        after_record=write_path_table,
    ),
]


if __name__ == "__main__":
    from kvwall.experiments.schemas.fused_decode import FusedDecodePathsRow
    from kvwall.results import register_row_schema

    register_row_schema("fused_decode_paths", FusedDecodePathsRow)  # the schema the result loads with (only this
    raise SystemExit(main())  # one: importing every experiment would put all of them in this result's fingerprint)
