"""``dsa_decode``: GLM-5's own decode path in SGLang 0.5.23 on Hopper -- the ``dsa`` backend with an FP8 cache --
measured beside the dense paths at chapter 5's points (heads x context x batch).

At each point, on the same 495,000-token pool seen twice -- SGLang's DSA rows (656 bytes: per-128 scaled e4m3 latent,
BF16 rotary; :func:`kvwall.peers.dsa.quantize_v32`) and the plain FP8 rows the dense paths read (576 bytes), both made
from the same BF16 keys -- and the same pages of 64:

- ``indexer_logits``: the indexer's scores of every token (GLM-5: 32 heads of 128, FP8; a Triton stand-in for
  DeepGEMM's ``fp8_paged_mqa_logits``, :func:`kvwall.peers.dsa.index_logits`), checked against float64 at batches up to
  8, with the recall of its top 2,048 against float64's;
- ``topk``: the top 2,048 of each request turned into pool slots (``torch.topk``, a stand-in for SGLang's kernel);
- ``sparse_decode``: FlashMLA's sparse FP8 decode over those 2,048 tokens, query heads padded to 64 as SGLang pads
  them (:class:`kvwall.peers.dsa.FlashMLASparseDecode`), checked against float64 attention over the same tokens, on
  the values the rows hold (``rel_err_f64``) and on the BF16 keys they were made from (``rel_err_vs_bf16``); at
  batches up to 8, what storing the keys alone costs the output (float64 attention on the stored values against
  float64 on the BF16 keys): the DSA rows over the selected tokens (``storage_rel_err``), the plain e4m3 rows the
  dense paths read over the same tokens (``plain_storage_rel_err``) and over every token (``dense_storage_rel_err``);
- ``layer``: the three back to back, one call;
- the dense paths (``ours`` on pages of 64, FlashMLA dense FP8 and BF16) exactly as ``fused_decode_bench`` times them
  (:func:`kvwall.experiments.fused_decode.bench.bench_point_rows`): every token of every request.

Each part's floor is the bytes it must read at the copy bandwidth measured in the same run. Batch 1 is one request of
``context`` tokens; larger batches are chapter 5's mixed lengths (summing to ``context * batch / 4``). On a CPU (small
scale) the indexer runs in Triton's interpreter and FlashMLA's rows say they need an SM90 GPU.

Device time at full scale: 30 s on the H200 for 3 contexts (2026-12-03); the 4 contexts of ``full`` (8,192 tokens
added: the decode step's request) about 40 s. The recording's ``seconds_total`` says what it took.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from kvwall.kernels.mla_decode.reference import mla_decode_reference
from kvwall.measure.accuracy import finite_or_none, relative_error
from kvwall.measure.failures import error_text, traceback_tail
from kvwall.measure.timing import copy_bandwidth_gbps, host_us_per_call, matmul_tflops, release_memory, synchronize
from kvwall.model.geometry import GLM5
from kvwall.peers.dsa import (
    INDEX_DOT,
    INDEX_HEAD_DIM,
    INDEX_ROW_BYTES,
    TOPK,
    V32_ROW_BYTES,
    FlashMLASparseDecode,
    dequantize_v32,
    index_logits,
    index_logits_reference,
    padded_heads,
    quantize_index_keys,
    quantize_v32,
    select_topk,
)
from kvwall.peers.flashmla import PAGE_SIZE, load_flash_mla
from kvwall.results import Result, collect_provenance
from kvwall.experiments.fused_decode.bench import bench_point_rows, time_call
from kvwall.experiments.fused_decode.strategies import BenchPoint, BuildContext, make_point, paged_layout
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "run_dsa_decode", "DSA_PARTS", "DENSE"]

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
DC = GLM5.kv_lora_rank
SM_SCALE = GLM5.sm_scale
#: The parts of a DSA decode, in the order a layer runs them.
DSA_PARTS = ("indexer_logits", "topk", "sparse_decode", "layer")
#: The dense paths timed at the same points (names of chapter 5's peer table).
DENSE = ["ours_page64", "flashmla_dense_fp8", "flashmla_dense_bf16"]
#: Batches up to this size check the indexer's scores against float64 (larger ones cost seconds for nothing new).
CHECK_INDEXER_UP_TO = 8

US_MEANS = (
    "device µs per call: CUDA graphs of reps x [flush, call] minus reps x [flush], best of rounds replays "
    "(as chapter 5's benchmark); the split schedule of FlashMLA's sparse decode is made once per step, "
    "outside the graph, as SGLang makes it; the head padding (zeros + copy) is inside, as SGLang does it "
    "on every call"
)


def _sglang_quantizer() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """SGLang's own DSA row quantizer (``quantize_k_cache``) from the sources ``KVWALL_SGLANG_SOURCE`` names, loaded
    from its file alone (it imports only torch and Triton), or None."""
    src = os.environ.get("KVWALL_SGLANG_SOURCE")
    path = Path(src or "") / "sglang" / "kernels" / "ops" / "quantization" / "dsa_quant_k_cache.py"
    if not src or not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_kvwall_sglang_dsa_quant_k_cache", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.quantize_k_cache


def _v32_pool(keys: torch.Tensor, pages: int, device: torch.device) -> tuple[torch.Tensor, str, bool | None]:
    """The DSA pool ``[pages, 64, 1, 656]`` uint8 from the BF16 keys: with SGLang's own quantizer where its source is
    here on a GPU (and whether its bytes equal :func:`quantize_v32`'s on the first 4,096 tokens), else ours."""
    sglang = _sglang_quantizer() if device.type == "cuda" else None
    ours = quantize_v32(keys[: pages * PAGE_SIZE])
    if sglang is None:
        return (
            ours.view(pages, PAGE_SIZE, 1, V32_ROW_BYTES),
            "kvwall.peers.dsa.quantize_v32 (SGLang's arithmetic)",
            None,
        )
    theirs = sglang(keys[: pages * PAGE_SIZE].view(pages, PAGE_SIZE, 1, -1)).view(torch.uint8)
    match = bool(torch.equal(theirs.reshape(-1, V32_ROW_BYTES)[:4096], ours[:4096]))
    del ours
    return theirs.reshape(pages, PAGE_SIZE, 1, V32_ROW_BYTES), "SGLang 0.5.23 quantize_k_cache", match


def _reference(pt: BenchPoint, values: Callable[[torch.Tensor], torch.Tensor], indices: torch.Tensor) -> torch.Tensor:
    """Float64 attention of the point over the selected tokens, whose ``[n, 576]`` float values ``values(slots)``
    gives (only the few thousand selected rows of the 495,000 are read)."""
    sel = [indices[b, 0][indices[b, 0] >= 0].long() for b in range(pt.batch)]
    rows = values(torch.cat(sel))
    indptr = torch.tensor(
        [0, *torch.tensor([len(s) for s in sel]).cumsum(0).tolist()], dtype=torch.int64, device=rows.device
    )
    compact = torch.arange(rows.shape[0], device=rows.device)
    return mla_decode_reference(
        pt.q_nope, pt.q_pe, rows[:, :DC], rows[:, DC:], indptr, compact, SM_SCALE, compute_dtype=torch.float64
    )


def _dsa_rows(
    pt: BenchPoint,
    v32: torch.Tensor,
    keys: torch.Tensor,
    fp8_rows: torch.Tensor,
    index_cache: torch.Tensor,
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    device: torch.device,
    flush: Callable[[], Any],
    *,
    index_heads: int,
    topk: int,
    copy_gbps: float,
    reps: int,
    rounds: int,
    host_calls: int,
    check_indexer: bool,
) -> list[dict[str, Any]]:
    table, seqlens, _ = layout
    gen = torch.Generator(device=device).manual_seed(pt.seed + 17)
    q_index = torch.randn(pt.batch, index_heads, INDEX_HEAD_DIM, generator=gen, device=device).to(FP8)
    weights = torch.randn(pt.batch, index_heads, generator=gen, device=device) * index_heads**-0.5
    logits = torch.empty(pt.batch, table.shape[1] * PAGE_SIZE, dtype=torch.float32, device=device)
    indices = torch.full((pt.batch, 1, topk), -1, dtype=torch.int32, device=device)
    selected = sum(min(n, topk) for n in pt.lens)
    base = {
        "section": "dsa",
        "heads": pt.heads,
        "padded_heads": padded_heads(pt.heads),
        "context": pt.context,
        "batch": pt.batch,
        "tokens": pt.tokens,
        "selected": selected,
    }
    floors = {
        "indexer_logits": pt.tokens * INDEX_ROW_BYTES,
        "topk": pt.tokens * 4,
        "sparse_decode": selected * V32_ROW_BYTES,
    }
    floors["layer"] = sum(floors.values())

    def run_logits() -> torch.Tensor:
        return index_logits(q_index, weights, index_cache, table, seqlens, logits)

    def run_topk() -> torch.Tensor:
        return select_topk(logits, table, seqlens, topk, out=indices)

    rows = {
        part: {
            **base,
            "part": part,
            "floor_bytes": floors[part],
            "floor_us": floors[part] / copy_gbps / 1e3,
            "us": None,
            "timing": "not timed",
        }
        for part in DSA_PARTS
    }
    calls: dict[str, Callable[[], Any]] = {"indexer_logits": run_logits, "topk": run_topk}
    try:
        run_logits()
        run_topk()
        synchronize(device)
        if check_indexer:
            want = index_logits_reference(q_index, weights, index_cache, table, seqlens)
            got = [logits[b, :n].double() for b, n in enumerate(pt.lens)]
            rows["indexer_logits"]["logits_rel_err_f64"] = finite_or_none(
                relative_error(torch.cat(got), torch.cat(want))
            )
            recall = []
            for b, n in enumerate(pt.lens):
                k = min(n, topk)
                exact = set(torch.topk(want[b], k).indices.tolist())
                chosen = set(torch.topk(got[b], k).indices.tolist())
                recall.append(len(exact & chosen) / k)
            rows["topk"]["topk_recall"] = min(recall)
    except Exception as exc:  # noqa: BLE001 - a part that cannot run is a row with an error
        for part in DSA_PARTS:
            rows[part].update(error=error_text(exc, 600), traceback_tail=traceback_tail())
        return list(rows.values())
    try:
        decode = FlashMLASparseDecode(pt.q_nope, pt.q_pe, v32, indices, SM_SCALE)
        got = decode().double()
        synchronize(device)
        flat = v32.view(-1, V32_ROW_BYTES)
        rows["sparse_decode"]["rel_err_f64"] = finite_or_none(
            relative_error(got, _reference(pt, lambda slots: dequantize_v32(flat[slots]), indices))
        )
        rows["sparse_decode"]["rel_err_vs_bf16"] = finite_or_none(
            relative_error(got, _reference(pt, lambda slots: keys[slots].float(), indices))
        )
        rows["layer"].update(
            rel_err_f64=rows["sparse_decode"]["rel_err_f64"], rel_err_vs_bf16=rows["sparse_decode"]["rel_err_vs_bf16"]
        )
        calls["sparse_decode"] = decode
        calls["layer"] = lambda: (run_logits(), run_topk(), decode())
    except Exception as exc:  # noqa: BLE001
        for part in ("sparse_decode", "layer"):
            rows[part].update(error=error_text(exc, 600), traceback_tail=traceback_tail())
    if check_indexer:  # what storing the keys costs the attention output, before any kernel: float64 on both sides
        try:
            flat = v32.view(-1, V32_ROW_BYTES)
            truth_sel = _reference(pt, lambda slots: keys[slots].float(), indices)
            rows["sparse_decode"]["storage_rel_err"] = finite_or_none(
                relative_error(_reference(pt, lambda slots: dequantize_v32(flat[slots]), indices), truth_sel)
            )
            rows["sparse_decode"]["plain_storage_rel_err"] = finite_or_none(
                relative_error(_reference(pt, lambda slots: fp8_rows[slots].float(), indices), truth_sel)
            )
            every = [
                layout[2][a:b]
                for a, b in zip(
                    [0, *torch.tensor(pt.lens).cumsum(0).tolist()[:-1]], torch.tensor(pt.lens).cumsum(0).tolist()
                )
            ]
            all_tokens = torch.stack(
                [torch.nn.functional.pad(e.to(torch.int32), (0, max(pt.lens) - len(e)), value=-1) for e in every]
            ).unsqueeze(1)
            rows["sparse_decode"]["dense_storage_rel_err"] = finite_or_none(
                relative_error(
                    _reference(pt, lambda slots: fp8_rows[slots].float(), all_tokens),
                    _reference(pt, lambda slots: keys[slots].float(), all_tokens),
                )
            )
        except Exception as exc:  # noqa: BLE001
            rows["sparse_decode"]["storage_error"] = error_text(exc, 600)
    for part, fn in calls.items():
        try:
            us, how, why = time_call(fn, flush, device, reps, rounds)
            rows[part].update(us=us, timing=how, **({"graph_error": why} if why else {}))
            rows[part]["host_us"] = host_us_per_call(fn, device, host_calls) if host_calls else None
        except Exception as exc:  # noqa: BLE001
            rows[part].update(error=error_text(exc, 600), traceback_tail=traceback_tail())
    release_memory(device)
    return list(rows.values())


def run_dsa_decode(
    device: torch.device,
    *,
    heads: list[int],
    contexts: list[int],
    batches: list[int],
    pool_slots: int = 495_000,
    max_total_tokens: int = 2_000_000,
    index_heads: int = 32,
    topk: int = TOPK,
    dense: list[str] | tuple[str, ...] = tuple(DENSE),
    reps: int = 10,
    rounds: int = 3,
    host_calls: int = 20,
    flush_mb: int = 256,
    seed: int = 0,
) -> Result:
    """See the module docstring. Rows: one ``setup``, then per point four ``dsa`` rows (its parts) and one ``bench``
    row per dense path."""
    t0 = time.perf_counter()
    pages = pool_slots // PAGE_SIZE
    gen = torch.Generator(device=device).manual_seed(seed)
    keys = (torch.randn(pages * PAGE_SIZE, GLM5.kv_dim, generator=gen, device=device) * 0.7).to(BF16)
    fp8_pool = keys.to(FP8).view(-1, 1, GLM5.kv_dim)  # the dense paths' rows: the same keys, 576 e4m3 bytes
    v32, quantizer, match = _v32_pool(keys, pages, device)
    index_cache = quantize_index_keys(torch.randn(pages * PAGE_SIZE, INDEX_HEAD_DIM, generator=gen, device=device))
    setup: dict[str, Any] = {
        "section": "setup",
        "device": str(device),
        "quantizer": quantizer,
        "quantizer_bytes_match": match,
        "index_heads": index_heads,
        "topk": topk,
        "us_means": US_MEANS,
    }
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        fm = load_flash_mla()
        setup.update(
            gpu=torch.cuda.get_device_name(device),
            sms=sms,
            copy_gbps=copy_bandwidth_gbps(device, 1 << 30)[1],
            flash_mla={k: v for k, v in fm.items() if isinstance(v, (str, int, float, bool))},
        )
        tflops = matmul_tflops(device)
    else:
        sms, tflops = 1, 1.0
        setup["copy_gbps"] = copy_bandwidth_gbps(device, 1 << 24)[1]
    copy_gbps = setup["copy_gbps"]
    scratch = torch.empty(flush_mb << 20, dtype=torch.uint8, device=device)
    ctx = BuildContext(sm_count=sms)
    rows: list[dict[str, Any]] = [setup]
    for h in heads:
        for context in contexts:
            for batch in batches:
                pt = make_point(
                    h,
                    context,
                    batch,
                    pool_slots=pages * PAGE_SIZE,
                    max_total=max_total_tokens,
                    gen=gen,
                    seed=seed,
                    device=device,
                )
                layout = paged_layout(pt, fp8_pool)
                rows += _dsa_rows(
                    pt,
                    v32,
                    keys,
                    fp8_pool.view(-1, GLM5.kv_dim),
                    index_cache,
                    layout,
                    device,
                    scratch.zero_,
                    index_heads=index_heads,
                    topk=topk,
                    copy_gbps=copy_gbps,
                    reps=reps,
                    rounds=rounds,
                    host_calls=host_calls,
                    check_indexer=batch <= CHECK_INDEXER_UP_TO,
                )
                rows += bench_point_rows(
                    pt,
                    fp8_pool,
                    device,
                    list(dense),
                    scratch.zero_,
                    copy_gbps=copy_gbps,
                    bf16_tflops=tflops,
                    reps=reps,
                    rounds=rounds,
                    host_calls=host_calls,
                    ctx=ctx,
                    sglang_split_sweep=[],
                )
                del pt, layout
                release_memory(device)
    setup["index_dot"] = INDEX_DOT.get("gpu", "float32 (interpreter)" if device.type != "cuda" else None)
    setup["seconds_total"] = round(time.perf_counter() - t0, 1)
    params = dict(
        heads=list(heads),
        contexts=list(contexts),
        batches=list(batches),
        pool_slots=pool_slots,
        max_total_tokens=max_total_tokens,
        index_heads=index_heads,
        topk=topk,
        dense=list(dense),
        reps=reps,
        rounds=rounds,
        host_calls=host_calls,
        flush_mb=flush_mb,
        seed=seed,
    )
    return Result("dsa_decode", params, rows, collect_provenance(device, __name__))


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "dsa_decode",
        run_dsa_decode,
        full=dict(
            heads=[16, 64],
            contexts=[4096, 8192, 32_768, 131_072],
            batches=[1, 8, 32, 64],
            pool_slots=495_000,
            max_total_tokens=2_000_000,
            index_heads=32,
            topk=TOPK,
            dense=list(DENSE),
            reps=10,
            rounds=3,
            host_calls=20,
            flush_mb=256,
            seed=0,
        ),
        small=dict(
            heads=[16],
            contexts=[3000],
            batches=[1, 2],
            pool_slots=8192,
            max_total_tokens=8192,
            index_heads=32,
            topk=TOPK,
            dense=["ours_page64"],
            reps=1,
            rounds=1,
            host_calls=0,
            flush_mb=1,
            seed=0,
        ),
        about="SGLang's DSA decode on Hopper (indexer, top-k, FlashMLA sparse FP8 over 2,048 tokens, heads "
        "padded to 64) beside ours and FlashMLA dense at chapter 5's points",
        requires=("cuda",),
    ),
]
