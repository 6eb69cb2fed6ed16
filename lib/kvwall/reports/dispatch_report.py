"""Chapter 5's dispatcher, from the recorded ``fused_decode_paths`` run: the measured table the dispatcher reads
(every path it timed at every point, the choice), how often each path is chosen, what the dispatcher picks on
GPUs other than the one measured, and each path's fixed cost. The paths shown are the ones the recording timed
(:func:`timed_paths`), not a typed list; every number comes from the run (or, for other GPUs, from
:func:`kvwall.kernels.mla_decode.path_table.decide_path` on the shipped ``kernel_paths.json``, beside the times of its
sidecar ``kernel_paths_measured.json``: the dispatcher reads only the choices).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

from kvwall.experiments.fused_decode.kernel_paths import MEASURED_FILE, measured_times, path_points, read_measured
from kvwall.experiments.fused_decode.strategies import OURS
from kvwall.kernels.mla_decode import path_table
from kvwall.model.step_paths import KERNEL_NAMES
from kvwall.reports.fused_bench_report import FM_BF16, FM_FP8, WORDS, Grid, Point, Row, label, point_label
from kvwall.reports.tables import Table, number
from kvwall.reports.words import columns


def timed_paths(paths: Grid) -> list[str]:
    """Ours' paths the run timed (any row), in the dispatcher's order: the recorded paths, not a typed count."""
    ran = set(paths.strategies())
    return [k for k in KERNEL_NAMES if k in ran]


def _path_points(paths: Grid, points: list[Point], page_size: int) -> list[tuple[Point, dict[str, float], list]]:
    """(point, each timed path's µs on ``page_size``, the ``kernel_paths.json`` point the run derives there: its
    choice by :func:`kvwall.experiments.fused_decode.kernel_paths.path_points`, the table's own rule) where the
    Triton path was timed."""
    derived = {tuple(pt[:3]): pt for pt in path_points(paths.result, page_size)}
    return [
        (p, {k: u for k in timed_paths(paths) if (u := paths.us(k, p, page_size)) is not None}, derived[p])
        for p in points
        if p in derived
    ]


def dispatcher_table(paths: Grid, caption: str, page_size: int = 1) -> Table:
    """The measured table the dispatcher reads (``kernel_paths.json``, derived from this run): every timed path's µs at
    every point of the grid, the fastest, its lead over the next (page ``page_size``), and where the run timed the
    dispatcher itself (recordings from 2026-12-03 on), what it ran."""
    rows = []
    for p, us, point in _path_points(paths, paths.floor_points + paths.points, page_size):
        others = [u for k, u in us.items() if k != point[3]]
        ran = (paths.row(OURS[page_size], p, page_size) if page_size in OURS else None) or Row()
        rows.append(
            Row(
                us,
                point=point_label(p),
                pick=KERNEL_NAMES[point[3]],
                ours=ran.us,
                x=min(others) / us[point[3]] if others else None,
                ours_path=KERNEL_NAMES.get(ran.kernel_path, ran.kernel_path),
            )
        )
    timed = {WORDS.path_us.format(name=KERNEL_NAMES[k]): (k, number(1)) for k in timed_paths(paths)}
    cols = columns(WORDS.dispatcher_table) | timed | columns(WORDS.dispatcher_pick)
    if any(r.ours for r in rows):
        cols |= columns(WORDS.dispatcher_ran)
    return Table(rows, cols, caption)


def dispatch_counts(paths: Grid, page_size: int = 1) -> dict[str, Any]:
    """How often each timed path is the table's choice on the measured grid (``dispatch_points``,
    ``dispatch_{path}``), and the points where the Triton path is (``triton_at``)."""
    picks = [(p, point[3]) for p, _, point in _path_points(paths, paths.points, page_size)]
    n = Counter(k for _, k in picks)
    return dict(
        dispatch_points=len(picks),
        **{f"dispatch_{k}": n[k] for k in timed_paths(paths)},
        triton_at=[point_label(p) for p, k in picks if k == "triton"],
    )


#: Other GPUs the dispatcher may meet: (name, compute capability); the wgmma paths are built for sm_90a (9.0) only.
OTHER_GPUS: tuple[tuple[str, tuple[int, int]], ...] = (
    ("NVIDIA H100 80GB HBM3", (9, 0)),
    ("NVIDIA B200", (10, 0)),
    ("NVIDIA RTX PRO 6000 Blackwell", (12, 0)),
)


def other_gpus_table(
    caption: str,
    table: Mapping[str, Any] | None = None,
    heads: int = 16,
    batch: int = 1,
    max_len: int = 131072,
    measured: Mapping[str, Any] | None = None,
    tokens: int | None = None,
) -> Table:
    """What :func:`kvwall.kernels.mla_decode.path_table.decide_path` picks for one call on GPUs other than the one
    measured (an H100 reads the H200's crossovers: the same compute capability), from the shipped
    ``kernel_paths.json``; and the times measured at the point it decided by, from the sidecar ``measured`` (default:
    the shipped
    ``kernel_paths_measured.json`` with the shipped table, none with a ``table`` given). ``tokens``: the batch's tokens
    (None: every request ``max_len`` long)."""
    if table is None:
        table = path_table.read_table(path_table.PATHS_FILE)
        measured = read_measured(MEASURED_FILE) if measured is None else measured
    table, measured, rows = dict(table), dict(measured or {}), []
    well_formed = path_table.table_problem(table) is None  # else decide_path says why, and no point is read
    for name, cap in OTHER_GPUS:
        refusal = (
            f"compute capability {cap[0]}.{cap[1]}: the wgmma path is built for sm_90a (9.0) only"
            if cap != (9, 0)
            else None
        )
        path, why = path_table.decide_path(
            heads, batch, max_len, tokens=tokens, gpu=name, capability=cap, refusal=refusal, table=table
        )
        found = None if refusal or not well_formed else path_table.table_entry(table, name, cap)
        choice = path_table.measured_choice(found[1], heads, batch, max_len, tokens) if found else None
        timed = measured_times(measured, found[0], choice[1]) if choice else None
        rows.append(
            Row(
                gpu=f"{name} ({cap[0]}.{cap[1]})",
                path=KERNEL_NAMES[path],
                why=why.split(": ", 1)[-1],
                us=", ".join(f"{path_table.SAID[k]} {us:.1f}" for k, us in timed.items()) if timed else None,
            )
        )
    cols = columns(WORDS.other_gpus_table) | (columns(WORDS.other_gpus_us) if any(r.us for r in rows) else {})
    return Table(rows, cols, caption)


def floor_table(paths: Grid, caption: str, bench: Grid | None = None) -> Table:
    """Each path's fixed cost: one short request (the paths run's floor context, 64 tokens) at each head count, page 1
    and 64, and FlashMLA's where the run timed it."""
    rows = []
    for p in paths.floor_points:
        r: dict[str, Any] = dict(point=point_label(p))
        r.update({f"{k}{page}": paths.us(k, p, page) for k in timed_paths(paths) for page in (1, 64)})
        r.update({peer: paths.us(peer, p) or (bench.us(peer, p) if bench else None) for peer in (FM_BF16, FM_FP8)})
        rows.append(r)
    cols = columns(WORDS.floor_table) | {
        WORDS.floor_path.format(name=KERNEL_NAMES[k], page=page): (f"{k}{page}", number(1))
        for k in timed_paths(paths)
        for page in (1, 64)
    }
    if any(r[FM_BF16] or r[FM_FP8] for r in rows):
        cols.update({label(FM_BF16): (FM_BF16, number(1)), label(FM_FP8): (FM_FP8, number(1))})
    return Table(rows, cols, caption)


def floor_ranges(paths: Grid, bench: Grid | None = None) -> dict[str, tuple[float, float]]:
    """Each kernel's fixed cost -- one request of the paths run's floor context at every head count -- as (least,
    most) µs: ours' paths (page 1) and FlashMLA's kernels where the run timed them (else the benchmark)."""
    found = {}
    for k, page in [*((k, 1) for k in KERNEL_NAMES), (FM_BF16, None), (FM_FP8, None)]:
        xs = [u for p in paths.floor_points if (u := paths.us(k, p, page) or (bench.us(k, p) if bench else None))]
        if xs:
            found[k] = (min(xs), max(xs))
    return found
