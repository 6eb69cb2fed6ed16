"""The work list of a decode batch: every request cut into chunks of about equal token counts, sized to the machine,
so a mixed batch's longest request no longer sets the kernel's time (chapter 5, "balancing a mixed batch").

:func:`build_work_list` is plain host arithmetic (no GPU, no torch): lengths in, items out. Each item is one program
of the split kernel (per head block): ``(request, first token, end token, partial row)``:

- a request of ``n`` tokens gets ``ceil(n / chunk)`` chunks of ``ceil(n / chunks)`` tokens rounded up to whole tiles,
  so every chunk of the batch holds at most ``chunk`` tokens;
- the last chunk of a request ends at :data:`TO_THE_END` (the kernel clamps it to the length it finds at run time),
  so a plan stays correct for a request that grew since it was made (decode appends a token a step);
- a request with one chunk writes its output directly (partial row ``-1``); the others write float32 partials,
  rows ``part_indptr[i] .. part_indptr[i + 1]`` for the ``i``-th of :attr:`WorkList.combine`, merged by the combine;
- items are ordered longest first (the largest pieces start in the first wave, short ones fill the tail);
- an empty request gets one empty item (it writes zeros and ``lse = -inf``).

``chunk`` is the total tokens over the items the machine wants at once (``items_wanted``: programs per head
block that fit the GPU at its occupancy, :func:`kvwall.kernels.mla_decode.triton_path.plan_mla_decode_triton`), rounded
up to whole tiles, and at least ``min_chunk`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["TO_THE_END", "WorkList", "build_work_list", "work_list_size"]

#: The end token of a request's last chunk: "to whatever length the request has when the kernel runs".
TO_THE_END = 2**31 - 1


@dataclass(frozen=True)
class WorkList:
    """Items ``(request, lo, hi, partial row)``, the requests the combine merges and their partial rows, the chunk
    size, the most chunks any request got, and the lengths it was planned for."""

    items: tuple[tuple[int, int, int, int], ...]
    combine: tuple[int, ...]
    part_indptr: tuple[int, ...]
    chunk_tokens: int
    max_chunks: int
    lengths: tuple[int, ...]

    @property
    def partial_rows(self) -> int:
        return self.part_indptr[-1]

    def item_tokens(self) -> list[int]:
        """Tokens of each item, at the planned lengths."""
        return [min(hi, self.lengths[b]) - lo for b, lo, hi, _ in self.items]

    def imbalance(self) -> float:
        """The largest item's tokens over the mean item's (1.0: perfectly even)."""
        toks = self.item_tokens()
        mean = sum(toks) / len(toks)
        return max(toks) / mean if mean > 0 else 1.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def build_work_list(
    lengths: Sequence[int],
    *,
    block_n: int,
    items_wanted: int,
    min_chunk: int | None = None,
    max_chunk: int | None = None,
) -> WorkList:
    """The work list for requests of ``lengths`` tokens (see the module docstring). ``block_n``: tokens per tile;
    ``items_wanted``: about how many items (per head block) the GPU runs at once; ``min_chunk`` (default one tile)
    and ``max_chunk`` bound the chunk size."""
    lengths = tuple(int(n) for n in lengths)
    if not lengths:
        raise ValueError("build_work_list: no requests (lengths is empty).")
    if any(n < 0 for n in lengths):
        raise ValueError(f"build_work_list: negative length in {lengths[:8]}.")
    if block_n < 1 or items_wanted < 1:
        raise ValueError(f"build_work_list: block_n ({block_n}) and items_wanted ({items_wanted}) must be >= 1.")
    total = sum(lengths)
    chunk = _cdiv(max(_cdiv(total, items_wanted), 1), block_n) * block_n
    chunk = max(chunk, min_chunk or block_n)
    if max_chunk:
        chunk = min(chunk, max(max_chunk, block_n))
    pieces: list[tuple[int, int, int, int]] = []  # (request, chunk, lo, hi)
    chunks_of: list[int] = []
    for b, n in enumerate(lengths):
        k = max(1, _cdiv(n, chunk))
        per = _cdiv(_cdiv(n, k), block_n) * block_n if n else 0
        k = max(1, _cdiv(n, per)) if per else 1
        chunks_of.append(k)
        for c in range(k):
            pieces.append((b, c, c * per, TO_THE_END if c == k - 1 else (c + 1) * per))
    combine = tuple(b for b, k in enumerate(chunks_of) if k > 1)
    part_indptr = [0]
    first_row = {}
    for b in combine:
        first_row[b] = part_indptr[-1]
        part_indptr.append(part_indptr[-1] + chunks_of[b])
    items = [(b, lo, hi, -1 if chunks_of[b] == 1 else first_row[b] + c) for b, c, lo, hi in pieces]
    size = {i: min(hi, lengths[b]) - lo for i, (b, lo, hi, _) in enumerate(items)}
    order = sorted(range(len(items)), key=lambda i: -size[i])  # longest first; stable among equals
    return WorkList(tuple(items[i] for i in order), combine, tuple(part_indptr), chunk, max(chunks_of), lengths)


def work_list_size(lengths: Sequence[int], *, block_n: int, items_wanted: int) -> tuple[int, int]:
    """``(items, chunk tokens)`` of :func:`build_work_list` for these arguments, by its arithmetic alone (no items
    built, nothing sorted): what a planner trying many ``items_wanted`` needs to compare them."""
    total = sum(lengths)
    chunk = max(_cdiv(max(_cdiv(total, items_wanted), 1), block_n) * block_n, block_n)
    items = 0
    for n in lengths:
        k = max(1, _cdiv(n, chunk))
        per = _cdiv(_cdiv(n, k), block_n) * block_n if n else 0
        items += max(1, _cdiv(n, per)) if per else 1
    return items, chunk
