"""Ours, the call a user makes: :func:`plan_mla_decode` once per decode step, :func:`mla_decode` once per layer --
FlashInfer's plan/run shape, because SGLang's ``flashinfer_mla`` backend (and vLLM's FlashInfer MLA backend) already
plan once per step and run once per layer: an engine swaps call for call. (FlashMLA's ``get_mla_metadata`` /
``flash_mla_with_kvcache`` would ask the engine for FlashMLA's tile-scheduler metadata instead.)

::

    plan = plan_mla_decode(kv_indptr, kv_indices, heads=16, sm_scale=1 / 576 ** 0.5, lengths=seq_lens_cpu)
    out = mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, plan, ckv_scale=k_scale, kpe_scale=k_scale)

**The plan** validates the step once (dtypes, devices, the page table, the lengths), chooses the path and its launch
shape, and cuts the work list; it keeps ``kv_indptr`` / ``kv_indices`` / ``kv_len`` by reference, as FlashInfer's plan
keeps its buffers. With ``lengths`` (host token counts: SGLang has ``seq_lens_cpu``) it reads nothing from the device;
without, it reads the lengths once. ``graph_max_len``: a plan for a CUDA graph, whose buffers keep their size and
address; :meth:`DecodePlan.refill` re-cuts it in place for each replay's lengths.

**The call** checks shapes, dtypes and devices only -- no host read, no synchronization: CUDA-graph capturable --
and launches the plan's path with the plan's launch shape.

**Multi-token queries** (``q_len`` 2..8: MTP / EAGLE target-verify and draft-extend): ``q_nope`` is ``[batch x
q_len, heads, 512]`` (a request's tokens consecutive, SGLang's layout) and token ``j`` of a request of ``n`` tokens
sees its first ``n - (q_len - 1 - j)`` (causal over the draft). Every path runs them folded, as FlashMLA folds
``s_q`` into its rows: the call views ``q`` as ``[batch, q_len x heads, 512]`` (free for SGLang's layout) and the
split kernels mask row ``r`` at its token ``j = r // heads``; the KV is read once for all of a request's tokens.

**The paths** (:data:`KERNEL_PATHS`), reachable by name for tests and benchmarks (``path=`` forces one):

- ``"triton"``: the Triton kernel (:mod:`.kernel`: ``mla_decode_fp8``, ``plan_mla_decode_triton``), portable: every
  GPU Triton supports (SM100 and SM120 included) and the CPU interpreter;
- ``"wgmma"``: the heads-on-M warpgroup-MMA kernel (:mod:`.wgmma`, 64 rows per CTA as wgmma's M), Hopper only;
- ``"wgmma_tokens"``: the tokens-on-M warpgroup-MMA kernel (:mod:`.wgmma_tokens`, a tile's 64 tokens as M and 16 or
  32 rows per CTA as N), Hopper only.

:func:`choose_path` decides, in this order:

1. where the wgmma paths cannot run -- not a GPU of compute capability 9.0, latent / rope widths other than
   512 / 64, cache rows not 16-byte aligned, or their library cannot be built here (no nvcc, a failed build: one
   warning) -- the Triton path;
2. else by the measured table ``kernel_paths.json`` (:mod:`.path_table`): the entry of this GPU model, else one measured
   on a GPU of the same compute capability; among its points of the call's row count (rows = q_len x heads), the point
   of the call's shape (batch, tokens, longest request), else the nearest in batch and tokens (log scale): the
   fastest of the paths timed there;
3. with no entry for this GPU or its capability, no point of its row count, or a table refused as malformed (named
   in a warning, once): the tokens-on-M wgmma path up to ``path_table.TOKENS_MAX_HEADS`` rows, the wgmma path above.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from kvwall.kernels._args import MAX_HEADS, MAX_PAGE_SIZE, MAX_TOKENS, bounded_int, check_device, sm_scale_number
from kvwall.kernels._common import check_output, fail, gpu_name
from kvwall.kernels.mla_decode import hopper
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode import wgmma_tokens as tokens_path
from kvwall.kernels.mla_decode.checks import INDEX_DTYPES, KV_DTYPE, Q_DTYPE, as_rows as _as_rows, parse_scale
from kvwall.kernels.mla_decode.launch_shape import MLADecodeConfig
from kvwall.kernels.mla_decode.triton_path import launch_planned, plan_mla_decode_triton
from kvwall.kernels.mla_decode.plan import MLADecodePlan, device_ints
from kvwall.kernels.mla_decode.path_table import (
    KERNEL_PATHS,
    PATHS_FILE,
    SAID,
    KernelPath,
    decide_path,
    read_table,
    table_refusal,
)
from kvwall.kernels.mla_decode.work_list import WorkList, build_work_list

__all__ = ["plan_mla_decode", "mla_decode", "DecodePlan", "choose_path", "KernelPath", "KERNEL_PATHS", "MAX_Q_LEN"]

_plan_fail = functools.partial(fail, "plan_mla_decode")
_fail = functools.partial(fail, "mla_decode")
#: The paths that run on the Hopper kernels (sm_90a), with the same refusals.
_HOPPER_PATHS: tuple[KernelPath, ...] = ("wgmma", "wgmma_tokens")
#: The most query tokens a request may bring (speculative decoding's draft tokens + 1).
MAX_Q_LEN = 8


def choose_path(
    heads: int,
    batch: int,
    max_len: int,
    device: torch.device,
    *,
    tokens: int | None = None,
    ckv_cache: torch.Tensor | None = None,
    kpe_cache: torch.Tensor | None = None,
    dims: tuple[int, int] = (512, 64),
    table_file: Path | None = None,
) -> tuple[KernelPath, str]:
    """``(path, why)`` for a call of ``heads`` heads, ``batch`` requests of ``tokens`` tokens together (None: ``batch
    x max_len``), at most ``max_len`` each, on ``device``, latent / rope widths ``dims`` (caches given: their row
    alignment is checked too), by the table in ``table_file`` (default ``kernel_paths.json``); the rule is the module
    docstring's, ``why`` says which step decided and on what numbers. Both wgmma paths refuse what
    :func:`~kvwall.kernels.mla_decode.wgmma.wgmma_refusal` and :func:`~kvwall.kernels.mla_decode.wgmma.rows_refusal`
    refuse: the tokens-on-M path checks its inputs with the wgmma path's code."""
    refusal = wgmma_path.wgmma_refusal(device) or wgmma_path.rows_refusal(
        dims, {"ckv_cache": ckv_cache, "kpe_cache": kpe_cache}
    )
    on_gpu = device.type == "cuda"
    source = Path(table_file or PATHS_FILE)
    return decide_path(
        heads,
        batch,
        max_len,
        tokens=tokens,
        gpu=gpu_name(device) if on_gpu else str(device),
        capability=torch.cuda.get_device_capability(device) if on_gpu else None,
        refusal=refusal,
        table=read_table(source),
        source=source,
        refused=table_refusal(source),
    )


_WARNED: set[str] = set()


def _usable(path: KernelPath, why: str, device: torch.device) -> tuple[KernelPath, str]:
    """``(path, why)``, or the Triton path where the chosen Hopper path's library cannot be built or loaded here (no
    nvcc, a failed build): said once per process in a warning, and in the plan's ``why``."""
    if path not in _HOPPER_PATHS or device.type != "cuda":
        return path, why
    refusal = hopper.build_refusal(path)
    if refusal is None:
        return path, why
    if path not in _WARNED:
        _WARNED.add(path)
        warnings.warn(
            f"kvwall: the {SAID[path]} path cannot be built here ({refusal}); ours runs the Triton path "
            "instead (slower on Hopper, the same results).",
            RuntimeWarning,
            stacklevel=3,
        )
    return "triton", f"Triton: {why.split(':')[0]} was chosen but cannot be built here ({refusal})"


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """One decode step's plan (:func:`plan_mla_decode`): what every layer's :func:`mla_decode` call runs.

    ``path`` / ``why``: the path chosen and the reason (the dispatcher's rule, or ``"forced"``); ``launch``: its
    launch shape in words; ``work``: the path's work list and partial buffers (cut for ``q_len x heads`` rows a
    request); ``kv_indptr`` / ``kv_indices`` / ``kv_len``: the step's page table, by reference; ``lengths``: the
    host lengths it was cut for (a graph plan: the latest :meth:`refill`)."""

    path: KernelPath
    why: str
    launch: str
    batch: int
    heads: int
    q_len: int
    page_size: int
    kv_lora_rank: int
    rope_dim: int
    sm_scale: float
    device: torch.device
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len: torch.Tensor | None
    work: MLADecodePlan
    lengths: tuple[int, ...]
    graph_capacity: int | None = None

    @property
    def rows(self) -> int:
        """Query rows a request brings: ``q_len x heads`` (its query tokens folded into the heads)."""
        return self.q_len * self.heads

    def refill(self, lengths: Sequence[int]) -> None:
        """A graph plan's work list re-cut for ``lengths`` (one per request; SGLang's padded requests give theirs)
        into the plan's buffers, in place: host arithmetic and two small host-to-device copies, no synchronization.
        Outside graph capture, before the replay."""
        if self.graph_capacity is None:
            raise ValueError(
                "DecodePlan.refill: only a graph plan (plan_mla_decode(..., graph_max_len=...)) is "
                "refilled; make a new plan for an eager step."
            )
        lengths = [int(n) for n in lengths]
        if len(lengths) != self.batch:
            raise ValueError(f"DecodePlan.refill: {len(lengths)} lengths for a plan of batch {self.batch}.")
        _check_lengths(lengths, self.q_len, ValueError, "DecodePlan.refill")
        items, ptr = _graph_items(
            lengths, self.work.config.block_n, self.graph_capacity - self.batch, self.graph_capacity
        )
        self.work.work.copy_(device_ints(items, self.device), non_blocking=True)
        self.work.part_indptr.copy_(device_ints(ptr, self.device), non_blocking=True)
        object.__setattr__(self, "lengths", tuple(lengths))


def _check_lengths(lengths: Sequence[int], q_len: int, kind: type[Exception], who: str) -> None:
    for i, n in enumerate(lengths):
        if 0 < n < q_len:  # (an empty request -- a graph batch's padding -- writes zeros and lse -inf)
            raise kind(
                f"{who}: request {i} holds {n} tokens, fewer than its q_len={q_len} query tokens (the draft "
                "tokens are in the cache before their verify)."
            )


def _graph_items(lengths: list[int], block_n: int, items_wanted: int, capacity: int) -> tuple[list, list[int]]:
    """A graph plan's work list for ``lengths``: the eager rule's items (:func:`build_work_list`), every request
    merged by the combine through its own partial rows (so the combine's grid is the batch, whatever the lengths),
    unused items empty (first token = end token = 0) writing a spare partial row no request reads."""
    wl = build_work_list(lengths, block_n=block_n, items_wanted=items_wanted)
    if len(wl.items) > capacity:  # every request adds at most one rounding chunk: items_wanted + batch bounds it
        raise AssertionError(f"DecodePlan: {len(wl.items)} items exceed the capacity {capacity}.")
    chunks: list[list[int]] = [[] for _ in lengths]
    for b, lo, _, _ in wl.items:
        chunks[b].append(lo)
    ptr = [0]
    for per in chunks:
        ptr.append(ptr[-1] + len(per))
    row_of = {(b, lo): ptr[b] + k for b, per in enumerate(chunks) for k, lo in enumerate(sorted(per))}
    items = [(b, lo, hi, row_of[(b, lo)]) for b, lo, hi, _ in wl.items]
    items += [(0, 0, 0, ptr[-1])] * (capacity - len(items))
    return items, ptr


def _host_lengths(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len: torch.Tensor | None, page_size: int, units: int | None
) -> list[int]:
    """Tokens per request, read from the device once (one synchronization), checked: ``kv_indptr`` starts at 0, never
    decreases and stays within ``kv_indices``; ``kv_len`` fits each request's pages; with ``units`` (slots or pages in
    the cache) every index the page table uses lies in ``0 .. units - 1`` (its minimum and maximum ride along)."""
    parts = [kv_indptr.to(torch.int64)] + ([kv_len.to(torch.int64)] if kv_len is not None else [])
    if units is not None and kv_indices.numel():
        used = torch.arange(kv_indices.numel(), device=kv_indices.device) < kv_indptr[-1]
        picked = torch.where(used, kv_indices.to(torch.int64), 0)
        parts.append(torch.stack([picked.min(), picked.max()]))
    values = torch.cat(parts).tolist()
    n = kv_indptr.numel()
    ptr = values[:n]
    if ptr[0] != 0 or any(b < a for a, b in zip(ptr, ptr[1:])) or ptr[-1] > kv_indices.numel():
        _plan_fail(
            ValueError,
            f"kv_indptr must start at 0, never decrease and end within kv_indices "
            f"({kv_indices.numel()} entries); got {ptr[:6]}{'...' if n > 6 else ''} ending at {ptr[-1]}.",
        )
    if units is not None and kv_indices.numel() and ptr[-1]:
        lo, hi = values[-2:]
        if lo < 0 or hi >= units:
            _plan_fail(
                IndexError,
                f"kv_indices reach outside the cache: min {lo}, max {hi}; it has {units} "
                f"{'slots' if page_size == 1 else 'pages'}.",
            )
    if kv_len is None:
        return [b - a for a, b in zip(ptr, ptr[1:])]
    lens = values[n : 2 * n - 1]
    for i, (t, a, b) in enumerate(zip(lens, ptr, ptr[1:])):
        if t < 0 or t > (b - a) * page_size:
            _plan_fail(ValueError, f"kv_len[{i}] = {t} does not fit request {i}'s {b - a} pages of {page_size} tokens.")
    return lens


def _describe(work: MLADecodePlan, path: KernelPath) -> str:
    if path == "triton":
        c = work.config
        return (
            f"Triton: {c.block_h} rows x {c.block_n} tokens a program, {c.num_warps} warps, {c.num_stages} stages"
            f"{', FP8 pairs' if c.pairs else ''}; {work.items} items"
        )
    per_cta = wgmma_path.HEADS_PER_CTA if path == "wgmma" else tokens_path.heads_per_cta(work.heads)
    return f"{SAID[path]}: {per_cta} rows a CTA, 64 tokens a tile; {work.items} items"


def plan_mla_decode(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    heads: int,
    sm_scale: float,
    kv_len: torch.Tensor | None = None,
    q_len: int = 1,
    page_size: int = 1,
    lengths: Sequence[int] | None = None,
    path: str = "auto",
    ckv_cache: torch.Tensor | None = None,
    kpe_cache: torch.Tensor | None = None,
    graph_max_len: int | None = None,
    config: MLADecodeConfig | None = None,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
) -> DecodePlan:
    """The plan of one decode step (see the module docstring): ``kv_indptr`` / ``kv_indices`` (and ``kv_len`` for
    ``page_size > 1``: then they count pages) on the device the step runs on; ``heads`` query heads per token,
    ``q_len`` query tokens per request, ``sm_scale`` the softmax scale; ``lengths`` the host token counts (no device
    read); ``path`` ``"auto"`` or one of :data:`KERNEL_PATHS` (forced); ``ckv_cache`` / ``kpe_cache`` (optional) let
    the dispatcher check the Hopper paths' row alignment; ``graph_max_len``: a plan for a CUDA graph of this batch
    whose requests hold at most that many tokens (refilled per replay); ``config``: the Triton path's launch shape,
    with ``path="triton"`` only. Every check runs here, once, before any launch."""
    named = {"kv_indptr": kv_indptr, "kv_indices": kv_indices, **({"kv_len": kv_len} if kv_len is not None else {})}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            _plan_fail(TypeError, f"{name} must be a tensor, got {type(t).__name__}.")
        if t.dtype not in INDEX_DTYPES or t.dim() != 1 or not t.is_contiguous():
            _plan_fail(
                TypeError,
                f"{name} must be a contiguous 1-D int32 or int64 tensor; got {t.dtype} of shape {tuple(t.shape)}.",
            )
    if len({t.device for t in named.values()}) != 1:
        _plan_fail(
            ValueError,
            f"kv_indptr, kv_indices and kv_len must be on one device; got "
            f"{sorted(str(t.device) for t in named.values())}.",
        )
    device = check_device(kv_indptr.device, _plan_fail)  # a CUDA device with its index
    bounded_int("heads", heads, _plan_fail, most=MAX_HEADS)
    bounded_int(
        "q_len",
        q_len,
        _plan_fail,
        most=MAX_Q_LEN,
        hint="ours takes decode and speculative verify; a prefill goes to a prefill kernel",
    )
    bounded_int("page_size", page_size, _plan_fail, most=MAX_PAGE_SIZE)
    sm_scale = sm_scale_number(sm_scale, _plan_fail)
    for name, value, least in (("kv_lora_rank", kv_lora_rank, 64), ("rope_dim", rope_dim, 16)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least or value & (value - 1):
            _plan_fail(
                ValueError, f"{name} must be a power of two >= {least} (512 and 64 for DeepSeek/GLM), got {value!r}."
            )
    for name, t in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        if t is not None and not isinstance(t, torch.Tensor):
            _plan_fail(TypeError, f"{name} must be the FP8 cache tensor (or None), got {type(t).__name__}.")
    if graph_max_len is not None:
        bounded_int(
            "graph_max_len",
            graph_max_len,
            _plan_fail,
            most=MAX_TOKENS,
            hint="the most tokens a request of the graph's batch holds",
        )
    if path != "auto" and path not in KERNEL_PATHS:
        _plan_fail(ValueError, f"path must be 'auto' or one of {', '.join(map(repr, KERNEL_PATHS))}, got {path!r}.")
    if config is not None and path != "triton":
        _plan_fail(ValueError, "config is the Triton path's launch shape: pass it with path='triton'.")
    if config is not None and not isinstance(config, MLADecodeConfig):
        _plan_fail(TypeError, f"config must be an MLADecodeConfig (or None), got {type(config).__name__}.")
    if (page_size > 1) != (kv_len is not None):
        _plan_fail(ValueError, "kv_len goes with paged caches (page_size > 1), and a paged cache needs it.")
    batch = kv_indptr.numel() - 1
    if batch < 1:
        _plan_fail(ValueError, "kv_indptr must have batch + 1 >= 2 entries.")
    if lengths is not None:
        if isinstance(lengths, (str, bytes, torch.Tensor)) or not hasattr(lengths, "__len__"):
            _plan_fail(ValueError, f"lengths must be a sequence of token counts (ints), got {type(lengths).__name__}.")
        if any(isinstance(n, (bool, float)) or not isinstance(n, (int, np.integer)) for n in lengths):
            _plan_fail(TypeError, f"lengths must hold whole numbers (tokens per request), got {list(lengths)[:6]}.")
        lengths = [int(n) for n in lengths]
        if len(lengths) != batch:
            _plan_fail(ValueError, f"lengths has {len(lengths)} entries; kv_indptr says batch = {batch}.")
        # what the page table can hold (a graph plan's lengths are its capacity: its page table is refilled later)
        most = MAX_TOKENS if graph_max_len is not None else min(kv_indices.numel() * page_size, MAX_TOKENS)
        if any(n < 0 or n > most for n in lengths):
            _plan_fail(
                ValueError,
                f"lengths must be token counts from 0 to {most} (kv_indices' {kv_indices.numel()} "
                f"entries x page_size {page_size}); got {lengths[:6]}{'...' if batch > 6 else ''}.",
            )
    else:
        units = None
        if isinstance(ckv_cache, torch.Tensor):  # the cache's slots (pages): indices are checked against them
            units = (
                ckv_cache.shape[0]
                if ckv_cache.dim() == 3 and page_size > 1
                else ckv_cache.numel() // max(ckv_cache.shape[-1], 1)
            )
        lengths = _host_lengths(kv_indptr, kv_indices, kv_len, page_size, units)
    _check_lengths(lengths, q_len, ValueError, "plan_mla_decode")
    if graph_max_len is not None and max(lengths) > graph_max_len:
        _plan_fail(
            ValueError,
            f"graph_max_len={graph_max_len} is below the longest request's {max(lengths)} tokens; "
            "a graph plan is cut for requests of at most graph_max_len tokens.",
        )
    rows = q_len * heads
    cut_for = [graph_max_len] * batch if graph_max_len else lengths
    if path == "auto":
        chosen, why = choose_path(
            rows,
            batch,
            max(cut_for),
            device,
            tokens=sum(cut_for),
            ckv_cache=ckv_cache,
            kpe_cache=kpe_cache,
            dims=(kv_lora_rank, rope_dim),
        )
        chosen, why = _usable(chosen, why, device)
    else:
        chosen, why = path, f"{SAID[path]}: forced (path={path!r})"  # type: ignore[index]
    if chosen in _HOPPER_PATHS:
        refusal = wgmma_path.wgmma_refusal(device) or wgmma_path.rows_refusal(
            (kv_lora_rank, rope_dim), {"ckv_cache": ckv_cache, "kpe_cache": kpe_cache}
        )
        if refusal:
            _plan_fail(ValueError, f"the {SAID[chosen]} path cannot run here: {refusal}.")
    indptr_host = torch.tensor([0] + [sum(cut_for[: i + 1]) for i in range(batch)], dtype=torch.int64)
    if chosen == "wgmma":
        work = wgmma_path.plan_mla_decode_wgmma(indptr_host, heads=heads, device=device, q_len=q_len)
    elif chosen == "wgmma_tokens":
        work = tokens_path.plan_mla_decode_wgmma_tokens(indptr_host, heads=heads, device=device, q_len=q_len)
    else:
        work = plan_mla_decode_triton(indptr_host, heads=rows, kv_lora_rank=kv_lora_rank, device=device, config=config)
    capacity = None
    if graph_max_len:
        capacity = work.items + batch
        items, ptr = _graph_items(lengths, work.config.block_n, work.items, capacity)
        shape = WorkList(
            items=((0, 0, 0, capacity),) * capacity,
            combine=tuple(range(batch)),
            part_indptr=tuple(range(batch + 1)),
            chunk_tokens=work.config.block_n,
            max_chunks=capacity,
            lengths=(0,) * batch,
        )
        work = dataclasses.replace(
            work,
            page_size=page_size,
            work_list=shape,
            work=device_ints(items, device),
            combine_requests=device_ints(list(range(batch)), device),
            part_indptr=device_ints(ptr, device),
            part_o=torch.empty(capacity + 1, rows, kv_lora_rank, dtype=torch.float32, device=device),
            part_lse=torch.empty(capacity + 1, rows, dtype=torch.float32, device=device),
        )
    elif work.page_size != page_size:  # cut above from token counts; the kernels read pages of page_size
        work = dataclasses.replace(work, page_size=page_size)
    return DecodePlan(
        chosen,
        why,
        _describe(work, chosen),
        batch,
        heads,
        q_len,
        page_size,
        kv_lora_rank,
        rope_dim,
        float(sm_scale),
        device,
        kv_indptr,
        kv_indices,
        kv_len,
        work,
        tuple(lengths),
        capacity,
    )


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    plan: DecodePlan,
    *,
    ckv_scale: float | torch.Tensor = 1.0,
    kpe_scale: float | torch.Tensor = 1.0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Ours: MLA decode attention straight from the FP8 cache on ``plan``'s path (module docstring). ``q_nope``
    ``[batch x q_len, heads, 512]`` and ``q_pe`` ``[..., 64]`` BF16; ``ckv_cache`` / ``kpe_cache`` FP8 e4m3,
    ``[slots, D]``, ``[slots, 1, D]`` (views of one SGLang ``[slots, 1, 576]`` pool) or ``[pages, page_size, D]``;
    the scales Python numbers or one-element float32 tensors on the device (read in the kernel). Returns ``out``
    ``[batch x q_len, heads, 512]`` BF16 (and the natural-log LSE ``[batch x q_len, heads]`` with ``return_lse``).
    Checks shapes, dtypes and devices; nothing is read back from the device (CUDA-graph capturable)."""
    if not isinstance(plan, DecodePlan):
        _fail(TypeError, f"plan must come from plan_mla_decode, got {type(plan).__name__}.")
    tokens, heads, dc, dr = plan.batch * plan.q_len, plan.heads, plan.kv_lora_rank, plan.rope_dim
    for name, t, dtype, shape in (
        ("q_nope", q_nope, Q_DTYPE, (tokens, heads, dc)),
        ("q_pe", q_pe, Q_DTYPE, (tokens, heads, dr)),
    ):
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != dtype
            or tuple(t.shape) != shape
            or t.device != plan.device
            or t.stride(-1) != 1
        ):
            _fail(
                ValueError,
                f"{name} must be a {dtype} tensor of shape {shape} (batch x q_len, heads, dim) on "
                f"{plan.device} with a contiguous last dim, as planned; got {_said(t)}.",
            )
    for name, t in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        if not isinstance(t, torch.Tensor) or t.dtype != KV_DTYPE or t.device != plan.device:
            _fail(
                TypeError,
                f"{name} must be an FP8 e4m3 tensor ({KV_DTYPE}, the FP8 cache) on {plan.device}; got {_said(t)}.",
            )
    ckv, page = _as_rows("ckv_cache", ckv_cache)
    kpe, kpe_page = _as_rows("kpe_cache", kpe_cache)
    if (
        page != plan.page_size
        or kpe_page != page
        or ckv.shape[-1] != dc
        or kpe.shape[-1] != dr
        or ckv.shape[0] != kpe.shape[0]
    ):
        _fail(
            ValueError,
            f"the caches ({tuple(ckv_cache.shape)}, {tuple(kpe_cache.shape)}) do not match the plan: "
            f"page size {plan.page_size}, widths {dc} and {dr}, as many slots in both.",
        )
    (c_t, c_v), (k_t, k_v) = (
        parse_scale("ckv_scale", ckv_scale, plan.device),
        parse_scale("kpe_scale", kpe_scale, plan.device),
    )
    if (c_t is None) != (k_t is None):  # one mode for both scales: a tensor (read in the kernel) for the number
        c_t = c_t if c_t is not None else torch.full((1,), c_v, dtype=torch.float32, device=plan.device)
        k_t = k_t if k_t is not None else torch.full((1,), k_v, dtype=torch.float32, device=plan.device)
    scales = ((c_t, c_v), (k_t, k_v))
    if out is None:
        out = torch.empty(tokens, heads, dc, dtype=Q_DTYPE, device=plan.device)
    elif (
        not isinstance(out, torch.Tensor)
        or out.dtype != Q_DTYPE
        or tuple(out.shape) != (tokens, heads, dc)
        or out.device != plan.device
        or out.stride(-1) != 1
    ):
        _fail(
            ValueError,
            f"out must be a {Q_DTYPE} tensor of shape {(tokens, heads, dc)} on {plan.device} with a "
            f"contiguous last dim; got {_said(out)}.",
        )
    else:  # a given out: its own memory (host arithmetic on pointers, no device access)
        check_output(
            out,
            {
                "q_nope": q_nope,
                "q_pe": q_pe,
                "ckv_cache": ckv_cache,
                "kpe_cache": kpe_cache,
                "kv_indptr": plan.kv_indptr,
                "kv_indices": plan.kv_indices,
                "kv_len": plan.kv_len,
                "ckv_scale": c_t,
                "kpe_scale": k_t,
            },
            _fail,
        )
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=plan.device) if return_lse else None
    qn, qp, o = _fold(q_nope, plan), _fold(q_pe, plan), _fold(out, plan)
    lse_rows = lse.view(plan.batch, plan.rows) if lse is not None else None
    if plan.path == "triton":
        launch_planned(
            plan.work,
            plan.work.config,
            qn,
            qp,
            ckv,
            kpe,
            plan.kv_indptr,
            plan.kv_indices,
            plan.kv_len,
            scales[0],
            scales[1],
            plan.sm_scale,
            o,
            lse_rows,
            q_len=plan.q_len,
        )
    else:
        hopper.launch_planned(
            plan.path,
            plan.work,
            qn,
            qp,
            ckv,
            kpe,
            plan.kv_indptr,
            plan.kv_indices,
            plan.kv_len,
            scales,
            plan.sm_scale,
            plan.q_len,
            heads,
            o,
            lse_rows,
            _stream(plan.device),
        )
    if o.data_ptr() != out.data_ptr():  # out could not be folded in place (rows not evenly spaced): copy back
        out.copy_(o.view(tokens, heads, dc))
    return (out, lse) if return_lse else out


#: The current CUDA stream's handle without torch.cuda.current_stream's Python wrapper (a few µs a call).
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(device: torch.device) -> int:
    if _RAW_STREAM is not None and device.type == "cuda":
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _fold(t: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
    """``[batch x q_len, heads, D]`` as ``[batch, q_len x heads, D]``: a view where the token stride is ``heads`` x
    the head stride (SGLang's layout; always at ``q_len`` 1), else a copy."""
    if plan.q_len == 1:
        return t
    if t.stride(0) == t.shape[1] * t.stride(1):
        return t.as_strided((plan.batch, plan.rows, t.shape[2]), (plan.q_len * t.stride(0), t.stride(1), 1))
    return t.contiguous().view(plan.batch, plan.rows, t.shape[2])


def _said(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device} strides {t.stride()}"
