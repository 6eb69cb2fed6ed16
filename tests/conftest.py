"""Shared fixtures: running a chapter under papermill, building the book once per session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
CHAPTERS = sorted(p for p in BOOK.glob("[0-9][0-9]_*.md"))


def run_chapter(path: Path, out_dir: Path, **parameters) -> dict:
    """Execute a MyST chapter with papermill (as CI and readers do) and return its execution record."""
    from kvwall.notebooks import execute_chapter

    return execute_chapter(path, out_dir, **parameters)


@pytest.fixture(scope="session")
def built_book() -> Path:
    """`make book`, exactly as readers and the publishing workflow run it."""
    env = {**os.environ, "VENV": str(Path(sys.prefix))}
    proc = subprocess.run(["make", "book", f"VENV={sys.prefix}"], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=1200)
    if proc.returncode != 0:
        pytest.fail(f"make book failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    return ROOT / "_build" / "html"
