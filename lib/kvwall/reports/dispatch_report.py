"""Chapter 5's dispatcher, from the recorded ``fused_decode_paths`` run: the measured table the dispatcher reads
(every path it timed at every point, the fastest), how often each path is the fastest, what the dispatcher picks on
GPUs other than the one measured, and each path's fixed cost. The paths shown are the ones the recording timed
(:func:`timed_paths`), not a typed list; every number comes from the run (or, for other GPUs, from
:func:`kvwall.kernels.mla_decode.path_table.decide_path` on the shipped ``paths.json``, beside the times of its
sidecar ``paths_measured.json``: the dispatcher reads only the choices).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

from kvwall.experiments.fused_decode.paths import MEASURED_FILE, measured_times, read_measured
from kvwall.experiments.fused_decode.strategies import OURS
from kvwall.kernels.mla_decode import path_table
from kvwall.model.paths import KERNEL_NAMES
from kvwall.reports.fused_bench_report import FM_BF16, FM_FP8, Grid, Point, label, point_label
from kvwall.reports.tables import Table, number, plain, times

__all__ = ["timed_paths", "dispatcher_table", "dispatcher_text", "OTHER_GPUS", "other_gpus_table", "floor_table",
           "floor_text"]


def timed_paths(paths: Grid) -> list[str]:
    """Ours' paths the run timed (any row), in the dispatcher's order: the recorded paths, not a typed count."""
    ran = set(paths.strategies())
    return [k for k in KERNEL_NAMES if k in ran]


def _path_points(paths: Grid, points: list[Point], page_size: int) -> list[tuple[Point, dict[str, float], list]]:
    """(point, each timed path's µs, the ``paths.json`` point: its shape as the Triton row ran it) where the Triton
    path was timed."""
    out = []
    for p in points:
        us = {k: u for k in timed_paths(paths) if (u := paths.us(k, p, page_size)) is not None}
        if "triton" in us:
            row = paths.row("triton", p, page_size) or {}
            out.append((p, us, path_table.path_point(*p, us["triton"], us.get("wgmma"), us.get("wgmma_tokens"),
                                                     tokens=row.get("tokens"), max_len=row.get("len_max"))))
    return out


def dispatcher_table(paths: Grid, page_size: int = 1) -> Table:
    """The measured table the dispatcher reads (``paths.json``, derived from this run): every timed path's µs at
    every point of the grid, the fastest, and its lead over the next (page ``page_size``)."""
    rows = []
    ours = OURS.get(page_size)
    for p, us, point in _path_points(paths, paths.floor_points + paths.points, page_size):
        pick = point[3]
        others = [u for k, u in us.items() if k != pick]
        ran = paths.row(ours, p, page_size) if ours else None
        rows.append({"point": point_label(p), **us, "pick": KERNEL_NAMES[pick],
                     "x": min(others) / us[pick] if others else None,
                     "ours": ran.get("us") if ran else None,
                     "ours_path": KERNEL_NAMES.get(ran.get("kernel_path"), ran.get("kernel_path")) if ran else None})
    kinds = timed_paths(paths)
    cols = {"heads, context, batch": "point", **{f"{KERNEL_NAMES[k]} µs": (k, number(1)) for k in kinds},
            "the dispatcher picks": "pick", "next fastest / the pick": ("x", times(2))}
    said = ""
    if any(r["ours"] for r in rows):  # the run timed the dispatcher too (recordings from 2026-12-03 on)
        cols.update({"the dispatcher ran, µs": ("ours", number(1)), "its path": ("ours_path", plain)})
        said = (" The dispatcher's own rows ran by the table in place when the run started (the one before this "
                "run's).")
    return Table(rows, cols,
                 paths.caption + f" Page size {page_size}; CUDA graphs, L2 flushed. When the run is recorded, "
                                 "kernels/mla_decode/paths.json (the pick at each point: all the dispatcher reads) and "
                                 f"{MEASURED_FILE.name} beside it (these times) are derived from these rows." + said)


def dispatcher_text(paths: Grid, page_size: int = 1) -> tuple[str, dict[str, Any]]:
    """How often each timed path is the fastest on the measured grid, and where the Triton path wins."""
    picks = [(p, point[3]) for p, _, point in _path_points(paths, paths.points, page_size)]
    n = Counter(k for _, k in picks)
    kinds = sorted(timed_paths(paths), key=lambda k: (-n.get(k, 0), list(KERNEL_NAMES).index(k)))
    triton_at = [point_label(p) for p, k in picks if k == "triton"]
    values = {"dispatch_points": len(picks), **{f"dispatch_{k}": n.get(k, 0) for k in kinds}}
    parts = [f"the {KERNEL_NAMES[k]} at **{n.get(k, 0)}**" + (f" ({'; '.join(triton_at)})" if k == "triton"
                                                               and triton_at else "") for k in kinds]
    said = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    text = f"On the {len(picks)} measured points the fastest is {said}."
    return text, values


#: Other GPUs the dispatcher may meet: (name, compute capability, why the wgmma path cannot run there, or None).
OTHER_GPUS: tuple[tuple[str, tuple[int, int], str | None], ...] = (
    ("NVIDIA H100 80GB HBM3", (9, 0), None),
    ("NVIDIA B200", (10, 0), "compute capability 10.0: the wgmma path is built for sm_90a (9.0) only"),
    ("NVIDIA RTX PRO 6000 Blackwell", (12, 0), "compute capability 12.0: the wgmma path is built for sm_90a (9.0) "
                                               "only"),
)


def _times_said(timed: Mapping[str, float] | None) -> str | None:
    return ", ".join(f"{path_table.SAID[k]} {us:.1f}" for k, us in timed.items()) if timed else None


def other_gpus_table(table: Mapping[str, Any] | None = None, heads: int = 16, batch: int = 1,
                     max_len: int = 131072, measured: Mapping[str, Any] | None = None,
                     tokens: int | None = None) -> Table:
    """What :func:`kvwall.kernels.mla_decode.path_table.decide_path` picks for one call on GPUs other than the one
    measured (an H100 reads the H200's crossovers: the same compute capability), from the shipped ``paths.json``; and
    the times measured at the point it decided by, from the sidecar ``measured`` (default: the shipped
    ``paths_measured.json`` with the shipped table, none with a ``table`` given). ``tokens``: the batch's tokens
    (None: every request ``max_len`` long)."""
    if table is None:
        table = path_table.read_table(path_table.PATHS_FILE)
        measured = read_measured(MEASURED_FILE) if measured is None else measured
    measured = measured or {}
    rows = []
    well_formed = path_table.table_problem(dict(table)) is None  # else decide_path says why, and no point is read
    for name, cap, refusal in OTHER_GPUS:
        path, why = path_table.decide_path(heads, batch, max_len, tokens=tokens, gpu=name, capability=cap,
                                           refusal=refusal, table=dict(table))
        found = None if refusal or not well_formed else path_table.table_entry(dict(table), name, cap)
        choice = path_table.measured_choice(found[1], heads, batch, max_len, tokens) if found else None
        timed = measured_times(dict(measured), found[0], choice[1]) if found and choice else None
        rows.append({"gpu": f"{name} ({cap[0]}.{cap[1]})", "path": KERNEL_NAMES[path], "why": why.split(": ", 1)[-1],
                     "us": _times_said(timed)})
    cols = {"GPU (compute capability)": "gpu", "path": "path", "why (the dispatcher's words)": "why"}
    if any(r["us"] for r in rows):
        cols["µs measured at that point"] = ("us", plain)
    return Table(rows, cols, f"Computed here by path_table.decide_path from kernels/mla_decode/paths.json, for one "
                             f"call of {heads} heads, batch {batch}, "
                             + (f"{tokens:,} tokens, the longest {max_len:,}" if tokens else
                                f"{max_len // 1024}K tokens a request") + "; the times from "
                             f"{MEASURED_FILE.name}, which the dispatcher does not read.")


def floor_table(paths: Grid, bench: Grid | None = None) -> Table:
    """Each path's fixed cost: one short request (the paths run's floor context, 64 tokens) at each head count, page 1
    and 64, and FlashMLA's where the run timed it."""
    rows = []
    kinds = timed_paths(paths)
    for p in paths.floor_points:
        r: dict[str, Any] = {"point": point_label(p)}
        for path in kinds:
            for page in (1, 64):
                r[f"{path}{page}"] = paths.us(path, p, page)
        for peer in (FM_BF16, FM_FP8):
            r[peer] = paths.us(peer, p) or (bench.us(peer, p) if bench else None)
        rows.append(r)
    cols = {"one request of": "point", **{f"{KERNEL_NAMES[k]}, page {page}": (f"{k}{page}", number(1))
                                          for k in kinds for page in (1, 64)}}
    if any(r.get(FM_BF16) or r.get(FM_FP8) for r in rows):
        cols.update({label(FM_BF16): (FM_BF16, number(1)), label(FM_FP8): (FM_FP8, number(1))})
    return Table(rows, cols, paths.caption + " µs per call; CUDA graphs, L2 flushed.")


def floor_text(paths: Grid, bench: Grid | None = None) -> tuple[str, dict[str, Any]]:
    """Each kernel's fixed cost -- one request of the paths run's floor context at every head count -- as ranges:
    ours' paths (page 1) and FlashMLA's kernels where the run timed them; Markdown and the values."""
    pts = paths.floor_points
    if not pts:
        return "", {}

    def rng(strategy: str, page: int | None) -> tuple[float, float] | None:
        xs = [u for p in pts if (u := paths.us(strategy, p, page) or (bench.us(strategy, p) if bench else None))]
        return (min(xs), max(xs)) if xs else None

    found = {k: r for k, page in (("wgmma_tokens", 1), ("wgmma", 1), ("triton", 1), (FM_BF16, None), (FM_FP8, None))
             if (r := rng(k, page))}
    parts = [f"{label(k)} {lo:.1f}–{hi:.1f} µs" for k, (lo, hi) in found.items()]
    heads = ", ".join(str(p[0]) for p in pts)
    text = (f"One request of {pts[0][1]} tokens, {heads} heads — each kernel's fixed cost (queries in, plan, one "
            f"tile, the write): " + "; ".join(parts) + ".")
    return text, {k: list(v) for k, v in found.items()}
