"""``chapters_gpu_mode``: every chapter executed in GPU mode (``-p mode=gpu``: full scale, live) on a GPU, as a reader
with one would run it: ``python -m kvwall execute`` in a child process, one chapter after another, each timed.

A row per chapter: its exit status, wall-clock seconds, the duration its own record gives, and the sha256 of its
source when it ran -- the reproducibility page compares that hash with the chapter as it is now, so a chapter edited
since its GPU run is marked, not silently credited. ``budget_s`` bounds the whole run (a chapter that would start
past it is recorded as not run); a chapter without a ``mode`` parameter (a page of prose) runs with none.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvwall.results import PROJECT_ROOT, Result, collect_provenance
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "run_chapters_gpu_mode", "chapter_sources", "source_sha"]

_CHAPTER = re.compile(r"\d\d[a-z]?_[A-Za-z0-9_]+\.md")


def chapter_sources(book: Path = PROJECT_ROOT / "book") -> list[Path]:
    """The chapters and their appendix pages, in order (what ``python -m kvwall execute`` takes)."""
    return sorted(p for p in book.glob("*.md") if _CHAPTER.fullmatch(p.name))


def source_sha(path: Path) -> str:
    """sha256 of a chapter's source, as the run saw it."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _takes_mode(path: Path) -> bool:
    return re.search(r"^mode = ", path.read_text(), flags=re.M) is not None


def run_chapters_gpu_mode(device: torch.device, *, chapters: list[str], timeout_s: int, budget_s: int) -> Result:
    """See the module docstring. ``chapters``: file names under ``book/`` (empty: every chapter)."""
    if device.type != "cuda":
        raise RuntimeError("chapters_gpu_mode runs every chapter in GPU mode: it needs an NVIDIA GPU.")
    t0 = time.perf_counter()
    paths = [PROJECT_ROOT / "book" / c for c in chapters] if chapters else chapter_sources()
    rows: list[dict] = [
        {
            "section": "setup",
            "gpu": torch.cuda.get_device_name(device),
            "budget_s": budget_s,
            "timeout_s": timeout_s,
            "chapters": [p.name for p in paths],
        }
    ]
    for path in paths:
        row = {
            "section": "chapter",
            "chapter": path.name,
            "source_sha256": source_sha(path),
            "params": "mode=gpu" if _takes_mode(path) else "",
            "rc": None,
            "seconds": None,
        }
        left = budget_s - (time.perf_counter() - t0)
        if left < 30:
            rows.append({**row, "error": f"not run: the run's budget of {budget_s} s was spent"})
            continue
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "kvwall", "execute", str(path), "--out", out]
            if row["params"]:
                cmd += ["-p", row["params"]]
            start = time.perf_counter()
            try:
                p = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    timeout=min(timeout_s, left),
                    env=dict(os.environ, PYTHONUNBUFFERED="1"),
                    check=False,
                )
                row.update(rc=p.returncode, seconds=round(time.perf_counter() - start, 1))
                if p.returncode:
                    row["error"] = (p.stderr or p.stdout)[-1500:]
                record = Path(out) / "execution" / f"{path.stem}.json"
                if record.is_file():
                    data = json.loads(record.read_text())
                    row.update(
                        duration_s=data.get("duration_s"),
                        mode=data.get("mode"),
                        scale=data.get("scale"),
                        device=data.get("device"),
                    )
            except subprocess.TimeoutExpired:
                row.update(
                    rc=None,
                    seconds=round(time.perf_counter() - start, 1),
                    error=f"stopped at the timeout of {min(timeout_s, left):.0f} s",
                )
        rows.append(row)
    rows[0]["seconds_total"] = round(time.perf_counter() - t0, 1)
    return Result(
        "chapters_gpu_mode",
        dict(chapters=list(chapters), timeout_s=timeout_s, budget_s=budget_s),
        rows,
        collect_provenance(device, __name__),
    )


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "chapters_gpu_mode",
        run_chapters_gpu_mode,
        full=dict(chapters=[], timeout_s=420, budget_s=540),
        small=dict(chapters=["06a_vllm.md"], timeout_s=120, budget_s=120),
        about="every chapter executed in GPU mode (full scale, live), each timed",
        requires=("cuda",),
    ),
]
