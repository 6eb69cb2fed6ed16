"""Calling FlashInfer's MLA doors the way a serving stack would, with GLM-5's shape.

:func:`make_inputs` builds GLM-5-shaped decode inputs for a :class:`~kvwall.peers.flashinfer.doors.DoorCase`
(a paged FP8 pool, a bf16 or FP8 query, the slots each request reads, so
:func:`kvwall.kernels.mla_decode_reference` can check an output); :func:`call_door` calls the
path on any device; :func:`outcome_of` describes what the library raised. FlashInfer is imported
inside :func:`call_door`: it is optional for the library, and in a replay
(:mod:`kvwall.peers.flashinfer.replay`) it must be the release put first on ``sys.path``.
"""

from __future__ import annotations

import os
import re
import traceback
from pathlib import Path
from typing import Any, Sequence

import torch

from kvwall.model.geometry import GLM5
from kvwall.peers.flashinfer.doors import DoorCase

__all__ = ["SPARSE_TOPK", "SPARSE_BYTES_PER_TOKEN", "make_inputs", "call_door", "outcome_of"]

SPARSE_TOPK = 2048  # GLM-5's DSA index_topk
SPARSE_BYTES_PER_TOKEN = 656  # 512 FP8 + 4 fp32 scales + 64 bf16 rope values


def make_inputs(
    case: DoorCase, device: torch.device | str, context_lens: Sequence[int] = (4096, 1000), seed: int = 0
) -> dict[str, Any]:
    """GLM-5-shaped decode inputs for ``case`` on ``device``: a paged FP8 pool (pages in random
    order, every request's tokens on its own pages), a bf16 (or FP8) query, and the slot list of
    each request so :func:`kvwall.kernels.mla_decode_reference` can check an output."""
    g = torch.Generator().manual_seed(seed)
    ps, rank, rope = case.page_size, GLM5.kv_lora_rank, GLM5.qk_rope_head_dim
    pages_per_req = [-(-n // ps) for n in context_lens]
    if case.door in ("cutlass", "trtllm-gen", "xqa"):  # block table width: a multiple of 128 / page size
        mult = max(1, 128 // ps)
        width = -(-max(pages_per_req) // mult) * mult
    else:
        width = max(pages_per_req)
    total_pages = sum(pages_per_req) + 1  # page 0 stays unused, as in SGLang
    order = (torch.randperm(total_pages - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(context_lens), width, dtype=torch.int32)
    slots, start = [], 0
    for b, n in enumerate(pages_per_req):
        pages = order[start : start + n]
        start += n
        table[b, :n] = torch.tensor(pages, dtype=torch.int32)
        slots.append([p * ps + o for p in pages for o in range(ps)][: context_lens[b]])
    kv_dtype = getattr(torch, case.kv_dtype)
    pool = (torch.randn(total_pages, ps, rank + rope, generator=g) * 0.5).to(kv_dtype)
    q = torch.randn(len(context_lens), case.heads, rank + rope, generator=g).to(getattr(torch, case.q_dtype))
    lens = torch.tensor(list(context_lens), dtype=torch.int32)
    inputs = {
        "pool": pool.to(device),
        "q": q.to(device),
        "table": table.to(device),
        "lens": lens.to(device),
        "slots": slots,
        "context_lens": list(context_lens),
        "sm_scale": GLM5.sm_scale,
    }
    if case.door == "sm120-sparse":  # the DSA indexer's top-k slot list and the packed cache
        topk = torch.full((len(context_lens), 1, SPARSE_TOPK), -1, dtype=torch.int32)
        for b, s in enumerate(slots):
            k = min(SPARSE_TOPK, len(s))
            pick = torch.tensor(s)[torch.randperm(len(s), generator=g)[:k]]
            topk[b, 0, :k] = pick.to(torch.int32)
        inputs["topk_indices"] = topk.to(device)
        inputs["topk_lens"] = torch.tensor([min(SPARSE_TOPK, n) for n in context_lens], dtype=torch.int32).to(device)
        inputs["packed"] = torch.zeros(total_pages, ps, SPARSE_BYTES_PER_TOKEN, dtype=torch.uint8).to(device)
    return inputs


def call_door(case: DoorCase, inputs: dict[str, Any], workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Call ``case.door`` as a serving stack would; returns its output ``[batch, heads, 512]``.
    Whatever the library raises propagates."""
    from flashinfer import mla as fmla  # optional; in a replay, the release under test

    pool, q, table, lens = inputs["pool"], inputs["q"], inputs["table"], inputs["lens"]
    device = q.device
    rank, rope = GLM5.kv_lora_rank, GLM5.qk_rope_head_dim
    batch = q.shape[0]
    if workspace is None:
        workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
    q_nope, q_pe = q[..., :rank].contiguous(), q[..., rank:].contiguous()
    ckv, kpe = pool[..., :rank], pool[..., rank:]
    if case.door in ("fa2", "fa3"):
        w = _wrapper(fmla, workspace, case.door)
        ps = case.page_size
        pages = [table[b, : -(-int(lens[b]) // ps)] for b in range(batch)]
        kv_indptr = torch.tensor([0] + [sum(len(p) for p in pages[: b + 1]) for b in range(batch)], dtype=torch.int32)
        kv_indices = torch.cat(pages).to(torch.int32)
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32)
        w.plan(
            qo_indptr.to(device),
            kv_indptr.to(device),
            kv_indices,
            lens,
            case.heads,
            rank,
            rope,
            ps,
            False,
            inputs["sm_scale"],
            q.dtype,
            pool.dtype,
        )
        scales = {"ckv_scale": 1.0, "kpe_scale": 1.0} if pool.dtype == torch.float8_e4m3fn else {}
        return w.run(q_nope, q_pe, ckv, kpe, **scales)
    if case.door == "cutlass":
        w = fmla.BatchMLAPagedAttentionWrapper(workspace, backend="cutlass")
        return w.run(q_nope, q_pe, ckv, kpe, kv_len=lens, page_table=table)
    max_len = int(max(inputs["context_lens"]))
    if case.door == "trtllm-gen":
        return fmla.trtllm_batch_decode_with_kv_cache_mla(
            q.unsqueeze(1),
            pool,
            workspace,
            GLM5.qk_nope_head_dim,
            rank,
            rope,
            table,
            lens,
            max_len,
            bmm1_scale=inputs["sm_scale"],
            bmm2_scale=1.0,
            backend="trtllm-gen",
        ).squeeze(1)
    if case.door == "xqa":
        return fmla.xqa_batch_decode_with_kv_cache_mla(
            q.unsqueeze(1),
            pool,
            workspace,
            GLM5.qk_nope_head_dim,
            rank,
            rope,
            table,
            lens,
            max_len,
            bmm1_scale=inputs["sm_scale"],
            bmm2_scale=1.0,
        ).squeeze(1)
    if case.door == "sm120-sparse":
        packed = inputs["packed"]
        return fmla.trtllm_batch_decode_with_kv_cache_mla(
            q.unsqueeze(1),
            packed,
            workspace,
            GLM5.qk_nope_head_dim,
            rank,
            rope,
            inputs["topk_indices"],
            inputs["topk_lens"],
            max_len,
            sparse_mla_top_k=SPARSE_TOPK,
            bmm1_scale=inputs["sm_scale"],
            bmm2_scale=1.0,
            backend="sparse",
            kv_scale_format="arbitrary_fp32",
        ).squeeze(1)
    raise ValueError(f"Unknown path {case.door!r}.")  # pragma: no cover - DoorCase validates


def _wrapper(fmla: Any, workspace: torch.Tensor, backend: str) -> Any:
    """``BatchMLAPagedAttentionWrapper(workspace, backend=...)``; on a CPU (replays) the pinned host
    buffer the constructor allocates cannot exist, so the same attributes are set by hand."""
    if workspace.device.type == "cuda":
        return fmla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
    w = object.__new__(fmla.BatchMLAPagedAttentionWrapper)
    w._float_workspace_buffer, w.device, w._backend = workspace, workspace.device, backend
    w._int_workspace_buffer = torch.empty(8 << 20, dtype=torch.uint8)
    w._pin_memory_int_workspace_buffer = torch.empty(8 << 20, dtype=torch.uint8)
    w._use_cuda_graph = False
    return w


_KVWALL_DIR = str(Path(__file__).resolve().parent)


def outcome_of(exc: BaseException) -> dict[str, Any]:
    """Structured description of what the library raised: type, message (first 600 characters),
    and the innermost frame inside FlashInfer as ``flashinfer/...py:line``."""
    where = ""
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        m = re.search(r"(flashinfer/.*)$", fr.filename.replace(os.sep, "/"))
        if m and not fr.filename.startswith(_KVWALL_DIR):
            where = f"{m.group(1)}:{fr.lineno}"
            break
    msg = str(exc).strip()
    return {"exc_type": type(exc).__name__, "message": msg[:600], "where": where}
