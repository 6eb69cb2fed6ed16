"""A cost model of every path past the wall: per-layer attention time and per-step time, for any MLA geometry and GPU.

A path is a KV **preparation** (nothing, the whole-pool cast, PyTorch's index-then-cast, or the ``gather_cast``
kernel) followed by an **attention** kernel (FlashInfer BF16 fa3 or fa2, FlashInfer native FP8, ours,
FlashMLA dense BF16 or FP8). Each component's time is modelled from the bytes and FLOPs it must move
(:mod:`kvwall.model.roofline`'s counts) and the rates it achieves::

    attention:    t = c0 + max(attention_bytes / B, flops / F)        (c0: launch and tail, µs)
    preparation:  t = c0 + prep_bytes / B

Rates are **fitted** on the H200 sweep (``path_sweep``): attention components on the paths that have no
preparation, then each preparation on the paths that add it, with their attention's fitted time subtracted. Only
part of the sweep is used for fitting; the rest is held out to validate the model (:func:`validate`).

**Other GPUs** have no measurement here. Their rates come from the H200's by two transfer rules, and the book shows
both as a range: *fraction of peak* (a kernel reaching x % of the H200's datasheet bandwidth or BF16 rate reaches
x % of the other GPU's), and *per-SM rate* (a kernel limited by the bytes in flight per SM, Little's law, scales
with the SM count, capped at the other GPU's peak). Datasheet figures are labelled as such in :data:`GPUS`. Ours
runs the path :mod:`kvwall.kernels.mla_decode.dispatch` picks: on the H200 the one its measured table says, off
Hopper the Triton path, so another GPU's ``ours`` is predicted from the Triton path's own rates
(:data:`OFF_REFERENCE`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

import numpy as np

from kvwall.model.geometry import GLM5, MLAGeometry
from kvwall.model.roofline import decode_flops, qo_bytes

__all__ = [
    "GPUSpec",
    "GPUS",
    "MODEL_PRESETS",
    "ATTENTIONS",
    "PREPARATIONS",
    "PATHS",
    "Point",
    "PathComposition",
    "ComponentFit",
    "CostModel",
    "component_bytes",
    "fit_cost_model",
    "validate",
    "split_train_test",
    "TRANSFER_RULES",
    "paths_on",
    "FUSED_MAX_HEADS",
    "OFF_REFERENCE",
]


@dataclass(frozen=True)
class GPUSpec:
    """A GPU's ceilings. ``source`` says where they come from (datasheet, or measured here)."""

    key: str
    name: str
    arch: str  # "sm_90", "sm_100", "sm_120"
    hbm_gbps: float  # datasheet memory bandwidth, GB/s
    bf16_tflops: float  # datasheet dense BF16 tensor rate (FP32 accumulate), TFLOP/s
    sms: int
    memory_gb: float
    source: str


GPUS: dict[str, GPUSpec] = {
    g.key: g
    for g in (
        GPUSpec(
            "h200",
            "NVIDIA H200 SXM",
            "sm_90",
            4800,
            989.4,
            132,
            141,
            "datasheet ceilings; every path's rates measured on it (path_sweep)",
        ),
        GPUSpec(
            "h100",
            "NVIDIA H100 SXM",
            "sm_90",
            3350,
            989.4,
            132,
            80,
            "datasheet (H100 SXM5: 3.35 TB/s, 989 TFLOP/s dense BF16); rates transferred from the H200",
        ),
        GPUSpec(
            "b200",
            "NVIDIA B200",
            "sm_100",
            8000,
            2250,
            148,
            180,
            "datasheet (HGX B200: 8 TB/s, 2.25 PFLOP/s dense BF16); rates transferred from the H200",
        ),
        GPUSpec(
            "rtx-pro-6000",
            "RTX PRO 6000 Blackwell",
            "sm_120",
            1792,
            500,
            188,
            96,
            "datasheet (1,792 GB/s GDDR7, 188 SMs; 4,000 AI TOPS FP4 sparse = ~500 TFLOP/s dense BF16); "
            "the original's GPU; rates transferred from the H200",
        ),
        GPUSpec(
            "rtx-5090",
            "GeForce RTX 5090",
            "sm_120",
            1792,
            209.5,
            170,
            32,
            "datasheet (1,792 GB/s, 170 SMs, 209.5 TFLOP/s BF16 with FP32 accumulate); rates transferred from the H200",
        ),
    )
}


def _preset(name: str, layers: int, dense: int, heads: int, nope: int, v: int) -> MLAGeometry:
    return MLAGeometry(
        name=name,
        num_layers=layers,
        num_dense_layers=dense,
        num_heads=heads,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=nope,
        v_head_dim=v,
        tensor_parallel=1,
    )


#: MLA models from their public configs (all: kv_lora_rank 512, qk_rope_head_dim 64: 576 values a token a layer).
MODEL_PRESETS: dict[str, MLAGeometry] = {
    "glm-5": GLM5.with_tensor_parallel(1),
    "deepseek-v3": _preset("DeepSeek-V3/R1", 61, 3, 128, 128, 128),
    "kimi-k2": _preset("Kimi-K2-style", 61, 1, 64, 128, 128),
}

#: Attention component -> (the KV dtype it reads, its page size (one 4-byte index per page), archs it runs on).
ATTENTIONS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "fa3_bf16": ("bf16", 1, ("sm_90",)),
    "fa2_bf16": ("bf16", 1, ("sm_90", "sm_100", "sm_120")),
    "flashinfer_fp8": ("fp8", 1, ("sm_90",)),
    "ours": ("fp8", 1, ("sm_90", "sm_100", "sm_120")),
    "triton": ("fp8", 1, ("sm_90", "sm_100", "sm_120")),
    "flashmla_bf16": ("bf16", 64, ("sm_90",)),
    "flashmla_fp8": ("fp8", 64, ("sm_90",)),
}
PREPARATIONS = ("none", "full_cast", "index_then_cast", "gather_cast")
#: Attention measured on the reference GPU as the dispatcher ran it there -> the attention that runs in its place on
#: a GPU without a measured dispatch table (the Triton path). A sweep without a ``triton`` series: the component
#: itself.
OFF_REFERENCE: dict[str, str] = {"ours": "triton"}


@dataclass(frozen=True)
class PathComposition:
    """A path: its preparation, its attention, and what to call it."""

    prep: str
    attention: str
    label: str

    @property
    def cache_dtype(self) -> str:
        return "bf16" if self.prep == "none" and ATTENTIONS[self.attention][0] == "bf16" else "fp8"


#: Every sweep path (``kvwall.experiments.answer.sweep.SWEEP_PATHS``) as a composition.
PATHS: dict[str, PathComposition] = {
    "full_pool_cast": PathComposition("full_cast", "fa3_bf16", "whole-pool cast + FlashInfer BF16 fa3 (the original)"),
    "full_pool_cast_fa2": PathComposition("full_cast", "fa2_bf16", "whole-pool cast + FlashInfer BF16 fa2"),
    "index_then_cast": PathComposition("index_then_cast", "fa3_bf16", "PyTorch index_select().to() + fa3"),
    "index_then_cast_fa2": PathComposition("index_then_cast", "fa2_bf16", "PyTorch index_select().to() + fa2"),
    "gather_cast": PathComposition("gather_cast", "fa3_bf16", "gather_cast + FlashInfer BF16 fa3"),
    "gather_cast_fa2": PathComposition("gather_cast", "fa2_bf16", "gather_cast + FlashInfer BF16 fa2"),
    "ours": PathComposition("none", "ours", "ours: FP8 MLA decode, the dispatcher's path"),
    "triton": PathComposition("none", "triton", "ours, the Triton path"),
    "flashinfer_fp8": PathComposition("none", "flashinfer_fp8", "FlashInfer native FP8 (fa3)"),
    "bf16_cache": PathComposition("none", "fa3_bf16", "BF16 cache + FlashInfer fa3 (2x memory)"),
    "bf16_cache_fa2": PathComposition("none", "fa2_bf16", "BF16 cache + FlashInfer fa2 (2x memory)"),
    "flashmla_bf16": PathComposition("none", "flashmla_bf16", "FlashMLA dense BF16 cache, page 64 (2x memory)"),
    "flashmla_fp8": PathComposition("none", "flashmla_fp8", "FlashMLA dense FP8, page 64 (FP8 query)"),
}


@dataclass(frozen=True)
class Point:
    """Where a path runs: heads per GPU, requests, KV tokens read in all, the pool's tokens, the geometry."""

    heads: int
    batch: int
    tokens: int
    pool_tokens: int
    geometry: MLAGeometry = GLM5


def _dtype_bytes(kind: str) -> int:
    return 2 if kind == "bf16" else 1


def component_bytes(component: str, p: Point) -> float:
    """Fewest bytes a component moves at ``p`` (reads + writes, one layer)."""
    d = p.geometry.kv_dim
    if component in ATTENTIONS:
        kv, page, _ = ATTENTIONS[component]
        return p.tokens * d * _dtype_bytes(kv) + 4 * math.ceil(p.tokens / page) + qo_bytes(p.batch, p.heads, p.geometry)
    if component == "full_cast":
        return p.pool_tokens * d * 3  # every slot: FP8 read, BF16 written
    if component == "index_then_cast":
        return p.tokens * (d * 5 + 8)  # index_select: FP8 read + written, int64 index; .to(): FP8 read, BF16 written
    if component == "gather_cast":
        return p.tokens * (d * 3 + 4)  # FP8 read, BF16 written, int32 index
    if component == "none":
        return 0.0
    raise ValueError(f"unknown component {component!r}")


@dataclass(frozen=True)
class ComponentFit:
    """A component's fitted constants: ``c0_us``, achieved GB/s, achieved TFLOP/s (None: not compute-limited)."""

    component: str
    c0_us: float
    gbps: float
    tflops: float | None
    points: int
    fitted_on: tuple[str, ...]

    def us(self, p: Point) -> float:
        if self.component == "none":
            return 0.0
        t_mem = component_bytes(self.component, p) / (self.gbps * 1e3)
        t_cmp = decode_flops(p.heads, p.tokens, p.geometry) / (self.tflops * 1e6) if self.tflops else 0.0
        return self.c0_us + max(t_mem, t_cmp)


NONE_FIT = ComponentFit("none", 0.0, math.inf, None, 0, ())

#: Transfer rules from the H200's fitted rates to another GPU's.
TRANSFER_RULES = ("fraction of peak", "per-SM rate")


def _transfer(fit: ComponentFit, src: GPUSpec, dst: GPUSpec, rule: str) -> ComponentFit:
    if fit.component == "none" or src.key == dst.key:
        return fit
    if rule == "fraction of peak":
        gbps = fit.gbps * dst.hbm_gbps / src.hbm_gbps
        tflops = fit.tflops * dst.bf16_tflops / src.bf16_tflops if fit.tflops else None
    elif rule == "per-SM rate":
        gbps = min(fit.gbps * dst.sms / src.sms, 0.95 * dst.hbm_gbps)
        tflops = min(fit.tflops * dst.sms / src.sms, dst.bf16_tflops) if fit.tflops else None
    else:
        raise ValueError(f"unknown transfer rule {rule!r}; use one of {TRANSFER_RULES}")
    return replace(fit, gbps=gbps, tflops=tflops)


#: Heads per GPU up to which ours (the Triton path) has a launch shape that fits an architecture (checked offline by
#: :mod:`kvwall.tuning.arch_check`); an architecture missing here: every head count. Since the launcher filters its
#: fallback shapes by the device's shared memory, tensor memory and spills, none is missing.
FUSED_MAX_HEADS: dict[str, int] = {}


def paths_on(arch: str, heads: int) -> list[str]:
    """The paths that exist on ``arch`` for ``heads`` per GPU (fa3, FlashInfer FP8 and FlashMLA: SM90 only; ours
    wherever :data:`FUSED_MAX_HEADS` allows, which is everywhere). Off the H200, ours' prediction assumes the per-SM
    rate of the shape measured on it; where the launcher must pick a smaller shape (more than 16 heads on SM120 and
    SM100, compiled offline), that is optimistic. ``triton`` is no choice of its own: it is what ``ours`` runs off
    Hopper (:data:`OFF_REFERENCE`)."""
    out = []
    for name, comp in PATHS.items():
        if arch not in ATTENTIONS[comp.attention][2] or comp.attention in OFF_REFERENCE.values():
            continue
        if comp.attention == "ours" and heads > FUSED_MAX_HEADS.get(arch, 10**6):
            continue
        out.append(name)
    return out


@dataclass
class CostModel:
    """Fitted components on ``reference`` (the GPU measured), and what predicting with them means."""

    components: dict[str, ComponentFit]
    reference: GPUSpec = GPUS["h200"]
    notes: list[str] = field(default_factory=list)

    def layer_us(self, path: str, p: Point, gpu: GPUSpec | None = None, rule: str = "fraction of peak") -> float:
        """Predicted µs of one layer of ``path`` at ``p`` on ``gpu`` (the reference GPU by default); off the
        reference GPU's architecture (where the dispatcher runs the Triton path) with the :data:`OFF_REFERENCE`
        attention where it was fitted; another GPU of the same architecture (an H100) runs the dispatcher's paths."""
        comp = PATHS[path]
        gpu = gpu or self.reference
        total = 0.0
        for name in (comp.prep, comp.attention):
            if gpu.arch != self.reference.arch and OFF_REFERENCE.get(name) in self.components:
                name = OFF_REFERENCE[name]
            fit = NONE_FIT if name == "none" else self.components[name]
            total += _transfer(fit, self.reference, gpu, rule).us(p)
        return total

    def layer_range_us(self, path: str, p: Point, gpu: GPUSpec) -> tuple[float, float]:
        """(low, high) over :data:`TRANSFER_RULES` (one value twice on the reference GPU)."""
        vals = [self.layer_us(path, p, gpu, rule) for rule in TRANSFER_RULES]
        return min(vals), max(vals)

    def step_ms(
        self, path: str, p: Point, gpu: GPUSpec | None = None, rule: str = "fraction of peak", *, rest_ms: float = 0.0
    ) -> float:
        """Per-step ms: the geometry's layers x one layer, plus ``rest_ms`` for everything else in the step."""
        return p.geometry.num_layers * self.layer_us(path, p, gpu, rule) / 1e3 + rest_ms


def _attention_fit(component: str, pts: Sequence[Point], us: np.ndarray, fitted_on: tuple[str, ...]) -> ComponentFit:
    """Fit ``c0 + max(bytes / B, flops / F)`` by a grid over B and F (log-spaced), c0 by weighted least squares,
    minimising squared relative error."""
    nbytes = np.array([component_bytes(component, p) for p in pts])
    flops = np.array([decode_flops(p.heads, p.tokens, p.geometry) for p in pts], dtype=float)
    w = 1.0 / us
    best: tuple[float, float, float, float | None] | None = None
    for gbps in np.geomspace(100, 6000, 90):
        t_mem = nbytes / (gbps * 1e3)
        for tflops in itertools.chain([None], np.geomspace(20, 1200, 70)):
            t = t_mem if tflops is None else np.maximum(t_mem, flops / (tflops * 1e6))
            c0 = max(float(np.sum(w * w * (us - t)) / np.sum(w * w)), 0.0)
            err = float(np.sum(((c0 + t - us) * w) ** 2))
            if best is None or err < best[0]:
                best = (err, c0, float(gbps), None if tflops is None else float(tflops))
    assert best is not None
    return ComponentFit(component, best[1], best[2], best[3], len(pts), fitted_on)


def _prep_fit(component: str, pts: Sequence[Point], us: np.ndarray, fitted_on: tuple[str, ...]) -> ComponentFit:
    """Fit ``c0 + bytes / B`` (weighted least squares, both non-negative) on what is left of each path's time
    once its attention's fitted time is subtracted."""
    nbytes = np.array([component_bytes(component, p) for p in pts])
    w = 1.0 / np.maximum(us, 1e-3)
    a = np.stack([np.ones_like(nbytes), nbytes], axis=1) * w[:, None]
    sol, *_ = np.linalg.lstsq(a, us * w, rcond=None)
    c0, inv = float(sol[0]), float(sol[1])
    if c0 < 0 or inv <= 0:  # the constrained optimum then lies on an edge
        inv = max(float(np.sum(w * w * nbytes * us) / np.sum(w * w * nbytes * nbytes)), 1e-12)
        c0 = 0.0
    return ComponentFit(component, c0, 1.0 / inv / 1e3, None, len(pts), fitted_on)


def fit_cost_model(samples: Iterable[tuple[str, Point, float]], reference: GPUSpec = GPUS["h200"]) -> CostModel:
    """Fit every component from ``(path, point, measured µs per layer)`` samples on ``reference``.

    Attention components come from paths without preparation (``bf16_cache`` -> fa3_bf16, ...); then each
    preparation from the paths that add it, after subtracting their attention's fitted time. A component with no
    sample is left out (paths that need it cannot be predicted)."""
    by_path: dict[str, list[tuple[Point, float]]] = {}
    for path, p, us in samples:
        if us is not None and us > 0 and path in PATHS:
            by_path.setdefault(path, []).append((p, float(us)))
    comps: dict[str, ComponentFit] = {}
    for att in ATTENTIONS:
        names = [n for n, c in PATHS.items() if c.prep == "none" and c.attention == att and n in by_path]
        got = [s for n in names for s in by_path[n]]
        if got:
            comps[att] = _attention_fit(att, [p for p, _ in got], np.array([u for _, u in got]), tuple(names))
    for prep in PREPARATIONS[1:]:
        got, names = [], []
        for n, c in PATHS.items():
            if c.prep == prep and n in by_path and c.attention in comps:
                names.append(n)
                got += [(p, max(us - comps[c.attention].us(p), 0.05 * us)) for p, us in by_path[n]]
        if got:
            comps[prep] = _prep_fit(prep, [p for p, _ in got], np.array([u for _, u in got]), tuple(names))
    return CostModel(comps, reference)


def split_train_test(
    samples: Sequence[tuple[str, str, Point, float]],
) -> tuple[list[tuple[str, Point, float]], list[tuple[str, str, Point, float]]]:
    """Interleave each (axis, path) series by its order of points: even positions fit, odd ones are held out.
    ``samples`` are ``(axis, path, point, us)``."""
    train, test = [], []
    seen: dict[tuple[str, str], int] = {}
    for axis, path, p, us in samples:
        k = seen.get((axis, path), 0)
        seen[(axis, path)] = k + 1
        if k % 2 == 0:
            train.append((path, p, us))
        else:
            test.append((axis, path, p, us))
    return train, test


def validate(model: CostModel, held_out: Sequence[tuple[str, str, Point, float]]) -> list[dict]:
    """One row per held-out sample: measured, predicted, and the relative error (predicted / measured - 1)."""
    rows = []
    for axis, path, p, us in held_out:
        if path not in PATHS:  # as the fit: a path the model does not compose is left out
            continue
        comp = PATHS[path]
        if comp.attention not in model.components or (comp.prep != "none" and comp.prep not in model.components):
            continue
        pred = model.layer_us(path, p)
        rows.append(
            {
                "axis": axis,
                "path": path,
                "heads": p.heads,
                "batch": p.batch,
                "tokens": p.tokens,
                "pool_tokens": p.pool_tokens,
                "measured_us": us,
                "predicted_us": pred,
                "rel_err": pred / us - 1,
            }
        )
    return rows
