"""Chapter 5's lab detail (its appendix page, and the numbers the chapter quotes from it), as numbers and tables:
the Triton path's tuning screen and splits sweep, the spill rule, the compiled loop's instruction mix, Nsight Compute
on each path's split kernel, the dispatcher's measured table and each path's fixed cost (:mod:`.dispatch_report`,
re-exported here), every path's contracts, and the full tables of the benchmark's grid.

Reads the recorded ``fused_decode_tuning``, ``fused_decode_paths``, ``fused_decode_profile``,
``fused_decode_validation`` and ``fused_decode_bench`` results; every number shown comes from them (or, for the
instruction mix, from compiling the kernel here). The pages write the sentences and captions around them.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any, Mapping

import plotly.graph_objects as go

from kvwall.experiments.fused_decode.strategies import STRATEGIES
from kvwall.model.step_paths import KERNEL_NAMES
from kvwall.reports import plots
from kvwall.reports.dispatch_report import (
    dispatch_counts,  # noqa: F401 - re-exported
    dispatcher_table,  # noqa: F401 - re-exported
    floor_ranges,  # noqa: F401 - re-exported
    floor_table,  # noqa: F401 - re-exported
    other_gpus_table,  # noqa: F401 - re-exported
    timed_paths,
)
from kvwall.reports.fused_bench_report import (
    WORDS,
    FLASHINFER,
    FM_BF16,
    FM_FP8,
    OURS,
    OURS_PAGE64,
    SGLANG,
    SHORT,
    Grid,
    Row,
    context_label,
    label,
    point_label,
    rows_of,
    us_cell,
)
from kvwall.reports.tables import MISSING, Table, number
from kvwall.reports.words import columns
from kvwall.results import Result

# --------------------------------------------------------------------------------------------------
# The Triton path's tuning
# --------------------------------------------------------------------------------------------------

#: The tuning result's sections: every candidate launch shape screened (at 128K tokens), and the winners (the
#: shapes it picked, per heads and tokens).
SCREEN, WINNER = "screen", "winner"


def launch_shape(row: Mapping[str, Any]) -> str:
    """A tuning row's launch shape in words, from its ``cfg_*`` fields (rows recorded with kernel options since
    retired name them too: a second load of the tile with its own cache hint, FP8 scores, tokens as M, another
    conversion)."""
    r = Row(row)
    retired = [
        ("two loads", r.cfg_cache_v not in (None, r.cfg_cache_k or "")),
        ("FP8 scores", r.cfg_s_fp8),
        ("tokens as M", r.cfg_tokens_m),
        (f"{r.cfg_convert} conversion", r.cfg_convert not in (None, "cvt")),
    ]
    return ", ".join(
        [
            f"{r.cfg_block_h}×{r.cfg_block_n}",
            f"{r.cfg_num_warps} warps",
            f"{r.cfg_num_stages} stages",
            "16-bit pairs" if r.cfg_pairs else "FP8 bytes",
            *(said for said, used in retired if used),
        ]
    )


def _share(r: Row) -> float | None:
    return r.roofline_us / r.us if r.us else None


def screen_table(tuning: Result, heads: int, caption: str) -> Table:
    """The tuning screen of one head count: each candidate's resources, error against float32, µs (or why it did not
    run) and share of the roofline, fastest first."""
    screen = sorted((r for r in rows_of(tuning, SCREEN) if r.heads == heads), key=lambda r: r.us or float("inf"))
    rows = [
        dict(
            r,
            shape=launch_shape(r),
            smem_kb=(r.shared_bytes or 0) / 1024,
            share=_share(r),
            us_or_error=f"{r.us:.1f}" if r.us else (r.error or "")[:40],
        )
        for r in screen
    ]
    return Table(rows, columns(WORDS.screen_table), caption)


def split_sweep_figure(tuning: Result, caption: str, heads: int = 16) -> go.Figure:
    """Time against chunks per request, for the winning shape at each context."""
    sweep, fig = rows_of(tuning, "sweep"), go.Figure()
    for w in sorted((w for w in rows_of(tuning, WINNER) if w.heads == heads), key=lambda w: w.tokens):
        same = [
            r
            for r in sweep
            if (r.heads, r.tokens) == (heads, w.tokens)
            and r.splits
            and r.us
            and all(r.get(k) == v for k, v in w.items() if k.startswith("cfg_"))
        ]
        if same:
            points = sorted((r.splits, r.us) for r in same)
            fig.add_scatter(
                name=f"{w.tokens // 1024}K tokens",
                x=[p[0] for p in points],
                y=[p[1] for p in points],
            )
    labels = WORDS.split_sweep_figure
    fig.update_layout(title=labels.title.format(heads=heads), xaxis_title=labels.x, yaxis_title=labels.y)
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return plots.with_caption(fig, caption, legend="top")


def winners_table(tuning: Result, caption: str) -> Table:
    """The shape and chunks the launcher uses at each (heads, context), with its two kernels' times."""
    rows = [
        dict(
            point=f"{w.heads} h, {w.tokens // 1024}K",
            shape=launch_shape(w),
            splits=w.splits or "default",
            us=w.us,
            split_us=w.split_kernel_us,
            combine_us=w.combine_kernel_us,
            share=_share(w),
        )
        for w in sorted(rows_of(tuning, WINNER), key=lambda r: (r.heads, r.tokens))
    ]
    return Table(rows, columns(WORDS.winners_table), caption)


def spill_rule_table(tuning: Result, caption: str) -> Table:
    """Per head count: the fastest candidate of the screen against the fastest that does not spill registers (the
    one the launcher ships), at the screening point."""
    rows = []
    for f in sorted(rows_of(tuning, "fastest_any"), key=lambda r: r.heads):
        clean = min(
            (r for r in rows_of(tuning, SCREEN) if r.heads == f.heads and r.us and r.spills == 0),
            key=lambda r: r.us,
            default=Row(),
        )
        rows.append(
            dict(
                heads=f.heads,
                fastest=launch_shape(f),
                f_us=f.us,
                f_spills=f.spills,
                c_us=clean.us,
                x=clean.us / f.us if clean.us and f.us else None,
            )
        )
    return Table(rows, columns(WORDS.spill_rule_table), caption)


def pairs_numbers(tuning: Result, heads: int = 16) -> dict[str, Any]:
    """What reading the tile as 16-bit pairs bought at ``heads``: the screen's winner (``shape``, ``us``, ``regs``,
    ``smem_kb``) and, where it reads pairs, its twin that reads FP8 bytes (``bytes_us``, ``bytes_regs``; None where
    the screen has no such twin); {} where nothing was timed at ``heads``."""
    timed = [r for r in rows_of(tuning, SCREEN) if r.heads == heads and r.us]
    if not timed:
        return {}
    best = min(timed, key=lambda r: r.us)
    keep = [k for k in best if k.startswith("cfg_") and k != "cfg_pairs" and not k.startswith("cfg_combine")]
    twin = next(
        (r for r in timed if best.cfg_pairs and not r.cfg_pairs and all(r.get(k) == best[k] for k in keep)), Row()
    )
    return dict(
        shape=launch_shape(best),
        us=best.us,
        regs=best.regs,
        smem_kb=best.shared_bytes / 1024,
        bytes_us=twin.us,
        bytes_regs=twin.regs,
    )


def loop_mix(config: Any, cap: int = 90) -> dict[str, Any]:
    """The Triton path's split kernel (work-list launch) with launch shape ``config`` compiled offline for ``cap`` (no
    GPU needed): PTX instructions of its token loop (the longest backward branch) per thread (``counts``, ``total``),
    each statement of an inline-assembly block counted (the 16-bit pairs' conversion is one), how many are one-byte
    shared-memory loads (``byte_loads``), the launch ``shape`` in words and the ``triton`` version."""
    import os

    import triton

    from kvwall.kernels.mla_decode.launch_shape import compile_offline, split_constexprs

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    ptx = (
        compile_offline("split", split_constexprs(config), config.num_warps, config.num_stages, cap)
        .asm["ptx"]
        .splitlines()
    )
    labels = {m.group(1): i for i, line in enumerate(ptx) if (m := re.match(r"^\s*(\$L__BB\d+_\d+):", line))}
    loop = (0, 0)
    for i, line in enumerate(ptx):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i and i - labels[m.group(1)] > loop[1] - loop[0]:
            loop = (labels[m.group(1)], i)
    counts: Counter = Counter()
    byte_loads = 0
    for stmt in (s for line in ptx[loop[0] : loop[1]] for s in re.split(r"[{};]", line)):
        m = re.match(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*)((?:\.[a-z0-9_]+)*)", stmt)
        if not m or m.group(1) == "reg":
            continue
        op, mods = m.group(1), m.group(2).split(".")
        counts[op + (f".{mods[1]}" if op in ("ld", "st", "cp", "mma", "wgmma", "cvt") and len(mods) > 1 else "")] += 1
        byte_loads += op == "ld" and m.group(2).startswith(".shared") and m.group(2).endswith(".b8")
    row = {f"cfg_{k}": v for k, v in dataclasses.asdict(config).items()}
    return dict(
        counts=counts,
        total=sum(counts.values()),
        byte_loads=byte_loads,
        shape=launch_shape(row),
        triton=triton.__version__,
    )


def instruction_mix_table(
    mix: Mapping[str, Any], caption: str, other: Mapping[str, Any] | None = None, top: int = 12
) -> Table:
    """The PTX instruction counts of the split kernel's token loop (:func:`loop_mix`) per thread per tile, and beside
    them another shape's (``other``)."""
    mix, other = Row(mix), Row(other or dict(counts=Counter()))
    ops = [k for k, _ in (mix.counts + other.counts).most_common(top)]
    rows = [dict(op=k, n=mix.counts.get(k, 0), m=other.counts.get(k, 0) if other.total else None) for k in ops]
    rows += [
        dict(op="all instructions", n=mix.total, m=other.total),
        dict(op="of them one-byte shared-memory loads", n=mix.byte_loads, m=other.byte_loads),
    ]
    columns = {"PTX instruction (token loop)": "op", mix.shape: "n", **({other.shape: "m"} if other.total else {})}
    return Table(rows, columns, caption)


# --------------------------------------------------------------------------------------------------
# Nsight Compute, per path
# --------------------------------------------------------------------------------------------------


def ncu_rows(profile: Result) -> list[Row]:
    """The profile rows that ran, Triton path first."""
    rows = [r for r in rows_of(profile, "profile") if not r.error and r.duration_ns]
    return sorted(rows, key=lambda r: (list(KERNEL_NAMES).index(r.path), r.heads, r.tokens))


def _stalls(row: Mapping[str, Any]) -> list[str]:
    """The row's stall reasons (its ``stall_*`` fields), largest first."""
    return sorted((k for k in row if k.startswith("stall_") and row[k] is not None), key=lambda k: -row[k])


def _stall_name(field: str) -> str:
    """``stall_long_scoreboard`` -> ``long scoreboard``."""
    return field.removeprefix("stall_").replace("_", " ")


def _ncu_point(r: Row) -> str:
    return f"{KERNEL_NAMES[r.path]}, {r.heads} h, {r.tokens // 1024}K"


def ncu_summary(profile: Result, caption: str) -> Table:
    """The chapter's view of Nsight Compute: per path and point, HBM's share of its peak, the tensor pipe's busy
    share, achieved occupancy, issue slots busy and the largest stall reason."""
    rows = [
        dict(
            r,
            point=_ncu_point(r),
            stall=f"{_stall_name(s[0])} ({r[s[0]]:.1f})" if (s := _stalls(r)) else MISSING,
        )
        for r in ncu_rows(profile)
    ]
    return Table(rows, columns(WORDS.ncu_summary), caption)


def peer_rows(profile: Result) -> list[Row]:
    """The ``peers`` rows that ran (ours beside FlashMLA at one bench point each), point by point in the recorded
    order, the strategies in the recorded order within each."""
    return [r for r in rows_of(profile, "peers") if not r.error and r.duration_ns]


def _launch_us(r: Row, combine: bool) -> float | None:
    """The longest launch of the call whose kernel is (``combine``) or is not a combine, in µs (None: no such)."""
    launches = [Row(k) for k in r.launches or []]
    times = [k.duration_ns / 1e3 for k in launches if k.duration_ns and _is_combine(k.kernel) == combine]
    return max(times) if times else None


def _is_combine(kernel: str | None) -> bool:
    """Whether a kernel's name is a combine's (FlashMLA's and ours' merge of a request's chunks)."""
    return "combine" in (kernel or "")


def _peer_view(r: Row) -> dict[str, Any]:
    """One ``peers`` row as the tables and sentences read it: the point, who, the call's time and its split and
    combine kernels' (µs), which kernel the metrics are of (``longest``: "split" or "combine"), ratios, and every
    metric in millions as ``{name}_m`` (the work counts' columns)."""
    stalls = _stalls(r)
    return dict(
        r,
        point=point_label((r.heads, r.context, r.batch)),
        who=SHORT.get(r.strategy, label(r.strategy)),
        split_us=(split := _launch_us(r, combine=False)),
        combine_us=(combine := _launch_us(r, combine=True)),
        longest=("split", "combine")[_is_combine(r.main_kernel)],
        us_parts=f"{r.total_duration_ns / 1e3:.1f} ({split or 0:.1f} + {combine or 0:.1f})",
        sectors=r.global_ld_sectors / r.global_ld_requests if r.global_ld_requests else None,
        stalls=", ".join(f"{_stall_name(k)} {r[k]:.1f}" for k in stalls[:2]) or MISSING,
        top_stall=_stall_name(stalls[0]) if stalls else None,
        **{f"{k}_m": v / 1e6 for k, v in r.items() if isinstance(v, float)},  # counts in millions
    )


def peer_points(profile: Result) -> list[tuple[int, int, int]]:
    """The (heads, context, batch) points of the ``peers`` section that ran, in the recorded order."""
    return list(dict.fromkeys((r.heads, r.context, r.batch) for r in peer_rows(profile)))


def peer_profile_table(profile: Result, caption: str) -> Table:
    """Ours and FlashMLA side by side under Nsight Compute at each peer point: the call's kernel time, its split and
    combine kernels', then the longest kernel's tensor pipe, shared-memory and L1 traffic, HBM, issue slots and its
    two largest stall reasons."""
    return Table([_peer_view(r) for r in peer_rows(profile)], columns(WORDS.peer_profile_table), caption)


def peer_work_table(profile: Result, caption: str) -> Table:
    """The same launches by the work they issued: warp and wgmma instructions, shared-memory load and store wavefronts
    and bank conflicts, global-load requests and sectors (millions), registers and CTAs."""
    return Table([_peer_view(r) for r in peer_rows(profile)], columns(WORDS.peer_work_table), caption)


def peer_profile_facts(profile: Result) -> dict[tuple[int, int, int], dict[str, dict[str, Any]]]:
    """Per peer point, each strategy's row as :func:`peer_profile_table` reads it (the chapter's sentences)."""
    out: dict[tuple[int, int, int], dict[str, dict[str, Any]]] = {}
    for r in peer_rows(profile):
        out.setdefault((r.heads, r.context, r.batch), {})[r.strategy] = _peer_view(r)
    return out


def ncu_ranges(profile: Result) -> dict[str, Any]:
    """Over every profiled launch: the (least, most) of HBM's share of its peak, achieved occupancy, issue slots busy
    and the tensor pipe's busy share, in % (None where no launch has it), and the paths profiled."""
    prof = ncu_rows(profile)
    keys = ("dram_pct_of_peak", "achieved_occupancy_pct", "issue_active_pct", "tensor_pipe_pct")
    spans = {k: [r[k] for r in prof if r[k] is not None] for k in keys}
    return dict(
        launches=len(prof),
        paths=[k for k in KERNEL_NAMES if any(r.path == k for r in prof)],
        **{k: (min(xs), max(xs)) if xs else None for k, xs in spans.items()},
    )


def ncu_table(profile: Result, caption: str) -> Table:
    """Nsight Compute's view of each path's split kernel: bytes against the minimum, rates, resources, occupancy."""
    rows = [
        dict(
            r,
            point=_ncu_point(r),
            us=r.duration_ns / 1e3,
            dram=(r.dram_read_bytes or 0) / r.min_bytes,
            l2=(r.l2_bytes or 0) / r.min_bytes,
            gbps=(r.dram_read_bytes or 0) / r.duration_ns,
            smem_kb=(r.dynamic_smem_bytes or 0) / 1024,
            occ=f"{r.theoretical_occupancy_pct or 0:.1f} / {r.achieved_occupancy_pct or 0:.1f}",
        )
        for r in ncu_rows(profile)
    ]
    return Table(rows, columns(WORDS.ncu_table), caption)


def stall_table(profile: Result, caption: str) -> Table:
    """Each profiled launch's stall reasons (warps per issued instruction), largest first by the first launch."""
    prof = ncu_rows(profile)
    rows = [
        dict(reason=_stall_name(k), **{str(i): r.get(k) for i, r in enumerate(prof)})
        for k in (_stalls(prof[0]) if prof else [])
    ]
    return Table(
        rows, {"stall reason": "reason", **{_ncu_point(r): (str(i), number(2)) for i, r in enumerate(prof)}}, caption
    )


# --------------------------------------------------------------------------------------------------
# Contracts
# --------------------------------------------------------------------------------------------------


def contracts_table(validation: Result, caption: str) -> Table:
    """Every contract (one row each) on every path it ran on (one column each): ``yes`` or ``NO``."""
    con = rows_of(validation, "contract")
    names = {**KERNEL_NAMES, OURS: OURS}
    checks: dict[str, dict[str, Any]] = {}
    for r in con:
        checks.setdefault(r.check, dict(check=r.check))[r.path] = "yes" if r.ok else "NO"
    return Table(
        list(checks.values()),
        {"contract": "check", **{names[p]: p for p in names if any(r.path == p for r in con)}},
        caption,
    )


# ---------------------------------------------------------------------------------------------------------
# The appendix's full tables
# ---------------------------------------------------------------------------------------------------------


def bench_tables(grid: Grid, caption: str) -> list[Table]:
    """One table per head count: µs of every strategy at every point (FlashInfer's native FP8: the faster of fa2 and
    fa3), beside the roofline; ten columns, so that it fits the page. Each caption: ``caption``, then the short
    names' legend."""
    fi8 = "flashinfer_fp8"
    names = {**SHORT, fi8: "FI FP8"}
    present = set(grid.strategies())
    shown = [
        s
        for s in (OURS, FM_BF16, FM_FP8, fi8, FLASHINFER[2], SGLANG, "gather_cast_bf16", "full_cast_bf16")
        if s in present or (s == fi8 and present & set(FLASHINFER[:2]))
    ]
    labels = {s: label(s) for s in shown if s in STRATEGIES} | {fi8: "FlashInfer native FP8, the faster of fa2 and fa3"}
    legend = "; ".join(f"{names[s]} = {labels[s]}" for s in shown if s != OURS)
    tables = []
    for h in sorted({p[0] for p in grid.points}):
        rows = [
            dict(
                {
                    s: min(filter(None, (grid.us(f, p) for f in FLASHINFER[:2])), default=None)
                    if s == fi8
                    else grid.us(s, p)
                    for s in shown
                },
                point=f"{context_label(p[1])}·{p[2]}",
                roof=(grid.row(OURS, p) or Row()).roofline_us,
            )
            for p in grid.points
            if p[0] == h
        ]
        cols = {f"{h} h: ctx·batch": "point", "roofline": ("roof", us_cell), **{names[s]: (s, us_cell) for s in shown}}
        tables.append(Table(rows, cols, f"{caption} {legend}."))
    return tables


def page_table(bench: Grid, caption: str, paths: Grid | None = None) -> Table:
    """Per head count, the time on SGLang's page-1 layout over the time on FlashMLA's 64-token pages (the same tokens
    per request), its range over the grid's points: ours (the bench), and each path forced (the paths run)."""

    def ratios(grid: Grid, h: int, one: Any, many: Any) -> str:
        xs = [a / b for p in grid.points if p[0] == h and (a := one(p)) and (b := many(p))]
        return f"{min(xs):.2f}–{max(xs):.2f}×" if xs else MISSING

    kinds = timed_paths(paths) if paths else []
    rows = [
        dict(
            heads=h,
            ours=ratios(bench, h, lambda p: bench.us(OURS, p), lambda p: bench.us(OURS_PAGE64, p)),
            **{k: ratios(paths, h, lambda p, k=k: paths.us(k, p, 1), lambda p, k=k: paths.us(k, p, 64)) for k in kinds},
        )
        for h in sorted({p[0] for p in bench.points})
    ]
    cols = {
        "heads": "heads",
        "ours: page 1 / page 64": "ours",
        **{f"{KERNEL_NAMES[k]}: page 1 / page 64": k for k in kinds},
    }
    return Table(rows, cols, caption)


def balance_table(grid: Grid, caption: str) -> Table:
    """Mixed batches under ours' plan: work items, the plan's imbalance (largest item over the mean), ns per token,
    against batch 1's ns per token at the same head count (its longest context)."""
    rows = []
    for p in (p for p in grid.points if p[2] > 1 and grid.us(OURS, p)):
        r = grid.row(OURS, p)
        single = max(
            (q for q in grid.points if q[0] == p[0] and q[2] == 1 and grid.us(OURS, q)),
            key=lambda q: q[1],
            default=None,
        )
        b1 = grid.row(OURS, single) if single else Row()
        rows.append(
            dict(
                point=point_label(p),
                lens=f"{r.len_min:,}–{r.len_max:,}",
                items=r.work_items,
                imbalance=r.imbalance,
                per_token=r.us / r.tokens * 1e3,
                b1=b1.us / b1.tokens * 1e3 if b1.us else None,
            )
        )
    return Table(rows, columns(WORDS.balance_table), caption)


def host_table(grid: Grid, caption: str, heads: int = 16) -> Table:
    """Host µs per eager (uncaptured) call of every strategy at batch 1, one column per context."""
    contexts = sorted({p[1] for p in grid.points if p[0] == heads and p[2] == 1})
    host = {s: {c: (grid.row(s, (heads, c, 1)) or Row()).host_us for c in contexts} for s in grid.strategies()}
    rows = [dict(by, s=label(s)) for s, by in host.items() if any(by.values())]
    return Table(
        rows,
        {f"{heads} heads, batch 1": "s", **{f"{context_label(c)} host µs": (c, number(0)) for c in contexts}},
        caption,
    )
