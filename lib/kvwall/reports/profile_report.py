"""Chapter 1's analysis: the whole-pool cast's bytes, the decode step's profile (live and recorded), why the
cast runs below copy bandwidth, and our numbers beside the original's.

Bytes come from :mod:`kvwall.model.roofline`; the original's figures from :mod:`kvwall.model.original`.
"""

from __future__ import annotations

from typing import Any, Mapping

import plotly.graph_objects as go

from kvwall.model.geometry import GLM5, MLAGeometry
from kvwall.model.original import ORIGINAL
from kvwall.model.roofline import attention_read_bytes, full_pool_cast_bytes
from kvwall.reports import plots
from kvwall.reports.tables import Table, number, percent
from kvwall.results import Result

__all__ = ["original_text", "bytes_text", "bytes_figure", "step_shares", "live_text", "ops_table", "recorded_text",
           "kernels_table", "phases", "step_figures", "copy_rows", "copies_table", "cast_rate_text", "sweeps_figure", "sweep_text",
           "side_by_side"]

_SHARE = {"share of step": ("share", percent)}


def original_text() -> str:
    """The original's reported figures, and the one that does not follow from the others, as Markdown."""
    o = ORIGINAL
    return (
        f"The original investigation's figures, as reported ({o.gpu}): a single-stream decode step of "
        f"**{o.step_ms:g} ms**, of which a `torch.profiler` trace put **{o.cast_ms:g} ms ({o.reported_cast_share:.0%})** "
        "in `aten::copy_` / `unrolled_elementwise_kernel`.\n\n"
        f"Those figures disagree with each other: {o.cast_ms:g} / {o.step_ms:g} = **{o.cast_share_of_step:.1%}**, not "
        f"{o.reported_cast_share:.0%} ({o.cast_ms:g} ms is {o.reported_cast_share:.0%} of "
        f"{o.cast_ms / o.reported_cast_share:.1f} ms, a total the original does not mention). This book uses the two "
        f"times, and so **{o.cast_share_of_step:.0%}** wherever it shows the original's share: the times are what a "
        "trace measures, the share is arithmetic on them, and the step model below spends the original's non-cast time, "
        f"{o.step_ms:g} − {o.cast_ms:g} ms, in its stand-in. Where the reported {o.reported_cast_share:.0%} is shown, "
        "it is labelled as reported.")


def bytes_text(context: int, pool_tokens: int = ORIGINAL.pool_tokens, geometry: MLAGeometry = GLM5) -> str:
    """Bytes the whole-pool cast moves per layer and step, against what attention over ``context`` tokens reads."""
    cast = full_pool_cast_bytes(geometry, pool_tokens)
    attention = attention_read_bytes(geometry, context)
    return (
        f"GLM-5 stores **{geometry.kv_dim} values per token per layer** ({geometry.kv_lora_rank} + "
        f"{geometry.qk_rope_head_dim}); with tensor parallelism {geometry.tensor_parallel} each GPU runs "
        f"**{geometry.heads_per_gpu} of {geometry.num_heads} heads**.\n\n"
        f"Casting a {pool_tokens:,}-token pool moves {cast['read'] / 1e6:,.1f} MB read + {cast['written'] / 1e6:,.1f} MB "
        f"written = **{cast['total'] / 1e6:,.1f} MB per layer** (the original reported about "
        f"{ORIGINAL.cast_mb_per_layer:.0f} MB), **{cast['total'] * geometry.num_layers / 1e9:,.1f} GB per step** over "
        f"{geometry.num_layers} layers (the book counts memory in decimal units, as the original does: 1 MB = 10⁶ "
        f"bytes, 1 GB = 10⁹). Attention over one {context:,}-token request reads {attention / 1e6:,.1f} MB of "
        f"BF16 per layer: the cast moves **{cast['total'] / attention:,.0f}×** the bytes attention needs.")


def bytes_figure(context: int, pool_tokens: int = ORIGINAL.pool_tokens, geometry: MLAGeometry = GLM5) -> go.Figure:
    """The same bytes as bars (computed, not measured)."""
    cast = full_pool_cast_bytes(geometry, pool_tokens)
    values = [cast["read"], cast["written"], attention_read_bytes(geometry, context)]
    return plots.bar(
        ["cast: read FP8 pool", "cast: write BF16 pool", "attention: read the request's KV"],
        {"MB per layer": [v / 1e6 for v in values]},
        title=f"Bytes per layer per decode step, {pool_tokens:,}-token pool", yaxis="MB per layer",
        caption=["Computed from the GLM-5 shape (not a measurement): "
                 f"{pool_tokens:,} tokens × {geometry.kv_dim} values × (1 B read + 2 B written); "
                 f"attention: {context:,} tokens × {geometry.kv_dim} × 2 B."],
        texts={"MB per layer": [f"{v / 1e6:,.1f}" for v in values]})


def _copy_calls(result: Result) -> float | None:
    return next((r["calls_per_step"] for r in result.table("ops") if r["name"] == "aten::copy_"), None)


def step_shares(result: Result) -> dict[str, Any]:
    """The cast's share of the step, by the two clocks of a ``decode_profile`` run, each a ratio of numbers from the
    same steps:

    - ``phase_*``: the phase clock (a mark at every phase boundary; the median of each phase over the timed steps,
      summed), which the figures show: the cast phase over the step;
    - ``profiler_*``: ``aten::copy_``'s self time over the profiled steps' own wall clock (mean per step, profiler
      overhead in both). ``profiler_step_ms`` and ``profiler_share`` are None for a recording made before the
      profiled steps carried a clock."""
    summary, by_phase = result.table("summary")[0], phases(result)
    phase_step = sum(by_phase.values())
    profiled = summary.get("profiled_step_ms")
    return {"phase_step_ms": phase_step, "phase_cast_ms": by_phase["kv_strategy"],
            "phase_share": by_phase["kv_strategy"] / phase_step,
            "copy_ms": summary["cast_op_ms_per_step"], "copy_calls": _copy_calls(result),
            "profiler_step_ms": profiled, "profiler_share": summary["cast_op_ms_per_step"] / profiled if profiled else None,
            "timed_steps": len(result.table("step")), "profiled_steps": result.params.get("profile_steps")}


def _shares_text(result: Result) -> str:
    sh = step_shares(result)
    text = (f"- **phase clock** (a mark at every phase boundary, median per phase over {sh['timed_steps']} timed steps; "
            f"what the figures show): step **{sh['phase_step_ms']:,.1f} ms**, the cast phase "
            f"**{sh['phase_cast_ms']:,.1f} ms ({sh['phase_share']:.0%})**\n")
    calls = f", {sh['copy_calls']:g} calls a step" if sh["copy_calls"] else ""
    if sh["profiler_share"] is not None:
        text += (f"- **torch.profiler** (over {sh['profiled_steps']} profiled steps, timed by their own clock, profiler "
                 f"overhead included): step **{sh['profiler_step_ms']:,.1f} ms**, `aten::copy_` self time "
                 f"**{sh['copy_ms']:,.1f} ms ({sh['profiler_share']:.0%})**{calls}")
    else:
        text += (f"- **torch.profiler**: `aten::copy_` self time **{sh['copy_ms']:,.1f} ms** per profiled step{calls}. "
                 "This recording predates the profiled steps' own clock, so no share is computed for it: dividing it by "
                 "the phase-clocked step would mix two runs.")
    return text


def live_text(live: Result, caption: str) -> str:
    """The live step's attention check and the cast's share of it by both clocks, as Markdown."""
    check = live.table("check")[0]
    cpu_note = ("\n\nOn a CPU, `aten::copy_` also counts the torch reference attention's dtype conversions, so it "
                "is somewhat more than the cast." if live.table("summary")[0]["device_kind"] == "cpu" else "")
    return (f"Attention check: {check['attention']} against float64, relative error "
            f"**{check['rel_err_vs_float64']:.2e}** (BF16 output: 1e-3 to 1e-2 is the expected range).\n\n"
            f"The live step, by two clocks:\n\n{_shares_text(live)}{cpu_note}\n\n{caption}")


def _share_denominator(result: Result) -> tuple[float | None, str]:
    """The profiled steps' own mean wall time, for shares of profiler times, and a note saying so."""
    profiled = result.table("summary")[0].get("profiled_step_ms")
    if profiled:
        return profiled, (f"Shares: of the profiled steps' own wall time ({profiled:,.1f} ms a step, profiler overhead "
                          "included).")
    return None, ("No share column: this recording predates the profiled steps' own clock (a share of the "
                  "phase-clocked step would divide numbers from two different runs).")


def ops_table(result: Result, caption: str, top: int = 8) -> Table:
    """Ops ranked by self time per step, with their share of the profiled steps."""
    step_ms, note = _share_denominator(result)
    rows = [{**r, "share": r["ms_per_step"] / step_ms if step_ms else None} for r in result.table("ops")[:top]]
    return Table(rows, {"op": "name", "calls / step": ("calls_per_step", number(0)),
                        "ms / step": ("ms_per_step", number(3)), **(_SHARE if step_ms else {})}, f"{caption} {note}")


def recorded_text(rec: Result) -> str:
    """The recorded full-scale step by both clocks, beside the original's, as Markdown."""
    summary, check = rec.table("summary")[0], rec.table("check")[0]
    o = ORIGINAL
    return (f"The recorded step ({summary['layers']} layers, {summary['pool_slots'] - 1:,}-token pool, "
            f"{summary['heads_per_gpu']} heads per GPU, context {rec.params['context_lens'][0]:,}; attention "
            f"{check['attention']}, relative error {check['rel_err_vs_float64']:.2e} against float64), by two clocks:\n\n"
            f"{_shares_text(rec)}\n\n"
            f"The original (as reported, {o.gpu}): **{o.step_ms:g} ms**, cast **{o.cast_ms:g} ms**, "
            f"{o.cast_ms:g} / {o.step_ms:g} = **{o.cast_share_of_step:.0%}** (printed as {o.reported_cast_share:.0%} "
            "in the original; see above).")


def kernels_table(rec: Result, top: int = 6) -> Table:
    """CUDA kernels ranked by time per step, with their share of the profiled steps."""
    step_ms, note = _share_denominator(rec)
    rows = [{**r, "share": r["ms_per_step"] / step_ms if step_ms else None} for r in rec.table("kernels")[:top]]
    return Table(rows, {"kernel": "kernel", "calls / step": ("calls_per_step", number(0)),
                        "ms / step": ("ms_per_step", number(3)), **(_SHARE if step_ms else {})},
                 rec.caption() + " Kernels ranked by CUDA time per step; spin_kernel is the stand-in. " + note)


def phases(result: Result) -> dict[str, float]:
    """ms per step of each phase of the decode step."""
    return {r["phase"]: r["ms_per_step"] for r in result.table("breakdown")}


def step_figures(live: Result, live_label: str, live_caption: str, rec: Result, *, same_axis: bool) -> list[go.Figure]:
    """Where one decode step goes, by the phase clock: the recorded full-scale run beside the original's reported
    step on one axis; the live run on that axis too when it is at full scale (``same_axis``), else in a figure of its
    own (a small-scale CPU step is neither the same work nor the same hardware, and would dwarf the GPU bars)."""
    original = {"original_cast": ORIGINAL.cast_ms, "original_rest": ORIGINAL.non_cast_ms}
    original_note = (f"Original: the investigation's reported {ORIGINAL.step_ms:g} ms step and {ORIGINAL.cast_ms:g} ms "
                     f"cast ({ORIGINAL.gpu}); its bar's share is {ORIGINAL.cast_ms:g} / {ORIGINAL.step_ms:g} "
                     f"(reported as {ORIGINAL.reported_cast_share:.0%}). Our 'rest of layer' is that non-cast time, "
                     "modelled.")
    clock = "Shares on the bars: the phase clock (cast phase over the sum of the phases' medians)."
    columns = {"recorded, H200<br>(full scale)": phases(rec), "original, RTX PRO 6000<br>(as reported)": original}
    if same_axis:
        columns = {live_label: phases(live), **columns}
        return [plots.step_breakdown(columns, title="Where one decode step goes",
                                     caption=[f"Live: {live_caption}", rec.caption(), original_note, clock])]
    return [
        plots.step_breakdown(columns, title="Where one decode step goes: recorded on an H200, and the original",
                             caption=[rec.caption(), original_note, clock]),
        plots.step_breakdown({live_label: phases(live)},
                             title="The same step live on this machine (small scale, its own axis)",
                             caption=[f"Live: {live_caption}",
                                      "A small pool on this machine's processor: the shape of the step, not a time "
                                      "to compare with the H200's. " + clock]),
    ]


def copy_rows(result: Result) -> tuple[list[dict[str, Any]], float]:
    """The pool-shaped copies, each with its share of the device-to-device copy rate; and that rate (GB/s)."""
    ceiling = result.table("device_copy")[0]["gbps"]
    return [{**r, "of_copy": r["gbps"] / ceiling} for r in result.table("copies")], ceiling


def copies_table(result: Result, caption: str) -> Table:
    """The pool-shaped copies against the device-to-device copy (whose rate the caption gets)."""
    rows, ceiling = copy_rows(result)
    return Table(rows, {"copy (pool-shaped)": "copy", "kernel PyTorch picks": "kernel", "ms": ("ms", number(3)),
                        "GB/s": ("gbps", number(0)), "of device copy": ("of_copy", percent)},
                 f"{caption} Device-to-device copy: {ceiling:,.0f} GB/s (read + write).")


def cast_rate_text(rec: Result, geometry: MLAGeometry = GLM5) -> str:
    """The cast against a plain copy and a same-width integer cast (rows 0 and 1 of the run), and the rate the
    original's own figures imply."""
    rows, _ = copy_rows(rec)
    cast, integer = rows[0], rows[1]
    original_gbps = ORIGINAL.cast_mb_per_layer * 1e6 * geometry.num_layers / (ORIGINAL.cast_ms * 1e-3) / 1e9
    return (
        f"On the H200 the cast reaches **{cast['gbps']:,.0f} GB/s, {cast['of_copy']:.0%} of a plain copy**. The same-width "
        f"integer cast, through the same `{integer['kernel']}`, reaches {integer['of_copy']:.0%}: the non-vectorized, "
        f"dynamically casting path alone leaves {1 - integer['of_copy']:.0%} of the copy rate unused, and the software "
        f"FP8 decode takes the cast to {cast['gbps'] / integer['gbps']:.0%} of what the integer cast reaches. The "
        f"original's figures imply {original_gbps:,.0f} GB/s on its GPU ({ORIGINAL.cast_mb_per_layer:g} MB × "
        f"{geometry.num_layers} layers in {ORIGINAL.cast_ms:g} ms), {original_gbps / cast['gbps']:.2f}× the H200's "
        "cast rate, on a GPU with well under half the H200's memory bandwidth: the cast is bound by the kernel, not by "
        "memory.")


def sweeps_figure(cast_sweep: list[Mapping[str, Any]], attention_sweep: list[Mapping[str, Any]], title: str,
                  caption: list[str]) -> go.Figure:
    """Cast time against pool size and attention time against context, on one token axis."""
    return plots.lines(
        {"whole-pool cast, per layer (x = pool tokens)": ([r["pool_tokens"] for r in cast_sweep],
                                                          [r["ms"] for r in cast_sweep]),
         "MLA decode, per layer (x = context tokens)": ([r["context_len"] for r in attention_sweep],
                                                        [r["ms"] for r in attention_sweep])},
        title=title, xaxis="tokens", yaxis="ms per layer", caption=caption)


def sweep_text(cast_sweep: list[Mapping[str, Any]], attention_sweep: list[Mapping[str, Any]],
               pool_tokens: int = ORIGINAL.pool_tokens) -> str:
    """The whole-pool cast against attention over the longest request of the sweep, as Markdown."""
    pool_cast_ms = next(r["ms"] for r in cast_sweep if r["pool_tokens"] == pool_tokens)
    longest = max(attention_sweep, key=lambda r: r["context_len"])
    return (f"Casting the {pool_tokens:,}-token pool takes **{pool_cast_ms:.3f} ms per layer**; attention over a "
            f"{longest['context_len']:,}-token request takes **{longest['ms']:.3f} ms**. The cast costs "
            f"**{pool_cast_ms / longest['ms']:.1f}×** the attention it feeds even at the longest context, and far more "
            "at ordinary ones: with a large pool the cast dominates at every context length.")


def side_by_side(rec: Result, live: Result, *, live_label: str, caption: str) -> Table:
    """The original's step, cast, share and bytes beside ours, recorded and live; each share by a named clock."""
    ours = {"rec": rec.table("summary")[0], "live": live.table("summary")[0]}
    shares = {"rec": step_shares(rec), "live": step_shares(live)}
    o = ORIGINAL
    rows = [
        {"what": "decode step, ms (phase clock; the original's: its reported step)", "orig": f"{o.step_ms:g}",
         **{k: f"{sh['phase_step_ms']:,.1f}" for k, sh in shares.items()}},
        {"what": "the cast phase, ms per step (phase clock)", "orig": "—",
         **{k: f"{sh['phase_cast_ms']:,.1f}" for k, sh in shares.items()}},
        {"what": "cast share of the step (phase clock)", "orig": "—",
         **{k: f"{sh['phase_share']:.0%}" for k, sh in shares.items()}},
        {"what": "aten::copy_, ms per profiled step (torch.profiler)", "orig": f"{o.cast_ms:g}",
         **{k: f"{sh['copy_ms']:,.1f}" for k, sh in shares.items()}},
        {"what": "aten::copy_ share of the step (torch.profiler)",
         "orig": f"{o.cast_share_of_step:.0%} ({o.cast_ms:g} / {o.step_ms:g}; printed as {o.reported_cast_share:.0%})",
         **{k: f"{sh['profiler_share']:.0%}" if sh["profiler_share"] is not None else "not in this recording"
            for k, sh in shares.items()}},
        {"what": "cast MB per layer", "orig": f"{o.cast_mb_per_layer:g}",
         **{k: f"{s['cast_bytes_per_layer'] / 1e6:,.1f}" for k, s in ours.items()}},
    ]
    return Table(rows, {"": "what", f"original ({o.gpu}, as reported)": "orig",
                        f"ours, recorded ({rec.provenance.gpu}, full scale)": "rec", live_label: "live"}, caption)
