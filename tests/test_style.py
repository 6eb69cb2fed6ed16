"""The code's style, as `make test` checks it: `ruff check` and `ruff format --check` on the Python (pyproject.toml's
[tool.ruff]), `clang-format` on the CUDA sources (.clang-format), with the environment's pinned tools
(requirements.txt). A failure prints what to run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

#: The environment's scripts (ruff, clang-format), beside the Python running the tests.
BIN = Path(sys.executable).parent
PYTHON = ["lib", "kernels", "tests"]
CUDA = sorted(str(p.relative_to(ROOT)) for pattern in ("*.cu", "*.cuh") for p in (ROOT / "kernels").rglob(pattern))


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    assert (BIN / tool).exists(), f"{tool} is not in {BIN.parent}: run `make setup` (requirements.txt pins it)"
    return subprocess.run([str(BIN / tool), *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize(
    "args,fix",
    [
        (["check", "--no-fix", "--output-format", "concise", *PYTHON], "fix each finding (ruff check names the rule)"),
        (["format", "--check", *PYTHON], "make format"),
    ],
    ids=["ruff-check", "ruff-format"],
)
def test_python(args, fix):
    proc = _run("ruff", *args)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}{proc.stderr[-2000:]}\nto fix: {fix}"


def test_cuda():
    assert CUDA, "no CUDA sources found under kernels/"
    proc = _run("clang-format", "--dry-run", "-Werror", *CUDA)
    assert proc.returncode == 0, f"{proc.stderr[-6000:]}\nto fix: make format"
