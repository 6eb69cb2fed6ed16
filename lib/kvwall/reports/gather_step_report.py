"""Chapter 4's decode step after the gather-cast: chapter 1's step model run with each KV strategy
(a recorded ``gather_cast_profile`` run, or a live one), measured by phase clock, unmarked and as a CUDA graph.
Numbers, tables and figures; chapter 4 writes the sentences.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping

from kvwall.model.original import ORIGINAL
from kvwall.results import Result

__all__ = ["SLOW_STEP", "CAPACITY_LABELS", "live_profile_params", "finding", "host_bound", "host_summary", "stalls",
           "breakdown", "gain_rows", "capacity_gain", "capacity_series", "capacity_for", "capacity_readings", "closing"]

#: Slower than this × its strategy's graph step, a phase-clocked step "ran long".
SLOW_STEP = 1.1
#: The strategies the chapter's finding and closing numbers compare.
_BEFORE, _TORCH, _FUSED = "full_pool_cast", "index_then_cast", "gather_cast"


def _by_strategy(result: Result) -> dict[str, dict[str, Any]]:
    return {r["strategy"]: r for r in result.table("strategies")}


def _graphed(result: Result) -> list[dict[str, Any]]:
    """The strategies that have a CUDA-graph step."""
    return [s for s in result.table("strategies") if s.get("graph_step_ms") is not None]


def finding(result: Result) -> dict[str, Any] | None:
    """The measured gain of PyTorch's gather-then-cast over the real length (``torch``) and of the fused kernel
    (``fused``) against the whole-pool cast: each a gain row's time saved and speed-up, from the CUDA-graph steps where
    the run has them (``graphs``), else the phase-clocked ones; None where the run lacks those strategies."""
    if not {_BEFORE, _TORCH, _FUSED} <= set(_by_strategy(result)):
        return None
    gains = {r["strategy"]: r for r in result.table("gain")}
    graphs = _by_strategy(result)[_TORCH].get("graph_step_ms") is not None
    saved, speedup = ("graph_time_saved", "graph_speedup") if graphs else ("time_saved", "speedup")
    return {"graphs": graphs, **{f"{k}_{m}": gains[s][key] for k, s in (("torch", _TORCH), ("fused", _FUSED))
                                 for m, key in (("saved", saved), ("speedup", speedup))}}


def live_profile_params(knobs: Mapping[str, int], small: Mapping[str, Any]) -> dict[str, Any]:
    """The live decode-step run's parameters from the chapter's knobs: the experiment's small-scale capacity
    (at least the context, at most the pool) and the capacities of its sweep that fit the pool."""
    pool, ctx = knobs["pool_tokens"], knobs["context_len"]
    return {"pool_tokens": pool, "layers": knobs["layers"], "context_lens": [ctx],
            "capacity": min(max(small["capacity"], ctx), pool), "capacity_sweep": [c for c in small["capacity_sweep"] if c <= pool]}


def host_bound(result: Result) -> list[dict[str, Any]]:
    """The strategies whose eager step is host-bound: the host takes longer to enqueue the step than the GPU takes
    to run it (its CUDA-graph step, device time alone), so an eager step runs at the host's pace."""
    return [s for s in _graphed(result) if s["host_enqueue_ms"] > s["graph_step_ms"]]


def host_summary(result: Result) -> dict[str, Any] | None:
    """Host against device, over the strategies with a CUDA-graph step: ``strategies`` (their count), ``bound``
    (:func:`host_bound`'s rows), over the others the largest share of their device time the host's enqueue takes
    (``share``, None if none) and the largest eager-step excess over the graph step (``eager_excess_ms``), and how
    close each graph step is to the sum of its phases' graphs (``phase_sum_gap_ms``); None without graph steps."""
    graphed, bound = _graphed(result), host_bound(result)
    others = [s for s in graphed if s not in bound]
    if not graphed:
        return None
    return {"strategies": len(graphed), "bound": bound,
            "share": max((s["host_enqueue_ms"] / s["graph_step_ms"] for s in others), default=None),
            "eager_excess_ms": max((s["unmarked_step_ms"] - s["graph_step_ms"] for s in others), default=None),
            "phase_sum_gap_ms": max(abs(s["graph_step_ms"] - s["graph_phase_sum_ms"]) for s in graphed)}


def stalls(result: Result) -> dict[str, Any] | None:
    """What the phase-clocked steps that ran long (over :data:`SLOW_STEP` × their strategy's graph step) had in
    common: their count of all (``slow``, ``marked``) and strategies; medians of the host's time through the step and
    of the GPU-empty ``kv_free`` phase in them and in the others; garbage-collector passes and the longest pause
    between two host marks in them (None where none ran long); and the most synchronizing torch calls any gather
    strategy makes per step. None when the run has no marked steps or no graph step to compare with."""
    strategies = _by_strategy(result)
    marked = [r for r in result.rows if r["section"] == "marked_steps"]
    if not marked or any(s["graph_step_ms"] is None for s in strategies.values()):
        return None
    slow = [r for r in marked if r["step_ms"] > SLOW_STEP * strategies[r["strategy"]]["graph_step_ms"]]
    normal = [r for r in marked if r not in slow]

    def median(rows: list[dict[str, Any]], key: str) -> float | None:
        return statistics.median(r[key] for r in rows) if rows else None

    return {"marked": len(marked), "slow": len(slow), "slow_strategies": sorted({r["strategy"] for r in slow}),
            "syncs": max(s["syncs_per_step"] for k, s in strategies.items() if k != _BEFORE),
            **{f"{key}_{which}": median(rows, key) for key in ("host_ms", "kv_free_ms")
               for which, rows in (("slow", slow), ("normal", normal))},
            "gc_passes": sum(r["gc_passes"] for r in slow) if slow else None,
            "max_host_gap_ms": max((r["max_host_gap_ms"] for r in slow), default=None)}


def breakdown(result: Result) -> tuple[dict[str, dict[str, float]], bool]:
    """One decode step with each KV strategy, ms per step of each phase, one column per strategy (for
    :func:`kvwall.reports.plots.step_breakdown`): from the per-phase CUDA graphs where the run has them (then True),
    else from the phase clock."""
    graphs = any(r["section"] == "graph_breakdown" for r in result.rows)
    names = {r["strategy"]: r["name"] for r in result.table("strategies")}
    rows = result.table("graph_breakdown" if graphs else "breakdown")
    return {names[s].replace(", ", "<br>", 1): {r["phase"]: r["ms_per_step"] for r in rows
                                                if r["strategy"] == s and r["ms_per_step"] is not None}
            for s in result.params["strategies"]}, graphs


def gain_rows(result: Result) -> list[dict[str, Any]]:
    """Each strategy's row joined with its gain against the whole-pool cast."""
    strategies = _by_strategy(result)
    return [{**strategies[r["strategy"]], **r} for r in result.table("gain")]


#: The capacity sweep's strategies, as its figure names them.
CAPACITY_LABELS = {"index_then_cast_capacity": "PyTorch index_select().to(), over the capacity",
                   "gather_cast_capacity": "gather_cast (Triton), real length from kv_indptr"}


def capacity_gain(result: Result) -> list[dict[str, Any]]:
    """Each capacity row with the step it gives (``step_ms``: the measured 'before' step − its KV time + layers × the
    per-layer KV time at that capacity; CUDA graphs where recorded) and the share of the 'before' step it saves."""
    before = _by_strategy(result)[_BEFORE]
    graph = before.get("graph_step_ms") is not None  # device time: the graph step and its KV phase's graph
    step0, kv0 = (before["graph_step_ms"], before["graph_kv_ms_per_step"]) if graph else (
        before["step_ms"], before["kv_strategy_ms_per_step"])
    steps = [step0 - kv0 + before["layers"] * r["ms_per_layer"] for r in result.table("capacity")]
    return [{**r, "step_ms": step, "time_saved": 1 - step / step0} for r, step in zip(result.table("capacity"), steps)]


def capacity_series(rows: list[dict[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """% of the step saved against the capacity, per strategy of :data:`CAPACITY_LABELS` (for
    :func:`kvwall.reports.plots.lines`)."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for r in rows:
        xs, ys = series.setdefault(CAPACITY_LABELS[r["strategy"]], ([], []))
        xs.append(r["capacity"])
        ys.append(100 * r["time_saved"])
    return series


def capacity_for(rows: list[dict[str, Any]], saved: float) -> tuple[float, dict[str, Any], dict[str, Any]] | None:
    """The capacity at which the step saves ``saved``: linear between the two neighbouring measured capacities whose
    savings bracket it (the per-layer time, and so the step, grows linearly with the capacity), with those two rows;
    None when no neighbouring pair brackets it."""
    pts = sorted(rows, key=lambda r: r["capacity"])
    for a, b in zip(pts, pts[1:]):
        lo, hi = sorted((a["time_saved"], b["time_saved"]))
        if lo != hi and lo <= saved <= hi:
            t = (a["time_saved"] - saved) / (a["time_saved"] - b["time_saved"])
            return a["capacity"] + t * (b["capacity"] - a["capacity"]), a, b
    return None


def capacity_readings(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The capacity sweep read against the original's figure: for each reading (``time_saved``, ``speedup``), the
    share of the step it saves (``saved``), the capacity of PyTorch's gather-then-cast that saves it (``capacity``,
    linear between the measured rows ``a`` and ``b``; None outside the measured range, with the ``nearest`` row
    instead); the fused kernel's rows (``fused``: per capacity, time saved and per-layer µs in a graph and by
    ``do_bench``) and its median host µs per call (``host_us``, None without graph timings)."""
    torch_rows, fused = ([r for r in rows if r["strategy"] == k] for k in CAPACITY_LABELS)
    out: dict[str, Any] = {"fused": fused, "host_us": statistics.median(r["host_us_per_call"] for r in fused)
                           if fused and fused[0].get("ms_per_layer_graph") is not None else None}
    for key, reading in (("time_saved", ORIGINAL.gain_as_time_saved), ("speedup", ORIGINAL.gain_as_speedup)):
        saved, found = reading["time_saved"], capacity_for(torch_rows, reading["time_saved"])
        capacity, a, b = found or (None, None, None)
        out[key] = {"saved": saved, "capacity": capacity, "a": a, "b": b,
                    "nearest": min(torch_rows, key=lambda r: abs(r["time_saved"] - saved)) if torch_rows else None}
    return out


def closing(profile: Result) -> dict[str, Any] | None:
    """The chapter's closing numbers (recorded, CUDA graphs): the graph step of the whole-pool cast, PyTorch's
    gather-then-cast over the real length and the fused kernel (each a strategy row), and the phase-clocked steps that
    still ran long (``slow`` of ``marked``); None where one of the three has no graph step."""
    s = _by_strategy(profile)
    if any(s[k]["graph_step_ms"] is None for k in (_BEFORE, _FUSED, _TORCH)):
        return None
    graphed = {g["strategy"]: g for g in _graphed(profile)}
    marked = [r for r in profile.rows if r["section"] == "marked_steps" and r["strategy"] in graphed]
    slow = [r for r in marked if r["step_ms"] > SLOW_STEP * graphed[r["strategy"]]["graph_step_ms"]]
    return {"before": s[_BEFORE], "torch": s[_TORCH], "fused": s[_FUSED], "slow": len(slow), "marked": len(marked)}
