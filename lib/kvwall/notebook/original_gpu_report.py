"""Chapter 6's "The original's GPU": what each path would give on an RTX PRO 6000 (SM120), predicted by the cost
model from the H200 sweep and checked against the one SM120 figure we have (the original's cast); and which of our
kernels compile for which architecture (:mod:`kvwall.tuning.arch_check`, offline)."""

from __future__ import annotations

from typing import Any, Sequence

from kvwall.model.cost import GPUS, PATHS, CostModel, GPUSpec, Point, paths_on
from kvwall.model.original import ORIGINAL
from kvwall.notebook.tables import Table, fmt_range

__all__ = ["rest_without_attention_ms", "original_gpu_rows", "original_gpu_table", "cast_check", "arch_table"]



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
        return "not checked (this Triton could not compile it)"
    used = f"{b['shared_bytes'] / 1024:,.0f} of {b['shared_limit'] / 1024:,.0f} KB shared, {b['regs']} regs"
    if b["trap_only"]:
        return "**no**: a trap-only kernel"
    if not b["fits"]:
        return f"**no**: {used}"
    return f"yes: {used}" + (f", {b['spills']} B spilled" if b["spills"] else "")


def arch_table(builds: Sequence[dict[str, Any]], caption: str) -> Table:
    """The offline compiles as one row per kernel (and head count), one column per architecture: the launch shape
    the launcher picks there, whether it would launch, and the shared memory (against the per-block limit),
    registers and spills the compiler reports."""
    archs = list(dict.fromkeys(b["arch"] for b in builds))
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for b in builds:
        what = b["kernel"] + (f", {b['heads']} heads" if b["heads"] else "")
        row = rows.setdefault((b["kernel"], b["heads"]), {"what": what})
        row[b["arch"]] = (f"{b['shape']} — " if b["shape"] else "") + _cell(b)
    return Table(list(rows.values()), {"kernel": "what", **{a: a for a in archs}}, caption)
