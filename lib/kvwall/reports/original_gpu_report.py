"""Chapter 6's "The original's GPU": what each path would give on an RTX PRO 6000 (SM120), predicted by the cost
model from the H200 sweep and checked against the one SM120 figure we have (the original's cast); and which of our
kernels compile for which architecture (:mod:`kvwall.tuning.arch_check`, offline: Triton's compile of the Triton path
for each architecture, nvcc's of the wgmma paths for sm_90a)."""

from __future__ import annotations

from typing import Any, Sequence

from kvwall.model.cost import GPUS, PATHS, CostModel, GPUSpec, Point, paths_on
from kvwall.model.original import ORIGINAL
from kvwall.model.paths import KERNEL_NAMES
from kvwall.reports.tables import Table, fmt_range

__all__ = ["rest_without_attention_ms", "original_gpu_rows", "original_gpu_table", "cast_check", "arch_table",
           "build_label", "arch_limits_text", "wgmma_build_rows", "wgmma_build_text"]



def rest_without_attention_ms(model: CostModel, p: Point, gpu: GPUSpec) -> tuple[float, float]:
    """The original's step minus its cast and minus its own attention (FlashInfer fa2 BF16, predicted on ``gpu``
    under each transfer rule): what every path adds its own KV work to. (low, high)."""
    lo, hi = (p.geometry.num_layers * v / 1e3 for v in model.layer_range_us("bf16_cache_fa2", p, gpu))
    return ORIGINAL.non_cast_ms - hi, ORIGINAL.non_cast_ms - lo


def original_gpu_rows(model: CostModel, p: Point, gpu: GPUSpec = GPUS["rtx-pro-6000"]) -> list[dict[str, Any]]:
    """Each path that exists on ``gpu`` at ``p``: predicted µs per layer and ms per step, as ranges over the two
    transfer rules, the step being the original's rest (its attention taken out) plus the path's own KV work."""
    rest_lo, rest_hi = rest_without_attention_ms(model, p, gpu)
    rows = []
    for path in paths_on(gpu.arch, p.heads):
        lo, hi = model.layer_range_us(path, p, gpu)
        layers = p.geometry.num_layers
        rows.append({"path": path, "label": PATHS[path].label, "layer_lo": lo, "layer_hi": hi,
                     "step_lo": rest_lo + layers * lo / 1e3, "step_hi": rest_hi + layers * hi / 1e3,
                     "cache": PATHS[path].cache_dtype.upper()})
    return rows


def original_gpu_table(rows: Sequence[dict[str, Any]], caption: str) -> Table:
    shaped = [{**r, "layer": fmt_range(r["layer_lo"], r["layer_hi"], 0), "step": fmt_range(r["step_lo"], r["step_hi"])}
              for r in rows]
    return Table(shaped, {"path": "label", "cache": "cache", "µs per layer (predicted)": "layer",
                          "ms per step (predicted)": "step"}, caption)


def cast_check(model: CostModel, p: Point, gpu: GPUSpec = GPUS["rtx-pro-6000"]) -> dict[str, float]:
    """The one SM120 measurement we have, the original's 64.6 ms of cast, against the model's whole-pool cast on
    ``gpu`` under each transfer rule; and the bandwidth the original's own figure implies."""
    fit = model.components["full_cast"]
    bytes_per_layer = p.pool_tokens * p.geometry.kv_dim * 3
    out = {"original_cast_ms": ORIGINAL.cast_ms,
           "original_gbps": bytes_per_layer * p.geometry.num_layers / (ORIGINAL.cast_ms * 1e6),
           "h200_gbps": fit.gbps, "h200_share_of_peak": fit.gbps / model.reference.hbm_gbps}
    out["original_share_of_peak"] = out["original_gbps"] / gpu.hbm_gbps
    for rule in ("fraction of peak", "per-SM rate"):
        out[rule] = p.geometry.num_layers * (model.layer_us("full_pool_cast_fa2", p, gpu, rule)
                                             - model.layer_us("bf16_cache_fa2", p, gpu, rule)) / 1e3
    return out




def _cell(b: dict[str, Any]) -> str:
    if b["error"]:
        return "not checked (this Triton could not compile it)" if b.get("triton") else \
            f"not checked (not compiled: {b['error'][:80]})"
    used = f"{b['shared_bytes'] / 1024:,.0f} of {b['shared_limit'] / 1024:,.0f} KB shared, {b['regs']} regs"
    if b["trap_only"]:
        return "**no**: a trap-only kernel"
    if not b["fits"]:
        return f"**no**: {used}"
    return f"yes: {used}" + (f", {b['spills']} B spilled" if b["spills"] else "")


def build_label(b: dict[str, Any]) -> str:
    """A build row's kernel in words: the kernel, its head count (a Triton shape's) or heads per CTA (a wgmma
    instantiation's)."""
    return (b["kernel"] + (f", {b['heads']} heads" if b["heads"] else "")
            + (f", {b['heads_per_cta']} heads per CTA" if b.get("heads_per_cta") else ""))


#: What a kernel built for one architecture only says in the other architectures' columns.
NOT_BUILT = "not built (sm_90a only: the Triton path runs here)"


def arch_table(builds: Sequence[dict[str, Any]], caption: str) -> Table:
    """The offline compiles as one row per kernel (and head count, or heads per CTA), one column per
    architecture (compute capability): the launch shape the launcher picks there, whether it would launch, and the
    shared memory (against the per-block limit), registers and spills the compiler reports. A wgmma path's rows
    (sm_90a, the same GPUs as sm_90) sit in the sm_90 column, named as their target; elsewhere they are not built."""
    archs: dict[int, str] = {}
    for b in builds:
        archs.setdefault(b["cap"], b["arch"])
    rows: dict[tuple[str, int, int], dict[str, Any]] = {}
    for b in builds:
        row = rows.setdefault((b["kernel"], b["heads"], b.get("heads_per_cta") or 0), {"what": build_label(b)})
        target = b["arch"].split(":")[0]
        named = f"{target}: " if target != archs[b["cap"]].split(":")[0] else ""
        row[archs[b["cap"]]] = named + (f"{b['shape']} — " if b["shape"] else "") + _cell(b)
    for row in rows.values():
        if any(v.startswith("sm_90a: ") for k, v in row.items() if k != "what"):
            for name in archs.values():
                row.setdefault(name, NOT_BUILT)
    return Table(list(rows.values()), {"kernel": "what", **{a: a for a in archs.values()}}, caption)


def arch_limits_text(builds: Sequence[dict[str, Any]]) -> str:
    """The limits :func:`arch_table` holds each build against, and what the builds spilled, computed from the rows:
    a spill slows a kernel but does not stop it, so it is reported, never assumed absent."""
    spilled = [b for b in builds if not b["error"] and b.get("spills")]
    limits = ("Limits: shared memory per block; tensor memory (SM100's 512 columns, whose overflow shows as a kernel "
              "that only traps). ")
    if not spilled:
        compiled = sum(1 for b in builds if not b["error"])
        return limits + f"Spills: none (all {compiled} compiled builds)."
    return limits + (f"Spills (they slow a kernel, they do not stop it): {len(spilled)} of "
                     f"{sum(1 for b in builds if not b['error'])} compiled builds, "
                     + "; ".join(f"{build_label(b)} on `{b['arch'].split(':')[0]}`: {b['spills']} B"
                                 for b in spilled) + ".")


def wgmma_build_rows(builds: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of ours' wgmma paths (``role`` the dispatcher's name of a wgmma path), in the dispatcher's order."""
    order = [k for k in KERNEL_NAMES if k != "triton"]
    return sorted((b for b in builds if b.get("role") in order), key=lambda b: (order.index(b["role"]),
                                                                              b.get("heads_per_cta") or 0))


def wgmma_build_text(builds: Sequence[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """What the compile says of ours' wgmma paths (registers, shared memory, spills and stack per build; on which
    architectures the Triton path runs instead), and the values it quotes: ``{"role:heads_per_cta": {regs,
    spills, stack_bytes, shared_bytes, fits}}``. Empty where the builds have no wgmma row."""
    rows = wgmma_build_rows(builds)
    if not rows:
        return "", {}
    values = {f"{b['role']}:{b.get('heads_per_cta')}": {k: b.get(k) for k in ("regs", "spills", "stack_bytes",
                                                                              "shared_bytes", "fits")}
              for b in rows}
    others = sorted({b["arch"].split(":")[0] for b in builds if b["cap"] != 90})
    paths = list(dict.fromkeys(b["role"] for b in rows))
    said = " and ".join(f"the {KERNEL_NAMES[p]}" for p in paths)
    text = (f"{said[0].upper() + said[1:]} {'are' if len(paths) > 1 else 'is'} built with nvcc for `sm_90a` alone "
            "(H100, H200: wgmma needs that target, whose code runs on compute capability 9.0 only)"
            + (f"; on {' and '.join(f'`{a}`' for a in others)} the dispatcher runs the Triton path" if others else "")
            + ". ")
    failed = [b for b in rows if b["error"]]
    if len(failed) == len(rows):
        return text + f"Here nvcc did not compile them: {failed[0]['error'][:200]}", values
    parts = []
    for p in paths:
        each = [f"{b['heads_per_cta']} heads per CTA: " + ("not compiled" if b["error"] else
                f"{b['regs']} registers, {b['shared_bytes'] / 1024:,.0f} KB of shared memory")
                for b in rows if b["role"] == p]
        parts.append(f"the {KERNEL_NAMES[p]} ({'; '.join(each)})")
    bad = [b for b in rows if b["error"] or b["spills"] or b["stack_bytes"] or not b["fits"]]
    limit = f"an H100 / H200 block's {rows[0]['shared_limit'] / 1024:,.0f} KB of shared memory"
    if not bad:
        verdict = f"All {len(rows)} builds compile with no spill and no stack frame, within {limit}."
    else:
        why = [f"the {KERNEL_NAMES[b['role']]} with {b['heads_per_cta']} heads per CTA: "
               + (b["error"][:120] if b["error"] else
                  f"{b['spills']} B spilled, {b['stack_bytes']} B of stack, {b['shared_bytes']:,} B of shared memory")
               for b in bad]
        verdict = (f"{len(rows) - len(bad)} of {len(rows)} builds compile with no spill and no stack frame within "
                   f"{limit}; **not** {'; '.join(why)}.")
    traded = (f" The {KERNEL_NAMES['wgmma_tokens']}'s count is a thread's at launch: `setmaxnreg` then gives its "
              "consumer warpgroup more and its producers fewer." if "wgmma_tokens" in paths else "")
    return text + "ptxas reports, per build, " + "; ".join(parts) + "." + traded + " " + verdict, values
