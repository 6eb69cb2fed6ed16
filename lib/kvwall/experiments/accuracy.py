"""``fp8_accuracy``: what each way of decoding from an FP8 cache does to attention that is sharp or long -- every path
of the peer table on identical inputs, against float64.

The inputs are :mod:`kvwall.model.sharp_attention`'s: per request, keys solved so that every head's logits follow a
:class:`~kvwall.model.sharp_attention.Profile` (a spread, sinks holding a chosen mass, needles a margin above the
rest), stored once in an FP8 pool; the BF16 paths read its exact BF16 copy (e4m3 values are BF16 values). Each
request's tokens sit on random pages of 64 of the pool, and the page-size-1 paths read the same slots, so every
path reads the same values. Four value channels are probes (their output *is* a sum of softmax weights), so
beside the output's relative error each row says what became of:

- the first **needle**'s weight (profiles with needles) -- ``top_err``, the largest relative error over requests and
  heads;
- one ordinary **tail token**'s weight -- ``tail_token_err`` (median relative error) and ``tail_token_flushed``
  (the fraction of heads where a kernel gave it exactly zero while float64 gives it a positive weight);
- the **tail's mass** (all tokens but sinks and needles) -- ``tail_mass_kept``: the kernel's over float64's, the
  smallest over requests and heads (1: kept; 0: flushed);
- the **sinks'** mass -- ``sink_mass_ratio``, likewise (median).

``rel_err`` is over the 508 value channels that are not probes. The case row says what the stored values really
give (:func:`kvwall.model.sharp_attention.realized`, medians over heads and requests), and ``floor_rel_err``: the
float64 output rounded to BF16, the smallest error a BF16 output can have.

Every path runs once per case (nothing is timed here: ``fused_decode_bench`` times them). FlashMLA's dense FP8
decode quantizes the query as SGLang's ``flashmla`` backend does (static, the cache's scale: 1 here;
:func:`kvwall.peers.flashmla.quantize_query_static`); SGLang's Triton MLA is run with its own split policy.
Device time at full scale: 324-376 s on the H200 (2026-12-01 and 2026-12-02, 70 cases x 10 paths; the setup row's
``seconds_total``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from typing import Any

import torch

from kvwall.experiments.fused_decode.strategies import (
    FORCED_PATHS,
    STRATEGIES,
    BenchPoint,
    BuildContext,
    build_strategy,
    paged_layout,
    reference_f64,
)
from kvwall.experiments.registry import Experiment
from kvwall.measure.accuracy import finite_or_none, relative_error
from kvwall.measure.failures import error_text, traceback_tail
from kvwall.measure.timing import release_memory, synchronize
from kvwall.model.attention import flashinfer_version
from kvwall.model.geometry import GLM5
from kvwall.model.sharp_attention import N_PROBES, PROBES, PROFILES, Profile, realized, sharp_request
from kvwall.peers.flashmla import PAGE_SIZE, load_flash_mla
from kvwall.peers.sglang import load_sglang
from kvwall.results import Result, collect_provenance

__all__ = [
    "EXPERIMENTS",
    "ACCURACY_STRATEGIES",
    "run_fp8_accuracy",
    "build_case",
    "path_metrics",
    "unmet_needs",
    "QUERY_QUANTIZATION",
]

#: Every way of decoding the issue names, one entry each of the peer table: ours and each of its paths forced;
#: FlashMLA dense FP8 and BF16; FlashInfer's native FP8 (BF16 query); gather_cast + FlashInfer BF16 (what every
#: BF16-on-a-copy path computes); SGLang's Triton MLA.
ACCURACY_STRATEGIES: list[str] = [
    "ours",
    *FORCED_PATHS,
    "flashmla_dense_fp8",
    "flashmla_dense_bf16",
    "flashinfer_fp8_fa2",
    "flashinfer_fp8_fa3",
    "gather_cast_bf16",
    "sglang_triton_fp8",
]

QUERY_QUANTIZATION = (
    "FlashMLA dense FP8: the query quantized as SGLang 0.5.23's flashmla backend does "
    "(forward_decode: scaled_fp8_quant(q, layer.k_scale), a static per-tensor e4m3 quantization, "
    "clamped to +-448, with the KV cache's scale, 1.0 when the checkpoint has none; descale_q = "
    "descale_k = that scale). SGLang Triton MLA: its own cast of the query to the cache dtype. "
    "Every other path: the BF16 query as given."
)

SM_SCALE = GLM5.sm_scale
FP8 = torch.float8_e4m3fn


def unmet_needs(name: str, device: torch.device) -> str | None:
    """Why strategy ``name`` cannot run on ``device`` (None: it can): its :attr:`Strategy.needs` and a CUDA GPU for
    all but ours and the Triton path (which run in Triton's interpreter on a CPU)."""
    needs = STRATEGIES[name].needs
    if device.type != "cuda":
        return None if name in ("ours", "triton") else "needs a CUDA GPU"
    if "sm90" in needs and torch.cuda.get_device_capability(device) != (9, 0):
        return "needs an SM90 (Hopper) GPU"
    if "flashinfer" in needs and importlib.util.find_spec("flashinfer") is None:
        return "the flashinfer package is not installed"
    if "sglang" in needs and "error" in load_sglang():
        return load_sglang()["error"]
    if "flash_mla" in needs and "error" in load_flash_mla():
        return load_flash_mla()["error"]
    return None


def _case_lens(context: int, batch: int, gen: torch.Generator) -> list[int]:
    """Batch 1: ``[context]``; a mixed batch: lengths uniform in [context / 32, context] (1K-32K at 32K)."""
    if batch == 1:
        return [context]
    low = max(context // 32, 16)
    return torch.randint(low, context + 1, (batch,), generator=gen).tolist()


def build_case(
    profile: Profile, heads: int, lens: list[int], *, context: int, seed: int, device: torch.device
) -> tuple[BenchPoint, torch.Tensor, list]:
    """(the point, the FP8 pool, the requests): each request of ``lens`` a :func:`sharp_request`, written to random
    pages of 64 of a pool a quarter larger than the batch needs; the point's page-size-1 slots are those pages'."""
    gen = torch.Generator(device=device).manual_seed(seed)
    reqs = [sharp_request(profile, heads, n, sm_scale=SM_SCALE, gen=gen, device=device) for n in lens]
    pages = sum(-(-n // PAGE_SIZE) for n in lens)
    pool = torch.zeros((pages + pages // 4 + 1) * PAGE_SIZE, 1, GLM5.kv_dim, dtype=FP8, device=device)
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    pt = BenchPoint(
        heads,
        context,
        len(lens),
        list(lens),
        torch.stack([r.q_nope for r in reqs]),
        torch.stack([r.q_pe for r in reqs]),
        indptr,
        torch.empty(0, dtype=torch.int32, device=device),
        torch.tensor(lens, dtype=torch.int32, device=device),
        seed=seed,
    )
    slots = paged_layout(pt, pool)[2]
    for i, r in enumerate(reqs):
        pool[slots[int(indptr[i]) : int(indptr[i + 1])], 0] = r.keys
    pt.idx = slots.to(torch.int32)
    return pt, pool, reqs


def path_metrics(got: torch.Tensor, want: torch.Tensor, *, needles: bool) -> dict[str, Any]:
    """The probes' verdicts of one output ``got [B, H, 512]`` against float64 ``want`` (module docstring); the top
    token's only where it is a needle (``needles``: without needles it is one head's largest logit, for the other
    heads just another tail token)."""
    got, want = got.double(), want.double()

    def ch(t: torch.Tensor, name: str) -> torch.Tensor:
        return t[..., PROBES[name]]

    top_w, top_g = ch(want, "top"), ch(got, "top")
    tok_w, tok_g = ch(want, "tail_token"), ch(got, "tail_token")
    tail_w, tail_g = ch(want, "tail_mass"), ch(got, "tail_mass")
    sink_w, sink_g = ch(want, "sink_mass"), ch(got, "sink_mass")
    has_sinks = bool((sink_w > 0).any())
    return {
        "rel_err": finite_or_none(relative_error(got[..., N_PROBES:], want[..., N_PROBES:])),
        "top_err": finite_or_none(float(((top_g - top_w).abs() / top_w).max())) if needles else None,
        "top_err_median": finite_or_none(float(((top_g - top_w).abs() / top_w).median())) if needles else None,
        "tail_token_err": finite_or_none(float(((tok_g - tok_w).abs() / tok_w).median())),
        "tail_token_flushed": float(((tok_g == 0) & (tok_w > 0)).double().mean()),
        "tail_mass_kept": finite_or_none(float((tail_g / tail_w).min())),
        "tail_mass_kept_median": finite_or_none(float((tail_g / tail_w).median())),
        "sink_mass_ratio": finite_or_none(float((sink_g / sink_w).median())) if has_sinks else None,
        "finite": bool(torch.isfinite(got).all()),
    }


def _case_row(case: str, profile: Profile, pt: BenchPoint, reqs: list, want: torch.Tensor) -> dict[str, Any]:
    real = [dataclasses.asdict(realized(r, SM_SCALE)) for r in reqs]

    def med(key: str) -> float | None:
        vals = [x[key] for x in real if x[key] is not None]
        return float(torch.tensor(vals, dtype=torch.float64).median()) if vals else None

    floor = relative_error(want[..., N_PROBES:].to(torch.bfloat16), want[..., N_PROBES:])
    return {
        "section": "case",
        "case": case,
        "profile": profile.name,
        "spread": profile.spread,
        "sinks": profile.sinks,
        "sink_mass": profile.sink_mass,
        "needles": profile.needles,
        "margin": profile.margin,
        "heads": pt.heads,
        "context": pt.context,
        "batch": pt.batch,
        "tokens": pt.tokens,
        "len_min": min(pt.lens),
        "len_max": max(pt.lens),
        "saturated": sum(r.saturated for r in reqs),
        "floor_rel_err": finite_or_none(floor),
        **{f"realized_{k}": med(k) for k in real[0]},
    }


def run_fp8_accuracy(
    device: torch.device,
    *,
    heads: list[int],
    contexts: list[int],
    mixed_contexts: list[int],
    mixed_batch: int,
    profiles: list[str],
    strategies: list[str],
    cast_backend: str = "fa3",
    sglang_max_context: int = 262_144,
    seed: int = 0,
) -> Result:
    """See the module docstring. Cases: every profile of ``profiles`` (names of
    :data:`~kvwall.model.sharp_attention.PROFILES`) x ``heads`` x (batch 1 at each of ``contexts``, and a batch of
    ``mixed_batch`` requests of lengths uniform in [c / 32, c] for each c of ``mixed_contexts``). Rows: one
    ``setup``, then per case one ``case`` row and one ``path`` row per strategy (its metrics, or the ``error``)."""
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        raise ValueError(f"unknown strategies {sorted(unknown)}; known: {list(STRATEGIES)}.")
    chosen = {p.name: p for p in PROFILES}
    if set(profiles) - set(chosen):
        raise ValueError(f"unknown profiles {sorted(set(profiles) - set(chosen))}; known: {list(chosen)}.")
    t0 = time.perf_counter()
    skipped = {s: why for s in strategies if (why := unmet_needs(s, device)) is not None}
    run = [s for s in strategies if s not in skipped]
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    ctx = BuildContext(cast_backend=cast_backend, sglang_max_context=sglang_max_context, sm_count=sm_count)
    setup: dict[str, Any] = {
        "section": "setup",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "strategies": run,
        "skipped": skipped,
        "query_quantization": QUERY_QUANTIZATION,
        "precision": {s: {"cache": STRATEGIES[s].cache, "query": STRATEGIES[s].query} for s in run},
        "flashinfer": flashinfer_version() if "flashinfer" not in str(skipped.values()) else None,
        "flash_mla": str(load_flash_mla().get("version")) if "flashmla_dense_fp8" in run else None,
        "probes": dict(PROBES),
    }
    rows: list[dict] = [setup]
    gen = torch.Generator().manual_seed(seed)
    shapes = [(c, 1) for c in contexts] + [(c, mixed_batch) for c in mixed_contexts]
    n_case = 0
    for name in profiles:
        profile = chosen[name]
        for h in heads:
            for context, batch in shapes:
                lens = _case_lens(context, batch, gen)
                case = f"{name} | {h} heads | {'batch 1' if batch == 1 else f'batch {batch} mixed'} | {context}"
                pt, pool, reqs = build_case(profile, h, lens, context=context, seed=seed + 7919 * n_case, device=device)
                n_case += 1
                want = reference_f64(pt, pool, paged=False)
                rows.append(_case_row(case, profile, pt, reqs, want))
                del reqs
                for s in run:
                    row: dict[str, Any] = {
                        "section": "path",
                        "case": case,
                        "strategy": s,
                        "heads": h,
                        "context": context,
                        "batch": batch,
                    }
                    fn = None
                    try:
                        fn, info = build_strategy(s, pt, pool, ctx)
                        info.pop("_fixed_splits", None)
                        row.update({k: info[k] for k in ("kernel_path", "backend", "page_size") if k in info})
                        got = fn()
                        synchronize(device)
                        row.update(path_metrics(got, want, needles=profile.needles > 0))
                    except Exception as exc:  # noqa: BLE001 - a path that fails a case is a row with an error
                        row.update(error=error_text(exc, 600), traceback_tail=traceback_tail())
                    finally:
                        fn = None
                        release_memory(device)
                    rows.append(row)
                del pt, pool, want
                release_memory(device)
    setup["seconds_total"] = round(time.perf_counter() - t0, 1)
    params = dict(
        heads=list(heads),
        contexts=list(contexts),
        mixed_contexts=list(mixed_contexts),
        mixed_batch=mixed_batch,
        profiles=list(profiles),
        strategies=list(strategies),
        cast_backend=cast_backend,
        sglang_max_context=sglang_max_context,
        seed=seed,
    )
    return Result("fp8_accuracy", params, rows, collect_provenance(device, __name__))


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "fp8_accuracy",
        run_fp8_accuracy,
        full=dict(
            heads=[16, 128],
            contexts=[4096, 32_768, 131_072, 262_144],
            mixed_contexts=[32_768],
            mixed_batch=8,
            profiles=[p.name for p in PROFILES],
            strategies=list(ACCURACY_STRATEGIES),
            cast_backend="fa3",
            sglang_max_context=262_144,
            seed=0,
        ),
        small=dict(
            heads=[16],
            contexts=[512],
            mixed_contexts=[256],
            mixed_batch=3,
            profiles=[p.name for p in PROFILES],
            strategies=["ours"],
            cast_backend="fa3",
            sglang_max_context=262_144,
            seed=0,
        ),
        about="every path on identical sharp / long attention (sinks, needles, spreads 1-10, 4K-256K) "
        "against float64: output error, a needle's and a tail token's weight, the tail's mass",
        requires=("cuda",),
    ),
]
