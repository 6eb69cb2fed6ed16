"""``fused_decode_paths`` (GPU): each of ours' paths forced -- the Triton path (``triton``), the wgmma path
(``wgmma``, Hopper only) and the tokens-on-M wgmma path (``wgmma_tokens``, Hopper only) -- on page-size-1 slots and
on pages of 64, at every point of heads {16, 32, 64, 128} x context {4K, 32K, 128K} x batch {1, 8, 32, 64} plus a
64-token context at batch 1 (each path's fixed cost), timed as ``fused_decode_bench`` times (CUDA graphs, L2
flushed, :func:`.bench.time_call`), each output checked against float64 first. Its ``build`` row has the GPU, nvcc,
each wgmma kernel's build and ptxas resources and the ceilings of the run.

From it, :func:`write_path_table` derives two files beside the dispatcher:

- ``kernels/mla_decode/paths.json`` (:func:`path_table`): what
  :func:`kvwall.kernels.mla_decode.dispatch.choose_path` reads and nothing else -- ``{gpu: {"capability",
  "page_size", "points": [[heads, context, batch, path], ...]}}``, the fastest path at each point, page size 1 (the
  layout ours runs in chapters 5 and 6). It is in the fingerprint of every result that ran the dispatcher, and it
  changes only when a choice does: re-recording this experiment stales them only where a faster path changed.
- ``kernels/mla_decode/paths_measured.json`` (:data:`MEASURED_FILE`, :func:`measured_table`): the times behind the
  choices -- ``{gpu: {"by", "recorded", "page_size", "columns", "points": [[heads, context, batch, triton_us,
  wgmma_us, wgmma_tokens_us], ...]}}`` (µs rounded to 0.01, None: not timed) -- and the run's caption, for chapter 5's
  report. The dispatcher never reads it, and no module beside it names it, so it is in no result's fingerprint.

``python -m kvwall record`` writes both right after recording this experiment (:attr:`Experiment.after_record`),
before the experiments that run ours.

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

from kvwall.kernels.mla_decode import path_table as table_rule
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode import wgmma_tokens as tokens_path
from kvwall.measure.timing import copy_bandwidth_gbps, matmul_tflops, release_memory
from kvwall.model.geometry import GLM5
from kvwall.peers.flashmla import PAGE_SIZE
from kvwall.results import PROJECT_ROOT, Result, collect_provenance, load_result
from kvwall.results.store import write_atomically
from kvwall.experiments.fused_decode.bench import bench_point_rows
from kvwall.experiments.fused_decode.strategies import FORCED_PATHS, BuildContext, make_point
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "PATHS_FILE", "MEASURED_FILE", "MEASURED_COLUMNS", "run_fused_decode_paths", "path_points",
           "measured_points", "path_table", "measured_table", "read_measured", "measured_times", "write_path_table",
           "points_of"]

D = GLM5.kv_dim
FP8 = torch.float8_e4m3fn
#: The dispatcher's measured table (read by :func:`kvwall.kernels.mla_decode.dispatch.choose_path`): its choices only.
PATHS_FILE = table_rule.PATHS_FILE
#: The times behind ``paths.json``'s choices, for readers other than the dispatcher (chapter 5's report imports this
#: name). Named here only: a module of ``kernels/mla_decode/`` naming it would put it in the fingerprints of every
#: result that runs the dispatcher (:mod:`kvwall.results.fingerprint`), and a re-timing would stale them.
MEASURED_FILE = PATHS_FILE.with_name("paths_measured.json")
#: What a point of :data:`MEASURED_FILE` holds.
MEASURED_COLUMNS = ("heads", "context", "batch", *(f"{p}_us" for p in table_rule.KERNEL_PATHS))
#: What ``paths_measured.json`` entries say made them.
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

def _timed(result: Result, page_size: int) -> dict[tuple[int, int, int], dict[str, float]]:
    """``{(heads, context, batch): {path: µs}}`` of the bench rows timed on ``page_size``, where the Triton path was
    timed (a wgmma path missing where it was not: a recording made before the tokens-on-M path has none of its
    times)."""
    by_point: dict[tuple[int, int, int], dict[str, float]] = {}
    for row in result.rows:
        if (row.get("section") == "bench" and row.get("us") and row.get("page_size") == page_size
                and row.get("strategy") in FORCED_PATHS):
            by_point.setdefault((row["heads"], row["context"], row["batch"]), {})[row["strategy"]] = row["us"]
    return {point: us for point, us in sorted(by_point.items()) if "triton" in us}


def path_points(result: Result, page_size: int = 1) -> list[list[Any]]:
    """``[heads, context, batch, path]`` per point where the Triton path was timed on ``page_size``: ``path`` the
    fastest (:func:`kvwall.kernels.mla_decode.path_table.path_point`). What ``paths.json`` holds."""
    return [table_rule.path_point(h, c, b, *(us.get(p) for p in table_rule.KERNEL_PATHS))
            for (h, c, b), us in _timed(result, page_size).items()]


def measured_points(result: Result, page_size: int = 1) -> list[list[Any]]:
    """``[heads, context, batch, triton_us, wgmma_us, wgmma_tokens_us]`` (:data:`MEASURED_COLUMNS`) at the points of
    :func:`path_points`, µs rounded to 0.01 as the choice compared them; None: not timed."""
    return [[h, c, b, *(None if (t := us.get(p)) is None else round(t, 2) for p in table_rule.KERNEL_PATHS)]
            for (h, c, b), us in _timed(result, page_size).items()]


def path_table(result: Result, page_size: int = 1) -> dict[str, Any]:
    """One GPU's entry of ``paths.json`` from a ``fused_decode_paths`` result: ``{gpu: {"capability", "page_size",
    "points"}}`` (points of :func:`path_points`, page size 1 by default: ours' layout in chapters 5 and 6; the page-64
    rows pick the same path at every point of the 2026-11-30 recording but one). Only what the dispatcher reads."""
    build = next(r for r in result.rows if r.get("section") == "build")
    return {build["gpu"]: {"capability": list(build["capability"]), "page_size": page_size,
                           "points": path_points(result, page_size)}}


def measured_table(result: Result, page_size: int = 1) -> dict[str, Any]:
    """One GPU's entry of :data:`MEASURED_FILE`: ``{gpu: {"by", "recorded", "page_size", "columns", "points"}}``
    (points of :func:`measured_points`; ``recorded``: the result's caption)."""
    build = next(r for r in result.rows if r.get("section") == "build")
    return {build["gpu"]: {"by": WRITTEN_BY, "recorded": result.caption(), "page_size": page_size,
                           "columns": list(MEASURED_COLUMNS), "points": measured_points(result, page_size)}}


def read_measured(path: Path = MEASURED_FILE) -> dict[str, Any]:
    """The sidecar's entries (``{}`` where there is none or it is not a JSON object)."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def measured_times(measured: dict[str, Any], gpu: str, point: list) -> dict[str, float] | None:
    """``{path: µs}`` timed at ``point`` (its heads, context, batch) in ``gpu``'s entry of the sidecar ``measured``
    (paths not timed there left out); None where the sidecar has no such point."""
    entry = measured.get(gpu)
    if not isinstance(entry, dict):
        return None
    columns = entry.get("columns") or list(MEASURED_COLUMNS)
    for p in entry.get("points") or []:
        if p[:3] == list(point[:3]):
            row = dict(zip(columns, p))
            return {k: us for k in table_rule.KERNEL_PATHS if (us := row.get(f"{k}_us")) is not None}
    return None


def _merged(path: Path, entry: dict[str, Any]) -> dict[str, Any]:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if not isinstance(table, dict):
        table = {}
    table.update(entry)
    return table


def write_path_table(result: Result, path: Path = PATHS_FILE) -> list[Path]:
    """Merge ``result``'s entries into ``path`` (the choices, :func:`path_table`) and into the sidecar beside it
    (:data:`MEASURED_FILE`'s name, :func:`measured_table`); other GPUs' entries stay. Each file is replaced whole (a
    reader sees the old or the new one), the sidecar first. Returns ``[path, sidecar]`` (what
    :attr:`Experiment.after_record` returns: the files it wrote). The dispatcher's cached read of the table is
    dropped, so the experiments ``record`` runs after this one in the same process choose by the new table."""
    sidecar = path.with_name(MEASURED_FILE.name)
    write_atomically(sidecar, table_rule.table_text(_merged(sidecar, measured_table(result))))
    write_atomically(path, table_rule.table_text(_merged(path, path_table(result))))
    table_rule.reload_table()
    return [path, sidecar]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvwall.experiments.fused_decode.paths",
                                     description="the dispatcher's table from the recorded fused_decode_paths")
    parser.add_argument("--write", action="store_true",
                        help=f"write {PATHS_FILE.name} and {MEASURED_FILE.name} from the recorded result")
    args = parser.parse_args(argv)
    result = load_result("fused_decode_paths")
    if args.write:
        print(f"wrote {', '.join(map(str, write_path_table(result)))}")
        return 0
    for gpu, entry in measured_table(result).items():
        print(gpu, entry["recorded"])
        for choice, times in zip(path_table(result)[gpu]["points"], entry["points"]):
            print("  ", choice, times[3:])
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
