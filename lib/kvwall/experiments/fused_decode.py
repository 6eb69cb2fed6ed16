"""Chapter 5's experiments: the fused FP8 MLA decode kernel (:func:`kvwall.kernels.mla_decode.kernel`), checked and timed.

* ``fused_decode_validation`` (any device): a table of seeded cases -- head counts, odd lengths, empty requests,
  mixed batches, ``ckv_scale``/``kpe_scale`` other than 1, strided views of one ``[slots, 1, 576]`` pool, contiguous
  caches, 3-D page-size-1 views and a paged cache (page 64, ``kv_len``) -- each against the float64 reference on
  the *dequantized* cache, beside "the BF16 path" on exactly the same inputs. The accuracy rule (the issue's): our
  relative error at most twice the BF16 path's. On a CPU the kernel runs in Triton's interpreter and the BF16 path
  is the torch reference computing in bfloat16 (FlashInfer needs a GPU; rows say so); on a GPU it is FlashInfer's
  BF16 MLA (fa2), and FlashInfer 0.6.18.post1's native FP8 MLA (fa2, fa3) is compared too. Bad inputs must raise
  before any launch, leaving a poisoned ``out`` untouched (both devices); on a GPU also: CUDA-graph capture, then
  replays with new indices, lengths and scales (bit-identical to eager calls), and ``compute-sanitizer --tool
  memcheck`` over :func:`sanitize_main` (its output kept).
* ``fused_decode_bench`` (GPU): heads x context x batch, every strategy of :data:`STRATEGIES` timed in CUDA graphs
  with L2 flushed (:func:`kvwall.tuning.fused.graph_us`), host µs per call beside it, against the roofline of the
  same run (copy bandwidth and BF16 matmul rate measured first). Batch 1 is one request of ``context`` tokens;
  batches 8 and 32 are mixed lengths (:func:`kvwall.experiments.gather_cast.mixed_lengths`) summing to
  ``context * batch / 4`` tokens (capped at ``max_total_tokens``, 2M): a quarter of ``batch`` full-length requests'
  worth of KV, spread log-uniformly. All requests read random slots (with repeats) of one 495,000-slot FP8 pool.

SGLang's Triton MLA decode (``sglang_triton_fp8``) is imported from ``$KVWALL_SGLANG_PATH`` when that is set (a
folder holding the kernel module's unmodified import closure, e.g. the git-ignored ``.whl-sglang-min/``; its
``deps/`` subfolder, if any, is appended to ``sys.path``), else from an installed ``sglang``.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvwall.kernels import gather_cast, mla_decode_fp8, mla_decode_reference
from kvwall.kernels.mla_decode.kernel import default_config, default_num_splits

from kvwall.results import Result, collect_provenance
from kvwall.model.pool import mixed_lengths
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "STRATEGIES", "DecodeCase", "validation_cases", "active_bytes", "qo_bytes", "decode_flops",
           "roofline_us", "sglang_max_kv_splits", "run_fused_decode_validation", "run_fused_decode_bench",
           "sanitize_main", "load_sglang"]

DC, DR = 512, 64
D = DC + DR
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
#: GLM-5's softmax scale: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim).
SM_SCALE = 1.0 / math.sqrt(192 + 64)
#: Bytes of page-table index each token costs (int32 ``kv_indices``, page size 1).
INDEX_BYTES = 4

VALIDATION_SOURCES = ("kernels/mla_decode/kernel.py", "kernels/mla_decode/tuned.json", "kernels/mla_decode/reference.py",
                      "lib/kvwall/experiments/fused_decode.py")
BENCH_SOURCES = VALIDATION_SOURCES + ("kernels/gather/kernel.py", "kernels/gather/tuned.json",
                                      "lib/kvwall/tuning/fused.py", "lib/kvwall/measure/timing.py",
                                      "lib/kvwall/experiments/gather_cast.py")


def _result(name: str, device: torch.device, params: dict[str, Any], rows: list[dict], sources) -> Result:
    return Result(name, params, rows, collect_provenance(device, sources))


def _err(exc: BaseException, limit: int = 400) -> str:
    return f"{type(exc).__name__}: {str(exc)[:limit]}"


def _finite(x: float | None) -> float | None:
    """JSON-safe number: None for None, NaN and infinities."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (0 when both are 0)."""
    want = want.double()
    diff = float((got.double() - want).norm())
    norm = float(want.norm())
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _flashinfer_version() -> str | None:
    try:
        import flashinfer

        return flashinfer.__version__
    except Exception:  # noqa: BLE001 - absent or broken: recorded as such
        return None


# ---------------------------------------------------------------------------------------------------------
# Bytes, FLOPs, roofline
# ---------------------------------------------------------------------------------------------------------

def active_bytes(tokens: int, *, dim: int = D, index_bytes: int = INDEX_BYTES) -> int:
    """The fewest HBM bytes a decode over ``tokens`` KV tokens must read: each token's FP8 latent (576 B for
    GLM-5: 512 ckv + 64 kpe) plus its page-table index (4 B, int32, page size 1). Queries and outputs are left out
    (:func:`qo_bytes`, recorded beside it): negligible at long contexts, but not with many heads over short
    requests (128 heads, 1,024 tokens per request: 47 % of the KV bytes)."""
    return int(tokens) * (dim + index_bytes)


def qo_bytes(batch: int, heads: int, *, dc: int = DC, dr: int = DR) -> int:
    """Bytes of BF16 queries read (``q_nope`` + ``q_pe``, 576 values) and outputs written (512) per call."""
    return 2 * int(batch) * int(heads) * ((dc + dr) + dc)


def decode_flops(heads: int, tokens: int, *, dc: int = DC, dr: int = DR) -> int:
    """FLOPs of MLA decode attention: per head and token, the logit ``q . k`` over ``dc + dr`` = 576 values
    and ``p . v`` over ``dc`` = 512, two FLOPs per multiply-add: ``2 * heads * tokens * (576 + 512)``."""
    return 2 * int(heads) * int(tokens) * ((dc + dr) + dc)


def roofline_us(heads: int, tokens: int, copy_gbps: float, bf16_tflops: float, *,
                index_bytes: int = INDEX_BYTES) -> float:
    """Lower bound on one decode call's device time in µs: the larger of moving :func:`active_bytes` at the
    device-to-device copy bandwidth (GB/s, read + write counted, as :func:`kvwall.measure.timing.copy_bandwidth_gbps`
    reports it) and doing :func:`decode_flops` at the dense BF16 matmul rate (TFLOP/s)."""
    if copy_gbps <= 0 or bf16_tflops <= 0:
        raise ValueError(f"copy_gbps={copy_gbps} and bf16_tflops={bf16_tflops} must be positive.")
    memory = active_bytes(tokens, index_bytes=index_bytes) / (copy_gbps * 1e3)  # bytes / (GB/s) -> µs
    compute = decode_flops(heads, tokens) / (bf16_tflops * 1e6)  # FLOPs / (TFLOP/s) -> µs
    return max(memory, compute)


def sglang_max_kv_splits(sm_count: int, max_context_len: int, base: int = 8) -> int:
    """SGLang 0.5.23's ``max_kv_splits`` for MLA on CUDA (``_mla_decode_kv_splits_cap`` in
    ``sglang/srt/layers/attention/triton_backend.py``): ``max(base, min(next_pow2(SMs), next_pow2(ceil(max_context
    / 32))))`` with ``base`` = ``--triton-attention-num-kv-splits`` (default 8). It sizes ``attn_logits``; the
    per-request counts come from SGLang's own ``get_num_kv_splits_triton``."""
    def next_pow2(n: int) -> int:
        return 1 << (n - 1).bit_length() if n > 0 else 1

    if sm_count <= 0:
        return base
    return max(base, min(next_pow2(sm_count), next_pow2(-(-max_context_len // 32))))


# ---------------------------------------------------------------------------------------------------------
# Cases and inputs
# ---------------------------------------------------------------------------------------------------------

#: Cache layouts our kernel is called with: strided 2-D views of one ``[slots, 1, 576]`` pool (what SGLang holds),
#: two contiguous caches (plus garbage ``kv_indices`` entries past ``kv_indptr[-1]``: a fixed-capacity buffer), the
#: pool's 3-D ``[slots, 1, D]`` views, and a paged pool ``[pages, page_size, 576]`` with ``kv_len``.
LAYOUTS = ("pool_view", "contiguous", "pool_view_3d")
#: (ckv_scale, kpe_scale): kpe_scale / ckv_scale is a power of two in each, so that the BF16 path's inputs stay
#: exact (see :func:`_bf16_inputs`); ckv_scale itself is not.
SCALES = ((1.0, 1.0), (0.37, 0.74), (2.5, 0.625))
PAGED_SCALES = (1.5, 0.75)
#: Split counts forced in turn (None: the launcher's default); 1 takes the kernel's direct path (no combine).
SPLITS = (None, 1, None, 7)


@dataclass(frozen=True)
class DecodeCase:
    name: str
    heads: int
    lens: tuple[int, ...]
    layout: str
    ckv_scale: float
    kpe_scale: float
    index_dtype: str
    num_splits: int | None
    seed: int
    page_size: int = 1


def _short(lens) -> str:
    lens = list(lens)
    return "[" + ",".join(map(str, lens)) + "]" if len(lens) <= 8 else f"[{len(lens)} requests, {sum(lens)} tokens]"


def validation_cases(heads: list[int], length_sets: list[list[int]], paged_length_sets: list[list[int]],
                     page_size: int, seed: int = 0) -> list[DecodeCase]:
    """The case table: every head count x every length set, layouts / scales / index dtypes / forced splits
    rotating with different periods (so nine consecutive cases cover every layout x scale pair), and every
    head count x every paged length set (page ``page_size``, ``kv_len``)."""
    cases = []
    k = 0
    for h in heads:
        for lens in length_sets:
            layout = LAYOUTS[k % len(LAYOUTS)]
            cs, ks = SCALES[(k // len(LAYOUTS)) % len(SCALES)]
            dtype = "int64" if k % 2 else "int32"
            splits = SPLITS[k % len(SPLITS)]
            cases.append(DecodeCase(f"h{h} {layout} lens={_short(lens)} scales=({cs}, {ks}) {dtype} splits={splits}",
                                    h, tuple(lens), layout, cs, ks, dtype, splits, seed + k))
            k += 1
        for lens in paged_length_sets:
            cs, ks = PAGED_SCALES
            cases.append(DecodeCase(f"h{h} paged{page_size} lens={_short(lens)} scales=({cs}, {ks}) int32",
                                    h, tuple(lens), "paged", cs, ks, "int32", None, seed + k, page_size))
            k += 1
    return cases


@dataclass
class CaseInputs:
    """What our kernel is called with, and the same batch as token slots of a token-level cache view."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    ckv_cache: torch.Tensor
    kpe_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len: torch.Tensor | None
    tok_ckv: torch.Tensor  # [T, 512] FP8, a view (or the contiguous cache itself)
    tok_kpe: torch.Tensor  # [T, 64]
    tok3_ckv: torch.Tensor  # [T, 1, 512] FP8 for FlashInfer (page size 1)
    tok3_kpe: torch.Tensor
    tok_slots: list[torch.Tensor]  # per request: its token slots (int64, on the device)


def make_case_inputs(case: DecodeCase, device: torch.device, pool_slots: int) -> CaseInputs:
    """Fresh seeded inputs: BF16 queries ~ N(0, 0.5^2), an FP8 pool ~ N(0, 0.7^2), random slots (repeats allowed)."""
    g = torch.Generator(device=device).manual_seed(case.seed)
    lens = list(case.lens)
    b, h = len(lens), case.heads
    idx_dtype = getattr(torch, case.index_dtype)
    q_nope = (torch.randn(b, h, DC, generator=g, device=device) * 0.5).to(BF16)
    q_pe = (torch.randn(b, h, DR, generator=g, device=device) * 0.5).to(BF16)
    kv_len = None
    if case.layout == "paged":
        p = case.page_size
        n_pages = [-(-n // p) for n in lens]
        pages_total = max(pool_slots // p, 2 * sum(n_pages), 4)
        pool = (torch.randn(pages_total, p, D, generator=g, device=device) * 0.7).to(FP8)
        pages = torch.randperm(pages_total, generator=g, device=device)[: sum(n_pages)]
        page_ptr = [0]
        for n in n_pages:
            page_ptr.append(page_ptr[-1] + n)
        tok_slots = [(pages[page_ptr[i]:page_ptr[i + 1]][:, None] * p + torch.arange(p, device=device)).flatten()[:n]
                     for i, n in enumerate(lens)]
        ckv_cache, kpe_cache = pool[..., :DC], pool[..., DC:]
        kv_indptr = torch.tensor(page_ptr, dtype=idx_dtype, device=device)
        kv_indices = pages.to(idx_dtype)
        kv_len = torch.tensor(lens, dtype=idx_dtype, device=device)
        flat = pool.view(-1, 1, D)
        tok3_ckv, tok3_kpe = flat[:, :, :DC], flat[:, :, DC:]
        tok_ckv, tok_kpe = flat[:, 0, :DC], flat[:, 0, DC:]
    else:
        slots = max(pool_slots, 8)
        pool = (torch.randn(slots, 1, D, generator=g, device=device) * 0.7).to(FP8)
        idx = torch.randint(0, slots, (sum(lens),), generator=g, device=device, dtype=torch.int64)
        ptr = [0]
        for n in lens:
            ptr.append(ptr[-1] + n)
        tok_slots = [idx[ptr[i]:ptr[i + 1]] for i in range(b)]
        spare = torch.empty(0, dtype=torch.int64, device=device)
        if case.layout == "contiguous":
            tok_ckv, tok_kpe = pool[:, 0, :DC].contiguous(), pool[:, 0, DC:].contiguous()
            ckv_cache, kpe_cache = tok_ckv, tok_kpe
            tok3_ckv, tok3_kpe = tok_ckv.unsqueeze(1), tok_kpe.unsqueeze(1)
            spare = torch.full((5,), -12345, dtype=torch.int64, device=device)  # garbage past kv_indptr[-1]
        else:
            tok_ckv, tok_kpe = pool[:, 0, :DC], pool[:, 0, DC:]
            tok3_ckv, tok3_kpe = pool[:, :, :DC], pool[:, :, DC:]
            ckv_cache, kpe_cache = (tok3_ckv, tok3_kpe) if case.layout == "pool_view_3d" else (tok_ckv, tok_kpe)
        kv_indptr = torch.tensor(ptr, dtype=idx_dtype, device=device)
        kv_indices = torch.cat([idx, spare]).to(idx_dtype)
    return CaseInputs(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_len, tok_ckv, tok_kpe,
                      tok3_ckv, tok3_kpe, tok_slots)


def _nonempty(lens) -> list[int]:
    return [i for i, n in enumerate(lens) if n > 0]


def _sub_batch(inp: CaseInputs, keep: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The non-empty requests as a page-size-1 batch over the token-level cache: (indptr, indices, lens), int32."""
    device = inp.q_nope.device
    lens = [int(inp.tok_slots[i].numel()) for i in keep]
    ptr = [0]
    for n in lens:
        ptr.append(ptr[-1] + n)
    return (torch.tensor(ptr, dtype=torch.int32, device=device),
            torch.cat([inp.tok_slots[i] for i in keep]).to(torch.int32),
            torch.tensor(lens, dtype=torch.int32, device=device))


def _reference64(inp: CaseInputs, keep: list[int], cs: float, ks: float, sm_scale: float) -> torch.Tensor:
    """float64 reference over the dequantized cache (``fp8 * scale`` in float64) for the requests ``keep``."""
    idx = torch.cat([inp.tok_slots[i] for i in keep])
    c = inp.tok_ckv.index_select(0, idx).double() * cs  # compact: only the rows the batch reads
    k = inp.tok_kpe.index_select(0, idx).double() * ks
    ptr, _, _ = _sub_batch(inp, keep)
    compact = torch.arange(idx.numel(), device=idx.device)
    return mla_decode_reference(inp.q_nope[keep], inp.q_pe[keep], c, k, ptr, compact, sm_scale,
                                compute_dtype=torch.float64)


def _bf16_inputs(inp: CaseInputs, keep: list[int], cs: float, ks: float, sm_scale: float):
    """The BF16 path's inputs, kept exact. FP8 -> BF16 is exact, so the cache is cast as it is (no scale folded
    into it: ``fp8 * 0.37`` is not a BF16 number). FlashInfer's BF16 ``run()`` takes no ``ckv_scale``/``kpe_scale``
    (it rejects them unless the KV is FP8; wall.py passes them only on FP8 runs), so the scales go elsewhere:
    ``sm_scale * ckv_scale`` as the softmax scale, ``q_pe * (kpe_scale / ckv_scale)`` (exact: the ratio is a power
    of two in every case) and the output times ``ckv_scale`` (in float64, then rounded to BF16 by
    :func:`_bf16_output`: every path delivers a BF16 output, ours included; left in float64, a one-token request's
    BF16-path output would be exact and no BF16 output could match it). Returns (q_nope, q_pe', sm_scale', output
    multiplier, whether q_pe' is exact)."""
    ratio = ks / cs
    qpe = (inp.q_pe[keep].float() * ratio).to(BF16)
    exact = bool(torch.equal(qpe.double(), inp.q_pe[keep].double() * ratio))
    return inp.q_nope[keep], qpe, sm_scale * cs, cs, exact


def _bf16_output(out: torch.Tensor, mul: float) -> torch.Tensor:
    """The BF16 path's output: its attention output times ``mul`` (= ckv_scale), rounded to BF16 once (exact when
    ``mul`` is 1)."""
    return (out.double() * mul).to(BF16) if mul != 1.0 else out.to(BF16)


def _defaults_used(case: DecodeCase, device: torch.device) -> tuple[int, dict]:
    """(splits, launch config) a checked call picks for the case (its max_len: the longest request)."""
    max_len = max(case.lens) if case.lens else 0
    cfg = default_config(case.heads, DC, device, max_len)
    splits = case.num_splits if case.num_splits is not None else default_num_splits(len(case.lens), case.heads,
                                                                                     max_len, device, cfg)
    return splits, dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------------------------
# FlashInfer
# ---------------------------------------------------------------------------------------------------------

def _fi_plan(backend: str, kv_dtype: torch.dtype, heads: int, indptr: torch.Tensor, indices: torch.Tensor,
             lens: torch.Tensor, sm_scale: float, device: torch.device):
    """A ``BatchMLAPagedAttentionWrapper`` planned for one page-size-1 batch (as SGLang's flashinfer_mla and
    :class:`kvwall.model.attention.FlashInferMLADecode` do); returns (wrapper, plan ms). plan() is host work."""
    import flashinfer

    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
    qo = torch.arange(lens.numel() + 1, dtype=torch.int32, device=device)
    t0 = time.perf_counter()
    wrapper.plan(qo, indptr.to(torch.int32), indices.to(torch.int32), lens.to(torch.int32), heads, DC, DR, 1, False,
                 sm_scale, BF16, kv_dtype)
    return wrapper, (time.perf_counter() - t0) * 1e3


def _fi_run(wrapper, q_nope, q_pe, ckv3, kpe3, out=None, *, fp8_scales: tuple[float, float] | None = None):
    kw = {} if fp8_scales is None else {"ckv_scale": float(fp8_scales[0]), "kpe_scale": float(fp8_scales[1])}
    return wrapper.run(q_nope, q_pe, ckv3, kpe3, out=out, **kw)


def prebuild_flashinfer(device: torch.device) -> dict[str, Any]:
    """JIT-build FlashInfer's four MLA modules (fa2/fa3 x BF16/FP8 KV, BF16 Q/O, int32 indices) in one ninja run,
    in parallel, before anything is timed; plan() then loads them. A failure here only means plan() builds."""
    info: dict[str, Any] = {"flashinfer": _flashinfer_version()}
    if device.type != "cuda":
        return {**info, "skipped": "no GPU"}
    t0 = time.perf_counter()
    try:
        from flashinfer.jit import gen_batch_mla_module
        from flashinfer.jit.core import build_jit_specs

        specs = [gen_batch_mla_module(backend, BF16, kv, BF16, torch.int32, DC, DR, False)
                 for backend in ("fa2", "fa3") for kv in (BF16, FP8)]
        build_jit_specs(specs, verbose=False)
        info["modules"] = len(specs)
    except Exception as exc:  # noqa: BLE001 - plan() builds whatever is missing, one at a time
        info["error"] = _err(exc)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    return info


# ---------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------

def _compare(case: DecodeCase, inp: CaseInputs, out: torch.Tensor, keep: list[int], row: dict,
             peers: bool) -> list[dict]:
    """Fill ``row`` with our error, the BF16 path's and the verdict; return the FP8 peers' rows (GPU)."""
    device = out.device
    on_gpu = device.type == "cuda"
    lens = list(case.lens)
    peer_rows: list[dict] = []
    cs, ks = case.ckv_scale, case.kpe_scale
    want = _reference64(inp, keep, cs, ks, SM_SCALE)
    ours = out[keep]
    row["rel_err"] = _finite(_rel(ours, want))

    # The BF16 path on the same inputs: FlashInfer BF16 (GPU) or the torch reference computing in bfloat16 (CPU).
    q_n, q_p, sm_b, mul, exact = _bf16_inputs(inp, keep, cs, ks, SM_SCALE)
    row["bf16_inputs_exact"] = exact
    ptr, idx, sub_lens = _sub_batch(inp, keep)
    bf16_out = None
    if on_gpu:
        try:
            ckv_b = inp.tok_ckv.to(BF16).unsqueeze(1)  # the exactly cast cache, [T, 1, 512]
            kpe_b = inp.tok_kpe.to(BF16).unsqueeze(1)
            w, _ = _fi_plan("fa2", BF16, case.heads, ptr, idx, sub_lens, sm_b, device)
            bf16_out = _bf16_output(_fi_run(w, q_n, q_p, ckv_b, kpe_b), mul)
            _sync(device)
            row["bf16_path"] = f"FlashInfer {_flashinfer_version()} BatchMLAPagedAttentionWrapper fa2, BF16 KV"
            del ckv_b, kpe_b, w
        except Exception as exc:  # noqa: BLE001 - fall back to the stand-in, saying why
            row["bf16_path_error"] = _err(exc)
            bf16_out = None
    if bf16_out is None:
        sel = inp.tok_ckv.index_select(0, idx.long()).to(BF16)
        selk = inp.tok_kpe.index_select(0, idx.long()).to(BF16)
        compact = torch.arange(idx.numel(), device=device)
        bf16_out = _bf16_output(mla_decode_reference(q_n, q_p, sel, selk, ptr, compact, sm_b,
                                                     compute_dtype=torch.bfloat16), mul)
        row["bf16_path"] = "torch reference, bfloat16 compute"
    bf16_err = _rel(bf16_out, want)
    row["bf16_rel_err"] = _finite(bf16_err)
    ours_err = _rel(ours, want)
    row["ratio"] = _finite(ours_err / bf16_err) if bf16_err > 0 else (1.0 if ours_err == 0 else None)
    # the rule: ours at most twice the BF16 path's error (both 0 passes)
    row["passed"] = bool(row["finite"] and row["empty_out_zero"] and ours_err <= 2.0 * bf16_err)

    if on_gpu and peers:
        fp8_ckv = inp.tok3_ckv
        fp8_kpe = inp.tok3_kpe
        for backend in ("fa2", "fa3"):
            prow: dict[str, Any] = {"section": "fp8_peers", "case": case.name, "heads": case.heads, "lens": lens,
                                    "layout": case.layout, "peer": f"flashinfer_fp8_{backend}",
                                    "flashinfer": _flashinfer_version(), "rel_err": None, "rel_diff_vs_ours": None,
                                    "ratio_vs_bf16": None}
            try:
                w, _ = _fi_plan(backend, FP8, case.heads, ptr, idx, sub_lens, SM_SCALE, device)
                o = _fi_run(w, inp.q_nope[keep], inp.q_pe[keep], fp8_ckv, fp8_kpe, fp8_scales=(cs, ks))
                _sync(device)
                e = _rel(o, want)
                prow.update(rel_err=_finite(e), rel_diff_vs_ours=_finite(_rel(o, ours)),
                            ratio_vs_bf16=_finite(e / bf16_err) if bf16_err > 0 else None,
                            finite=bool(torch.isfinite(o).all()))
                del w, o
            except Exception as exc:  # noqa: BLE001 - one failing peer is a row with an error
                prow["error"] = _err(exc)
            peer_rows.append(prow)
    return peer_rows


def _case_rows(case: DecodeCase, device: torch.device, pool_slots: int, peers: bool) -> list[dict]:
    lens = list(case.lens)
    keep = _nonempty(lens)
    empties = [i for i in range(len(lens)) if i not in keep]
    row: dict[str, Any] = {"section": "cases", "case": case.name, "heads": case.heads, "lens": lens,
                           "batch": len(lens), "tokens": sum(lens), "layout": case.layout,
                           "page_size": case.page_size, "index_dtype": case.index_dtype,
                           "ckv_scale": case.ckv_scale, "kpe_scale": case.kpe_scale, "seed": case.seed,
                           "num_splits": None, "rel_err": None, "bf16_path": None, "bf16_rel_err": None,
                           "ratio": None, "finite": None, "empty_requests": len(empties), "empty_out_zero": None,
                           "passed": False}
    peer_rows: list[dict] = []
    try:
        inp = make_case_inputs(case, device, pool_slots)
        row["num_splits"], row["config"] = _defaults_used(case, device)
        poisoned = torch.full((len(lens), case.heads, DC), float("nan"), dtype=BF16, device=device)
        out = mla_decode_fp8(inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices,
                             SM_SCALE, ckv_scale=case.ckv_scale, kpe_scale=case.kpe_scale, out=poisoned,
                             kv_len=inp.kv_len, num_splits=case.num_splits)
        _sync(device)
        row["finite"] = bool(torch.isfinite(out).all())
        row["empty_out_zero"] = bool((out[empties] == 0).all()) if empties else True
    except Exception as exc:  # noqa: BLE001 - a failing case is a row
        row["error"] = _err(exc)
        row["traceback_tail"] = traceback.format_exc()[-1500:]
        return [row]
    if not keep:  # nothing to compare: every request empty, the output must be zeros
        row["passed"] = bool(row["finite"] and row["empty_out_zero"])
        return [row]
    try:
        peer_rows = _compare(case, inp, out, keep, row, peers)
    except Exception as exc:  # noqa: BLE001 - a comparison that fails (reference, BF16 path) is the row's error
        row["error"] = _err(exc)
        row["traceback_tail"] = traceback.format_exc()[-1500:]
        row["passed"] = False
    del inp
    return [row] + peer_rows


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _bad_inputs(device: torch.device):
    """(what, kwargs change, expected exception) -- each must raise before any launch."""
    case = DecodeCase("errors", 2, (3, 5), "pool_view", 1.0, 1.0, "int32", None, 10)
    inp = make_case_inputs(case, device, 64)
    ok = dict(q_nope=inp.q_nope, q_pe=inp.q_pe, ckv_cache=inp.ckv_cache, kpe_cache=inp.kpe_cache,
              kv_indptr=inp.kv_indptr, kv_indices=inp.kv_indices)
    paged = (torch.randn(32, 2, D, device=device) * 0.5).to(FP8)
    other = "cpu" if device.type == "cuda" else "meta"
    i32 = dict(dtype=torch.int32, device=device)
    cases = [
        ("cache dtype bf16", dict(ckv_cache=inp.ckv_cache.to(BF16)), TypeError),
        ("q_nope float32", dict(q_nope=inp.q_nope.float()), TypeError),
        ("kv_indices float32", dict(kv_indices=inp.kv_indices.float()), TypeError),
        ("q_pe heads differ", dict(q_pe=inp.q_pe[:, :1]), ValueError),
        ("index one past the pool", dict(kv_indices=torch.tensor([0, 1, 2, 3, 4, 5, 6, 64], **i32)), IndexError),
        ("negative index", dict(kv_indices=torch.tensor([0, -1, 2, 3, 4, 5, 6, 7], **i32)), IndexError),
        ("kv_indptr decreasing", dict(kv_indptr=torch.tensor([0, 5, 3], **i32)), ValueError),
        ("kv_indptr past kv_indices", dict(kv_indptr=torch.tensor([0, 3, 99], **i32)), ValueError),
        ("paged: kv_len past its pages", dict(ckv_cache=paged[..., :DC], kpe_cache=paged[..., DC:],
                                              kv_indices=torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], **i32),
                                              kv_len=torch.tensor([3, 17], **i32)), ValueError),
        ("paged: page index out of range", dict(ckv_cache=paged[..., :DC], kpe_cache=paged[..., DC:],
                                                kv_indices=torch.tensor([0, 1, 2, 3, 4, 5, 6, 32], **i32),
                                                kv_len=torch.tensor([3, 5], **i32)), IndexError),
        ("tensors on two devices", dict(kv_indptr=inp.kv_indptr.to(other)), ValueError),
        ("out of the wrong shape", dict(out=torch.full((2, 3, DC), float("nan"), dtype=BF16, device=device)),
         ValueError),
        ("out aliases q_nope", dict(out=inp.q_nope), ValueError),
        ("num_splits 0", dict(num_splits=0), ValueError),
        ("scale tensor float64", dict(ckv_scale=torch.ones(1, dtype=torch.float64, device=device)), ValueError),
        ("sm_scale NaN", dict(sm_scale=float("nan")), TypeError),
    ]
    return ok, cases


def _error_rows(device: torch.device) -> list[dict]:
    ok, cases = _bad_inputs(device)
    rows = []
    for what, change, kind in cases:
        args = {**ok, "sm_scale": SM_SCALE, "out": torch.full((2, 2, DC), float("nan"), dtype=BF16, device=device),
                **change}
        out = args["out"]
        before = _bits(out).clone()
        raised, message = "nothing", ""
        try:
            mla_decode_fp8(args.pop("q_nope"), args.pop("q_pe"), args.pop("ckv_cache"), args.pop("kpe_cache"),
                           args.pop("kv_indptr"), args.pop("kv_indices"), args.pop("sm_scale"), **args)
            _sync(device)
        except Exception as exc:  # noqa: BLE001 - the row records what was raised
            raised, message = type(exc).__name__, str(exc)
        untouched = bool(torch.equal(_bits(out), before))
        rows.append({"section": "errors", "input": what, "expected": kind.__name__, "raised": raised,
                     "message": message[:300], "out_untouched": untouched,
                     "passed": raised == kind.__name__ and untouched})
    if device.type == "cuda":  # a checked call (host reads of kv_indptr/kv_indices) inside graph capture
        out = torch.full((2, 2, DC), float("nan"), dtype=BF16, device=device)
        before = _bits(out).clone()
        mla_decode_fp8(**{k: v for k, v in ok.items()}, sm_scale=SM_SCALE, num_splits=2, check_range=False)
        _sync(device)
        raised, message = "nothing", ""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                mla_decode_fp8(**ok, sm_scale=SM_SCALE, out=out, num_splits=2)
        except Exception as exc:  # noqa: BLE001
            raised, message = type(exc).__name__, str(exc)
        del graph
        _sync(device)
        untouched = bool(torch.equal(_bits(out), before))
        rows.append({"section": "errors", "input": "checked call inside CUDA-graph capture", "expected": "RuntimeError",
                     "raised": raised, "message": message[:300], "out_untouched": untouched,
                     "passed": raised == "RuntimeError" and untouched})
    return rows


#: Graph trials: (request lengths, ckv_scale, kpe_scale); the capture saw the first.
GRAPH_TRIALS = [([100, 3000, 0, 5], 1.0, 1.0), ([0, 8000, 1, 4097], 1.5, 0.75), ([4000, 4000, 4000, 4000], 0.37, 0.74),
                ([0, 0, 0, 0], 2.0, 2.0), ([16_384, 0, 0, 0], 0.5, 0.25), ([1, 1, 1, 1], 1.0, 1.0)]


def _graph_rows(device: torch.device, heads: int, *, seed: int) -> list[dict]:
    """Capture one call with static buffers (capacity-sized ``kv_indices``, scales as tensors, fixed splits,
    ``check_range=False``), then replay it with new indices, lengths and scales: each replay against the float64
    reference and bit for bit against an eager (checked) call with the same inputs."""
    slots, capacity, batch = 100_000, 16_384, 4
    g = torch.Generator(device=device).manual_seed(seed)
    pool = (torch.randn(slots, 1, D, generator=g, device=device) * 0.7).to(FP8)
    ckv, kpe = pool[:, 0, :DC], pool[:, 0, DC:]
    q_nope = (torch.randn(batch, heads, DC, generator=g, device=device) * 0.5).to(BF16)
    q_pe = (torch.randn(batch, heads, DR, generator=g, device=device) * 0.5).to(BF16)
    idx_buf = torch.zeros(capacity, dtype=torch.int32, device=device)
    ptr_buf = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    cs_t = torch.ones(1, dtype=torch.float32, device=device)
    ks_t = torch.ones(1, dtype=torch.float32, device=device)
    out = torch.empty(batch, heads, DC, dtype=BF16, device=device)
    cfg = default_config(heads, DC, device, capacity)
    splits = default_num_splits(batch, heads, capacity, device, cfg)
    kw = dict(ckv_scale=cs_t, kpe_scale=ks_t, out=out, num_splits=splits, check_range=False, config=cfg)
    rows = []

    def load(lens, cs, ks):
        n = sum(lens)
        idx_buf.fill_(slots + 7)  # garbage past the real rows: the kernel must not read it
        if n:
            idx_buf[:n] = torch.randint(0, slots, (n,), generator=g, device=device, dtype=torch.int32)
        ptr_buf.copy_(torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32))
        cs_t.fill_(cs)
        ks_t.fill_(ks)

    try:
        load(*GRAPH_TRIALS[0])
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compile and load before the capture
            mla_decode_fp8(q_nope, q_pe, ckv, kpe, ptr_buf, idx_buf, SM_SCALE, **kw)
        torch.cuda.current_stream(device).wait_stream(side)
        _sync(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mla_decode_fp8(q_nope, q_pe, ckv, kpe, ptr_buf, idx_buf, SM_SCALE, **kw)
    except Exception as exc:  # noqa: BLE001
        return [{"section": "graph", "heads": heads, "trial": None, "error": _err(exc), "passed": False}]
    for trial, (lens, cs, ks) in enumerate(GRAPH_TRIALS):
        row: dict[str, Any] = {"section": "graph", "heads": heads, "trial": trial, "lens": lens, "ckv_scale": cs,
                               "kpe_scale": ks, "num_splits": splits, "config": dataclasses.asdict(cfg),
                               "capacity": capacity, "rel_err": None, "passed": False}
        try:
            load(lens, cs, ks)
            out.fill_(float("nan"))
            graph.replay()
            _sync(device)
            keep = _nonempty(lens)
            empties = [i for i in range(batch) if i not in keep]
            eager = mla_decode_fp8(q_nope, q_pe, ckv, kpe, ptr_buf, idx_buf, SM_SCALE, ckv_scale=cs_t, kpe_scale=ks_t,
                                   num_splits=splits, config=cfg)  # checked; same variant, config, splits: same bits
            row["equal_to_eager"] = bool(torch.equal(_bits(out), _bits(eager)))
            row["empty_out_zero"] = bool((out[empties] == 0).all()) if empties else True
            row["finite"] = bool(torch.isfinite(out).all())
            if keep:
                ptr = ptr_buf.tolist()
                inp = CaseInputs(q_nope, q_pe, ckv, kpe, ptr_buf, idx_buf, None, ckv, kpe, ckv, kpe,
                                 [idx_buf[ptr[i]:ptr[i + 1]].long() for i in range(batch)])
                row["rel_err"] = _finite(_rel(out[keep], _reference64(inp, keep, cs, ks, SM_SCALE)))
            row["passed"] = bool(row["equal_to_eager"] and row["empty_out_zero"] and row["finite"]
                                 and (not keep or (row["rel_err"] is not None and row["rel_err"] <= 1e-2)))
        except Exception as exc:  # noqa: BLE001
            row["error"] = _err(exc)
        rows.append(row)
    del graph
    return rows


def _sanitizer_rows(timeout_s: int) -> list[dict]:
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return [{"section": "sanitizer", "tool": "memcheck", "ran": False, "returncode": None,
                 "summary": "compute-sanitizer not found on PATH", "output_tail": "", "passed": None}]
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}  # every tensor its own allocation: exact bounds
    code = "from kvwall.experiments.fused_decode import sanitize_main; raise SystemExit(sanitize_main())"
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-c", code]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        output += (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        rc = None
    summary = re.findall(r"ERROR SUMMARY: .*", output)
    summary_line = summary[-1] if summary else "(no summary line)"
    return [{"section": "sanitizer", "tool": "memcheck", "ran": True, "returncode": rc,
             "seconds": round(time.time() - t0, 1), "summary": summary_line,
             "command": "compute-sanitizer --tool memcheck --error-exitcode 3 python3 -c "
                        "'from kvwall.experiments.fused_decode import sanitize_main; ...'",
             "output_tail": "\n".join(output.strip().splitlines()[-40:]),
             "passed": rc == 0 and summary_line.startswith("ERROR SUMMARY: 0 errors")}]


#: What memcheck runs: small cases that reach every edge (empty requests, one token, tile and split boundaries,
#: garbage past kv_indptr[-1], the direct path, many empty splits, pages with a partial last page, 128 heads).
SANITIZED_CASES = [
    DecodeCase("h16 pool_view", 16, (0, 1, 65, 300), "pool_view", 0.37, 0.74, "int32", None, 1),
    DecodeCase("h3 contiguous spare", 3, (7, 0, 129), "contiguous", 1.0, 1.0, "int64", 40, 2),
    DecodeCase("h64 3d direct", 64, (33, 200), "pool_view_3d", 2.5, 0.625, "int32", 1, 3),
    DecodeCase("h128 pool_view", 128, (500, 1), "pool_view", 1.0, 1.0, "int32", 5, 4),
    DecodeCase("h16 paged64", 16, (1, 0, 63, 64, 65, 200), "paged", 1.5, 0.75, "int32", 3, 5, 64),
    DecodeCase("h1 all empty", 1, (0, 0), "pool_view", 1.0, 1.0, "int32", None, 6),
]


def sanitize_main() -> int:
    """Run :data:`SANITIZED_CASES` on the GPU (under ``compute-sanitizer``): each against the float64 reference;
    exit status 1 if any result is wrong."""
    device = torch.device("cuda")
    wrong = []
    for case in SANITIZED_CASES:
        inp = make_case_inputs(case, device, 2_000)
        out = mla_decode_fp8(inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices,
                             SM_SCALE, ckv_scale=case.ckv_scale, kpe_scale=case.kpe_scale, kv_len=inp.kv_len,
                             num_splits=case.num_splits)
        torch.cuda.synchronize()
        keep = _nonempty(case.lens)
        empties = [i for i in range(len(case.lens)) if i not in keep]
        ok = bool(torch.isfinite(out).all()) and (not empties or bool((out[empties] == 0).all()))
        if keep:
            ok = ok and _rel(out[keep], _reference64(inp, keep, case.ckv_scale, case.kpe_scale, SM_SCALE)) <= 1e-2
        print(f"{case.name:24s} {'ok' if ok else 'WRONG'}", flush=True)
        wrong += [] if ok else [case.name]
    torch.cuda.synchronize()
    print("wrong results:", ", ".join(wrong) if wrong else "none", flush=True)
    return 1 if wrong else 0


def run_fused_decode_validation(device: torch.device, *, heads: list[int], length_sets: list[list[int]],
                                paged_length_sets: list[list[int]], page_size: int, pool_slots: int, peers: bool,
                                graph: bool, sanitizer: bool, sanitizer_timeout_s: int = 300,
                                seed: int = 0) -> Result:
    """See the module docstring. Row sections: ``cases`` (one per case), ``fp8_peers`` (GPU), ``errors``,
    ``graph`` (GPU), ``sanitizer`` (GPU, with ``sanitizer``)."""
    on_gpu = device.type == "cuda"
    rows: list[dict] = []
    if on_gpu and peers:
        rows.append({"section": "setup", "flashinfer_prebuild": prebuild_flashinfer(device)})
    for case in validation_cases(heads, length_sets, paged_length_sets, page_size, seed):
        rows += _case_rows(case, device, pool_slots, peers)
        _free(device)
    rows += _error_rows(device)
    if on_gpu and graph:
        for h in sorted({heads[0], heads[-1]}):
            rows += _graph_rows(device, h, seed=seed + h)
            _free(device)
    if on_gpu and sanitizer:
        rows += _sanitizer_rows(sanitizer_timeout_s)
    params = dict(heads=list(heads), length_sets=[list(x) for x in length_sets],
                  paged_length_sets=[list(x) for x in paged_length_sets], page_size=page_size, pool_slots=pool_slots,
                  peers=peers, graph=graph, sanitizer=sanitizer, sanitizer_timeout_s=sanitizer_timeout_s, seed=seed)
    return _result("fused_decode_validation", device, params, rows, VALIDATION_SOURCES)


# ---------------------------------------------------------------------------------------------------------
# SGLang's Triton MLA decode
# ---------------------------------------------------------------------------------------------------------

_SGLANG: dict[str, Any] = {}


def load_sglang() -> dict[str, Any]:
    """SGLang 0.5.23's ``decode_attention_fwd`` and ``get_num_kv_splits_triton`` (cached): from
    ``$KVWALL_SGLANG_PATH`` (put first on ``sys.path``; its ``deps/``, if present, appended last) or an installed
    ``sglang``. Returns ``{"decode_attention_fwd", "get_num_kv_splits_triton", "source", "file"}`` or
    ``{"error", "source"}``."""
    if _SGLANG:
        return _SGLANG
    path = os.environ.get("KVWALL_SGLANG_PATH")
    info: dict[str, Any] = {"source": f"KVWALL_SGLANG_PATH={path}" if path else "installed sglang"}
    try:
        if path:
            if not os.path.isdir(os.path.join(path, "sglang")):
                raise FileNotFoundError(f"KVWALL_SGLANG_PATH={path} has no sglang/ folder")
            if path not in sys.path:
                sys.path.insert(0, path)
            deps = os.path.join(path, "deps")
            if os.path.isdir(deps) and deps not in sys.path:
                sys.path.append(deps)  # last: packages the machine already has win
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
        from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

        import sglang.kernels.ops.attention.decode_attention as mod

        info.update(decode_attention_fwd=decode_attention_fwd, get_num_kv_splits_triton=get_num_kv_splits_triton,
                    file=mod.__file__)
    except BaseException as exc:  # noqa: BLE001 - an import that fails is the strategy's error row
        info["error"] = f"sglang import failed: {_err(exc, 600)}"
    _SGLANG.update(info)
    return _SGLANG


# ---------------------------------------------------------------------------------------------------------
# Benchmark
# ---------------------------------------------------------------------------------------------------------

STRATEGIES = ("fused_fp8", "full_cast_bf16", "gather_cast_bf16", "flashinfer_fp8_fa2", "flashinfer_fp8_fa3",
              "flashinfer_bf16_precast", "sglang_triton_fp8")

HOST_US_MEANS = ("host µs per call: wall-clock time of N back-to-back calls from Python (no CUDA graph, no "
                 "synchronization between them) divided by N, after a warm-up call and a sync; it includes the "
                 "Python wrappers, argument checks, allocations, and every kernel launch of the call (for "
                 "full_cast_bf16 the cast too, for gather_cast_bf16 the gather-cast's plan and launch); FlashInfer's "
                 "plan() is not included (done once per point, reported as plan_ms). When it exceeds `us`, an eager "
                 "(uncaptured) call is host-bound.")
ACTIVE_BYTES_MEANS = ("tokens x (576 + 4): each token's FP8 latent (512 ckv + 64 kpe bytes) and its int32 page-table "
                      "index, read once; BF16 queries and outputs left out (qo_bytes: batch x heads x (576 + 512) x 2, "
                      "in each row)")
ROOFLINE_MEANS = ("max(active_bytes / copy GB/s, 2 x heads x tokens x (576 + 512) FLOPs / BF16 matmul TFLOP/s), both "
                  "ceilings measured at the start of this run (copy counts read + write bytes)")
US_MEANS = ("device µs per call from kvwall.tuning.fused.graph_us: CUDA graphs of reps x [flush 256 MB, call] minus "
            "reps x [flush], best of rounds replays; FlashInfer plan() and SGLang's split choice outside the graph")


@dataclass
class _Point:
    heads: int
    context: int
    batch: int
    lens: list[int]
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    indptr: torch.Tensor
    idx: torch.Tensor
    lens_t: torch.Tensor

    @property
    def tokens(self) -> int:
        return sum(self.lens)


def bench_lengths(context: int, batch: int, *, max_total: int, seed: int) -> list[int]:
    """Batch 1: ``[context]``; larger batches: :func:`mixed_lengths` summing to ``min(context * batch // 4,
    max_total)``."""
    if batch == 1:
        return [int(context)]
    total = min(context * batch // 4, max_total)
    return mixed_lengths(total, batch, seed=seed)


def _host_us(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    _sync(device)
    return us


def _build(name: str, pt: _Point, pool: torch.Tensor, device: torch.device, *, cast_backend: str,
           sglang_max_context: int, sm_count: int) -> tuple[Callable[[], torch.Tensor], dict[str, Any]]:
    """(the call to time, fields for the row) for one strategy at one point; everything outside the call (plan(),
    buffers, SGLang's split choice, the one-off BF16 pool of ``flashinfer_bf16_precast``) is done here."""
    b, h = pt.batch, pt.heads
    out = torch.empty(b, h, DC, dtype=BF16, device=device)
    ckv8, kpe8 = pool[:, :, :DC], pool[:, :, DC:]
    info: dict[str, Any] = {}
    if name == "fused_fp8":
        # What a checked call would pick (its max_len is the longest request's), passed explicitly: an unchecked
        # call cannot read the lengths and would size its defaults from len(kv_indices) / batch instead.
        max_len = max(pt.lens)
        cfg = default_config(h, DC, device, max_len)
        splits = default_num_splits(b, h, max_len, device, cfg)
        info.update(num_splits=splits, config=dataclasses.asdict(cfg))
        c2, k2 = pool[:, 0, :DC], pool[:, 0, DC:]
        return (lambda: mla_decode_fp8(pt.q_nope, pt.q_pe, c2, k2, pt.indptr, pt.idx, SM_SCALE, out=out,
                                       num_splits=splits, check_range=False, config=cfg)), info
    if name == "full_cast_bf16":  # the original: the whole pool cast every call, then FlashInfer BF16 (fa2)
        w, plan_ms = _fi_plan("fa2", BF16, h, pt.indptr, pt.idx, pt.lens_t, SM_SCALE, device)
        info.update(backend="fa2", plan_ms=plan_ms)

        def full_cast_call():
            p = pool.to(BF16)
            return w.run(pt.q_nope, pt.q_pe, p[:, :, :DC], p[:, :, DC:], out=out)
        return full_cast_call, info
    if name == "gather_cast_bf16":  # chapter 4: only the rows the batch reads, into a compact BF16 buffer
        buf = torch.empty(pt.tokens, 1, D, dtype=BF16, device=device)
        compact = torch.arange(pt.tokens, dtype=torch.int32, device=device)
        w, plan_ms = _fi_plan(cast_backend, BF16, h, pt.indptr, compact, pt.lens_t, SM_SCALE, device)
        info.update(backend=cast_backend, plan_ms=plan_ms, buffer_bytes=buf.numel() * 2)

        def gather_call():
            gather_cast(pool, pt.idx, None, out=buf, check_range=False)
            return w.run(pt.q_nope, pt.q_pe, buf[:, :, :DC], buf[:, :, DC:], out=out)
        return gather_call, info
    if name in ("flashinfer_fp8_fa2", "flashinfer_fp8_fa3"):
        backend = name.rsplit("_", 1)[1]
        w, plan_ms = _fi_plan(backend, FP8, h, pt.indptr, pt.idx, pt.lens_t, SM_SCALE, device)
        info.update(backend=backend, plan_ms=plan_ms)
        return (lambda: _fi_run(w, pt.q_nope, pt.q_pe, ckv8, kpe8, out, fp8_scales=(1.0, 1.0))), info
    if name == "flashinfer_bf16_precast":  # BF16 attention alone: the pool cast once, outside the timing
        pb = pool.to(BF16)
        tried = {}
        for backend in ("fa3", "fa2"):
            try:
                w, plan_ms = _fi_plan(backend, BF16, h, pt.indptr, pt.idx, pt.lens_t, SM_SCALE, device)
                w.run(pt.q_nope, pt.q_pe, pb[:, :, :DC], pb[:, :, DC:], out=out)
                _sync(device)
                break
            except Exception as exc:  # noqa: BLE001 - fa3 may not run a shape: fall back to fa2, say so
                tried[backend] = _err(exc)
        else:
            raise RuntimeError(f"neither fa3 nor fa2 ran: {tried}")
        info.update(backend=backend, plan_ms=plan_ms, pool_bf16_bytes=pb.numel() * 2,
                    **({"fa3_error": tried["fa3"]} if "fa3" in tried else {}))
        return (lambda: w.run(pt.q_nope, pt.q_pe, pb[:, :, :DC], pb[:, :, DC:], out=out)), info
    if name == "sglang_triton_fp8":
        sg = load_sglang()
        if "error" in sg:
            raise RuntimeError(sg["error"])
        fwd, splits_kernel = sg["decode_attention_fwd"], sg["get_num_kv_splits_triton"]
        q = torch.cat([pt.q_nope, pt.q_pe], dim=-1).contiguous()  # SGLang's q: [B, H, 576], BF16
        v_buffer = pool[:, :, :DC]
        max_splits = sglang_max_kv_splits(sm_count, sglang_max_context)
        num_kv_splits = torch.empty(b, dtype=torch.int32, device=device)
        # SGLang's own split policy (triton_backend.get_num_kv_splits): one kernel over the batch's lengths
        splits_kernel[(1,)](num_kv_splits, pt.lens_t, b, 1, h, 1, max_splits, sm_count,
                            MAX_NUM_SEQ=256 if b < 256 else 1 << (b - 1).bit_length())
        chosen = num_kv_splits.tolist()
        use_pdl = torch.cuda.get_device_capability(device)[0] >= 9  # sgl_kernel's is_arch_support_pdl on CUDA

        def make(n_splits_t, s_max):
            logits = torch.empty(b, h, s_max, DC, dtype=torch.float32, device=device)
            lse = torch.empty(b, h, s_max, dtype=torch.float32, device=device)

            def call(pdl=use_pdl):
                fwd(q, pool, v_buffer, out, pt.indptr, pt.idx, logits, lse, n_splits_t, s_max, SM_SCALE, 1.0, 1.0,
                    has_mla=True, use_pdl=pdl)
                return out
            return call

        call = make(num_kv_splits, max_splits)
        try:
            call()
            _sync(device)
        except Exception as exc:  # noqa: BLE001 - PDL launch refused: SGLang without PDL, recorded
            info["pdl_error"] = _err(exc)
            use_pdl = False
            base = call
            call = lambda: base(False)  # noqa: E731
        info.update(max_kv_splits=max_splits, num_kv_splits_min=min(chosen), num_kv_splits_max=max(chosen),
                    use_pdl=use_pdl, sglang_file=sg.get("file"), sglang_source=sg.get("source"))
        return call, info
    raise ValueError(f"unknown strategy {name!r}; known: {STRATEGIES}")


def _sglang_sweep(pt: _Point, pool: torch.Tensor, device: torch.device, splits: list[int], flush, reps: int,
                  rounds: int, use_pdl: bool) -> dict[str, Any]:
    """SGLang's kernel with every request on ``S`` splits (``max_kv_splits = S``), for each S: µs, and the best."""
    from kvwall.tuning.fused import graph_us

    sg = load_sglang()
    if "error" in sg or not splits:
        return {}
    fwd = sg["decode_attention_fwd"]
    b, h = pt.batch, pt.heads
    q = torch.cat([pt.q_nope, pt.q_pe], dim=-1).contiguous()
    out = torch.empty(b, h, DC, dtype=BF16, device=device)
    sweep: dict[str, float | str] = {}
    def fixed(s: int):
        n_t = torch.full((b,), s, dtype=torch.int32, device=device)
        logits = torch.empty(b, h, s, DC, dtype=torch.float32, device=device)
        lse = torch.empty(b, h, s, dtype=torch.float32, device=device)
        return lambda: fwd(q, pool, pool[:, :, :DC], out, pt.indptr, pt.idx, logits, lse, n_t, s, SM_SCALE, 1.0, 1.0,
                           has_mla=True, use_pdl=use_pdl)

    for s in splits:
        try:
            sweep[str(s)] = graph_us(fixed(s), flush, reps=reps, rounds=rounds)
        except Exception as exc:  # noqa: BLE001
            sweep[str(s)] = _err(exc, 200)
        _free(device)
    good = {k: v for k, v in sweep.items() if isinstance(v, float)}
    best = min(good, key=good.get) if good else None
    return {"sweep_us": sweep, "best_fixed_splits": int(best) if best else None,
            "best_fixed_us": good[best] if best else None}


def _time(fn: Callable[[], object], flush, device: torch.device, reps: int, rounds: int) -> tuple[float, str, str | None]:
    """(µs, how it was timed, why not in a graph): CUDA graphs when the call can be captured, else CUDA events."""
    from kvwall.tuning.fused import graph_us

    try:
        return graph_us(fn, flush, reps=reps, rounds=rounds), "cuda_graph", None
    except Exception as exc:  # noqa: BLE001 - a call a graph cannot hold is still timed, and labelled
        why = _err(exc, 300)
        _sync(device)
    import triton.testing

    ms = triton.testing.do_bench(lambda: (flush(), fn()), warmup=25, rep=100, return_mode="median")
    flush_ms = triton.testing.do_bench(flush, warmup=25, rep=100, return_mode="median")
    return max(ms - flush_ms, 0.0) * 1e3, "cuda_events", why


def make_point(heads: int, context: int, batch: int, *, pool_slots: int, max_total: int, gen: torch.Generator,
               seed: int, device: torch.device) -> _Point:
    """One bench point: :func:`bench_lengths`, random slots (repeats allowed) of a ``pool_slots`` pool, BF16 queries."""
    lens = bench_lengths(context, batch, max_total=max_total, seed=seed + 1000 * batch + context)
    n = sum(lens)
    return _Point(heads, context, batch, lens,
                  (torch.randn(batch, heads, DC, generator=gen, device=device) * 0.5).to(BF16),
                  (torch.randn(batch, heads, DR, generator=gen, device=device) * 0.5).to(BF16),
                  torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device),
                  torch.randint(0, pool_slots, (n,), generator=gen, device=device, dtype=torch.int32),
                  torch.tensor(lens, dtype=torch.int32, device=device))


def bench_point_rows(pt: _Point, pool: torch.Tensor, device: torch.device, strategies, flush, *, copy_gbps: float,
                     bf16_tflops: float, reps: int, rounds: int, host_calls: int, cast_backend: str,
                     sglang_max_context: int, sm_count: int, sglang_split_sweep: list[int]) -> list[dict]:
    """One ``bench`` row per strategy at one point. Each strategy is built (outside the timing), run once (its output
    compared with fused_fp8's), timed by :func:`_time`, its host µs measured, and freed; any exception on the way
    becomes the row's ``error`` (with the traceback's tail), never a crash."""
    h, n = pt.heads, pt.tokens
    roof = roofline_us(h, n, copy_gbps, bf16_tflops)
    fused_out = None
    rows = []
    for name in strategies:
        row: dict[str, Any] = {"section": "bench", "strategy": name, "heads": h, "context": pt.context,
                               "batch": pt.batch, "tokens": n, "len_min": min(pt.lens), "len_max": max(pt.lens),
                               "active_bytes": active_bytes(n), "qo_bytes": qo_bytes(pt.batch, h),
                               "flops": decode_flops(h, n), "roofline_us": roof,
                               "us": None, "host_us": None, "gbps": None, "tflops": None, "pct_roofline": None}
        fn = None
        try:
            fn, info = _build(name, pt, pool, device, cast_backend=cast_backend,
                              sglang_max_context=sglang_max_context, sm_count=sm_count)
            row.update(info)
            got = fn()
            _sync(device)
            if name == "fused_fp8":
                fused_out = got.clone()
            elif fused_out is not None:
                row["rel_diff_vs_fused"] = _finite(_rel(got, fused_out))
            us, how, why = _time(fn, flush, device, reps, rounds)
            row.update(us=us, timing=how, **({"graph_error": why} if why else {}))
            row["host_us"] = _host_us(fn, device, host_calls)
            if us > 0:
                row.update(gbps=active_bytes(n) / us / 1e3, tflops=decode_flops(h, n) / us / 1e6,
                           pct_roofline=roof / us * 100)
            if name == "sglang_triton_fp8" and sglang_split_sweep:
                row.update(_sglang_sweep(pt, pool, device, list(sglang_split_sweep), flush, reps, rounds,
                                         bool(row.get("use_pdl"))))
        except Exception as exc:  # noqa: BLE001 - one failing strategy is a row with an error
            row["error"] = _err(exc, 600)
            row["traceback_tail"] = traceback.format_exc()[-1200:]
        finally:
            fn = None
            _free(device)
        rows.append(row)
    return rows


def run_fused_decode_bench(device: torch.device, *, heads: list[int], contexts: list[int], batches: list[int],
                           pool_slots: int = 495_000, max_total_tokens: int = 2_000_000,
                           strategies: tuple[str, ...] | list[str] = STRATEGIES, reps: int = 10, rounds: int = 3,
                           host_calls: int = 20, flush_mb: int = 256, cast_backend: str = "fa2",
                           sglang_max_context: int = 131_072, sglang_split_sweep: tuple[int, ...] | list[int] = (),
                           seed: int = 0) -> Result:
    """See the module docstring. Rows: one ``ceilings`` header (copy GB/s, BF16 TFLOP/s, GPU, how ``us`` and
    ``host_us`` are measured, what was JIT-built and where SGLang came from), then ``bench`` rows, one per
    (heads, context, batch, strategy)."""
    if device.type != "cuda":
        raise RuntimeError("fused_decode_bench times CUDA kernels in CUDA graphs: it needs an NVIDIA GPU. On a CPU, "
                           "the chapter shows the recorded run (and fused_decode_validation runs live).")
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        raise ValueError(f"unknown strategies {sorted(unknown)}; known: {STRATEGIES}.")
    from kvwall.tuning.fused import matmul_tflops
    from kvwall.measure.timing import copy_bandwidth_gbps

    t_start = time.perf_counter()
    props = torch.cuda.get_device_properties(device)
    sm_count = props.multi_processor_count
    copy_bytes = 1 << 30
    copy_ms, copy_gbps = copy_bandwidth_gbps(device, copy_bytes)
    tflops = matmul_tflops(device)
    uses_flashinfer = set(strategies) - {"fused_fp8", "sglang_triton_fp8"}
    prebuild = prebuild_flashinfer(device) if uses_flashinfer else {}
    sg = load_sglang() if "sglang_triton_fp8" in strategies else {}
    rows: list[dict] = [{"section": "ceilings", "gpu": torch.cuda.get_device_name(device), "sms": sm_count,
                         "copy_gbps": copy_gbps, "copy_ms": copy_ms, "copy_bytes": copy_bytes,
                         "bf16_tflops": tflops, "flashinfer": _flashinfer_version(), "flashinfer_prebuild": prebuild,
                         "sglang": {k: v for k, v in sg.items() if isinstance(v, (str, int, float))},
                         "us_means": US_MEANS, "host_us_means": HOST_US_MEANS,
                         "active_bytes_means": ACTIVE_BYTES_MEANS, "roofline_means": ROOFLINE_MEANS,
                         "seconds_to_here": round(time.perf_counter() - t_start, 1)}]
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = (torch.randn(pool_slots, 1, D, generator=gen, device=device) * 0.7).to(FP8)
    scratch = torch.empty(flush_mb << 20, dtype=torch.uint8, device=device)
    flush = scratch.zero_
    for h in heads:
        for context in contexts:
            for batch in batches:
                pt = make_point(h, context, batch, pool_slots=pool_slots, max_total=max_total_tokens, gen=gen,
                                seed=seed, device=device)
                rows += bench_point_rows(pt, pool, device, strategies, flush, copy_gbps=copy_gbps, bf16_tflops=tflops,
                                         reps=reps, rounds=rounds, host_calls=host_calls, cast_backend=cast_backend,
                                         sglang_max_context=sglang_max_context, sm_count=sm_count,
                                         sglang_split_sweep=list(sglang_split_sweep))
                del pt
                _free(device)
    rows[0]["seconds_total"] = round(time.perf_counter() - t_start, 1)
    params = dict(heads=list(heads), contexts=list(contexts), batches=list(batches), pool_slots=pool_slots,
                  max_total_tokens=max_total_tokens, strategies=list(strategies), reps=reps, rounds=rounds,
                  host_calls=host_calls, flush_mb=flush_mb, cast_backend=cast_backend,
                  sglang_max_context=sglang_max_context, sglang_split_sweep=list(sglang_split_sweep), seed=seed)
    return _result("fused_decode_bench", device, params, rows, BENCH_SOURCES)


EXPERIMENTS: list[Experiment] = [
    Experiment("fused_decode_validation", run_fused_decode_validation,
               full=dict(heads=[16, 64, 128],
                         length_sets=[[1], [7], [4097], [32_768], [131_072], [0, 1, 777, 4096, 33, 20_000, 130, 5],
                                      [65, 0, 129, 2], [0, 0]],
                         paged_length_sets=[[1, 0, 4097, 30_000, 64, 65]], page_size=64, pool_slots=495_000,
                         peers=True, graph=True, sanitizer=True, sanitizer_timeout_s=300),
               small=dict(heads=[1, 3, 16], length_sets=[[1], [7], [0, 7, 130, 1, 33], [65, 0, 129, 2], [333], [0, 0]],
                          paged_length_sets=[[1, 0, 63, 64, 65, 200]], page_size=64, pool_slots=4096,
                          peers=True, graph=True, sanitizer=False),
               about="fused FP8 MLA decode vs float64 and the BF16 path (<= 2x its error); FP8 peers; errors; graphs; memcheck",
               needs="any"),
    Experiment("fused_decode_bench", run_fused_decode_bench,
               full=dict(heads=[16, 64, 128], contexts=[4096, 32_768, 131_072], batches=[1, 8, 32],
                         pool_slots=495_000, max_total_tokens=2_000_000, strategies=list(STRATEGIES), reps=10,
                         rounds=3, host_calls=20, flush_mb=256, cast_backend="fa2", sglang_max_context=131_072,
                         sglang_split_sweep=[8, 16, 32, 64], seed=0),
               small=dict(heads=[16, 64], contexts=[4096], batches=[1, 8], pool_slots=50_000,
                          max_total_tokens=2_000_000, strategies=list(STRATEGIES), reps=3, rounds=2, host_calls=5,
                          flush_mb=256, cast_backend="fa2", sglang_max_context=131_072, sglang_split_sweep=[16],
                          seed=0),
               about="fused FP8 MLA decode vs full cast, gather-cast, FlashInfer FP8/BF16, SGLang Triton: µs vs roofline"),
]
