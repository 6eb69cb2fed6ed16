"""Shared fixtures: running a chapter under papermill, building the book once per session."""

from __future__ import annotations

import json
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
    import jupytext
    import papermill

    exec_dir = out_dir / "execution"
    os.environ["KVWALL_EXECUTION_DIR"] = str(exec_dir)
    try:
        papermill.execute_notebook(
            jupytext.read(path), str(out_dir / f"{path.stem}.ipynb"), parameters=parameters,
            kernel_name="python3", cwd=str(BOOK), progress_bar=False, execution_timeout=600,
        )
    finally:
        os.environ.pop("KVWALL_EXECUTION_DIR", None)
    return json.loads((exec_dir / f"{path.stem}.json").read_text())


@pytest.fixture(scope="session")
def built_book() -> Path:
    """`make book`, exactly as readers and the publishing workflow run it."""
    env = {**os.environ, "VENV": str(Path(sys.prefix))}
    proc = subprocess.run(["make", "book", f"VENV={sys.prefix}"], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=1200)
    if proc.returncode != 0:
        pytest.fail(f"make book failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    return ROOT / "_build" / "html"
