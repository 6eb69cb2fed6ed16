"""``fused_decode_validation`` (any device): ours and each of its paths against float64, beside the BF16 path.

A table of seeded cases (:func:`kvwall.kernels.mla_decode.cases.validation_cases`) -- head counts, odd lengths,
empty requests, mixed batches, ``ckv_scale``/``kpe_scale`` other than 1, strided views of one ``[slots, 1, 576]``
pool, contiguous caches, 3-D page-size-1 views and a paged cache (page 64, ``kv_len``) -- run on every path of
``paths`` (rows carry ``path``): ``"triton"`` (the Triton path, with the case's forced splits), ``"wgmma"`` (the
wgmma path, Hopper only), ``"wgmma_tokens"`` (the tokens-on-M wgmma path, Hopper only) and ``"ours"`` (the
dispatcher with its plan; ``kernel_path`` says where it went), each against the float64 reference on the
*dequantized* cache, beside "the BF16 path" on exactly the same inputs. The accuracy rule (the issue's): a path's
relative error at most twice the BF16 path's. On a CPU the kernels run in Triton's interpreter (the wgmma paths are
refused: the ``setup`` row says why) and the BF16 path is the torch
reference computing in bfloat16 (FlashInfer needs a GPU; rows say so); on a GPU it is FlashInfer's BF16 MLA (fa2),
and the FP8 peers are compared too (against ours): FlashInfer's native FP8 MLA (fa2, fa3) and, where ``flash_mla``
imports, FlashMLA dense BF16 (every case) and dense FP8 (cases with unit scales), on the same rows laid out in
pages of 64. Beside the cases, :mod:`.contracts`: every path's contracts (one function, parametrized over the
paths: NaN isolation, graph replay, refusals, misaligned rows), the Triton path's bad inputs and CUDA-graph replays,
and ``compute-sanitizer --tool memcheck`` over ``python -m kvwall.kernels.mla_decode.sanitize`` on every kernel path
that runs on the device (``--paths``; on the H200 the Triton path and both wgmma paths: :func:`sanitizer_row`).

The full scale's head counts are 16, 32, 64 and 128 per GPU: 32 is DeepSeek's at tensor parallelism 4 and the
tokens-on-M path's second instantiation (32 heads per CTA), which 16 heads never reach; 9 cases per head count.

Device time at full scale: **174 s** measured on the H200 (2026-12-01, a trial run of the code before the
tokens-on-M path, with heads 16, 64 and 128, not recorded): FlashInfer's prebuild ~27 s, the first case ~70 s (first
builds), the other 26 cases x 3 paths with the peers ~40 s, contracts, errors and graphs ~14 s, memcheck 23 s (the
Triton path). Estimated on top, not measured: the fourth path (its build, its cases, its contracts) ~25 s, the 9
cases of 32 heads x 4 paths with the peers ~20 s, memcheck over both wgmma paths ~20 s: ~240 s in all.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from kvwall.kernels.mla_decode import sanitize as sanitized_program
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode import wgmma_tokens as tokens_path
from kvwall.kernels.mla_decode.cases import CaseInputs, DecodeCase, make_case_inputs, validation_cases
from kvwall.kernels.mla_decode.dispatch import mla_decode, plan_mla_decode
from kvwall.kernels.mla_decode.launch_shape import default_config
from kvwall.kernels.mla_decode.triton_path import mla_decode_fp8, plan_mla_decode_triton
from kvwall.kernels.mla_decode.reference import mla_decode_reference, nonempty_requests, reference64
from kvwall.measure.accuracy import finite_or_none, relative_error
from kvwall.measure.failures import error_text, traceback_tail
from kvwall.measure.sanitizer import memcheck_row
from kvwall.measure.timing import release_memory, synchronize
from kvwall.model.attention import FlashInferMLADecode, flashinfer_version, prebuild_flashinfer_mla
from kvwall.model.geometry import GLM5
from kvwall.peers.flashmla import PAGE_SIZE, FlashMLADecode
from kvwall.results import Result, collect_provenance
from kvwall.experiments.fused_decode.contracts import (
    CONTRACT_PATHS,
    error_rows,
    graph_rows,
    path_contract_rows,
    path_refusal,
)
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "run_fused_decode_validation", "sanitizer_row"]

DC = GLM5.kv_lora_rank
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
SM_SCALE = GLM5.sm_scale
#: FlashMLA's dense kernels are compared at 16 heads and more (the head counts they were measured at; GLM-5 per GPU).
FLASHMLA_MIN_HEADS = 16


def _bf16_inputs(inp: CaseInputs, keep: list[int], cs: float, ks: float, sm_scale: float):
    """The BF16 path's inputs, kept exact. FP8 -> BF16 is exact, so the cache is cast as it is (no scale folded
    into it: ``fp8 * 0.37`` is not a BF16 number). FlashInfer's BF16 ``run()`` takes no ``ckv_scale``/``kpe_scale``
    (it rejects them unless the KV is FP8), so the scales go elsewhere: ``sm_scale * ckv_scale`` as the softmax
    scale, ``q_pe * (kpe_scale / ckv_scale)`` (exact: the ratio is a power of two in every case) and the output times
    ``ckv_scale`` (in float64, then rounded to BF16 by :func:`_bf16_output`: every path delivers a BF16 output, ours
    included; left in float64, a one-token request's BF16-path output would be exact and no BF16 output could match
    it). Returns (q_nope, q_pe', sm_scale', output multiplier, whether q_pe' is exact)."""
    ratio = ks / cs
    qpe = (inp.q_pe[keep].float() * ratio).to(BF16)
    exact = bool(torch.equal(qpe.double(), inp.q_pe[keep].double() * ratio))
    return inp.q_nope[keep], qpe, sm_scale * cs, cs, exact


def _bf16_output(out: torch.Tensor, mul: float) -> torch.Tensor:
    """The BF16 path's output: its attention output times ``mul`` (= ckv_scale), rounded to BF16 once (exact when
    ``mul`` is 1)."""
    return (out.double() * mul).to(BF16) if mul != 1.0 else out.to(BF16)


def _defaults_used(case: DecodeCase, inp: CaseInputs, device: torch.device) -> tuple[int | None, int | None, dict]:
    """(forced splits, work items of the plan a checked call makes when none are forced, launch config) for the
    case (the config for its longest request)."""
    max_len = max(case.lens) if case.lens else 0
    cfg = default_config(case.heads, DC, device, max_len)
    items = None
    if case.num_splits is None:
        items = plan_mla_decode_triton(
            inp.kv_indptr, inp.kv_len, heads=case.heads, page_size=case.page_size, device=device, config=cfg
        ).items
    return case.num_splits, items, dataclasses.asdict(cfg)


def _bf16_path(case: DecodeCase, inp: CaseInputs, keep: list[int], row: dict) -> torch.Tensor:
    """The BF16 path's output on the case: FlashInfer BF16 fa2 (GPU) or the torch reference computing in bfloat16
    (CPU, or where FlashInfer failed: ``bf16_path_error`` says why)."""
    device = inp.q_nope.device
    q_n, q_p, sm_b, mul, exact = _bf16_inputs(inp, keep, case.ckv_scale, case.kpe_scale, SM_SCALE)
    row["bf16_inputs_exact"] = exact
    ptr, idx, sub_lens = inp.token_batch(keep)
    if device.type == "cuda":
        try:
            ckv_b = inp.tok_ckv.to(BF16).unsqueeze(1)  # the exactly cast cache, [T, 1, 512]
            kpe_b = inp.tok_kpe.to(BF16).unsqueeze(1)
            wrapper = FlashInferMLADecode(case.heads, ptr, idx, sub_lens, sm_b, kv_dtype=BF16, backend="fa2")
            out = _bf16_output(wrapper.run(q_n, q_p, ckv_b, kpe_b), mul)
            synchronize(device)
            row["bf16_path"] = (
                f"FlashInfer {wrapper.flashinfer_version} BatchMLAPagedAttentionWrapper {wrapper.backend}, BF16 KV"
            )
            return out
        except Exception as exc:  # noqa: BLE001 - fall back to the stand-in, saying why
            row["bf16_path_error"] = error_text(exc)
    sel = inp.tok_ckv.index_select(0, idx.long()).to(BF16)
    selk = inp.tok_kpe.index_select(0, idx.long()).to(BF16)
    compact = torch.arange(idx.numel(), device=device)
    row["bf16_path"] = "torch reference, bfloat16 compute"
    return _bf16_output(
        mla_decode_reference(q_n, q_p, sel, selk, ptr, compact, sm_b, compute_dtype=torch.bfloat16), mul
    )


def _peer_row(case: DecodeCase, peer: str) -> dict[str, Any]:
    return {
        "section": "fp8_peers",
        "case": case.name,
        "heads": case.heads,
        "lens": list(case.lens),
        "layout": case.layout,
        "peer": peer,
        "flashinfer": flashinfer_version(),
        "rel_err": None,
        "rel_diff_vs_ours": None,
        "ratio_vs_bf16": None,
    }


def _score(prow: dict, got: torch.Tensor, want: torch.Tensor, ours: torch.Tensor, bf16_err: float) -> None:
    err = relative_error(got, want)
    prow.update(
        rel_err=finite_or_none(err),
        rel_diff_vs_ours=finite_or_none(relative_error(got, ours)),
        ratio_vs_bf16=finite_or_none(err / bf16_err) if bf16_err > 0 else None,
        finite=bool(torch.isfinite(got).all()),
    )


def _flashinfer_fp8_rows(
    case: DecodeCase, inp: CaseInputs, keep: list[int], want: torch.Tensor, ours: torch.Tensor, bf16_err: float
) -> list[dict]:
    """FlashInfer 0.6.18.post1's native FP8 MLA (fa2, fa3) on the case's page-size-1 token view."""
    ptr, idx, sub_lens = inp.token_batch(keep)
    rows = []
    for backend in ("fa2", "fa3"):
        prow = _peer_row(case, f"flashinfer_fp8_{backend}")
        try:
            wrapper = FlashInferMLADecode(case.heads, ptr, idx, sub_lens, SM_SCALE, kv_dtype=FP8, backend=backend)
            got = wrapper.run(
                inp.q_nope[keep],
                inp.q_pe[keep],
                inp.tok3_ckv,
                inp.tok3_kpe,
                fp8_scales=(case.ckv_scale, case.kpe_scale),
            )
            synchronize(got.device)
            _score(prow, got, want, ours, bf16_err)
        except Exception as exc:  # noqa: BLE001 - one failing peer is a row with an error
            prow["error"] = error_text(exc)
        rows.append(prow)
    return rows


def _paged_rows(inp: CaseInputs, keep: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows the requests ``keep`` read, copied request by request into pages of :data:`PAGE_SIZE`:
    ``(pages [P, 64, 1, 576] FP8, block_table [B, max pages] int32, cache_seqlens [B] int32)``."""
    device = inp.q_nope.device
    lens = [int(inp.tok_slots[i].numel()) for i in keep]
    pages = [-(-n // PAGE_SIZE) for n in lens]
    cache = torch.zeros(sum(pages), PAGE_SIZE, 1, DC + GLM5.qk_rope_head_dim, dtype=FP8, device=device)
    flat = cache.view(-1, DC + GLM5.qk_rope_head_dim)
    table = torch.zeros(len(keep), max(pages), dtype=torch.int32, device=device)
    first = 0
    for row, (i, n, p) in enumerate(zip(keep, lens, pages)):
        slots = inp.tok_slots[i]
        flat[first * PAGE_SIZE : first * PAGE_SIZE + n, :DC] = inp.tok_ckv.index_select(0, slots)
        flat[first * PAGE_SIZE : first * PAGE_SIZE + n, DC:] = inp.tok_kpe.index_select(0, slots)
        table[row, :p] = torch.arange(first, first + p, dtype=torch.int32, device=device)
        first += p
    return cache, table, torch.tensor(lens, dtype=torch.int32, device=device)


def _flashmla_rows(
    case: DecodeCase, inp: CaseInputs, keep: list[int], want: torch.Tensor, ours: torch.Tensor, bf16_err: float
) -> list[dict]:
    """FlashMLA dense BF16 (the scales folded as the BF16 path folds them) and, with unit scales, dense FP8 (the
    query quantized as SGLang's flashmla backend does: static, the cache's scale 1), on the case's rows laid out in
    pages of 64; cases with 16 heads or more."""
    if case.heads < FLASHMLA_MIN_HEADS:
        return []
    rows = []
    try:
        cache, table, seqlens = _paged_rows(inp, keep)
    except Exception as exc:  # noqa: BLE001 - no pages, no FlashMLA rows: say why once
        prow = _peer_row(case, "flashmla_dense_bf16")
        prow["error"] = error_text(exc)
        return [prow]
    for peer in ("flashmla_dense_bf16", "flashmla_dense_fp8"):
        if peer.endswith("fp8") and (case.ckv_scale, case.kpe_scale) != (1.0, 1.0):
            continue  # one per-tensor descale_k: unit scales only, so nothing is folded into FlashMLA's FP8 path
        prow = _peer_row(case, peer)
        try:
            if peer.endswith("bf16"):
                q_n, q_p, sm_b, mul, _ = _bf16_inputs(inp, keep, case.ckv_scale, case.kpe_scale, SM_SCALE)
                decode = FlashMLADecode(q_n, q_p, cache.to(BF16), table, seqlens, sm_b)
                got = _bf16_output(decode(), mul)
            else:
                decode = FlashMLADecode(inp.q_nope[keep], inp.q_pe[keep], cache, table, seqlens, SM_SCALE, fp8=True)
                got = decode()
            synchronize(got.device)
            prow["flash_mla"] = decode.version
            _score(prow, got, want, ours, bf16_err)
        except Exception as exc:  # noqa: BLE001 - FlashMLA absent or refusing a shape: a row with an error
            prow["error"] = error_text(exc)
        rows.append(prow)
    return rows


def _run_path(path: str, case: DecodeCase, inp: CaseInputs, out: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """One checked call of ``path`` on the case into ``out``: the Triton path with the case's forced splits, a
    wgmma path (it plans for itself), or ours (:func:`~kvwall.kernels.plan_mla_decode`, then
    :func:`~kvwall.kernels.mla_decode`)."""
    kw = dict(ckv_scale=case.ckv_scale, kpe_scale=case.kpe_scale, out=out, kv_len=inp.kv_len)
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE)
    if path == "triton":
        return mla_decode_fp8(*args, num_splits=case.num_splits, **kw), {}
    if path == "wgmma":
        return wgmma_path.mla_decode_fp8_wgmma(*args, **kw), {}
    if path == "wgmma_tokens":
        return tokens_path.mla_decode_fp8_wgmma_tokens(*args, **kw), {}
    plan = plan_mla_decode(
        inp.kv_indptr,
        inp.kv_indices,
        heads=case.heads,
        sm_scale=SM_SCALE,
        kv_len=inp.kv_len,
        page_size=case.page_size,
        ckv_cache=inp.ckv_cache,
        kpe_cache=inp.kpe_cache,
    )
    got = mla_decode(
        inp.q_nope,
        inp.q_pe,
        inp.ckv_cache,
        inp.kpe_cache,
        plan,
        ckv_scale=case.ckv_scale,
        kpe_scale=case.kpe_scale,
        out=out,
    )
    return got, {"kernel_path": plan.path, "path_why": plan.why, "work_items": plan.work.items}


def _case_rows(case: DecodeCase, device: torch.device, pool_slots: int, peers: bool, paths: list[str]) -> list[dict]:
    """One ``cases`` row per path of ``paths`` (the BF16 path and the reference computed once for all), then the
    FP8 peers' rows (GPU, ``peers``), compared with ours' output (or the first path's that ran)."""
    lens = list(case.lens)
    keep = nonempty_requests(lens)
    empties = [i for i in range(len(lens)) if i not in keep]
    base: dict[str, Any] = {
        "section": "cases",
        "case": case.name,
        "heads": case.heads,
        "lens": lens,
        "batch": len(lens),
        "tokens": sum(lens),
        "layout": case.layout,
        "page_size": case.page_size,
        "index_dtype": case.index_dtype,
        "ckv_scale": case.ckv_scale,
        "kpe_scale": case.kpe_scale,
        "seed": case.seed,
        "num_splits": None,
        "rel_err": None,
        "bf16_path": None,
        "bf16_rel_err": None,
        "ratio": None,
        "finite": None,
        "empty_requests": len(empties),
        "empty_out_zero": None,
        "passed": False,
    }
    try:
        inp = make_case_inputs(case, device, pool_slots)
    except Exception as exc:  # noqa: BLE001 - inputs that cannot be made fail every path's row
        return [{**base, "path": p, "error": error_text(exc), "traceback_tail": traceback_tail(1500)} for p in paths]
    rows: list[dict] = []
    outs: dict[str, torch.Tensor] = {}
    for path in paths:
        row = {**base, "path": path}
        try:
            if path == "triton":
                row["num_splits"], row["work_items"], row["config"] = _defaults_used(case, inp, device)
            poisoned = torch.full((len(lens), case.heads, DC), float("nan"), dtype=BF16, device=device)
            out, info = _run_path(path, case, inp, poisoned)
            synchronize(device)
            row.update(info)
            row["finite"] = bool(torch.isfinite(out).all())
            row["empty_out_zero"] = bool((out[empties] == 0).all()) if empties else True
            outs[path] = out
        except Exception as exc:  # noqa: BLE001 - a failing path on a case is a row
            row.update(error=error_text(exc), traceback_tail=traceback_tail(1500))
        rows.append(row)
    ran = [r for r in rows if "error" not in r]
    if not keep:  # nothing to compare: every request empty, the output must be zeros
        for row in ran:
            row["passed"] = bool(row["finite"] and row["empty_out_zero"])
        return rows
    try:
        want = reference64(inp, keep, case.ckv_scale, case.kpe_scale, SM_SCALE)
        bf16_info: dict[str, Any] = {}
        bf16_err = relative_error(_bf16_path(case, inp, keep, bf16_info), want)
    except Exception as exc:  # noqa: BLE001 - a comparison that fails (reference, BF16 path) is every row's error
        for row in ran:
            row.update(error=error_text(exc), traceback_tail=traceback_tail(1500), passed=False)
        return rows
    for row in ran:
        err = relative_error(outs[row["path"]][keep], want)
        row.update(
            bf16_info,
            rel_err=finite_or_none(err),
            bf16_rel_err=finite_or_none(bf16_err),
            ratio=finite_or_none(err / bf16_err) if bf16_err > 0 else (1.0 if err == 0 else None),
        )
        # the rule: at most twice the BF16 path's error (both 0 passes)
        row["passed"] = bool(row["finite"] and row["empty_out_zero"] and err <= 2.0 * bf16_err)
    if device.type != "cuda" or not peers or not outs:
        return rows
    ours = outs.get("ours", next(iter(outs.values())))[keep]
    try:
        return rows + (
            _flashinfer_fp8_rows(case, inp, keep, want, ours, bf16_err)
            + _flashmla_rows(case, inp, keep, want, ours, bf16_err)
        )
    except Exception as exc:  # noqa: BLE001 - the peers' comparison failing is one peer row, not a crash
        prow = _peer_row(case, "flashinfer_fp8_fa2")
        prow["error"] = error_text(exc)
        return rows + [prow]


def sanitizer_row(device: torch.device, timeout_s: int) -> dict[str, Any]:
    """``compute-sanitizer --tool memcheck`` over the sanitizer program (:mod:`kvwall.kernels.mla_decode.sanitize`)
    on every kernel path that runs on ``device`` (its ``--paths``), as one row that names them (``paths``)."""
    paths = sanitized_program.runnable_paths(device)
    return {**memcheck_row(sanitized_program.__name__, timeout_s, ["--paths", *paths]), "paths": paths}


def run_fused_decode_validation(
    device: torch.device,
    *,
    heads: list[int],
    length_sets: list[list[int]],
    paged_length_sets: list[list[int]],
    page_size: int,
    pool_slots: int,
    peers: bool,
    graph: bool,
    sanitizer: bool,
    paths: list[str] = list(CONTRACT_PATHS),
    contract_heads: int = 64,
    contract_lens: list[int] = [300, 5000, 70],
    sanitizer_timeout_s: int = 300,
    seed: int = 0,
) -> Result:
    """See the module docstring. Row sections: ``setup`` (the paths that ran, why others did not, FlashInfer's
    prebuild on a GPU, seconds), ``cases`` (one per case and path), ``fp8_peers`` (GPU), ``contract`` (per path),
    ``errors``, ``graph`` (GPU), ``sanitizer`` (GPU, with ``sanitizer``)."""
    unknown = set(paths) - set(CONTRACT_PATHS)
    if unknown:
        raise ValueError(f"unknown paths {sorted(unknown)}; known: {CONTRACT_PATHS}.")
    t0 = time.perf_counter()
    on_gpu = device.type == "cuda"
    skipped = {p: why for p in paths if (why := path_refusal(p, device))}
    runs = [p for p in paths if p not in skipped]
    setup: dict[str, Any] = {
        "section": "setup",
        "device": device.type,
        "paths": runs,
        "skipped": skipped,
        "flashinfer_prebuild": prebuild_flashinfer_mla(device) if on_gpu and peers else None,
        "seconds_total": None,
    }
    rows: list[dict] = [setup]
    for case in validation_cases(heads, length_sets, paged_length_sets, page_size, seed):
        rows += _case_rows(case, device, pool_slots, peers, runs)
        release_memory(device)
    for path in runs:
        try:
            rows += path_contract_rows(device, path, heads=contract_heads, lens=list(contract_lens), seed=seed + 3)
        except Exception as exc:  # noqa: BLE001 - contracts that crash are a failed row, the run goes on
            rows.append(
                {
                    "section": "contract",
                    "path": path,
                    "check": "contracts ran",
                    "ok": False,
                    "detail": error_text(exc, 300),
                }
            )
        release_memory(device)
    rows += error_rows(device)
    if on_gpu and graph:
        for h in sorted({heads[0], heads[-1]}):
            rows += graph_rows(device, h, seed=seed + h)
            rows += graph_rows(device, h, seed=seed + h, planned=True)
            release_memory(device)
    if on_gpu and sanitizer:
        rows.append(sanitizer_row(device, sanitizer_timeout_s))
    setup["seconds_total"] = round(time.perf_counter() - t0, 1)
    params = dict(
        heads=list(heads),
        length_sets=[list(x) for x in length_sets],
        paged_length_sets=[list(x) for x in paged_length_sets],
        page_size=page_size,
        pool_slots=pool_slots,
        peers=peers,
        graph=graph,
        sanitizer=sanitizer,
        paths=list(paths),
        contract_heads=contract_heads,
        contract_lens=list(contract_lens),
        sanitizer_timeout_s=sanitizer_timeout_s,
        seed=seed,
    )
    return Result("fused_decode_validation", params, rows, collect_provenance(device, __name__))


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "fused_decode_validation",
        run_fused_decode_validation,
        full=dict(
            heads=[16, 32, 64, 128],
            length_sets=[
                [1],
                [7],
                [4097],
                [32_768],
                [131_072],
                [0, 1, 777, 4096, 33, 20_000, 130, 5],
                [65, 0, 129, 2],
                [0, 0],
            ],
            paged_length_sets=[[1, 0, 4097, 30_000, 64, 65]],
            page_size=64,
            pool_slots=495_000,
            peers=True,
            graph=True,
            sanitizer=True,
            paths=list(CONTRACT_PATHS),
            contract_heads=64,
            contract_lens=[300, 5000, 70],
            sanitizer_timeout_s=300,
            seed=0,
        ),
        small=dict(
            heads=[1, 3, 16],
            length_sets=[[1], [7], [0, 7, 130, 1, 33], [65, 0, 129, 2], [333], [0, 0]],
            paged_length_sets=[[1, 0, 63, 64, 65, 200]],
            page_size=64,
            pool_slots=4096,
            peers=True,
            graph=True,
            sanitizer=False,
            paths=list(CONTRACT_PATHS),
            contract_heads=16,
            contract_lens=[30, 200, 7],
            sanitizer_timeout_s=300,
            seed=0,
        ),
        about="ours and each of its paths (Triton, wgmma, tokens-on-M wgmma) vs float64 and the BF16 path "
        "(<= 2x its error); FP8 peers and FlashMLA; every path's contracts; errors; graphs; memcheck",
        requires=("cuda", "flashinfer", "compute-sanitizer"),
    ),
]
