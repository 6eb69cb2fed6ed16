"""``fused_decode_paths`` (GPU): each of ours' paths forced -- the Triton path (``triton``), the wgmma path
(``wgmma``, Hopper only) and the tokens-on-M wgmma path (``wgmma_tokens``, Hopper only) -- and the dispatcher's own
choice (``ours`` on page-size-1 slots, ``ours_page64`` on pages of 64: ``path="auto"``, the table in place when the
run starts), on page-size-1 slots and on pages of 64, at every point of heads {16, 32, 64, 128} x context {4K, 32K,
128K} x batch {1, 8, 32, 64} plus a 64-token context at batch 1 (each path's fixed cost). A point's requests are
``fused_decode_bench``'s (:func:`~kvwall.experiments.fused_decode.strategies.make_point`, the same code: batch 1 one
request of ``context`` tokens, larger batches mixed lengths summing to ``context x batch / 4``), timed as
``fused_decode_bench`` times (CUDA graphs, L2 flushed, :func:`.bench.time_call`), each output checked against float64
first. Its ``build`` row has the GPU, nvcc, each wgmma kernel's build and ptxas resources, the ceilings of the run and
the table the dispatcher's rows ran by (``dispatch_table``).

From it, :func:`write_path_table` derives two files beside the dispatcher:

- ``kernels/mla_decode/kernel_paths.json`` (:func:`path_table`): what
  :func:`kvwall.kernels.mla_decode.dispatch.choose_path` reads and nothing else -- ``{gpu: {"capability",
  "page_size", "points": [[heads, context, batch, path, tokens, max_len], ...]}}``, per point the forced path whose
  worst ratio to the fastest, over page sizes 1 and 64, is least (:func:`choose_path`; page size 1, the layout ours
  runs in chapters 5 and 6, keys the table and breaks ties), keyed by the shape a call has when it is planned (heads,
  batch, the batch's tokens, its longest request: :mod:`kvwall.kernels.mla_decode.path_table`). It is in the
  fingerprint of every result that ran the dispatcher, and it changes only when a choice does: re-recording this
  experiment stales them only where a choice changed. The page-64 rows are not a key of their own; until 2026-12-03
  the choice was the fastest on page size 1 alone, and a re-record that evening (a5148ba) found that choice 7-8 % off
  on pages of 64 at two near-ties of 32 heads, where a path within 1 % on both layouts existed.
- ``kernels/mla_decode/kernel_paths_measured.json`` (:data:`MEASURED_FILE`, :func:`measured_table`): the times behind
  the choices -- ``{gpu: {"by", "recorded", "page_size", "columns", "points": [[heads, context, batch, triton_us,
  wgmma_us, wgmma_tokens_us, then the same on pages of 64 (``*_us_page64``)], ...]}}`` (µs rounded to 0.01, None: not
  timed; :func:`choice_from_measured` re-derives each choice from them) -- and the run's caption, for chapter 5's
  report. The dispatcher never reads it, and no module beside it names it, so it is in no result's fingerprint.

:func:`dispatch_check` holds the dispatcher to the run: at every recorded point and page size, the path
:func:`~kvwall.kernels.mla_decode.path_table.decide_path` picks for the row's shape (heads, batch, tokens, longest
request) by the shipped table, timed forced in this run, within :data:`DISPATCH_TOLERANCE` (5 %) of the fastest forced
path there (``tests/test_dispatch_rule.py``).

``python -m kvwall record`` writes both right after recording this experiment (:attr:`Experiment.after_record`),
before the experiments that run ours.

Device time at full scale: **101 s** measured on the H200 for the three forced paths (2026-12-02, the recorded run:
52 points x 3 paths x 2 page sizes = 312 rows, ~0.28 s a row, the builds, ptxas checks and ceilings ~13 s). With the
dispatcher's own rows (52 points x 2 page sizes = 104 more, the same cost a row): **about 130 s** estimated, not yet
measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from kvwall.kernels.mla_decode import path_table as table_rule
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode import wgmma_tokens as tokens_path
from kvwall.measure.timing import copy_bandwidth_gbps, matmul_tflops, release_memory
from kvwall.model.geometry import GLM5
from kvwall.peers.flashmla import PAGE_SIZE
from kvwall.results import PROJECT_ROOT, Result, collect_provenance, load_result
from kvwall.results.store import write_atomically
from kvwall.experiments.fused_decode.bench import bench_point_rows, time_call
from kvwall.experiments.fused_decode.strategies import FORCED_PATHS, OURS, BuildContext, make_point
from kvwall.experiments.registry import Experiment

__all__ = [
    "EXPERIMENTS",
    "PATHS_FILE",
    "MEASURED_FILE",
    "MEASURED_COLUMNS",
    "DISPATCH_TOLERANCE",
    "run_fused_decode_paths",
    "paths_rows",
    "timed_entries",
    "choose_path",
    "choice_from_measured",
    "path_points",
    "measured_points",
    "measured_columns",
    "path_table",
    "measured_table",
    "read_measured",
    "measured_times",
    "write_path_table",
    "points_of",
    "check_problem",
    "dispatch_check",
]

D = GLM5.kv_dim
FP8 = torch.float8_e4m3fn
#: The dispatcher's measured table (read by :func:`kvwall.kernels.mla_decode.dispatch.choose_path`): its choices only.
PATHS_FILE = table_rule.PATHS_FILE
#: The times behind ``kernel_paths.json``'s choices, for readers other than the dispatcher (chapter 5's report imports
#: this name). Named here only: a module of ``kernels/mla_decode/`` naming it would put it in the fingerprints of every
#: result that runs the dispatcher (:mod:`kvwall.results.fingerprint`), and a re-timing would stale them.
MEASURED_FILE = PATHS_FILE.with_name("kernel_paths_measured.json")
#: What a point of :data:`MEASURED_FILE` holds first (the table's own page size; :func:`measured_columns` adds the
#: others).
MEASURED_COLUMNS = ("heads", "context", "batch", *(f"{p}_us" for p in table_rule.KERNEL_PATHS))
#: What ``kernel_paths_measured.json`` entries say made them.
WRITTEN_BY = "fused_decode_paths (python -m kvwall record fused_decode_paths)"
#: How much slower than the fastest forced path the dispatcher's pick may be at a recorded point (issue 35: 5 %).
DISPATCH_TOLERANCE = 1.05


def points_of(
    heads: list[int], contexts: list[int], batches: list[int], floor_contexts: list[int]
) -> list[tuple[int, int, int]]:
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
            per_cta[str(hn)] = dict(
                smem=smem,
                block_n=block_n,
                threads=threads,
                ptxas_ok=report.ok,
                registers=report.registers,
                stack_bytes=report.stack_bytes,
                spill_bytes=report.spill_bytes,
            )
        built.update(
            arch=wgmma_path.ARCH,
            build_s=round(build_s, 2),
            heads_per_cta=list(tokens_path.HEADS_PER_CTA),
            per_cta=per_cta,
        )
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
        wgmma.update(
            arch=wgmma_path.ARCH,
            build_s=round(build_s, 2),
            smem=wgmma_path.SMEM_BYTES,
            heads_per_cta=wgmma_path.HEADS_PER_CTA,
            block_n=wgmma_path.BLOCK_N,
            threads=wgmma_path.THREADS,
            ptxas_ok=getattr(report, "ok", None),
            registers=report.registers,
            stack_bytes=report.stack_bytes,
            spill_bytes=report.spill_bytes,
        )
    return {
        "section": "build",
        "gpu": torch.cuda.get_device_name(device),
        "capability": list(torch.cuda.get_device_capability(device)),
        "sms": torch.cuda.get_device_properties(device).multi_processor_count,
        "nvcc": nvcc,
        "copy_gbps": copy_gbps,
        "copy_ms": copy_ms,
        "bf16_tflops": tflops,
        "wgmma": wgmma,
        "wgmma_tokens": _tokens_build(why),
        "seconds_total": None,
    }


def timed_entries(paths: list[str], page_sizes: list[int]) -> list[tuple[str, int]]:
    """What a point times, ``(strategy, page size)``: on each page size the dispatcher's own choice first (``ours``,
    ``ours_page64``: the forced rows are compared with its output) where the peer table has one, then each path of
    ``paths`` forced."""
    return [
        e for page in page_sizes for e in ([(OURS[page], page)] if page in OURS else []) + [(p, page) for p in paths]
    ]


def paths_rows(
    points: list[tuple[int, int, int]],
    pool: torch.Tensor,
    device: torch.device,
    entries: list[tuple[str, int]],
    flush,
    *,
    gen: torch.Generator,
    pool_slots: int,
    max_total_tokens: int,
    copy_gbps: float,
    bf16_tflops: float,
    reps: int,
    rounds: int,
    seed: int,
    ctx: BuildContext,
    timer=time_call,
) -> list[dict[str, Any]]:
    """The ``bench`` rows of ``points`` (``(heads, context, batch)``), every one of ``entries`` at each: the point's
    requests made as ``fused_decode_bench`` makes them (:func:`.strategies.make_point`, queries and slots drawn from
    ``gen`` after the pool, as the bench draws them), each entry built, checked against float64 and timed by
    ``timer`` (:func:`.bench.bench_point_rows`)."""
    rows: list[dict[str, Any]] = []
    for h, c, b in points:
        pt = make_point(h, c, b, pool_slots=pool_slots, max_total=max_total_tokens, gen=gen, seed=seed, device=device)
        rows += bench_point_rows(
            pt,
            pool,
            device,
            entries,
            flush,
            copy_gbps=copy_gbps,
            bf16_tflops=bf16_tflops,
            reps=reps,
            rounds=rounds,
            host_calls=0,
            ctx=ctx,
            sglang_split_sweep=[],
            timer=timer,
        )
        del pt
        release_memory(device)
    return rows


def _dispatch_table(gpu: str) -> dict[str, Any]:
    """The table the dispatcher's rows of this run choose by (the one in place when it starts): its file, the entry
    it reads for ``gpu`` (or None), the recording that wrote it (the sidecar's caption), why it was refused."""
    table = table_rule.read_table(PATHS_FILE)
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    found = table_rule.table_entry(table, gpu, cap)
    entry = read_measured().get(found[0]) if found else None
    return {
        "file": PATHS_FILE.relative_to(PROJECT_ROOT).as_posix(),
        "entry": found[0] if found else None,
        "recorded": entry.get("recorded") if isinstance(entry, dict) else None,
        "refused": table_rule.table_refusal(PATHS_FILE),
    }


def run_fused_decode_paths(
    device: torch.device,
    *,
    heads: list[int],
    contexts: list[int],
    batches: list[int],
    floor_contexts: list[int],
    page_sizes: list[int],
    pool_slots: int = 495_000,
    max_total_tokens: int = 2_000_000,
    reps: int = 10,
    rounds: int = 3,
    flush_mb: int = 256,
    seed: int = 0,
) -> Result:
    """See the module docstring. Rows: one ``build``, then ``bench`` rows, per point and page size the dispatcher's
    own (``ours`` / ``ours_page64``) and one per path forced, in ``fused_decode_bench``'s row format (``strategy``
    ``ours``, ``ours_page64`` or one of :data:`.strategies.FORCED_PATHS`, ``page_size``)."""
    if device.type != "cuda":
        raise RuntimeError(
            "fused_decode_paths times ours' paths on a GPU (CUDA graphs): it needs an NVIDIA GPU. "
            "On a CPU the chapter shows the recorded run; the dispatcher reads the kernel_paths.json written "
            "from it."
        )
    t_start = time.perf_counter()
    copy_ms, copy_gbps = copy_bandwidth_gbps(device, 1 << 30)
    tflops = matmul_tflops(device)
    build = _build_row(device, copy_ms, copy_gbps, tflops)
    build["dispatch_table"] = _dispatch_table(build["gpu"])
    paths = [p for p in FORCED_PATHS if p not in build or build[p]["runs"]]  # a wgmma path that cannot run: no rows
    ctx = BuildContext(sm_count=build["sms"])
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = (torch.randn(pool_slots, 1, D, generator=gen, device=device) * 0.7).to(FP8)
    scratch = torch.empty(flush_mb << 20, dtype=torch.uint8, device=device)
    rows: list[dict[str, Any]] = [build]
    rows += paths_rows(
        points_of(heads, contexts, batches, floor_contexts),
        pool,
        device,
        timed_entries(paths, page_sizes),
        scratch.zero_,
        gen=gen,
        pool_slots=pool_slots,
        max_total_tokens=max_total_tokens,
        copy_gbps=copy_gbps,
        bf16_tflops=tflops,
        reps=reps,
        rounds=rounds,
        seed=seed,
        ctx=ctx,
    )
    build["seconds_total"] = round(time.perf_counter() - t_start, 1)
    params = dict(
        heads=list(heads),
        contexts=list(contexts),
        batches=list(batches),
        floor_contexts=list(floor_contexts),
        page_sizes=list(page_sizes),
        pool_slots=pool_slots,
        max_total_tokens=max_total_tokens,
        reps=reps,
        rounds=rounds,
        flush_mb=flush_mb,
        seed=seed,
    )
    # kernel_paths.json is this run's output (after_record); its dispatcher rows read the one in place (build's
    # dispatch_table), the forced rows none.
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
        if (
            row.get("section") == "bench"
            and row.get("us")
            and row.get("page_size") == page_size
            and row.get("strategy") in FORCED_PATHS
        ):
            by_point.setdefault((row["heads"], row["context"], row["batch"]), {})[row["strategy"]] = row["us"]
    return {point: us for point, us in sorted(by_point.items()) if "triton" in us}


def _shapes(result: Result) -> dict[tuple[int, int, int], tuple[int, int]]:
    """``{(heads, context, batch): (tokens, longest request)}`` of the run's bench rows (the point's requests: the
    same for every strategy and page size)."""
    return {
        (r["heads"], r["context"], r["batch"]): (r["tokens"], r["len_max"])
        for r in result.rows
        if r.get("section") == "bench"
    }


def choose_path(times: Sequence[Mapping[str, float | None]]) -> str:
    """The path a point's entry holds, from its times on each page size timed (``times[0]`` the table's own page size,
    then the others; µs rounded to 0.01 as :data:`MEASURED_FILE` holds them; None: not timed): the path timed on every
    page size whose worst ratio to that page size's fastest is least -- so the choice holds on every layout the
    dispatcher serves, not only on the one it is keyed by -- ties (at 0.0001) to the fastest on ``times[0]``, then the
    earlier of :data:`~kvwall.kernels.mla_decode.path_table.KERNEL_PATHS`. With one page size timed it is the fastest
    there (:func:`~kvwall.kernels.mla_decode.path_table.fastest`)."""
    timed = [{p: us for p, us in t.items() if us is not None} for t in times]
    everywhere = [p for p in table_rule.KERNEL_PATHS if all(p in t for t in timed)]
    if not timed or not timed[0]:
        raise ValueError("no path was timed at this point")
    if not everywhere:
        return table_rule.fastest(timed[0])

    def worst(p: str) -> float:
        return max(t[p] / min(t.values()) for t in timed)

    return min(everywhere, key=lambda p: (round(worst(p), 4), timed[0][p], table_rule.KERNEL_PATHS.index(p)))


def _page_sizes(result: Result, page_size: int) -> list[int]:
    """``page_size`` first, then the run's other page sizes (its bench rows'), smallest first."""
    pages = {r["page_size"] for r in result.rows if r.get("section") == "bench" and r.get("page_size") is not None}
    return [page_size, *sorted(pages - {page_size})]


def _rounded(us: Mapping[str, float]) -> list[float | None]:
    """Each path's µs at a point (:data:`~kvwall.kernels.mla_decode.path_table.KERNEL_PATHS` order), rounded to 0.01 as
    :data:`MEASURED_FILE` holds it; None: not timed."""
    return [None if (t := us.get(p)) is None else round(t, 2) for p in table_rule.KERNEL_PATHS]


def path_points(result: Result, page_size: int = 1, *, other_pages: bool = True) -> list[list[Any]]:
    """``[heads, context, batch, path, tokens, max_len]`` per point where the Triton path was timed on ``page_size``:
    ``path`` by :func:`choose_path` from its times on ``page_size`` and on the run's other page sizes (those timed at
    the point; ``other_pages=False``: on ``page_size`` alone, the rule tables were written by before 2026-12-03's
    evening), ``tokens`` / ``max_len`` the point's requests as timed. What ``kernel_paths.json`` holds."""
    shapes = _shapes(result)
    by_page = [_timed(result, p) for p in _page_sizes(result, page_size)[: None if other_pages else 1]]
    points = []
    for (h, c, b), us in by_page[0].items():
        times = [dict(zip(table_rule.KERNEL_PATHS, _rounded(t[h, c, b]))) for t in by_page if (h, c, b) in t]
        points.append([h, c, b, choose_path(times), *shapes[h, c, b]])
    return points


def measured_points(result: Result, page_size: int = 1) -> list[list[Any]]:
    """Per point of :func:`path_points` (:data:`MEASURED_COLUMNS`): ``[heads, context, batch, triton_us, wgmma_us,
    wgmma_tokens_us]`` on ``page_size``, then the same three on each other page size of the run (``measured_table``
    names them), µs rounded to 0.01 as the choice compared them; None: not timed."""
    by_page = [_timed(result, p) for p in _page_sizes(result, page_size)]
    return [
        [h, c, b, *_rounded(us), *(v for t in by_page[1:] for v in _rounded(t.get((h, c, b), {})))]
        for (h, c, b), us in by_page[0].items()
    ]


def measured_columns(page_sizes: Sequence[int]) -> list[str]:
    """The columns of a sidecar entry whose run timed ``page_sizes`` (the table's own first): :data:`MEASURED_COLUMNS`,
    then ``{path}_us_page{n}`` for each other page size."""
    return [*MEASURED_COLUMNS, *(f"{p}_us_page{n}" for n in page_sizes[1:] for p in table_rule.KERNEL_PATHS)]


def choice_from_measured(columns: Sequence[str], timed: Sequence[Any]) -> str:
    """:func:`choose_path` re-derived from one point of a sidecar entry (its ``columns``, one of its ``points``): the
    choice ``kernel_paths.json`` holds there."""
    row = dict(zip(columns, timed))
    pages = [""] + sorted({c.rsplit("_us", 1)[1] for c in columns if "_us_page" in c})
    return choose_path([{p: row.get(f"{p}_us{suffix}") for p in table_rule.KERNEL_PATHS} for suffix in pages])


def path_table(result: Result, page_size: int = 1) -> dict[str, Any]:
    """One GPU's entry of ``kernel_paths.json`` from a ``fused_decode_paths`` result:
    ``{gpu: {"capability", "page_size", "points"}}`` (points of :func:`path_points`, keyed by page size 1 by default:
    ours' layout in chapters 5 and 6; each choice holds on every page size the run timed, and :func:`dispatch_check`
    holds it to 5 % on each). Only what the dispatcher reads."""
    build = next(r for r in result.rows if r.get("section") == "build")
    return {
        build["gpu"]: {
            "capability": list(build["capability"]),
            "page_size": page_size,
            "points": path_points(result, page_size),
        }
    }


def measured_table(result: Result, page_size: int = 1) -> dict[str, Any]:
    """One GPU's entry of :data:`MEASURED_FILE`: ``{gpu: {"by", "recorded", "page_size", "columns", "points"}}``
    (points of :func:`measured_points`, columns of :func:`measured_columns`; ``recorded``: the result's caption)."""
    build = next(r for r in result.rows if r.get("section") == "build")
    return {
        build["gpu"]: {
            "by": WRITTEN_BY,
            "recorded": result.caption(),
            "page_size": page_size,
            "columns": measured_columns(_page_sizes(result, page_size)),
            "points": measured_points(result, page_size),
        }
    }


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


def check_problem(result: Result) -> str | None:
    """Why :func:`dispatch_check` cannot hold the dispatcher to ``result`` (None: it can): a run without a ``build``
    row, without the point's shape in its rows (tokens, longest request), or without a row (timed or failed) of every
    forced path at every point and page size it ran (a recording made before the tokens-on-M path)."""
    build = next((r for r in result.rows if r.get("section") == "build"), None)
    bench = [r for r in result.rows if r.get("section") == "bench"]
    if build is None or not bench:
        return "it has no build row or no bench rows"
    if any(r.get("tokens") is None or r.get("len_max") is None for r in bench):
        return "its rows do not say each point's tokens and longest request"
    ran: dict[tuple[int, int, int, int], set[str]] = {}
    for r in bench:
        ran.setdefault((r["heads"], r["context"], r["batch"], r["page_size"]), set()).add(r["strategy"])
    short = [k for k, names in ran.items() if not set(FORCED_PATHS) <= names]
    if short:
        return (
            f"it has no row of every forced path ({', '.join(FORCED_PATHS)}) at {len(short)} of its {len(ran)} "
            f"points and page sizes (e.g. heads, context, batch, page {short[0]})"
        )
    return None


def dispatch_check(result: Result, table: dict | None = None, source: str | Path | None = None) -> list[dict[str, Any]]:
    """At every (point, page size) of ``result`` (:func:`check_problem` says where it cannot): the path
    :func:`~kvwall.kernels.mla_decode.path_table.decide_path` picks for the row's shape (its heads, batch, tokens and
    longest request) on the run's GPU by ``table`` (default: the shipped ``kernel_paths.json``, read as the dispatcher
    reads it), and why; its time forced in this run (None: it failed there); the fastest forced path there and its time;
    ``ratio`` the pick's time / the fastest (None: the pick was not timed), ``ok`` within :data:`DISPATCH_TOLERANCE`;
    and, where the run has them, the dispatcher's own row (``ours_path``, ``ours_us``: what it ran by the table in
    place when the run started)."""
    build = next(r for r in result.rows if r.get("section") == "build")
    refusal = None if (build.get("wgmma") or {}).get("runs", True) else (build["wgmma"].get("why") or "not run")
    refused = None
    if table is None:
        source = PATHS_FILE if source is None else source
        table, refused = table_rule.read_table(Path(source)), table_rule.table_refusal(Path(source))
    by: dict[tuple[int, int, int, int], dict[str, dict[str, Any]]] = {}
    for r in result.rows:
        if r.get("section") == "bench":
            by.setdefault((r["heads"], r["context"], r["batch"], r["page_size"]), {})[r["strategy"]] = r
    out = []
    for (h, c, b, page), rows in sorted(by.items()):
        any_row = next(iter(rows.values()))
        tokens, max_len = any_row["tokens"], any_row["len_max"]
        pick, why = table_rule.decide_path(
            h,
            b,
            max_len,
            tokens=tokens,
            gpu=build["gpu"],
            capability=tuple(build["capability"]),
            refusal=refusal,
            table=table,
            source=source,
            refused=refused,
        )
        forced = {p: rows[p].get("us") or None for p in FORCED_PATHS if p in rows}
        timed = {p: us for p, us in forced.items() if us is not None}
        best = table_rule.fastest(timed) if timed else None
        pick_us = forced.get(pick)
        ratio = pick_us / timed[best] if pick_us is not None and best else None
        ours = rows.get(OURS.get(page, ""), {})
        out.append(
            {
                "heads": h,
                "context": c,
                "batch": b,
                "page_size": page,
                "tokens": tokens,
                "max_len": max_len,
                "pick": pick,
                "why": why,
                "pick_us": pick_us,
                "best": best,
                "best_us": timed[best] if best else None,
                "ratio": ratio,
                "ok": ratio is not None and ratio <= DISPATCH_TOLERANCE,
                "ours_path": ours.get("kernel_path"),
                "ours_us": ours.get("us"),
            }
        )
    return out


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
    parser = argparse.ArgumentParser(
        prog="python -m kvwall.experiments.fused_decode.kernel_paths",
        description="the dispatcher's table from the recorded fused_decode_paths",
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help=f"write {PATHS_FILE.name} and {MEASURED_FILE.name} from the recorded result",
    )
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
        "fused_decode_paths",
        run_fused_decode_paths,
        full=dict(
            heads=[16, 32, 64, 128],
            contexts=[4096, 32_768, 131_072],
            batches=[1, 8, 32, 64],
            floor_contexts=[64],
            page_sizes=[1, PAGE_SIZE],
            pool_slots=495_000,
            max_total_tokens=2_000_000,
            reps=10,
            rounds=3,
            flush_mb=256,
            seed=0,
        ),
        small=dict(
            heads=[16, 64],
            contexts=[4096],
            batches=[1, 8],
            floor_contexts=[64],
            page_sizes=[1, PAGE_SIZE],
            pool_slots=50_000,
            max_total_tokens=2_000_000,
            reps=3,
            rounds=2,
            flush_mb=256,
            seed=0,
        ),
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
