"""Chapter 4's decode step after the gather-cast: chapter 1's step model run with each KV strategy
(a recorded ``gather_cast_profile`` run, or a live one), measured by phase clock, unmarked and as a CUDA graph.
Numbers and rows; chapter 4 writes the sentences, tables and figures around them.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping

from kvwall.model.original import ORIGINAL
from kvwall.results import Result
from kvwall.reports.rows import Row, rows_of

#: Slower than this × its strategy's graph step, a phase-clocked step "ran long".
SLOW_STEP = 1.1
#: The strategies the chapter's finding and closing numbers compare.
_BEFORE, _TORCH, _FUSED = "full_pool_cast", "index_then_cast", "gather_cast"
#: The capacity sweep's strategies (PyTorch's two kernels over the capacity, the fused kernel), as its figure names
#: them.
CAPACITY_LABELS = {
    "index_then_cast_capacity": "PyTorch index_select().to(), over the capacity",
    "gather_cast_capacity": "gather_cast (Triton), real length from kv_indptr",
}


def _by_strategy(result: Result) -> dict[str, Row]:
    return {r.strategy: r for r in rows_of(result, "strategies")}


def _graphed(result: Result) -> list[Row]:
    """The strategies that have a CUDA-graph step."""
    return [s for s in _by_strategy(result).values() if s.graph_step_ms is not None]


def _slow(marked: list[Row], graphed: Mapping[str, Row]) -> list[Row]:
    """The phase-clocked steps that ran long: over :data:`SLOW_STEP` × their strategy's graph step."""
    return [r for r in marked if r.step_ms > SLOW_STEP * graphed[r.strategy].graph_step_ms]


def finding(result: Result) -> dict[str, Any] | None:
    """The measured gain of PyTorch's gather-then-cast over the real length (``torch_saved``, ``torch_speedup``) and
    of the fused kernel (``fused_saved``, ``fused_speedup``) against the whole-pool cast, from the CUDA-graph steps
    where the run has them (``graphs``), else the phase-clocked ones; None where the run lacks those strategies."""
    strategies = _by_strategy(result)
    if not {_BEFORE, _TORCH, _FUSED} <= set(strategies):
        return None
    gains = {r.strategy: r for r in rows_of(result, "gain")}
    torch, fused, graphs = gains[_TORCH], gains[_FUSED], strategies[_TORCH].graph_step_ms is not None
    if graphs:
        return dict(
            graphs=True,
            torch_saved=torch.graph_time_saved,
            torch_speedup=torch.graph_speedup,
            fused_saved=fused.graph_time_saved,
            fused_speedup=fused.graph_speedup,
        )
    return dict(
        graphs=False,
        torch_saved=torch.time_saved,
        torch_speedup=torch.speedup,
        fused_saved=fused.time_saved,
        fused_speedup=fused.speedup,
    )


def live_profile_params(knobs: Mapping[str, int], small: Mapping[str, Any]) -> dict[str, Any]:
    """The live decode-step run's parameters from the chapter's knobs (``pool_tokens``, ``layers``, ``context_len``):
    the experiment's small-scale capacity (at least the context, at most the pool) and the capacities of its sweep
    that fit the pool."""
    k, s = Row(knobs), Row(small)
    return dict(
        pool_tokens=k.pool_tokens,
        layers=k.layers,
        context_lens=[k.context_len],
        capacity=min(max(s.capacity, k.context_len), k.pool_tokens),
        capacity_sweep=[c for c in s.capacity_sweep if c <= k.pool_tokens],
    )


def host_bound(result: Result) -> list[Row]:
    """The strategies whose eager step is host-bound: the host takes longer to enqueue the step than the GPU takes
    to run it (its CUDA-graph step, device time alone), so an eager step runs at the host's pace."""
    return [s for s in _graphed(result) if s.host_enqueue_ms > s.graph_step_ms]


def host_summary(result: Result) -> dict[str, Any] | None:
    """Host against device, over the strategies with a CUDA-graph step: ``strategies`` (their count), ``bound``
    (:func:`host_bound`'s rows), over the others the largest share of their device time the host's enqueue takes
    (``share``, None if none) and the largest eager-step excess over the graph step (``eager_excess_ms``), and how
    close each graph step is to the sum of its phases' graphs (``phase_sum_gap_ms``); None without graph steps."""
    graphed, bound = _graphed(result), host_bound(result)
    others = [s for s in graphed if s not in bound]
    if not graphed:
        return None
    return dict(
        strategies=len(graphed),
        bound=bound,
        share=max((s.host_enqueue_ms / s.graph_step_ms for s in others), default=None),
        eager_excess_ms=max((s.unmarked_step_ms - s.graph_step_ms for s in others), default=None),
        phase_sum_gap_ms=max(abs(s.graph_step_ms - s.graph_phase_sum_ms) for s in graphed),
    )


def stalls(result: Result) -> dict[str, Any] | None:
    """What the phase-clocked steps that ran long (over :data:`SLOW_STEP` × their strategy's graph step) had in
    common: their count of all (``slow``, ``marked``) and strategies; medians of the host's time through the step and
    of the GPU-empty ``kv_free`` phase in them and in the others; garbage-collector passes and the longest pause
    between two host marks in them (None where none ran long); and the most synchronizing torch calls any gather
    strategy makes per step. None when the run has no marked steps or no graph step to compare with."""
    strategies, marked = _by_strategy(result), rows_of(result, "marked_steps")
    if not marked or any(s.graph_step_ms is None for s in strategies.values()):
        return None
    slow = _slow(marked, strategies)
    normal = [r for r in marked if r not in slow]

    def median(rows: list[Row], field: str) -> float | None:
        return statistics.median(r[field] for r in rows) if rows else None

    return dict(
        marked=len(marked),
        slow=len(slow),
        slow_strategies=sorted({r.strategy for r in slow}),
        syncs=max(s.syncs_per_step for k, s in strategies.items() if k != _BEFORE),
        host_ms_slow=median(slow, "host_ms"),
        host_ms_normal=median(normal, "host_ms"),
        kv_free_ms_slow=median(slow, "kv_free_ms"),
        kv_free_ms_normal=median(normal, "kv_free_ms"),
        gc_passes=sum(r.gc_passes for r in slow) if slow else None,
        max_host_gap_ms=max((r.max_host_gap_ms for r in slow), default=None),
    )


def breakdown(result: Result) -> tuple[dict[str, dict[str, float]], bool]:
    """One decode step with each KV strategy, ms per step of each phase, one column per strategy (for
    :func:`kvwall.reports.plots.step_breakdown`): from the per-phase CUDA graphs where the run has them (then True),
    else from the phase clock."""
    strategies, graphs = _by_strategy(result), rows_of(result, "graph_breakdown")
    rows = graphs or rows_of(result, "breakdown")
    return {
        strategies[s].name.replace(", ", "<br>", 1): {
            r.phase: r.ms_per_step for r in rows if r.strategy == s and r.ms_per_step is not None
        }
        for s in result.params["strategies"]
    }, bool(graphs)


def gain_rows(result: Result) -> list[Row]:
    """Each strategy's row joined with its gain against the whole-pool cast."""
    strategies = _by_strategy(result)
    return [Row({**strategies[r.strategy], **r}) for r in rows_of(result, "gain")]


def capacity_gain(result: Result) -> list[Row]:
    """Each capacity row with the step it gives (``step_ms``: the measured 'before' step − its KV time + layers × the
    per-layer KV time at that capacity; CUDA graphs where recorded) and the share of the 'before' step it saves."""
    before = _by_strategy(result)[_BEFORE]
    step0, kv0 = (
        (before.graph_step_ms, before.graph_kv_ms_per_step)
        if before.graph_step_ms is not None
        else (before.step_ms, before.kv_strategy_ms_per_step)
    )  # device time where recorded
    steps = [(r, step0 - kv0 + before.layers * r.ms_per_layer) for r in rows_of(result, "capacity")]
    return [Row(r, step_ms=step, time_saved=1 - step / step0) for r, step in steps]


def capacity_series(rows: list[Row]) -> dict[str, tuple[list[float], list[float]]]:
    """% of the step saved against the capacity, per strategy of :data:`CAPACITY_LABELS` (for
    :func:`kvwall.reports.plots.lines`)."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for r in rows:
        xs, ys = series.setdefault(CAPACITY_LABELS[r.strategy], ([], []))
        xs.append(r.capacity)
        ys.append(100 * r.time_saved)
    return series


def capacity_for(rows: list[Row], saved: float) -> tuple[float, Row, Row] | None:
    """The capacity at which the step saves ``saved``: linear between the two neighbouring measured capacities whose
    savings bracket it (the per-layer time, and so the step, grows linearly with the capacity), with those two rows;
    None when no neighbouring pair brackets it."""
    pts = sorted(map(Row, rows), key=lambda r: r.capacity)
    for a, b in zip(pts, pts[1:]):
        lo, hi = sorted((a.time_saved, b.time_saved))
        if lo != hi and lo <= saved <= hi:
            t = (a.time_saved - saved) / (a.time_saved - b.time_saved)
            return a.capacity + t * (b.capacity - a.capacity), a, b
    return None


def capacity_readings(rows: list[Row]) -> dict[str, Any]:
    """The capacity sweep read against the original's figure: for each reading (``time_saved``, ``speedup``), the
    share of the step it saves (``saved``), the capacity of PyTorch's gather-then-cast that saves it (``capacity``,
    linear between the measured rows ``a`` and ``b``; None outside the measured range, with the ``nearest`` row
    instead); the fused kernel's rows (``fused``: per capacity, time saved and per-layer ms in a graph and by
    ``do_bench``) and its median host µs per call (``host_us``, None without graph timings)."""
    torch_rows, fused = ([Row(r) for r in rows if r.strategy == k] for k in CAPACITY_LABELS)
    timed = fused and fused[0].ms_per_layer_graph is not None
    out = dict(fused=fused, host_us=statistics.median(r.host_us_per_call for r in fused) if timed else None)
    for key, reading in dict(time_saved=ORIGINAL.gain_as_time_saved, speedup=ORIGINAL.gain_as_speedup).items():
        saved = Row(reading).time_saved
        capacity, a, b = capacity_for(torch_rows, saved) or (None, None, None)
        out[key] = dict(
            saved=saved,
            capacity=capacity,
            a=a,
            b=b,
            nearest=min(torch_rows, key=lambda r: abs(r.time_saved - saved), default=None),
        )
    return out


def closing(profile: Result) -> dict[str, Any] | None:
    """The chapter's closing numbers (recorded, CUDA graphs): the whole-pool cast's, PyTorch's gather-then-cast's
    over the real length and the fused kernel's strategy rows (``before``, ``torch``, ``fused``), and the
    phase-clocked steps that still ran long (``slow`` of ``marked``); None where one of the three has no graph step."""
    s = _by_strategy(profile)
    if any(k not in s or s[k].graph_step_ms is None for k in (_BEFORE, _FUSED, _TORCH)):
        return None
    graphed = {g.strategy: g for g in _graphed(profile)}
    marked = [r for r in rows_of(profile, "marked_steps") if r.strategy in graphed]
    return dict(
        before=s[_BEFORE], torch=s[_TORCH], fused=s[_FUSED], slow=len(_slow(marked, graphed)), marked=len(marked)
    )
