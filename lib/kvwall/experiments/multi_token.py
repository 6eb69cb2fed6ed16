"""``multi_token_decode`` (GPU; small on CPU): ours with speculative decoding's query shapes -- ``q_len`` query tokens
a request, causal over the draft (MTP / EAGLE target-verify: 2-4 tokens; up to 8) -- beside FlashMLA dense BF16 and
FP8 (its ``s_q``), on the same page table (pages of 64, the only size FlashMLA takes), in the same run.

Per point (heads, context, batch, q_len) and path: device µs (CUDA graphs, L2 flushed, as chapter 5's benchmark
times), host µs per eager call (calls only enqueued), for ours the plan's host µs (with the host lengths a serving
engine has: no device read) and the path it chose, and the error against float64 on the FP8 cache's exact values
(FlashMLA FP8: its FP8 query, quantized as SGLang's ``flashmla`` backend does, inside the timing).

What it answers: does a verify step of ``q_len`` tokens cost ``q_len`` decode steps, or one? Ours folds a request's
query tokens into the heads (``q_len x heads`` rows read the KV once), as FlashMLA folds ``s_q``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvwall.kernels import mla_decode, plan_mla_decode
from kvwall.kernels.mla_decode.verify_reference import mla_verify_reference
from kvwall.measure.accuracy import relative_error
from kvwall.measure.failures import error_text
from kvwall.measure.timing import host_us_per_call, release_memory, synchronize
from kvwall.model.geometry import GLM5
from kvwall.peers.flashmla import PAGE_SIZE, FlashMLADecode, load_flash_mla, random_page_table
from kvwall.results import Result, collect_provenance
from kvwall.experiments.fused_decode.bench import time_call
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "run_multi_token_decode", "MULTI_TOKEN_PATHS"]

DC, DR = GLM5.kv_lora_rank, GLM5.qk_rope_head_dim
SM_SCALE = GLM5.sm_scale
FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
#: What each point runs: ours (the path its plan chooses), FlashMLA dense BF16 (on a BF16 copy of the pool), FlashMLA
#: dense FP8 (FP8 query).
MULTI_TOKEN_PATHS = ("ours", "flashmla_dense_bf16", "flashmla_dense_fp8")
US_MEANS = (
    "device µs per call: CUDA graphs of reps x [flush, call] minus reps x [flush], best of rounds replays "
    "(chapter 5's timer); host_us: host µs per eager call, calls only enqueued; plan_us (ours): host µs of "
    "plan_mla_decode with the host lengths, best of 5"
)


def _reference(
    qn: torch.Tensor, qp: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, lens: list[int], q_len: int
) -> torch.Tensor:
    """float64 on the FP8 pool's exact values, the batch's pages gathered token by token, causal over the draft."""
    offsets = torch.arange(PAGE_SIZE, device=pool.device)
    slots = torch.cat(
        [
            (table[i, : -(-n // PAGE_SIZE)].long()[:, None] * PAGE_SIZE + offsets).flatten()[:n]
            for i, n in enumerate(lens)
        ]
    )
    ptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64, device=pool.device)
    rows = pool.view(-1, DC + DR)
    return mla_verify_reference(
        qn, qp, rows[:, :DC], rows[:, DC:], ptr, slots, SM_SCALE, q_len=q_len, compute_dtype=torch.float64
    )


def _point_rows(
    heads: int,
    context: int,
    batch: int,
    q_len: int,
    pool8: torch.Tensor,
    pool16: torch.Tensor | None,
    device: torch.device,
    flush,
    *,
    paths: list[str],
    reps: int,
    rounds: int,
    host_calls: int,
    seed: int,
) -> list[dict[str, Any]]:
    gen = torch.Generator(device=device).manual_seed(seed + heads * 7 + context + batch * 3 + q_len)
    pages = pool8.shape[0]
    lens = [context] * batch
    table, seqlens = random_page_table(lens, pages, gen, device)
    n_pages = -(-context // PAGE_SIZE)
    kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * n_pages
    kv_indices = table[:, :n_pages].contiguous().flatten()
    qn = (torch.randn(batch * q_len, heads, DC, generator=gen, device=device) * 0.5).to(BF16)
    qp = (torch.randn(batch * q_len, heads, DR, generator=gen, device=device) * 0.5).to(BF16)
    want = _reference(qn, qp, pool8, table, lens, q_len)
    base = dict(section="point", heads=heads, context=context, batch=batch, q_len=q_len)
    rows = []
    for path in paths:
        row: dict[str, Any] = dict(base, path=path, us=None, host_us=None, timing="not timed")
        fn = None
        try:
            if path == "ours":
                ckv, kpe = pool8[:, :, :DC], pool8[:, :, DC:]
                plan_args = dict(
                    heads=heads,
                    sm_scale=SM_SCALE,
                    kv_len=seqlens,
                    q_len=q_len,
                    page_size=PAGE_SIZE,
                    lengths=lens,
                    ckv_cache=ckv,
                    kpe_cache=kpe,
                )
                plan_us = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    plan = plan_mla_decode(kv_indptr, kv_indices, **plan_args)
                    plan_us.append((time.perf_counter() - t0) * 1e6)
                out = torch.empty(batch * q_len, heads, DC, dtype=BF16, device=device)
                row.update(kernel_path=plan.path, path_why=plan.why, launch=plan.launch, plan_us=min(plan_us))
                fn = lambda: mla_decode(qn, qp, ckv, kpe, plan, out=out)  # noqa: E731
            elif path == "flashmla_dense_bf16":
                if pool16 is None:
                    raise RuntimeError("FlashMLA is not installed here")
                fn = FlashMLADecode(qn, qp, pool16, table, seqlens, SM_SCALE, q_len=q_len)
            else:
                if pool16 is None:
                    raise RuntimeError("FlashMLA is not installed here")
                fn = FlashMLADecode(
                    qn, qp, pool8.view(pages, PAGE_SIZE, 1, DC + DR), table, seqlens, SM_SCALE, fp8=True, q_len=q_len
                )
            got = fn()
            synchronize(device)
            row["rel_err_f64"] = relative_error(got, want)
            if device.type == "cuda":
                us, how, why = time_call(fn, flush, device, reps, rounds)
                row.update(us=us, timing=how, **({"graph_error": why} if why else {}))
                row["host_us"] = host_us_per_call(fn, device, host_calls) if host_calls else None
        except Exception as exc:  # noqa: BLE001 - a path that fails is a row with its error
            row["error"] = error_text(exc, 500)
        finally:
            fn = None
            release_memory(device)
        rows.append(row)
    return rows


def run_multi_token_decode(
    device: torch.device,
    *,
    heads: list[int],
    contexts: list[int],
    batches: list[int],
    q_lens: list[int],
    paths: list[str] | tuple[str, ...] = MULTI_TOKEN_PATHS,
    pool_slots: int = 495_000,
    reps: int = 10,
    rounds: int = 3,
    host_calls: int = 50,
    flush_mb: int = 256,
    seed: int = 0,
) -> Result:
    """See the module docstring. Rows: one ``setup``, then one ``point`` row per (heads, context, batch, q_len,
    path of ``paths``)."""
    unknown = set(paths) - set(MULTI_TOKEN_PATHS)
    if unknown:
        raise ValueError(f"unknown paths {sorted(unknown)}; known: {MULTI_TOKEN_PATHS}.")
    t0 = time.perf_counter()
    pages = pool_slots // PAGE_SIZE
    gen = torch.Generator(device=device).manual_seed(seed)
    pool8 = (
        (torch.randn(pages * PAGE_SIZE, DC + DR, generator=gen, device=device) * 0.7)
        .to(FP8)
        .view(pages, PAGE_SIZE, DC + DR)
    )
    fm = load_flash_mla() if device.type == "cuda" else {"error": "FlashMLA needs an SM90 GPU"}
    pool16 = None if "error" in fm else pool8.to(BF16).view(pages, PAGE_SIZE, 1, DC + DR)
    setup: dict[str, Any] = {
        "section": "setup",
        "device": str(device),
        "us_means": US_MEANS,
        "flash_mla": {k: v for k, v in fm.items() if isinstance(v, (str, int, float, bool))},
    }
    if device.type == "cuda":
        setup["gpu"] = torch.cuda.get_device_name(device)
    scratch = torch.empty(flush_mb << 20, dtype=torch.uint8, device=device)
    rows: list[dict[str, Any]] = [setup]
    for h in heads:
        for context in contexts:
            for batch in batches:
                for q_len in q_lens:
                    rows += _point_rows(
                        h,
                        context,
                        batch,
                        q_len,
                        pool8,
                        pool16,
                        device,
                        scratch.zero_,
                        paths=list(paths),
                        reps=reps,
                        rounds=rounds,
                        host_calls=host_calls,
                        seed=seed,
                    )
    setup["seconds_total"] = round(time.perf_counter() - t0, 1)
    params = dict(
        heads=list(heads),
        contexts=list(contexts),
        batches=list(batches),
        q_lens=list(q_lens),
        paths=list(paths),
        pool_slots=pool_slots,
        reps=reps,
        rounds=rounds,
        host_calls=host_calls,
        flush_mb=flush_mb,
        seed=seed,
    )
    return Result("multi_token_decode", params, rows, collect_provenance(device, __name__))


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "multi_token_decode",
        run_multi_token_decode,
        full=dict(
            heads=[16, 64, 128],
            contexts=[4096, 32_768],
            batches=[1, 32],
            q_lens=[1, 2, 4, 8],
            paths=list(MULTI_TOKEN_PATHS),
            pool_slots=495_000,
            reps=10,
            rounds=3,
            host_calls=50,
            flush_mb=256,
            seed=0,
        ),
        small=dict(
            heads=[16],
            contexts=[200],
            batches=[2],
            q_lens=[1, 2, 4],
            paths=["ours"],
            pool_slots=4096,
            reps=1,
            rounds=1,
            host_calls=0,
            flush_mb=1,
            seed=0,
        ),
        about="ours with speculative decoding's verify shapes (q_len 1-8 query tokens a request, causal) "
        "beside FlashMLA dense BF16 and FP8 (s_q), same page table, same run; device and host µs, "
        "error vs float64",
        requires=(),
    ),
]
