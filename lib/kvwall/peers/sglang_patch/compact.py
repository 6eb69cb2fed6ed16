"""The rows a step references, FP8 -> BF16, in a compact buffer: what both patches give FlashInfer's BF16 MLA wrapper
wherever a query has several tokens per request (target-verify, draft-extend, paged prefill with a cached prefix, the
DCP buffer), and what ``gather_cast.diff`` gives it in decode too. The wrapper is planned over indices ``0..n-1``;
each layer gathers+casts the ``n`` referenced rows (:func:`kvwall.kernels.gather.kernel.launch_gather`) instead of
casting the whole pool.

- **Eager steps** (no CUDA graph, and SGLang's piecewise / breakable prefill graphs, which run attention eagerly
  between their captured segments): the step's ``kv_indices`` are read in place and the gather writes a transient
  buffer of the step's own ``n`` rows, allocated per call (the original cast made a pool-sized one per layer).
- **CUDA graphs**: :meth:`CompactKV.reserve` (from ``init_cuda_graph_state``, where SGLang's backends allocate what
  captured graphs use, before any capture) makes, once, a buffer of ``capacity`` rows -- the most rows the captured
  graphs can reference: ``min(pool rows, max batch x context limit + max tokens)`` -- its slot list and a device
  count. Graphs hold these addresses; nothing is rebound on replay. :meth:`CompactKV.plan` (outside capture) copies
  the step's slots into the slot list and writes ``0..n-1`` over the step's ``kv_indices`` in place (the buffer the
  captured wrapper reads), so a replay gathers exactly the step's rows. A step that references more positions than
  ``capacity`` (possible only when requests share prefix slots) is planned over its *distinct* slots instead --
  ``torch.unique``, one synchronization, slower -- which never exceed the pool's rows: it stays correct and never
  raises.
"""

from __future__ import annotations

import torch

from kvwall.kernels.gather.kernel import launch_gather, plan_gather

__all__ = ["CompactKV", "graph_capacity"]


def graph_capacity(pool_rows: int, max_bs: int, max_context_len: int, max_num_tokens: int = 0) -> int:
    """Rows the compact buffer needs so that every step a captured graph can replay fits it after deduplication."""
    return max(1, min(int(pool_rows), int(max_bs) * int(max_context_len) + int(max_num_tokens)))


class CompactKV:
    """See the module docstring. ``dim``: the cache row width (kv_lora_rank + rope)."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.capacity = 0
        self.slots = self.count = self.out = self.arange = None  # the graph buffers (reserve)
        self.step = None  # (slots, count or None, out) of the current step
        self.gather = None  # the step's validated gather plan (first layer), launched by every layer
        self.dedup_steps = 0  # steps planned over their distinct slots (more positions than the capacity)
        self._eager_arange = torch.empty(0, dtype=torch.int32)

    @property
    def reserved_bytes(self) -> int:
        """What :meth:`reserve` allocated (the BF16 rows, the slot list, the compact indices, the count)."""
        return 0 if self.out is None else self.capacity * (self.dim * 2 + 8) + 4

    def reserve(self, rows: int, device: torch.device) -> None:
        """The graph buffers, once (before any capture); a second call keeps the first buffers (captured graphs hold
        them) unless it asks for more rows and nothing was captured with them yet."""
        if self.out is not None and rows <= self.capacity:
            return
        self.capacity = int(rows)
        self.slots = torch.zeros(self.capacity, dtype=torch.int32, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)
        self.out = torch.empty((self.capacity, 1, self.dim), dtype=torch.bfloat16, device=device)
        self.arange = torch.arange(self.capacity, dtype=torch.int32, device=device)

    def _arange(self, n: int, device: torch.device) -> torch.Tensor:
        if self._eager_arange.numel() < n or self._eager_arange.device != device:
            self._eager_arange = torch.arange(max(n, 2 * self._eager_arange.numel()), dtype=torch.int32, device=device)
        return self._eager_arange[:n]

    def plan(self, kv_indices: torch.Tensor, n: int, *, graph: bool) -> torch.Tensor:
        """Once per step, where the wrapper is planned: ``kv_indices`` the step's pool slots (their first ``n``
        entries used), ``graph`` whether a captured graph runs the step (capture or replay). Returns the indices to
        plan the wrapper with (in graph mode: ``kv_indices`` itself, overwritten with compact indices)."""
        self.gather = None
        n = int(n)
        if not graph:
            self.step = (kv_indices[:n], None, None)
            return self._arange(n, kv_indices.device)
        if self.out is None:
            raise RuntimeError("CompactKV.plan: reserve() was not called (init_cuda_graph_state).")
        used = kv_indices[:n]
        if n <= self.capacity:
            self.slots[:n].copy_(used)
            used.copy_(self.arange[:n])
            rows = n
        else:  # shared prefix slots: the distinct ones (at most the pool's rows) -- one sync, correct
            uniq, inverse = torch.unique(used, return_inverse=True)
            rows = uniq.numel()
            if rows > self.capacity:  # not reachable: capacity >= pool rows whenever n can exceed it
                raise AssertionError(f"CompactKV: {rows} distinct slots exceed the capacity {self.capacity}.")
            self.slots[:rows].copy_(uniq)
            used.copy_(inverse.to(used.dtype))
            self.dedup_steps += 1
        self.count.fill_(rows)
        self.step = (self.slots, self.count, self.out)
        return kv_indices

    def kv(self, pool: torch.Tensor) -> torch.Tensor:
        """One layer's compact BF16 rows ``[rows, 1, dim]`` from its FP8 buffer ``pool`` (``[slots, 1, dim]``)."""
        slots, count, out = self.step
        if count is None and pool.is_cuda and torch.cuda.is_current_stream_capturing():
            # an eager step's rows (their number fixed now) captured into a graph would be replayed for other steps
            raise RuntimeError(
                "CompactKV: an eager step's gather is being captured into a CUDA graph; plan it with "
                "graph=True (SGLang's piecewise/breakable prefill graphs run attention eagerly)."
            )
        if self.gather is None:  # host checks only (no sync): also under capture
            self.gather = plan_gather(pool, slots, count, out=out, check_range=False)
        return launch_gather(self.gather, pool=pool)
