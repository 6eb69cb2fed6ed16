"""Chapter 3's reading of the door matrix: the replays counted per path and GPU family, GPU calls that stopped on a
missing download rather than on a check (set aside, and noted in the matrix's evidence), and XQA asked the way
GLM-5 would have to use it on SM120. Chapter 3 writes the sentences and tables around them.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from kvwall.peers.flashinfer.doors import DoorCase
from kvwall.peers.flashinfer.replay import replay_cases
from kvwall.reports.rows import Row

#: Messages FlashInfer gives when a trtllm-gen artifact (cubin, checksums, header) could not be loaded or fetched:
#: ``jit/attention/modules.py`` asserts on an empty ``get_artifact`` result, ``jit/cubin_loader.py`` raises under
#: ``FLASHINFER_NO_DOWNLOAD``.
MISSING_DOWNLOAD = ("Failed to get checksums.txt", "Artifact not found locally", "FLASHINFER_NO_DOWNLOAD")


def is_missing_download(row: Mapping[str, Any]) -> bool:
    """A call that stopped because FlashInfer could not fetch a run-time artifact (no network), not on a check."""
    row = Row(row)
    return row.outcome == "refused" and any(m in (row.message or "") for m in MISSING_DOWNLOAD)


def replay_counts(replays: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, tuple[int, int]]]:
    """The replays counted, per path and GPU family (in the replays' order): how many of the path's calls (head
    counts, page sizes, query dtypes) reached the kernel module, of how many replayed; a family a path was not
    replayed for is absent."""
    counts: dict[str, dict[str, tuple[int, int]]] = {}
    for r in map(Row, replays):
        reached, n = counts.setdefault(r.door, {}).get(r.family, (0, 0))
        counts[r.door][r.family] = (reached + (r.outcome == "kernel_reached"), n + 1)
    return counts


def calls_for_matrix(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """GPU calls for :func:`~kvwall.peers.flashinfer.doors.door_matrix`, with the missing downloads set aside
    (``skipped``): such a call says nothing about the path, so its cell rests on the next evidence (a cited check,
    or the replay)."""
    return [dict(r, outcome="skipped") if is_missing_download(r) else dict(r) for r in calls]


def note_missing_downloads(cells: list[dict[str, Any]], calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Add, to each cell whose GPU calls stopped on a missing download, evidence saying so."""
    for c in map(Row, cells):
        missing = [r for r in map(Row, calls) if (r.door, r.family) == (c.door, c.family) and is_missing_download(r)]
        if missing:
            pages = ", ".join(sorted({f"{r.heads} heads / page {r.page_size}" for r in missing}))
            c.evidence.append(
                dict(
                    kind="gpu",
                    where=missing[0].get("where", ""),
                    text=f"the H200 call ({pages}) stopped before the kernel because FlashInfer could "
                    "not download its trtllm-gen cubins offline: not an answer about this path",
                )
            )
    return cells


def xqa_padded_replays() -> list[dict[str, Any]]:
    """XQA on SM120 asked the way it would have to be used for GLM-5: the query padded to 128 heads, in FP8 (and,
    for contrast, padded but BF16), at SGLang's FP8 page size 64. A replay of the release's checks (kernel stubbed)."""
    cases = [DoorCase("xqa", 128, 64, q_dtype=q, family="SM120") for q in ("float8_e4m3fn", "bfloat16")]
    return replay_cases(cases)["rows"]
