"""Chapter 4's decode step after the gather-cast: chapter 1's step model run with each KV strategy
(a recorded ``gather_cast_profile`` run, or a live one), measured by phase clock, unmarked and as a CUDA graph.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping

import plotly.graph_objects as go

from kvwall.model.original import ORIGINAL
from kvwall.reports import plots
from kvwall.reports.tables import Table, number, percent, scientific, times
from kvwall.results import Result

__all__ = ["KV_PHASE_NAMES", "live_profile_params", "strategies_table", "host_bound", "host_bound_text", "eager_text",
           "capacity_for", "stall_story", "profile_columns", "step_figure", "gain_rows",
           "gain_table", "live_gain_table", "CapacityGain", "capacity_gain", "summary_text", "reported_gain_readings",
           "original_gain_text"]

#: Phase names where the KV phase is not (only) the whole-pool cast.
KV_PHASE_NAMES = {"kv_strategy": "prepare KV (the cast, or the gather-cast)", "kv_free": "free the cast buffer"}
#: Slower than this × its strategy's graph step, a phase-clocked step "ran long".
SLOW_STEP = 1.1
_ms = number(2)


def _by_strategy(result: Result) -> dict[str, dict[str, Any]]:
    return {r["strategy"]: r for r in result.table("strategies")}


def reported_gain_readings() -> str:
    """The original's Option B figure and its two readings, as a phrase (computed from :data:`ORIGINAL`)."""
    saved, speedup = ORIGINAL.gain_as_time_saved, ORIGINAL.gain_as_speedup
    return (f"the original's reported gain of about {ORIGINAL.reported_gather_cast_gain:.0%} (unit not stated: "
            f"{saved['time_saved']:.0%} of the step saved is a {saved['speedup']:.2f}× speed-up; a "
            f"{speedup['speedup']:.2f}× speed-up saves {speedup['time_saved']:.1%})")


def original_gain_text(result: Result) -> str | None:
    """The measured finding first (recorded, CUDA graphs where the run has them), then the original's figure read
    both ways; None where the run lacks the strategies it names."""
    s = _by_strategy(result)
    if not {"full_pool_cast", "index_then_cast", "gather_cast"} <= set(s):
        return None
    graphs = s["index_then_cast"].get("graph_step_ms") is not None
    gains = {r["strategy"]: r for r in result.table("gain")}
    saved_key, speed_key = ("graph_time_saved", "graph_speedup") if graphs else ("time_saved", "speedup")
    torch_gain, fused_gain = gains["index_then_cast"], gains["gather_cast"]
    saved, speedup = ORIGINAL.gain_as_time_saved, ORIGINAL.gain_as_speedup
    how = "CUDA-graph steps" if graphs else "phase-clocked steps"
    return (
        f"**Measured first** (recorded, {how}, the step of chapter 1 with the whole-pool cast replaced): PyTorch's own "
        f"`pool[idx].to(torch.bfloat16)` (`index_select` then `.to`) over the request's real length already saves "
        f"**{torch_gain[saved_key]:.0%}** of the step ({torch_gain[speed_key]:.2f}×); our fused gather-cast kernel saves "
        f"{fused_gain[saved_key]:.1%} ({fused_gain[speed_key]:.2f}×). Most of the gain is in *what* is cast, not in "
        "how.\n\n"
        f"The original reported Option B as a gain of about **{ORIGINAL.reported_gather_cast_gain:.0%}** (the "
        "original's figure; its code is not available) without saying of what. Read as **time saved**, "
        f"{saved['time_saved']:.0%} of the step is a **{saved['speedup']:.2f}× speed-up**; read as a **speed-up** "
        f"({speedup['speedup']:.2f}×), it saves **{speedup['time_saved']:.1%}** of the step. Either way it is well short "
        f"of the {torch_gain[saved_key]:.0%} that the simplest gather-then-cast gives here; the capacity sweep further "
        "down shows one way an implementation lands near either reading.")


def live_profile_params(knobs: Mapping[str, int], small: Mapping[str, Any]) -> dict[str, Any]:
    """The live decode-step run's parameters from the chapter's knobs: the experiment's small-scale capacity
    (at least the context, at most the pool) and the capacities of its sweep that fit the pool."""
    pool = knobs["pool_tokens"]
    return {"pool_tokens": pool, "layers": knobs["layers"], "context_lens": [knobs["context_len"]],
            "capacity": min(max(small["capacity"], knobs["context_len"]), pool),
            "capacity_sweep": [c for c in small["capacity_sweep"] if c <= pool]}


def strategies_table(result: Result) -> Table:
    """Each strategy's step three ways (phase clock, unmarked, CUDA graph), its syncs and host time."""
    return Table(result.table("strategies"),
                 {"KV strategy": "name", "phase clock, ms": ("step_ms", _ms), "unmarked, ms": ("unmarked_step_ms", _ms),
                  "host enqueue, ms": ("host_enqueue_ms", _ms), "CUDA graph, ms": ("graph_step_ms", _ms),
                  "Σ phase graphs, ms": ("graph_phase_sum_ms", _ms), "syncs / step": ("syncs_per_step", number(0)),
                  "host µs / KV prep": ("host_us_prepare_kv", number(1))},
                 result.caption())


def host_bound(result: Result) -> list[dict[str, Any]]:
    """The strategies whose eager step is host-bound: the host takes longer to enqueue the step than the GPU takes
    to run it (its CUDA-graph step, device time alone), so an eager step runs at the host's pace."""
    return [s for s in result.table("strategies")
            if s.get("graph_step_ms") is not None and s["host_enqueue_ms"] > s["graph_step_ms"]]


def host_bound_text(result: Result) -> str:
    """Which strategies are host-bound when run eagerly, from the recorded host and device times, and what the
    CUDA graph does about it."""
    strategies = [s for s in result.table("strategies") if s.get("graph_step_ms") is not None]
    bound = host_bound(result)
    others = [s for s in strategies if s not in bound]
    graph_vs_phases = max(abs(s["graph_step_ms"] - s["graph_phase_sum_ms"]) for s in strategies)
    if not bound:
        share = max(s["host_enqueue_ms"] / s["graph_step_ms"] for s in strategies)
        return (f"No strategy is host-bound: enqueueing an eager step takes the host at most {share:.0%} of the "
                f"step's device time (its CUDA-graph step), so the GPU never waits for the host in steady state. "
                f"The CUDA-graph step agrees with the sum of its phases' graphs to within {graph_vs_phases:.2f} ms.")
    each = "; ".join(f"{s['name']}: the host takes **{s['host_enqueue_ms']:.1f} ms** to enqueue a step whose device "
                     f"work takes {s['graph_step_ms']:.1f} ms, and the eager step takes {s['unmarked_step_ms']:.1f} ms"
                     for s in bound)
    text = (f"Run eagerly, **{len(bound)} of {len(strategies)}** strategies are **host-bound** — the host's enqueue "
            f"takes longer than the GPU's work, so the eager step runs at the host's pace ({each}). ")
    if others:
        share = max(s["host_enqueue_ms"] / s["graph_step_ms"] for s in others)
        eager_vs_graph = max(s["unmarked_step_ms"] - s["graph_step_ms"] for s in others)
        text += (f"The other {len(others)} keep the GPU ahead: their enqueue takes at most {share:.0%} of their device "
                 f"time, and their eager step is within {eager_vs_graph:.2f} ms of their graph step. ")
    text += ("CUDA graphs remove the host from the loop: a replayed step is device time alone, which is why the "
             f"steps below are the graph steps (each agrees with the sum of its phases' graphs to within "
             f"{graph_vs_phases:.2f} ms).")
    return text


def stall_story(result: Result) -> str | None:
    """What the phase-clocked steps that ran long had in common (host clock, GC, the GPU-empty ``kv_free`` phase);
    None when the run has no marked steps or no graph step to compare with."""
    strategies = _by_strategy(result)
    marked = [r for r in result.rows if r["section"] == "marked_steps"]
    if not marked or any(s["graph_step_ms"] is None for s in strategies.values()):
        return None
    slow = [r for r in marked if r["step_ms"] > SLOW_STEP * strategies[r["strategy"]]["graph_step_ms"]]
    normal = [r for r in marked if r not in slow]
    syncs = max(s["syncs_per_step"] for k, s in strategies.items() if k != "full_pool_cast")
    text = f"No gather strategy makes a synchronizing torch call ({syncs} per step). " + host_bound_text(result) + "\n\n"
    if not slow:
        return text + "No phase-clocked step ran more than 10 % over its strategy's graph step in this run."

    def median(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return text + (
        f"**{len(slow)} of {len(marked)}** phase-clocked steps ran more than 10 % over their strategy's graph step "
        f"({', '.join(sorted({r['strategy'] for r in slow}))}). In those, the host took a median "
        f"**{median(slow, 'host_ms'):.1f} ms** to get through the step, against {median(normal, 'host_ms'):.1f} ms in "
        f"the others; the `kv_free` phase, which has no GPU work at all between its two events, measured "
        f"{median(slow, 'kv_free_ms'):.2f} ms instead of {median(normal, 'kv_free_ms'):.2f} ms; the garbage collector "
        f"ran {sum(r['gc_passes'] for r in slow)} times in them (and some were taken with it off), and the longest pause "
        f"between two of the host's marks was {max(r['max_host_gap_ms'] for r in slow):.2f} ms. The host was "
        "uniformly slower for a while, the GPU ran dry, and its idle time was charged to the phases after host work. "
        "That is a property of the measurement on this shared machine, not of the kernels.")


def profile_columns(result: Result, section: str = "breakdown") -> dict[str, dict[str, float]]:
    """ms per step of each phase, one column per strategy (for :func:`kvwall.reports.plots.step_breakdown`)."""
    names = {r["strategy"]: r["name"] for r in result.table("strategies")}
    rows = [r for r in result.rows if r["section"] == section]
    return {names[s].replace(", ", "<br>", 1): {r["phase"]: r["ms_per_step"] for r in rows
                                                if r["strategy"] == s and r["ms_per_step"] is not None}
            for s in result.params["strategies"]}


def step_figure(result: Result, title: str, caption: list[str], *, with_original: bool = True) -> go.Figure:
    """One decode step with each KV strategy, phase by phase: from the per-phase CUDA graphs where the run has them,
    else from the phase clock; with the original's reported step beside it."""
    graphs = any(r["section"] == "graph_breakdown" for r in result.rows)
    columns = profile_columns(result, "graph_breakdown" if graphs else "breakdown")
    notes = [f"Each phase: its {result.params['layers']} layers captured in a CUDA graph and replayed (device time)."
             if graphs else "Phase clock."]
    if with_original:
        columns["original, RTX PRO 6000<br>(as reported)"] = {"original_cast": ORIGINAL.cast_ms,
                                                             "original_rest": ORIGINAL.non_cast_ms}
        notes.append("Original: as reported; 'rest of layer' is modelled.")
    return plots.step_breakdown(columns, title=title + (" (CUDA graphs)" if graphs else ""), names=KV_PHASE_NAMES,
                                caption=[*caption, *notes])


def gain_rows(result: Result) -> list[dict[str, Any]]:
    """Each strategy's row joined with its gain against the whole-pool cast."""
    strategies = _by_strategy(result)
    return [{**strategies[r["strategy"]], **r} for r in result.table("gain")]


def gain_table(result: Result) -> Table:
    """Each strategy's step and time saved against the whole-pool cast, as a graph and by phase clock."""
    return Table(gain_rows(result),
                 {"KV strategy": "name", "graph step ms": ("graph_step_ms", _ms),
                  "time saved (graph)": ("graph_time_saved", percent), "speed-up (graph): before / after": ("graph_speedup", times(2)),
                  "phase-clock step ms": ("step_ms", _ms), "time saved (phase clock)": ("time_saved", percent),
                  "attention rel. err": ("rel_err_vs_float64", scientific)},
                 result.caption() + f" For comparison: {reported_gain_readings()}.")


def live_gain_table(result: Result, caption: str) -> Table:
    """A live run's steps and time saved (phase clock and unmarked; no graphs on a CPU)."""
    return Table(gain_rows(result),
                 {"KV strategy": "name", "step ms (phase clock)": ("step_ms", _ms),
                  "unmarked ms": ("unmarked_step_ms", _ms), "time saved": ("time_saved", percent),
                  "speed-up: before / after": ("speedup", times(2)), "attention rel. err": ("rel_err_vs_float64", scientific)},
                 caption)


@dataclass(frozen=True)
class CapacityGain:
    """The step's gain at each capacity of the index buffer: a figure and what it says."""

    figure: go.Figure
    text: str
    rows: list[dict[str, Any]]


_CAPACITY_LABELS = {"index_then_cast_capacity": "PyTorch index_select().to(), over the capacity",
                    "gather_cast_capacity": "gather_cast (Triton), real length from kv_indptr"}


def capacity_gain(result: Result) -> CapacityGain:
    """Step = the measured 'before' step − its KV time + layers × the per-layer KV time at each capacity."""
    before = _by_strategy(result)["full_pool_cast"]
    if before.get("graph_step_ms") is not None:  # device time: the graph step and its KV phase's graph
        before_step, rest_ms = before["graph_step_ms"], before["graph_step_ms"] - before["graph_kv_ms_per_step"]
    else:
        before_step, rest_ms = before["step_ms"], before["step_ms"] - before["kv_strategy_ms_per_step"]
    layers = before["layers"]
    rows = []
    for r in result.table("capacity"):
        step = rest_ms + layers * r["ms_per_layer"]
        rows.append({**r, "step_ms": step, "time_saved": 1 - step / before_step})
    series: dict[str, tuple[list[float], list[float]]] = {}
    for r in rows:
        xs, ys = series.setdefault(_CAPACITY_LABELS[r["strategy"]], ([], []))
        xs.append(r["capacity"])
        ys.append(100 * r["time_saved"])
    capacities = sorted({r["capacity"] for r in rows})
    for reading, label in ((ORIGINAL.gain_as_time_saved, "read as time saved"),
                           (ORIGINAL.gain_as_speedup, f"read as a {ORIGINAL.gain_as_speedup['speedup']:.2f}× speed-up")):
        series[f"the original's {ORIGINAL.reported_gather_cast_gain:.0%}, {label} ({reading['time_saved']:.1%} saved)"] = (
            capacities, [100 * reading["time_saved"]] * len(capacities))
    figure = plots.lines(series, title="Step time saved against the graph's capacity",
                         xaxis="capacity of the index buffer (rows)", yaxis="% of the whole-pool-cast step saved",
                         caption=[result.caption(),
                                  f"Step = measured 'before' step − its KV time + {layers} × the measured per-layer "
                                  "time at that capacity (CUDA graphs where recorded); the request has "
                                  f"{result.params['context_lens'][0]:,} real tokens."], log_y=False)
    return CapacityGain(figure, _capacity_text(rows), rows)


def capacity_for(rows: list[dict[str, Any]], saved: float) -> tuple[float, dict[str, Any], dict[str, Any]] | None:
    """The capacity at which the step saves ``saved``: linear between the two neighbouring measured capacities whose
    savings bracket it (the per-layer time, and so the step, grows linearly with the capacity), with those two rows;
    None when no neighbouring pair brackets it."""
    pts = sorted(rows, key=lambda r: r["capacity"])
    for a, b in zip(pts, pts[1:]):
        if a["time_saved"] != b["time_saved"] and min(a["time_saved"], b["time_saved"]) <= saved <= max(
                a["time_saved"], b["time_saved"]):
            t = (a["time_saved"] - saved) / (a["time_saved"] - b["time_saved"])
            return a["capacity"] + t * (b["capacity"] - a["capacity"]), a, b
    return None


def _capacity_reading(torch_rows: list[dict[str, Any]], reading: str, saved: float) -> str:
    found = capacity_for(torch_rows, saved)
    if found is None:
        near = min(torch_rows, key=lambda r: abs(r["time_saved"] - saved))
        return (f"read {reading}, the original's figure ({saved:.1%} saved) lies outside the measured range: the "
                f"nearest capacity, **{near['capacity']:,}** rows, saves **{near['time_saved']:.0%}**")
    capacity, a, b = found
    return (f"read {reading}, the original's figure ({saved:.1%} saved) lies between the measured capacities "
            f"{a['capacity']:,} ({a['time_saved']:.0%} saved) and {b['capacity']:,} ({b['time_saved']:.0%}): a "
            f"capacity of about **{round(capacity, -3):,.0f}** rows saves it")


def _capacity_text(rows: list[dict[str, Any]]) -> str:
    torch_rows = [r for r in rows if r["strategy"] == "index_then_cast_capacity"]
    readings = {"as time saved": ORIGINAL.gain_as_time_saved["time_saved"],
                "as a speed-up": ORIGINAL.gain_as_speedup["time_saved"]}
    text = ("PyTorch's two-kernel gather-then-cast over a graph-sized capacity costs in proportion to the capacity, "
            "not the request: "
            + "; ".join(_capacity_reading(torch_rows, k, v) for k, v in readings.items())
            + ". Between two measured capacities the step is interpolated linearly, as the cost grows in proportion "
              "to the capacity; around a modelled rest of the step, this is an explanation that fits, not a "
              "reconstruction of the original's code.")
    fused = [r for r in rows if r["strategy"] == "gather_cast_capacity"]
    if not fused:
        return text
    low, high = (f"{f(r['time_saved'] for r in fused):.0%}" for f in (min, max))
    text += f" The fused kernel saves {low}" + (f" to {high}" if low != high else "")
    text += " at every capacity, because it reads the real length on the device."
    if fused[0].get("ms_per_layer_graph") is not None:
        host_us = statistics.median(r["host_us_per_call"] for r in fused)
        text += ("\n\nPer layer, in a graph, the fused kernel takes "
                 + ", ".join(f"{r['ms_per_layer_graph'] * 1e3:.1f} µs at {r['capacity']:,}" for r in fused)
                 + "; timed call by call with `do_bench` the same launches read "
                 + ", ".join(f"{r['ms_per_layer_events'] * 1e3:.1f}" for r in fused)
                 + f" µs, because each call also costs the host about {host_us:.0f} µs to launch and the GPU waits for "
                 "it whenever it is the slower side. The growth at the largest capacity is the grid: the launch starts "
                 "one program per block of the capacity, and the programs past the real length only read `kv_indptr` "
                 "and exit.")
    return text


def eager_text(profile: Result) -> str | None:
    """Whether an eager (not graph-replayed) step of the recording waited for the host, from its host enqueue and
    graph step times (:func:`host_bound`) and the phase-clocked steps that ran long; None without graph steps."""
    strategies = [s for s in profile.table("strategies") if s.get("graph_step_ms") is not None]
    if not strategies:
        return None
    bound = host_bound(profile)
    by_name = {s["strategy"]: s for s in strategies}
    marked = [r for r in profile.rows if r["section"] == "marked_steps" and r["strategy"] in by_name]
    slow = [r for r in marked if r["step_ms"] > SLOW_STEP * by_name[r["strategy"]]["graph_step_ms"]]
    stalls = (f" {len(slow)} of {len(marked)} phase-clocked steps still ran more than "
              f"{SLOW_STEP - 1:.0%} over their graph step, when this shared machine's host slowed down (above)." if slow else "")
    if not bound:
        share = max(s["host_enqueue_ms"] / s["graph_step_ms"] for s in strategies)
        return (f"Timed eagerly, no strategy of this recording is host-bound: the host enqueues a step in at most "
                f"{share:.0%} of its device time, so the GPU need not wait for it." + stalls)
    return (f"Timed eagerly, {len(bound)} of {len(strategies)} strategies are host-bound (their host enqueue outlasts "
            "their device work): " + ", ".join(s["name"] for s in bound) + "." + stalls)


def summary_text(profile: Result, gather_of_copy_131k: float) -> str | None:
    """The chapter's closing numbers (recorded, CUDA graphs); None where the run has no graph steps."""
    s = _by_strategy(profile)
    if any(s[k]["graph_step_ms"] is None for k in ("full_pool_cast", "gather_cast", "index_then_cast")):
        return None
    fused = s["gather_cast"]
    return (f"In numbers (recorded, CUDA graphs): the whole-pool cast's step is {s['full_pool_cast']['graph_step_ms']:.1f} "
            f"ms, PyTorch's gather-then-cast over the real length {s['index_then_cast']['graph_step_ms']:.1f} ms, the "
            f"fused kernel {fused['graph_step_ms']:.1f} ms, of which its {fused['layers']} launches take "
            f"{fused['graph_kv_ms_per_step']:.2f} ms ({fused['graph_kv_ms_per_step'] * 1e3 / fused['layers']:.1f} µs a "
            f"layer); the kernel itself moves a 131K-row gather at {gather_of_copy_131k:.0%} of the copy bandwidth. "
            + (eager_text(profile) or ""))
