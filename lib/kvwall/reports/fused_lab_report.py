"""Chapter 5's lab detail (its appendix page, and the short summaries the chapter quotes): the Triton path's tuning
screen and splits sweep, the spill rule, the compiled loop's instruction mix, Nsight Compute on each path's split
kernel, the dispatcher's measured table and each path's fixed cost (:mod:`.dispatch_report`, re-exported here), and
every path's contracts.

Reads the recorded ``fused_decode_tuning``, ``fused_decode_paths``, ``fused_decode_profile`` and
``fused_decode_validation`` results; every number shown comes from them (or, for the instruction mix, from compiling
the kernel here); the sentences are computed from them.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any, Mapping

import plotly.graph_objects as go

from kvwall.experiments.fused_decode.strategies import STRATEGIES
from kvwall.model.paths import KERNEL_NAMES
from kvwall.reports import plots
from kvwall.reports.dispatch_report import (dispatcher_table, dispatcher_text, floor_table, floor_text,
                                             other_gpus_table, timed_paths)
from kvwall.reports.fused_bench_report import (FLASHINFER, FM_BF16, FM_FP8, OURS, OURS_PAGE64, SGLANG, SHORT, Grid,
                                               context_label, label, point_label, us_cell)
from kvwall.reports.tables import Table, number, percent, plain, scientific, times
from kvwall.results import Result

__all__ = ["launch_shape", "screen_table", "split_sweep_figure", "winners_table", "spill_rule_table", "pairs_lesson",
           "loop_mix", "instruction_mix_table", "ncu_rows", "ncu_summary", "ncu_table", "stall_table", "ncu_brief",
           "ncu_text", "timed_paths", "dispatcher_table", "dispatcher_text", "other_gpus_table", "floor_table",
           "floor_text", "contracts_table", "bench_tables", "page_table", "balance_table", "host_table"]


# --------------------------------------------------------------------------------------------------
# The Triton path's tuning
# --------------------------------------------------------------------------------------------------


def launch_shape(row: Mapping[str, Any]) -> str:
    """A tuning row's launch shape in words, from its ``cfg_*`` fields (rows recorded with kernel options since
    retired name them too)."""
    extra = [w for k, w in (("cfg_s_fp8", "FP8 scores"), ("cfg_tokens_m", "tokens as M")) if row.get(k)]
    if row.get("cfg_convert") not in (None, "cvt"):
        extra.append(f"{row['cfg_convert']} conversion")
    if row.get("cfg_cache_v") not in (None, row.get("cfg_cache_k", "")):
        extra.insert(0, "two loads")  # a second load of the tile for p @ kv, with its own cache hint (retired)
    tile = "16-bit pairs" if row.get("cfg_pairs") else "FP8 bytes"
    return ", ".join([f"{row['cfg_block_h']}×{row['cfg_block_n']}", f"{row['cfg_num_warps']} warps",
                      f"{row['cfg_num_stages']} stages", tile, *extra])


def _share(row: Mapping[str, Any]) -> float | None:
    return row["roofline_us"] / row["us"] if row.get("us") else None


def screen_table(tuning: Result, heads: int | None = None) -> Table:
    """The tuning screen (of one head count, or all): each candidate's resources, error against float32, µs and
    share of the roofline, fastest first."""
    screen = sorted((r for r in tuning.table("screen") if heads is None or r["heads"] == heads),
                    key=lambda r: (r["heads"], r.get("us") or float("inf")))
    rows = [{**r, "shape": launch_shape(r), "smem_kb": (r.get("shared_bytes") or 0) / 1024, "share": _share(r),
             "us_or_error": f"{r['us']:.1f}" if r.get("us") else (r.get("error") or "")[:40]} for r in screen]
    cols = {"heads": "heads", "launch shape": "shape", "registers": "regs", "spills": "spills",
            "smem KB": ("smem_kb", number(0)), "error vs fp32": ("rel_err", scientific), "µs": "us_or_error",
            "of roofline": ("share", percent)}
    if heads is not None:
        cols.pop("heads")
    return Table(rows, cols, tuning.caption() + f" Batch 1, one request of {screen[0]['tokens'] // 1024 if screen else 0}K "
                 "random slots, the launcher's default plan, CUDA graph, L2 flushed.")


def _same_config(row: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    return all(row.get(k) == other[k] for k in other if k.startswith("cfg_"))


def split_sweep_figure(tuning: Result, heads: int = 16) -> go.Figure:
    """Time against chunks per request, for the winning shape at each context."""
    sweep = tuning.table("sweep")
    fig = go.Figure()
    for w in sorted(tuning.table("winner"), key=lambda r: r["tokens"]):
        if w["heads"] != heads:
            continue
        points = sorted((r["splits"], r["us"]) for r in sweep if r["heads"] == heads and r["tokens"] == w["tokens"]
                        and r["splits"] and r.get("us") and _same_config(r, w))
        if not points:
            continue
        fig.add_scatter(name=f"{w['tokens'] // 1024}K tokens", x=[p[0] for p in points], y=[p[1] for p in points],
                        mode="lines+markers")
    fig.update_layout(title=f"The Triton path, {heads} heads, batch 1: time against chunks per request",
                      xaxis_title="chunks per request (the plan's items at batch 1)",
                      yaxis_title="µs (CUDA graph, L2 flushed)")
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    return plots.with_caption(fig, tuning.caption(), legend="top")


def winners_table(tuning: Result) -> Table:
    """The shape and chunks the launcher uses at each (heads, context), with its two kernels' times."""
    rows = [{"point": f"{w['heads']} h, {w['tokens'] // 1024}K", "shape": launch_shape(w),
             "splits": w["splits"] or "default", "us": w["us"], "split_us": w.get("split_kernel_us"),
             "combine_us": w.get("combine_kernel_us"), "share": _share(w)}
            for w in sorted(tuning.table("winner"), key=lambda r: (r["heads"], r["tokens"]))]
    return Table(rows, {"point": "point", "winning shape": "shape", "chunks": "splits", "µs": ("us", number(1)),
                        "split µs": ("split_us", number(1)), "combine µs": ("combine_us", number(1)),
                        "of roofline": ("share", percent)},
                 tuning.caption() + " Kernel times from torch.profiler (L2 warm, without graph gaps).")


def spill_rule_table(tuning: Result) -> Table:
    """Per head count: the fastest candidate of the screen against the fastest that does not spill registers (the
    one the launcher ships), at the screening point."""
    fastest = {r["heads"]: r for r in tuning.rows if r.get("section") == "fastest_any"}
    rows = []
    for heads, f in sorted(fastest.items()):
        clean = min((r for r in tuning.table("screen") if r["heads"] == heads and r.get("us") and r.get("spills") == 0),
                    key=lambda r: r["us"], default=None)
        rows.append({"heads": heads, "fastest": launch_shape(f), "f_us": f.get("us"), "f_spills": f.get("spills"),
                     "c_us": clean["us"] if clean else None,
                     "x": clean["us"] / f["us"] if clean and f.get("us") else None})
    return Table(rows, {"heads": "heads", "fastest candidate": "fastest", "µs": ("f_us", number(1)),
                        "its spills": "f_spills", "fastest without spills, µs": ("c_us", number(1)),
                        "cost of the rule: µs without spills / fastest µs": ("x", times(2))},
                 tuning.caption() + " Batch 1, the screening point; spills: Triton's n_spills.")


def pairs_lesson(tuning: Result, heads: int = 16) -> tuple[str, dict[str, float]]:
    """What reading the tile as 16-bit pairs bought at ``heads``: the winner against its twin that reads FP8 bytes;
    Markdown and the numbers."""
    timed = [r for r in tuning.table("screen") if r["heads"] == heads and r.get("us")]
    if not timed:
        return "", {}
    best = min(timed, key=lambda r: r["us"])

    def twin(**diff: Any) -> dict[str, Any] | None:
        keep = [k for k in best if k.startswith("cfg_") and k[4:] not in diff and not k.startswith("cfg_combine")]
        return next((r for r in timed if all(r.get(k) == best[k] for k in keep)
                     and all(r.get(f"cfg_{k}") == v for k, v in diff.items())), None)

    lines = [f"The winner at {heads} heads ({launch_shape(best)}): **{best['us']:.1f} µs**, {best['regs']} registers, "
             f"{best['shared_bytes'] / 1024:.0f} KB of shared memory per program."]
    values = {"winner_us": best["us"]}
    if best.get("cfg_pairs") and (b := twin(pairs=False)):
        lines.append(f"- the same shape reading FP8 bytes (a shared-memory load per byte): **{b['us']:.1f} µs** "
                     f"({b['us'] / best['us']:.2f}×), {b['regs']} registers")
        values["bytes_us"] = b["us"]
    return "\n".join(lines), values


def loop_mix(config: Any, cap: int = 90) -> dict[str, Any]:
    """The Triton path's split kernel (work-list launch) with launch shape ``config`` compiled offline for ``cap`` (no
    GPU needed): PTX instructions of its token loop (the longest backward branch) per thread, each statement of an
    inline-assembly block counted (the 16-bit pairs' conversion is one), and how many are one-byte shared-memory
    loads."""
    import os

    import triton

    from kvwall.kernels.mla_decode.kernel import compile_offline, split_constexprs

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    ptx = compile_offline("split", split_constexprs(config), config.num_warps, config.num_stages,
                          cap).asm["ptx"].splitlines()
    labels = {line.split(":")[0].strip(): i for i, line in enumerate(ptx) if re.match(r"^\$L__BB\d+_\d+:", line.strip())}
    loop = (0, 0)
    for i, line in enumerate(ptx):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i and i - labels[m.group(1)] > loop[1] - loop[0]:
            loop = (labels[m.group(1)], i)
    counts: Counter = Counter()
    byte_loads = 0
    for line in ptx[loop[0]:loop[1]]:
        for stmt in line.replace("{", ";").replace("}", ";").split(";"):
            m = re.match(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*)((?:\.[a-z0-9_]+)*)", stmt)
            if not m or m.group(1) == "reg":
                continue
            mods = m.group(2).split(".")
            op = m.group(1) + (f".{mods[1]}" if m.group(1) in ("ld", "st", "cp", "mma", "wgmma", "cvt") and len(mods) > 1
                               else "")
            counts[op] += 1
            byte_loads += m.group(1) == "ld" and m.group(2).startswith(".shared") and m.group(2).endswith(".b8")
    row = {f"cfg_{k}": v for k, v in dataclasses.asdict(config).items()}
    return {"counts": counts, "total": sum(counts.values()), "byte_loads": byte_loads, "shape": launch_shape(row),
            "triton": triton.__version__}


def instruction_mix_table(mix: Mapping[str, Any], other: Mapping[str, Any] | None = None, top: int = 12) -> Table:
    """The PTX instruction counts of the split kernel's token loop (:func:`loop_mix`) per thread per tile, and beside
    them another shape's (``other``)."""
    ops = [k for k, _ in (mix["counts"] + (other["counts"] if other else Counter())).most_common(top)]
    rows = [{"op": k, "n": mix["counts"].get(k, 0), "m": other["counts"].get(k, 0) if other else None} for k in ops]
    rows.append({"op": "all instructions", "n": mix["total"], "m": other["total"] if other else None})
    rows.append({"op": "of them one-byte shared-memory loads", "n": mix["byte_loads"],
                 "m": other["byte_loads"] if other else None})
    columns = {"PTX instruction (token loop)": "op", mix["shape"]: "n"}
    if other:
        columns[other["shape"]] = "m"
    return Table(rows, columns, f"Computed here: Triton {mix['triton']} compiling the Triton path for sm_90; per "
                                "thread per 64-token tile.")


# --------------------------------------------------------------------------------------------------
# Nsight Compute, per path
# --------------------------------------------------------------------------------------------------


def ncu_rows(profile: Result) -> list[dict[str, Any]]:
    """The profile rows that ran, Triton path first."""
    rows = [r for r in profile.rows if r.get("section") == "profile" and not r.get("error") and r.get("duration_ns")]
    return sorted(rows, key=lambda r: (list(KERNEL_NAMES).index(r["path"]), r["heads"], r["tokens"]))


def _stalls(row: Mapping[str, Any]) -> list[str]:
    return sorted((k for k in row if k.startswith("stall_") and row[k] is not None), key=lambda k: -row[k])


def _ncu_point(r: Mapping[str, Any]) -> str:
    return f"{KERNEL_NAMES[r['path']]}, {r['heads']} h, {r['tokens'] // 1024}K"


def ncu_summary(profile: Result) -> Table:
    """The chapter's view of Nsight Compute: per path and point, HBM's share of its peak, the tensor pipe's busy
    share, achieved occupancy, issue slots busy and the largest stall reason."""
    rows = []
    for r in ncu_rows(profile):
        top = _stalls(r)[0] if _stalls(r) else None
        rows.append({"point": _ncu_point(r), "dram": r.get("dram_pct_of_peak"), "tensor": r.get("tensor_pipe_pct"),
                     "occ": r.get("achieved_occupancy_pct"), "issue": r.get("issue_active_pct"),
                     "stall": f"{top[6:].replace('_', ' ')} ({r[top]:.1f})" if top else "—"})
    return Table(rows, {"path, heads, tokens (batch 1)": "point", "HBM % of peak": ("dram", number(0)),
                        "tensor pipe busy %": ("tensor", number(0)),
                        "occupancy %": ("occ", number(1)), "issue slots busy %": ("issue", number(0)),
                        "largest stall (warps per issue)": "stall"},
                 profile.caption() + " One launch of each path's split kernel; ncu locks clocks to base.")


def ncu_table(profile: Result) -> Table:
    """Nsight Compute's view of each path's split kernel: bytes against the minimum, rates, resources, occupancy."""
    rows = [{**r, "point": _ncu_point(r), "us": r["duration_ns"] / 1e3,
             "dram": (r.get("dram_read_bytes") or 0) / r["min_bytes"], "l2": (r.get("l2_bytes") or 0) / r["min_bytes"],
             "gbps": (r.get("dram_read_bytes") or 0) / r["duration_ns"],
             "smem_kb": (r.get("dynamic_smem_bytes") or 0) / 1024,
             "occ": f"{r.get('theoretical_occupancy_pct') or 0:.1f} / {r.get('achieved_occupancy_pct') or 0:.1f}"}
            for r in ncu_rows(profile)]
    return Table(rows, {"point": "point", "µs under ncu": ("us", number(1)), "HBM read / minimum": ("dram", times(2)),
                        "HBM GB/s": ("gbps", number(0)), "L2 / minimum": ("l2", times(1)),
                        "tensor pipe busy %": ("tensor_pipe_pct", number(0)),
                        "shared ld/st % of peak": ("shared_lsu_pct", number(0)),
                        "registers": ("registers_per_thread", number(0)), "smem KB": ("smem_kb", number(0)),
                        "occupancy % (theory / achieved)": ("occ", plain)},
                 profile.caption() + " Minimum: kvwall.model.roofline.kv_read_bytes (580 B per token). Tensor pipe: "
                 "sm__pipe_tensor_cycles_active over elapsed cycles (wgmma and mma.sync); shared ld/st: the "
                 "shared-memory load and store wavefronts, not wgmma's operand reads.")


def stall_table(profile: Result) -> Table:
    """Each profiled launch's stall reasons (warps per issued instruction), largest first by the first launch."""
    prof = ncu_rows(profile)
    keys = _stalls(prof[0]) if prof else []
    rows = [{"reason": k[6:].replace("_", " "), **{str(i): r.get(k) for i, r in enumerate(prof)}} for k in keys]
    return Table(rows, {"stall reason": "reason", **{_ncu_point(r): (str(i), number(2)) for i, r in enumerate(prof)}},
                 profile.caption())


def ncu_brief(profile: Result) -> str:
    """One sentence over every profiled launch: the ranges of HBM's share of its peak, occupancy and busy issue
    slots."""
    prof = ncu_rows(profile)
    if not prof:
        return "Nsight Compute profiled no launch in this recording."

    def rng(key: str, unit: str = " %") -> str:
        xs = [r[key] for r in prof if r.get(key) is not None]
        return (f"{min(xs):.0f}" if round(min(xs)) == round(max(xs)) else f"{min(xs):.0f}–{max(xs):.0f}") + unit \
            if xs else "—"

    names = [f"the {KERNEL_NAMES[k]}" for k in KERNEL_NAMES if any(r["path"] == k for r in prof)]
    which = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    tensor = (f", the tensor pipe busy in **{rng('tensor_pipe_pct')}**"
              if any(r.get("tensor_pipe_pct") is not None for r in prof) else "")
    return (f"Over the {len(prof)} profiled launches ({which}): HBM at **{rng('dram_pct_of_peak')}** of its peak, "
            f"**{rng('achieved_occupancy_pct')}** of a multiprocessor's warps resident, issue slots busy in "
            f"**{rng('issue_active_pct')}** of cycles{tensor}.")


def ncu_text(profile: Result) -> tuple[str, dict[str, Any]]:
    """What Nsight Compute says limits each path: HBM's share, occupancy, issue, the top stalls; and the values."""
    prof = ncu_rows(profile)
    if not prof:
        errors = [r.get("error") for r in profile.rows if r.get("section") == "profile" and r.get("error")]
        return "Nsight Compute profiled no launch in this recording" + (f" ({errors[0]})." if errors else "."), {}
    parts, values = [], {}
    for r in prof:
        top = ", ".join(f"{k[6:].replace('_', ' ')}" for k in _stalls(r)[:2])
        tensor = (f", the tensor pipe busy {r['tensor_pipe_pct']:.0f} % of the time"
                  if r.get("tensor_pipe_pct") is not None else "")
        parts.append(f"the {_ncu_point(r)} reads HBM at {r['dram_pct_of_peak']:.0f} % of its peak with "
                     f"{r['achieved_occupancy_pct']:.1f} % occupancy and {r['issue_active_pct']:.0f} % of issue slots "
                     f"busy{tensor} (stalls mostly {top})")
        values[f"{r['path']}_{r['heads']}h"] = {k: r.get(k) for k in ("dram_pct_of_peak", "achieved_occupancy_pct",
                                                                      "issue_active_pct", "tensor_pipe_pct")}
    text = "Under Nsight Compute, " + "; ".join(parts) + "."
    return text, values


# --------------------------------------------------------------------------------------------------
# Contracts
# --------------------------------------------------------------------------------------------------


def contracts_table(validation: Result) -> Table:
    """Every contract (one row each) on every path it ran on (one column each)."""
    con = [r for r in validation.rows if r.get("section") == "contract"]
    paths = [p for p in (*KERNEL_NAMES, "ours") if any(r["path"] == p for r in con)]
    checks: dict[str, dict[str, Any]] = {}
    for r in con:
        checks.setdefault(r["check"], {"check": r["check"]})[r["path"]] = "yes" if r["ok"] else "NO"
    names = {"ours": "ours", **KERNEL_NAMES}
    return Table(list(checks.values()), {"contract": "check", **{names[p]: p for p in paths}},
                 validation.caption() + " The details of each check are in the recorded rows (`detail`).")


# ---------------------------------------------------------------------------------------------------------
# The appendix's full tables
# ---------------------------------------------------------------------------------------------------------


def bench_tables(grid: Grid) -> list[Table]:
    """One table per head count: µs of every strategy at every point (FlashInfer's native FP8: the faster of fa2 and
    fa3), beside the roofline; ten columns, so that it fits the page."""
    order = [OURS, FM_BF16, FM_FP8, "flashinfer_fp8", "flashinfer_bf16_precast", SGLANG, "gather_cast_bf16",
             "full_cast_bf16"]
    names = {**SHORT, "flashinfer_fp8": "FI FP8"}
    present = set(grid.strategies())
    shown = [s for s in order if s in present or (s == "flashinfer_fp8" and present & set(FLASHINFER[:2]))]
    labels = {**{s: label(s) for s in shown if s in STRATEGIES}, "flashinfer_fp8": "FlashInfer native FP8, the faster "
              "of fa2 and fa3"}
    legend = "; ".join(f"{names[s]} = {labels[s]}" for s in shown if s != OURS)
    tables = []
    for h in sorted({p[0] for p in grid.points}):
        rows = []
        for p in (q for q in grid.points if q[0] == h):
            fi8 = min((u for u in (grid.us(s, p) for s in FLASHINFER[:2]) if u), default=None)
            rows.append({"point": f"{context_label(p[1])}·{p[2]}", "roof": (grid.row(OURS, p) or {}).get("roofline_us"),
                         **{s: fi8 if s == "flashinfer_fp8" else grid.us(s, p) for s in shown}})
        cols = {f"{h} h: ctx·batch": "point", "roofline": ("roof", us_cell), **{names[s]: (s, us_cell) for s in shown}}
        tables.append(Table(rows, cols, grid.caption + f" µs per layer, {h} heads; ctx·batch: context (K tokens) and "
                                                       f"batch. {legend}. The path ours ran: the dispatcher's table "
                                                       "below."))
    return tables


def page_table(bench: Grid, paths: Grid | None = None) -> Table:
    """Per head count, the time on SGLang's page-1 layout over the time on FlashMLA's 64-token pages (the same tokens
    per request), its range over the grid's points: ours (the bench), and each path forced (the paths run)."""
    def ratios(strategy: str, grid: Grid, h: int, forced: bool) -> str:
        xs = []
        for p in (q for q in grid.points if q[0] == h):
            one = grid.us(strategy, p, 1) if forced else grid.us(OURS, p)
            many = grid.us(strategy, p, 64) if forced else grid.us(OURS_PAGE64, p)
            if one and many:
                xs.append(one / many)
        return f"{min(xs):.2f}–{max(xs):.2f}×" if xs else "—"

    rows = []
    for h in sorted({p[0] for p in bench.points}):
        r = {"heads": h, "ours": ratios(OURS, bench, h, False)}
        if paths:
            r.update({k: ratios(k, paths, h, True) for k in timed_paths(paths)})
        rows.append(r)
    cols = {"heads": "heads", "ours: page 1 / page 64": "ours"}
    if paths:
        cols.update({f"{KERNEL_NAMES[k]}: page 1 / page 64": k for k in timed_paths(paths)})
    return Table(rows, cols, bench.caption + (" Paths forced: " + paths.caption if paths else "")
                 + " Range over each head count's points; below 1× page 1 is the faster.")


def balance_table(grid: Grid) -> Table:
    """Mixed batches under ours' plan: work items, the plan's imbalance (largest item over the mean), ns per token,
    against batch 1's ns per token at the same head count (its longest context)."""
    rows = []
    for p in grid.points:
        r = grid.row(OURS, p)
        if not r or not r.get("us") or p[2] == 1:
            continue
        single = max((q for q in grid.points if q[0] == p[0] and q[2] == 1 and grid.us(OURS, q)), key=lambda q: q[1],
                     default=None)
        b1 = grid.row(OURS, single) if single else None
        rows.append({"point": point_label(p), "lens": f"{r['len_min']:,}–{r['len_max']:,}", "items": r.get("work_items"),
                     "imbalance": r.get("imbalance"), "per_token": r["us"] / r["tokens"] * 1e3,
                     "b1": b1["us"] / b1["tokens"] * 1e3 if b1 else None})
    return Table(rows, {"point": "point", "request lengths": "lens", "work items": "items",
                        "largest item / mean": ("imbalance", times(2)), "ns per token": ("per_token", number(2)),
                        "batch 1, longest context: ns per token": ("b1", number(2))},
                 grid.caption + " Ours (the path it ran is in the tables above); work items of its plan.")


def host_table(grid: Grid, heads: int = 16) -> Table:
    """Host µs per eager (uncaptured) call of every strategy at batch 1, one column per context."""
    contexts = sorted({p[1] for p in grid.points if p[0] == heads and p[2] == 1})
    rows = [{"s": label(s), **{c: (grid.row(s, (heads, c, 1)) or {}).get("host_us") for c in contexts}}
            for s in grid.strategies() if any((grid.row(s, (heads, c, 1)) or {}).get("host_us") for c in contexts)]
    return Table(rows, {f"{heads} heads, batch 1": "s", **{f"{context_label(c)} host µs": (c, number(0)) for c in contexts}},
                 grid.caption + " " + grid.ceilings.get("host_us_means", ""))
