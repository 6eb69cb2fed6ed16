"""``fused_decode_cuda`` (GPU): the CUDA C++ paths of the fused kernel -- :mod:`kvwall.kernels.mla_decode.cuda`
(mma.sync straight from the FP8 tile, sm_89+) and, on an H100 / H200, :mod:`kvwall.kernels.mla_decode.wgmma`
(warpgroup MMA, 64 heads per CTA, the tile converted once) -- against the Triton path and FlashMLA.

- ``build``: the GPU, nvcc, the build's seconds, the ceilings of this run (copy GB/s, BF16 TFLOP/s) and ptxas's
  resources for every variant and for the wgmma kernel (registers, stack, spills; shared memory from the shape);
- ``validation``: the case table (:func:`kvwall.kernels.mla_decode.cases.validation_cases` plus the sanitizer's
  cases) against float64 -- the default variant on every case, every other variant on every third -- each beside
  the Triton path's error on the same inputs; the wgmma path (variant ``"wgmma"``) on every case;
- ``contract``: an out-of-range index in an unchecked call makes exactly its request NaN; a planned call replayed in
  a CUDA graph equals the eager call bit for bit; bad inputs are refused before any launch;
- ``bench``: heads x context x batch (the issue's grid; ``floor_contexts`` at batch 1 show each kernel's fixed cost;
  ``sweep_variants`` beside ``variants`` at ``sweep_heads``; ``balance_contexts`` at batch 1 pair with mixed batches of
  the same total tokens, for issue 12's target 6),
  every strategy timed as ``fused_decode_bench`` times (CUDA graphs, L2 flushed, :func:`.bench.time_call`), each
  output checked against float64 first: the CUDA path (``cuda_v<N>``, page 64; ``cuda_v<N>_page1`` on page-size-1
  slots), the wgmma path (``cuda_wgmma``, ``cuda_wgmma_page1``), the Triton path (``fused_fp8_page64``) and
  FlashMLA dense BF16 / FP8;
- ``phases``: where the wgmma kernel's cycles go at ``trace_points`` (``[heads, context, batch]``, page 64): per
  warpgroup, the cycles per tile of each phase between two ``clock64`` marks, and each CTA's fixed phases
  (:func:`kvwall.kernels.mla_decode.wgmma.trace_wgmma_phases`, the ``KVWALL_TRACE`` build), beside both builds' µs;
- ``profile``: Nsight Compute on the split kernels (``python -m kvwall.kernels.mla_decode.cuda --profile-one`` and
  ``python -m kvwall.kernels.mla_decode.wgmma --profile-one``; variant ``"wgmma"``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from kvwall.kernels.mla_decode import cuda as cuda_path
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode.cases import SANITIZED_CASES, check_case, validation_cases
from kvwall.kernels.mla_decode.kernel import mla_decode_fp8
from kvwall.kernels.mla_decode.reference import make_mla_inputs
from kvwall.measure.accuracy import finite_or_none, relative_error
from kvwall.measure.failures import error_text, traceback_tail
from kvwall.measure.ncu import ncu_path, profile_kernel
from kvwall.measure.timing import copy_bandwidth_gbps, matmul_tflops, release_memory, synchronize
from kvwall.model.geometry import GLM5
from kvwall.model.roofline import decode_flops, kv_read_bytes, roofline_us
from kvwall.peers.flashmla import PAGE_SIZE, load_flash_mla
from kvwall.results import Result, collect_provenance
from kvwall.experiments.fused_decode.bench import time_call
from kvwall.experiments.fused_decode.bench_strategies import (BenchPoint, build_strategy, make_point, paged_layout,
                                                             reference_f64)
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "run_fused_decode_cuda"]

DC, DR = GLM5.kv_lora_rank, GLM5.qk_rope_head_dim
D = DC + DR
SM_SCALE = GLM5.sm_scale
FP8 = torch.float8_e4m3fn
#: The Triton path as timed beside the CUDA path (page 64, the CUDA rows' layout).
TRITON_STRATEGY = "fused_fp8_page64"
#: The warpgroup-MMA path's name in rows (``variant``) and strategies (``cuda_wgmma``, ``cuda_wgmma_page1``).
WGMMA = "wgmma"
#: The peers timed beside the CUDA path (names of :data:`.bench_strategies.STRATEGIES`).
PEERS = (TRITON_STRATEGY, "flashmla_dense_bf16", "flashmla_dense_fp8")


def _wgmma_build(device: torch.device) -> dict[str, Any]:
    """The wgmma kernel's build and ptxas resources, or why it does not run on ``device``."""
    why = wgmma_path.wgmma_refusal(device)
    if why:
        return {"runs": False, "why": why}
    t0 = time.perf_counter()
    wgmma_path.load_mla_decode_wgmma()
    build_s = time.perf_counter() - t0
    report = wgmma_path.nvcc_compile_check_wgmma()
    return {"runs": True, "arch": wgmma_path.ARCH, "build_s": round(build_s, 2), "smem": wgmma_path.SMEM_BYTES,
            "heads_per_cta": wgmma_path.HEADS_PER_CTA, "block_n": wgmma_path.BLOCK_N, "threads": wgmma_path.THREADS,
            "registers": report.registers.get(0), "stack_bytes": report.stack_bytes.get(0),
            "spill_bytes": report.spill_bytes.get(0)}


def _build_row(device: torch.device, copy_gbps: float, tflops: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    cuda_path.load_mla_decode_cuda()
    build_s = time.perf_counter() - t0
    cap = torch.cuda.get_device_capability(device)
    report = cuda_path.nvcc_compile_check(f"sm_{cap[0]}{cap[1]}")
    wgmma = _wgmma_build(device)
    return {"section": "build", "gpu": torch.cuda.get_device_name(device),
            "sms": torch.cuda.get_device_properties(device).multi_processor_count, "nvcc": report.nvcc,
            "build_s": round(build_s, 2), "copy_gbps": copy_gbps, "bf16_tflops": tflops,
            "shared_limit": cuda_path.shared_limit(device), "default_variant": cuda_path.DEFAULT_VARIANT,
            "variants": {str(i): {"name": str(v), "warps": v.warps, "block_n": v.block_n, "stages": v.stages,
                                  "min_blocks": v.min_blocks, "v_bits": v.v_bits, "smem": v.smem,
                                  "registers": report.registers.get(i), "stack_bytes": report.stack_bytes.get(i),
                                  "spill_bytes": report.spill_bytes.get(i)}
                         for i, v in cuda_path.VARIANTS.items()},
            "wgmma": wgmma,
            "flash_mla": {k: v for k, v in load_flash_mla().items() if isinstance(v, (str, int, float, bool))},
            "seconds_total": None}


def _variant_fn(variant: int | str) -> Callable[..., Any]:
    def fn(*args, num_splits=None, **kwargs):  # the case table's forced splits: the CUDA paths always plan
        if variant == WGMMA:
            return wgmma_path.mla_decode_fp8_wgmma(*args, **kwargs)
        return cuda_path.mla_decode_fp8_cuda(*args, variant=variant, **kwargs)
    return fn


def _validation_rows(device: torch.device, heads: list[int], length_sets: list[list[int]],
                     paged_length_sets: list[list[int]], pool_slots: int, every_other: int) -> list[dict]:
    cases = validation_cases(heads, length_sets, paged_length_sets, PAGE_SIZE) + list(SANITIZED_CASES)
    triton_err: dict[str, float | None] = {}
    rows = []
    runs_wgmma = wgmma_path.wgmma_refusal(device) is None
    for variant in [*cuda_path.VARIANTS, *([WGMMA] if runs_wgmma else [])]:
        for i, case in enumerate(cases):
            if variant not in (cuda_path.DEFAULT_VARIANT, WGMMA) and i % every_other:
                continue
            row: dict[str, Any] = {"section": "validation", "variant": variant, "case": case.name,
                                   "heads": case.heads, "tokens": sum(case.lens), "page_size": case.page_size}
            try:
                got = check_case(_variant_fn(variant), case, device, pool_slots)
                if case.name not in triton_err:
                    triton_err[case.name] = check_case(mla_decode_fp8, case, device, pool_slots)["rel_err"]
                row.update(ok=got["ok"], rel_err=got["rel_err"], lse_max_err=got["lse_max_err"],
                           finite=got["finite"], empty_out_zero=got["empty_out_zero"],
                           triton_rel_err=triton_err[case.name])
            except Exception as exc:  # noqa: BLE001 - a failing case is a row
                row.update(ok=False, error=error_text(exc, 400), traceback_tail=traceback_tail())
            rows.append(row)
            release_memory(device)
    return rows


def _expect_refusal(name: str, call: Callable[[], Any], words: str) -> dict[str, Any]:
    row: dict[str, Any] = {"section": "contract", "check": name}
    try:
        call()
        row.update(ok=False, detail="no error raised")
    except Exception as exc:  # noqa: BLE001 - the error is what is checked
        text = f"{type(exc).__name__}: {exc}"
        row.update(ok=words in text and "launch failed" not in text, detail=text[:300])
    return row


def _shared_contracts(device: torch.device, prefix: str, heads: int, seed: int, plan_fn: Callable[..., Any],
                      call: Callable[..., Any]) -> tuple[list[dict], tuple]:
    """What every CUDA path must keep: an out-of-range index in an unchecked call makes exactly its request NaN; a
    planned call replayed in a CUDA graph equals the eager call bit for bit; an unchecked call without a plan is
    refused. Returns the rows and the inputs (for the path's own checks)."""
    rows = []
    inp = make_mla_inputs([300, 5000, 70], heads, seed=seed, layout="pool_view", pool_slots=100_000, device=device)
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr)
    plan = plan_fn(inp.kv_indptr, heads=heads)
    idx = inp.kv_indices.clone()
    idx[310] = 10**8  # request 1's eleventh token
    out = call(*args, idx, SM_SCALE, check_range=False, plan=plan)
    nan_rows = [bool(out[b].isnan().all()) for b in range(3)]
    rows.append({"section": "contract", "check": f"{prefix}unchecked out-of-range index: only its request is NaN",
                 "ok": nan_rows == [False, True, False], "detail": f"NaN rows {nan_rows}"})
    eager = call(*args, inp.kv_indices, SM_SCALE, check_range=False, plan=plan)
    graphed = torch.empty_like(eager)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        call(*args, inp.kv_indices, SM_SCALE, check_range=False, plan=plan, out=graphed)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(*args, inp.kv_indices, SM_SCALE, check_range=False, plan=plan, out=graphed)
    graphed.fill_(float("nan"))
    graph.replay()
    synchronize(device)
    rows.append({"section": "contract", "check": f"{prefix}planned call replayed in a CUDA graph equals the eager call",
                 "ok": bool(torch.equal(graphed, eager)), "detail": "bitwise comparison after a NaN-poisoned out"})
    rows.append(_expect_refusal(f"{prefix}an unchecked call without a plan is refused",
                                lambda: call(*args, inp.kv_indices, SM_SCALE, check_range=False), "plan="))
    return rows, (inp, args)


def _contract_rows(device: torch.device) -> list[dict]:
    rows, (inp, args) = _shared_contracts(device, "", 16, 3, cuda_path.plan_mla_decode_cuda,
                                          cuda_path.mla_decode_fp8_cuda)
    mis = torch.empty(inp.ckv_cache.shape[0] * 577 + 16, dtype=torch.uint8, device=device)
    odd = mis[1:1 + inp.ckv_cache.shape[0] * 577].view(-1, 577).view(FP8)
    rows.append(_expect_refusal("rows not 16-byte aligned are refused before the launch",
                                lambda: cuda_path.mla_decode_fp8_cuda(inp.q_nope, inp.q_pe, odd[:, :DC], odd[:, DC:D],
                                                                      inp.kv_indptr, inp.kv_indices, SM_SCALE),
                                "16-byte"))
    bad = inp.kv_indices.clone()
    bad[5] = -1
    rows.append(_expect_refusal("a checked call with an out-of-range index is refused",
                                lambda: cuda_path.mla_decode_fp8_cuda(*args, bad, SM_SCALE), "outside"))
    if wgmma_path.wgmma_refusal(device) is None:
        rows += _wgmma_contract_rows(device)
    return rows


def _wgmma_contract_rows(device: torch.device) -> list[dict]:
    """The wgmma path's contracts: the shared ones, and a plan of another path is refused."""
    rows, (inp, args) = _shared_contracts(device, "wgmma: ", 64, 4, wgmma_path.plan_mla_decode_wgmma,
                                          wgmma_path.mla_decode_fp8_wgmma)
    other = cuda_path.plan_mla_decode_cuda(inp.kv_indptr, heads=64)
    rows.append(_expect_refusal("wgmma: a plan cut for the mma.sync path is refused",
                                lambda: wgmma_path.mla_decode_fp8_wgmma(*args, inp.kv_indices, SM_SCALE, plan=other),
                                "plan_mla_decode_wgmma"))
    return rows


def _cuda_call(pt: BenchPoint, pool: torch.Tensor, variant: int | str, paged: bool, info: dict[str, Any]):
    if variant == WGMMA:
        plan_fn, call_fn, kw = wgmma_path.plan_mla_decode_wgmma, wgmma_path.mla_decode_fp8_wgmma, {}
    else:
        plan_fn, call_fn, kw = cuda_path.plan_mla_decode_cuda, cuda_path.mla_decode_fp8_cuda, {"variant": variant}
    out = torch.empty(pt.batch, pt.heads, DC, dtype=torch.bfloat16, device=pool.device)
    if paged:
        pages = pool.shape[0] // PAGE_SIZE
        pp = pool[:pages * PAGE_SIZE].view(pages, PAGE_SIZE, D)
        table, seqlens, _ = paged_layout(pt, pool)
        n_pages = [-(-n // PAGE_SIZE) for n in pt.lens]
        indptr = torch.tensor([0, *torch.tensor(n_pages).cumsum(0).tolist()], dtype=torch.int32, device=pool.device)
        indices = torch.cat([table[i, :n] for i, n in enumerate(n_pages)]).contiguous()
        plan = plan_fn(indptr, seqlens, heads=pt.heads, page_size=PAGE_SIZE, **kw)
        c, k = pp[:, :, :DC], pp[:, :, DC:]
        call = lambda: call_fn(pt.q_nope, pt.q_pe, c, k, indptr, indices, SM_SCALE, out=out,  # noqa: E731
                               kv_len=seqlens, check_range=False, plan=plan)
    else:
        plan = plan_fn(pt.indptr, heads=pt.heads, **kw)
        c, k = pool[:, 0, :DC], pool[:, 0, DC:]
        call = lambda: call_fn(pt.q_nope, pt.q_pe, c, k, pt.indptr, pt.idx, SM_SCALE, out=out,  # noqa: E731
                               check_range=False, plan=plan)
    info.update(variant=None if variant == WGMMA else variant, page_size=PAGE_SIZE if paged else 1, work_items=plan.items,
                chunk_tokens=plan.work_list.chunk_tokens, imbalance=plan.work_list.imbalance())
    return call


def _bench_rows(pt: BenchPoint, pool: torch.Tensor, device: torch.device, variants: list[int | str],
                page1_variants: list[int | str], flush: Callable[[], object], *, copy_gbps: float, tflops: float,
                reps: int, rounds: int, sms: int) -> list[dict]:
    roof = roofline_us(pt.heads, pt.tokens, copy_gbps, tflops)
    name = lambda v: f"cuda_{v}" if v == WGMMA else f"cuda_v{v}"  # noqa: E731
    strategies = [(name(v), v, True) for v in variants] + [(f"{name(v)}_page1", v, False) for v in page1_variants]
    strategies += [(name, None, None) for name in PEERS]
    refs: dict[bool, torch.Tensor] = {}
    rows = []
    for label, variant, paged in strategies:
        row: dict[str, Any] = {"section": "bench", "strategy": label, "heads": pt.heads, "context": pt.context,
                               "batch": pt.batch, "tokens": pt.tokens, "len_min": min(pt.lens),
                               "len_max": max(pt.lens), "roofline_us": roof, "us": None, "timing": "not timed"}
        call = None
        try:
            info: dict[str, Any] = {}
            if variant is not None:
                call = _cuda_call(pt, pool, variant, paged, info)
            else:
                call, info, _ = build_strategy(label, pt, pool, cast_backend="fa3", sglang_max_context=131_072,
                                               sm_count=sms)
                paged = "page_size" in info
            row.update({k: v for k, v in info.items() if isinstance(v, (int, float, str, bool)) or v is None})
            got = call()
            synchronize(device)
            if paged not in refs:
                refs[paged] = reference_f64(pt, pool, paged)
            row["rel_err_f64"] = finite_or_none(relative_error(got, refs[paged]))
            us, how, why = time_call(call, flush, device, reps, rounds)
            row.update(us=us, timing=how, **({"graph_error": why} if why else {}))
            if us > 0:
                row.update(gbps=kv_read_bytes(pt.tokens) / us / 1e3, tflops=decode_flops(pt.heads, pt.tokens) / us / 1e6,
                           pct_roofline=roof / us * 100)
        except Exception as exc:  # noqa: BLE001 - a failing strategy is a row
            row.update(error=error_text(exc, 500), traceback_tail=traceback_tail())
        finally:
            call = None
            release_memory(device)
        rows.append(row)
    return rows


def _phase_rows(points: list[list[int]], pool: torch.Tensor, device: torch.device, flush: Callable[[], object], *,
                max_total: int, gen: torch.Generator, seed: int, reps: int, rounds: int) -> list[dict]:
    """The wgmma kernel's per-phase cycles (the ``KVWALL_TRACE`` build) at each ``[heads, context, batch]``, beside the
    shipped and the traced build's µs (the clock reads' cost)."""
    rows = []
    for h, c, b in points:
        pt = make_point(h, c, b, pool_slots=pool.shape[0], max_total=max_total, gen=gen, seed=seed, device=device)
        row: dict[str, Any] = {"section": "phases", "heads": h, "context": c, "batch": b, "tokens": pt.tokens}
        try:
            info: dict[str, Any] = {}
            call = _cuda_call(pt, pool, WGMMA, True, info)
            call()
            row["us"] = time_call(call, flush, device, reps, rounds)[0]
            trace = wgmma_path.trace_wgmma_phases(call)
            with wgmma_path.traced_build():
                row["us_traced"] = time_call(call, flush, device, reps, rounds)[0]
            row.update(work_items=info["work_items"], ctas=trace.ctas, tiles=trace.tiles,
                       per_tile={str(wg): v for wg, v in trace.per_tile.items()},
                       per_cta={str(wg): v for wg, v in trace.per_cta.items()})
        except Exception as exc:  # noqa: BLE001 - a failed trace is a row
            row.update(error=error_text(exc, 500), traceback_tail=traceback_tail())
        finally:
            call = None
            release_memory(device)
        rows.append(row)
    return rows


def run_fused_decode_cuda(device: torch.device, *, heads: list[int], contexts: list[int], batches: list[int],
                          floor_contexts: list[int], variants: list[int | str], page1_variants: list[int | str],
                          sweep_variants: list[int], sweep_heads: list[int],
                          check_heads: list[int], check_length_sets: list[list[int]],
                          check_paged_length_sets: list[list[int]], check_every_other: int,
                          profile_points: list[list[int | str]], balance_contexts: list[int] | None = None,
                          trace_points: list[list[int]] | None = None, pool_slots: int = 495_000,
                          max_total_tokens: int = 2_000_000, reps: int = 10, rounds: int = 3, flush_mb: int = 256,
                          timeout_s: int = 120, seed: int = 0) -> Result:
    """See the module docstring. ``variants`` / ``page1_variants``: mma.sync variants and ``"wgmma"`` (timed only
    where it runs). ``profile_points``: ``[heads, tokens, variant]`` for ncu. ``balance_contexts``: batch-1 points
    beside the grid (equal total tokens to its mixed batches); ``trace_points``: the wgmma kernel's phases."""
    if device.type != "cuda":
        raise RuntimeError("fused_decode_cuda builds and times a CUDA C++ kernel: it needs an NVIDIA GPU (the CPU "
                           "tests compile it with nvcc for sm_90, sm_100 and sm_120 instead).")
    why = cuda_path.cuda_refusal(device)
    if why:
        raise RuntimeError(f"fused_decode_cuda: {why}.")
    t_start = time.perf_counter()
    if wgmma_path.wgmma_refusal(device):
        variants = [v for v in variants if v != WGMMA]
        page1_variants = [v for v in page1_variants if v != WGMMA]
        profile_points = [p for p in profile_points if p[2] != WGMMA]
        trace_points = []
    balance_contexts, trace_points = balance_contexts or [], trace_points or []
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    _, copy_gbps = copy_bandwidth_gbps(device, 1 << 30)
    tflops = matmul_tflops(device)
    rows: list[dict[str, Any]] = [_build_row(device, copy_gbps, tflops)]
    rows += _validation_rows(device, check_heads, check_length_sets, check_paged_length_sets, pool_slots=600_000,
                             every_other=check_every_other)
    try:
        rows += _contract_rows(device)
    except Exception as exc:  # noqa: BLE001 - a contract that crashes is a failed row, the run goes on
        rows.append({"section": "contract", "check": "contracts ran", "ok": False, "detail": error_text(exc, 400)})
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = (torch.randn(pool_slots, 1, D, generator=gen, device=device) * 0.7).to(FP8)
    scratch = torch.empty(flush_mb << 20, dtype=torch.uint8, device=device)
    points = [(h, c, 1) for h in heads for c in floor_contexts]
    points += [(h, c, b) for h in heads for c in contexts for b in batches]
    points += [(h, c, 1) for h in heads for c in balance_contexts if c not in contexts]
    for h, c, b in points:
        pt = make_point(h, c, b, pool_slots=pool_slots, max_total=max_total_tokens, gen=gen, seed=seed, device=device)
        timed = variants + ([v for v in sweep_variants if v not in variants] if h in sweep_heads else [])
        rows += _bench_rows(pt, pool, device, timed, page1_variants, scratch.zero_, copy_gbps=copy_gbps,
                            tflops=tflops, reps=reps, rounds=rounds, sms=sms)
        del pt
        release_memory(device)
    rows += _phase_rows(trace_points, pool, device, scratch.zero_, max_total=max_total_tokens, gen=gen, seed=seed,
                        reps=reps, rounds=rounds)
    del pool, scratch
    release_memory(device)
    for h, tokens, variant in profile_points:
        row: dict[str, Any] = {"section": "profile", "heads": h, "tokens": tokens, "variant": variant,
                               "min_bytes": kv_read_bytes(tokens), "flops": decode_flops(h, tokens)}
        if ncu_path() is None:
            row["error"] = "ncu (Nsight Compute) is not installed here"
        else:
            try:
                if variant == WGMMA:
                    row.update(profile_kernel(wgmma_path.__name__, ["--profile-one", str(h), str(tokens)],
                                              kernel_regex="mla_wgmma_split_kernel", launch_skip=3,
                                              timeout_s=timeout_s))
                else:
                    row.update(profile_kernel(cuda_path.__name__, ["--profile-one", str(h), str(tokens), str(variant)],
                                              kernel_regex="mla_split_kernel", launch_skip=3, timeout_s=timeout_s))
            except Exception as exc:  # noqa: BLE001 - a failed profile is a row
                row["error"] = f"{type(exc).__name__}: {str(exc)[-600:]}"
        rows.append(row)
    rows[0]["seconds_total"] = round(time.perf_counter() - t_start, 1)
    params = dict(heads=heads, contexts=contexts, batches=batches, floor_contexts=floor_contexts, variants=variants,
                  page1_variants=page1_variants, sweep_variants=sweep_variants, sweep_heads=sweep_heads,
                  check_heads=check_heads, check_length_sets=check_length_sets,
                  check_paged_length_sets=check_paged_length_sets, check_every_other=check_every_other,
                  profile_points=profile_points, balance_contexts=balance_contexts, trace_points=trace_points,
                  pool_slots=pool_slots, max_total_tokens=max_total_tokens, reps=reps,
                  rounds=rounds, flush_mb=flush_mb, timeout_s=timeout_s, seed=seed)
    return Result("fused_decode_cuda", params, rows, collect_provenance(device, __name__))


_CHECKS = dict(check_heads=[16, 64, 128, 3, 20], check_length_sets=[[4096], [32768], [0, 1, 777, 4096, 33, 20000, 130, 5]],
               check_paged_length_sets=[[1, 0, 63, 64, 65, 200], [5000, 70000]], check_every_other=3)

EXPERIMENTS: list[Experiment] = [
    Experiment(
        "fused_decode_cuda", run_fused_decode_cuda,
        full=dict(heads=[16, 64, 128], contexts=[4096, 32_768, 131_072], batches=[1, 8, 32, 64], floor_contexts=[64],
                  variants=[5, 2, WGMMA], page1_variants=[5, WGMMA], sweep_variants=[0, 4, 6], sweep_heads=[16],
                  **_CHECKS, profile_points=[[16, 131_072, 5], [16, 131_072, 2], [128, 131_072, 5],
                                             [64, 131_072, WGMMA], [128, 131_072, WGMMA]],
                  balance_contexts=[262_144],
                  trace_points=[[16, 131_072, 1], [64, 131_072, 1], [64, 131_072, 8], [128, 131_072, 8],
                                [128, 4096, 64]], pool_slots=495_000,
                  max_total_tokens=2_000_000, reps=10, rounds=3, flush_mb=256, timeout_s=120, seed=0),
        small=dict(heads=[16], contexts=[4096], batches=[1, 8], floor_contexts=[64], variants=[5], page1_variants=[5],
                   sweep_variants=[6], sweep_heads=[16],
                   check_heads=[16, 3], check_length_sets=[[4096], [0, 7, 130]], check_paged_length_sets=[[1, 65]],
                   check_every_other=3, profile_points=[], pool_slots=50_000, max_total_tokens=2_000_000, reps=3,
                   rounds=2, flush_mb=256, timeout_s=120, seed=0),
        about="the CUDA C++ paths of the fused FP8 MLA decode (mma.sync from the FP8 tile; wgmma, 64 heads per CTA): "
              "validated, timed against the Triton path and FlashMLA dense BF16/FP8, profiled",
        requires=("cuda", "nvcc"),
    ),
]
