"""Chapter 6's "The original's GPU": what each path would give on an RTX PRO 6000 (SM120), predicted by the cost
model from the H200 sweep and checked against the one SM120 figure we have (the original's cast); and which of our
kernels compile for which architecture (:mod:`kvwall.tuning.arch_check`, offline: Triton's compile of the Triton path
for each architecture, nvcc's of the wgmma paths for sm_90a). Numbers and tables; chapter 6 writes what they say."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from kvwall.model.cost import GPUS, PATHS, CostModel, GPUSpec, Point, paths_on
from kvwall.model.original import ORIGINAL
from kvwall.model.step_paths import KERNEL_NAMES
from kvwall.reports.rows import Row
from kvwall.reports.tables import Table, fmt_range

RULES = ("fraction of peak", "per-SM rate")


def rest_without_attention_ms(model: CostModel, p: Point, gpu: GPUSpec) -> tuple[float, float]:
    """The original's step minus its cast and minus its own attention (FlashInfer fa2 BF16, predicted on ``gpu``
    under each transfer rule): what every path adds its own KV work to. (low, high)."""
    lo, hi = (p.geometry.num_layers * v / 1e3 for v in model.layer_range_us("bf16_cache_fa2", p, gpu))
    return ORIGINAL.non_cast_ms - hi, ORIGINAL.non_cast_ms - lo


def original_gpu_rows(model: CostModel, p: Point, gpu: GPUSpec = GPUS["rtx-pro-6000"]) -> list[Row]:
    """Each path that exists on ``gpu`` at ``p``: predicted µs per layer and ms per step, as ranges over the two
    transfer rules, the step being the original's rest (its attention taken out) plus the path's own KV work."""
    rest_lo, rest_hi = rest_without_attention_ms(model, p, gpu)
    layers, rows = p.geometry.num_layers, []
    for path in paths_on(gpu.arch, p.heads):
        lo, hi = model.layer_range_us(path, p, gpu)
        rows.append(
            Row(
                path=path,
                label=PATHS[path].label,
                layer_lo=lo,
                layer_hi=hi,
                cache=PATHS[path].cache_dtype.upper(),
                step_lo=rest_lo + layers * lo / 1e3,
                step_hi=rest_hi + layers * hi / 1e3,
            )
        )
    return rows


def original_gpu_table(rows: Sequence[Row], caption: str) -> Table:
    shaped = [Row(r, layer=fmt_range(r.layer_lo, r.layer_hi, 0), step=fmt_range(r.step_lo, r.step_hi)) for r in rows]
    return Table(
        shaped,
        {"path": "label", "cache": "cache", "µs per layer (predicted)": "layer", "ms per step (predicted)": "step"},
        caption,
    )


def cast_check(model: CostModel, p: Point, gpu: GPUSpec = GPUS["rtx-pro-6000"]) -> dict[str, float]:
    """The one SM120 measurement we have, the original's 64.6 ms of cast, against the model's whole-pool cast on
    ``gpu`` under each transfer rule (keyed by the rule's name, :data:`RULES`); and the bandwidth the original's own
    figure implies, beside the H200's, each also as a share of its GPU's datasheet bandwidth."""
    fit = model.components["full_cast"]
    bytes_per_layer = p.pool_tokens * p.geometry.kv_dim * 3
    original_gbps = bytes_per_layer * p.geometry.num_layers / (ORIGINAL.cast_ms * 1e6)
    out = dict(
        original_cast_ms=ORIGINAL.cast_ms,
        original_gbps=original_gbps,
        h200_gbps=fit.gbps,
        h200_share_of_peak=fit.gbps / model.reference.hbm_gbps,
        original_share_of_peak=original_gbps / gpu.hbm_gbps,
    )
    for rule in RULES:
        out[rule] = (
            p.geometry.num_layers
            * (model.layer_us("full_pool_cast_fa2", p, gpu, rule) - model.layer_us("bf16_cache_fa2", p, gpu, rule))
            / 1e3
        )
    return out


def _cell(b: Row) -> str:
    """A build's cell of :func:`arch_table`: whether it would launch, and what the compiler reports."""
    if b.error:
        return (
            "not checked (this Triton could not compile it)"
            if b.triton
            else f"not checked (not compiled: {b.error[:80]})"
        )
    used = f"{b.shared_bytes / 1024:,.0f} of {b.shared_limit / 1024:,.0f} KB shared, {b.regs} regs"
    if b.trap_only:
        return "**no**: a trap-only kernel"
    return f"yes: {used}" + (f", {b.spills} B spilled" if b.spills else "") if b.fits else f"**no**: {used}"


def build_label(b: Mapping[str, Any]) -> str:
    """A build row's kernel: the kernel, its head count (a Triton shape's) or heads per CTA (a wgmma
    instantiation's)."""
    b = Row(b)
    return (
        b.kernel
        + (f", {b.heads} heads" if b.heads else "")
        + (f", {b.heads_per_cta} heads per CTA" if b.heads_per_cta else "")
    )


#: What a kernel built for one architecture only says in the other architectures' columns.
NOT_BUILT = "not built (sm_90a only: the Triton path runs here)"


def arch_table(builds: Sequence[dict[str, Any]], caption: str) -> Table:
    """The offline compiles as one row per kernel (and head count, or heads per CTA), one column per
    architecture (compute capability): the launch shape the launcher picks there, whether it would launch, and the
    shared memory (against the per-block limit), registers and spills the compiler reports. A wgmma path's rows
    (sm_90a, the same GPUs as sm_90) sit in the sm_90 column, named as their target; elsewhere they are not built."""
    archs: dict[int, str] = {}
    builds = [Row(b) for b in builds]
    for b in builds:
        archs.setdefault(b.cap, b.arch)
    rows: dict[tuple[str, int, int], dict[str, Any]] = {}
    for b in builds:
        row = rows.setdefault((b.kernel, b.heads, b.heads_per_cta or 0), dict(what=build_label(b)))
        target = b.arch.split(":")[0]
        named = f"{target}: " if target != archs[b.cap].split(":")[0] else ""
        row[archs[b.cap]] = named + (f"{b.shape} — " if b.shape else "") + _cell(b)
    for row in rows.values():
        if any(v.startswith("sm_90a: ") for k, v in row.items() if k != "what"):
            for name in archs.values():
                row.setdefault(name, NOT_BUILT)
    return Table(list(rows.values()), {"kernel": "what", **{a: a for a in archs.values()}}, caption)


def spilled_builds(builds: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The compiled builds that spilled registers (a spill slows a kernel but does not stop it: reported, never
    assumed absent), and how many builds compiled."""
    compiled = [b for b in map(Row, builds) if not b.error]
    return [b for b in compiled if b.spills], len(compiled)


def wgmma_build_rows(builds: Sequence[Mapping[str, Any]]) -> list[Row]:
    """The rows of ours' wgmma paths (``role`` the dispatcher's name of a wgmma path), in the dispatcher's order."""
    order = [k for k in KERNEL_NAMES if k != "triton"]
    return sorted(
        (b for b in map(Row, builds) if b.role in order),
        key=lambda b: (order.index(b.role), b.heads_per_cta or 0),
    )


def wgmma_build_values(builds: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What the compile says of each wgmma build, ``{"role:heads_per_cta": {regs, spills, stack_bytes, shared_bytes,
    fits, clean}}``; ``clean``: compiled with no spill and no stack frame, within the block's shared memory."""
    return {
        f"{b.role}:{b.get('heads_per_cta')}": {
            **{k: b.get(k) for k in ("regs", "spills", "stack_bytes", "shared_bytes", "fits")},
            "clean": not (b.error or b.spills or b.stack_bytes or not b.fits),
        }
        for b in wgmma_build_rows(builds)
    }
