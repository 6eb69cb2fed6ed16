"""Ours (:func:`kvwall.kernels.mla_decode.dispatch.mla_decode`) under a CUDA-graph runner: a per-step plan whose
device buffers keep their size and address across replays, refilled in place from the host lengths outside capture.

A plan of :func:`~kvwall.kernels.mla_decode.dispatch.plan_mla_decode_auto` fixes, at the launch it is first used in,
the number of work items (the split kernel's grid), the number of requests the combine merges (its grid) and the
partial buffers' addresses. A captured graph keeps all three, so a plan made for the capture batch would be replayed
unchanged for a later batch of other lengths. :class:`GraphStepPlan` keeps them fixed instead, by construction:

- ``capacity`` items: the work list of any lengths, cut for ``items_wanted`` items per head block, has at most
  ``items_wanted + batch`` items (every request adds at most one rounding chunk), so ``capacity`` is that bound;
  unused items are empty (first token = end token = 0) and write a spare partial row no request reads;
- every request is merged by the combine (a request of one chunk too, through one partial row), so the combine's
  grid is ``batch``, whatever the lengths;
- the partial buffers hold ``capacity + 1`` rows.

:meth:`GraphStepPlan.refill` cuts the work list for the step's lengths (:func:`kvwall.kernels.mla_decode.plan.
build_work_list`, the same rule as the eager plan) and copies it into those buffers: host arithmetic and three small
host-to-device copies, no synchronization. The path (Triton, wgmma or tokens-on-M wgmma: every path's plan has the
same work list and buffers) and the Triton path's launch shape are chosen
once, when the plan is made, for ``batch`` requests of ``max_len`` tokens (the graph's batch at the context limit).
Eager steps need none of this: :func:`eager_step_plan` is ``plan_mla_decode_auto`` on host lengths.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from kvwall.kernels.mla_decode import dispatch
from kvwall.kernels.mla_decode.plan import WorkList, build_work_list

__all__ = ["GraphStepPlan", "eager_step_plan", "ours_decode", "plan_path"]


def plan_path(plan) -> str:
    """The path a plan runs (:func:`kvwall.kernels.mla_decode.dispatch.path_of_plan`: ``"triton"``, ``"wgmma"`` or
    ``"wgmma_tokens"``)."""
    return dispatch.path_of_plan(plan)


def _host_indptr(lengths: Sequence[int]) -> torch.Tensor:
    ptr = [0]
    for n in lengths:
        ptr.append(ptr[-1] + int(n))
    return torch.tensor(ptr, dtype=torch.int64)


def eager_step_plan(lengths: Sequence[int], *, heads: int, device: torch.device, ckv_cache: torch.Tensor | None = None,
                    kpe_cache: torch.Tensor | None = None, path: str = "auto"):
    """The eager step's plan: :func:`~kvwall.kernels.mla_decode.dispatch.plan_mla_decode_auto` on the host lengths
    (no device synchronization)."""
    return dispatch.plan_mla_decode_auto(_host_indptr(lengths), heads=heads, device=device, path=path,
                                         ckv_cache=ckv_cache, kpe_cache=kpe_cache)


class GraphStepPlan:
    """A plan for one captured batch size whose buffers never move (see the module docstring).

    ``batch``: the graph's batch size; ``max_len``: the longest request it may see (the context limit); the caches
    (layer 0's FP8 views) let the dispatcher check the wgmma path's row alignment. ``plan`` is what every layer's
    :func:`ours_decode` call gets."""

    def __init__(self, batch: int, *, heads: int, max_len: int, device: torch.device,
                 ckv_cache: torch.Tensor | None = None, kpe_cache: torch.Tensor | None = None, path: str = "auto"):
        if batch < 1 or max_len < 1:
            raise ValueError(f"GraphStepPlan: batch ({batch}) and max_len ({max_len}) must be >= 1.")
        base = eager_step_plan([max_len] * batch, heads=heads, device=device, ckv_cache=ckv_cache,
                               kpe_cache=kpe_cache, path=path)
        self.batch, self.heads, self.max_len = batch, heads, max_len
        self.block_n = base.config.block_n
        self.items_wanted = base.items  # items per head block the path cut for the graph's batch at max_len
        self.capacity = self.items_wanted + batch
        i32 = dict(dtype=torch.int32, device=base.device)
        rows = self.capacity + 1  # + the spare row the empty items write
        work = torch.zeros(self.capacity, 4, **i32)
        combine = torch.arange(batch, **i32)
        part_indptr = torch.zeros(batch + 1, **i32)
        part_o = torch.empty(rows, heads, base.kv_lora_rank, dtype=torch.float32, device=base.device)
        part_lse = torch.empty(rows, heads, dtype=torch.float32, device=base.device)
        shape = WorkList(items=((0, 0, 0, self.capacity),) * self.capacity, combine=tuple(range(batch)),
                         part_indptr=tuple(range(batch + 1)), chunk_tokens=self.block_n,
                         max_chunks=self.capacity, lengths=(0,) * batch)
        self.plan = dataclasses.replace(base, work_list=shape, work=work, combine_requests=combine,
                                        part_indptr=part_indptr, part_o=part_o, part_lse=part_lse)
        self.path = plan_path(self.plan)
        self.refills = 0
        self.last_items = 0

    def refill(self, lengths: Sequence[int]) -> None:
        """Cut the work list for ``lengths`` (one entry per request of the graph's batch; padded requests give
        their own, e.g. SGLang's fill value) into the plan's buffers, in place. Outside graph capture; no sync."""
        lengths = [int(n) for n in lengths]
        if len(lengths) != self.batch:
            raise ValueError(f"GraphStepPlan.refill: {len(lengths)} lengths for a plan of batch {self.batch}.")
        wl = build_work_list(lengths, block_n=self.block_n, items_wanted=self.items_wanted)
        if len(wl.items) > self.capacity:  # the bound of the module docstring; never expected
            raise AssertionError(f"GraphStepPlan: {len(wl.items)} items exceed the capacity {self.capacity}.")
        chunks: list[list[tuple[int, int]]] = [[] for _ in lengths]
        for b, lo, hi, _ in wl.items:
            chunks[b].append((lo, hi))
        ptr = [0]
        for per in chunks:
            ptr.append(ptr[-1] + len(per))
        row_of: dict[tuple[int, int], int] = {}
        for b, per in enumerate(chunks):
            for k, (lo, _) in enumerate(sorted(per)):
                row_of[(b, lo)] = ptr[b] + k
        items = [(b, lo, hi, row_of[(b, lo)]) for b, lo, hi, _ in wl.items]  # the plan's order: longest first
        items += [(0, 0, 0, ptr[-1])] * (self.capacity - len(items))  # empty items -> the spare row
        self.plan.work.copy_(torch.tensor(items, dtype=torch.int32))
        self.plan.part_indptr.copy_(torch.tensor(ptr, dtype=torch.int32))
        self.refills += 1
        self.last_items = len(wl.items)


def ours_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float, plan, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Ours on the step's plan, unchecked (no host work: CUDA-graph capturable), with the Triton path's launch shape
    taken from its plan (as chapter 6's step calls it)."""
    kwargs = {"config": plan.config} if plan_path(plan) == "triton" else {}
    return dispatch.mla_decode(q_nope, q_pe, ckv, kpe, kv_indptr, kv_indices, sm_scale, plan=plan, out=out,
                               check_range=False, **kwargs)
