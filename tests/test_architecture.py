"""The library's shape is a checked contract, not a hope.

- The layers (``[tool.importlinter]`` in pyproject.toml): each layer of ``kvwall`` imports only from layers
  below it. ``kvwall.kernels`` lives in the top-level ``kernels/`` folder (a setuptools package-dir), which
  import-linter cannot see as part of ``kvwall``; the test therefore lints a copy of the package with
  ``kernels/`` placed where Python finds it at run time.
- No repeated code: pylint's duplicate-code check (6 or more similar lines, imports, docstrings and comments
  ignored) is clean on ``lib/`` and ``kernels/``; so is a check of the same threshold over the CUDA sources.
- No module over ~500 lines, unless it is one kernel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import background_job

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "lib" / "kvwall"
KERNELS = ROOT / "kernels"
#: In ruff-formatted lines. The limit was 500 before `ruff format` (issue 36), whose one-argument-a-line calls made the
#: same modules up to 47 % longer (experiments/gather_cast.py: 490 -> 720 lines) without adding code.
MAX_LINES = 750
#: Modules allowed past MAX_LINES: each is one kernel (its Triton source and launcher).
ONE_KERNEL = {KERNELS / "gather" / "kernel.py"}


def _bin(name: str) -> str:
    path = Path(sys.executable).with_name(name)
    if not path.exists():
        pytest.fail(f"{name} is not installed in {path.parent}: run `make setup` (it comes from requirements.txt).")
    return str(path)


def _package_view(tmp_path: Path) -> Path:
    view = tmp_path / "view"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(LIBRARY, view / "kvwall", ignore=ignore)
    shutil.copytree(KERNELS, view / "kvwall" / "kernels", ignore=ignore)
    return view


def test_layers_contract(tmp_path):
    view = _package_view(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(view)}
    proc = subprocess.run(
        [_bin("lint-imports"), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=view,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # quoted: import-linter's report
    assert "Contracts: 1 kept, 0 broken." in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_a_higher_layer_import_breaks_the_contract(tmp_path):
    """The contract can fail: a model module importing the notebook layer is reported as broken."""
    view = _package_view(tmp_path)
    pool = view / "kvwall" / "model" / "pool.py"
    pool.write_text(pool.read_text() + "\nimport kvwall.reports.tables  # a layer violation\n")
    env = {**os.environ, "PYTHONPATH": str(view)}
    proc = subprocess.run(
        [_bin("lint-imports"), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=view,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # quoted: import-linter's report
    assert proc.returncode != 0 and "kvwall.model.pool -> kvwall.reports.tables" in proc.stdout, proc.stdout[-3000:]


#: Lines a CUDA source may repeat of another's before the repetition counts (pylint's threshold for Python).
CUDA_MIN_SIMILAR = 6


def _cuda_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, the line with comments and spacing dropped) of each non-trivial line of a CUDA source: not
    blank, not a lone brace or ``#pragma``, not a comment."""
    kept = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        code = " ".join(line.split("//")[0].split())
        if code and not code.startswith("#pragma") and code.strip("{}();, ") and not code.startswith("*"):
            kept.append((number, code))
    return kept


def cuda_repeats(paths: list[Path], least: int = CUDA_MIN_SIMILAR) -> list[str]:
    """Runs of ``least`` or more consecutive non-trivial lines one CUDA source repeats of another, as
    ``"a.cu:12 = b.cu:40 (n lines)"``."""
    seen: dict[tuple[str, ...], tuple[Path, int]] = {}
    found = []
    for path in paths:
        lines = _cuda_lines(path)
        for i in range(len(lines) - least + 1):
            window = tuple(code for _, code in lines[i : i + least])
            first = seen.setdefault(window, (path, lines[i][0]))
            if first[0] != path:
                found.append(f"{first[0].name}:{first[1]} = {path.name}:{lines[i][0]} ({least} lines)")
    return found


@background_job
def pylint_duplicate_code(out: Path) -> subprocess.CompletedProcess:
    """pylint's duplicate-code check of the library and the kernels (~12 s of CPU): a background job."""
    return subprocess.run(
        [
            _bin("pylint"),
            "--disable=all",
            "--enable=duplicate-code",
            # 10 formatted lines: 6 before `ruff format`, which writes one argument a line where a call does not fit
            "--min-similarity-lines=10",
            "--ignore-signatures=yes",
            "--ignore-imports=yes",
            "--ignore-docstrings=yes",
            "--ignore-comments=yes",
            "--score=no",
            str(LIBRARY),
            str(KERNELS),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_no_duplicate_code(background):
    """pylint's check on the Python; on the CUDA sources (``kernels/**/*.cu``, ``*.cuh``) a line-window check of the
    same threshold across files (what two kernels share belongs in a header)."""
    cuda = sorted([*KERNELS.rglob("*.cu"), *KERNELS.rglob("*.cuh")])
    assert cuda and not cuda_repeats(cuda), cuda_repeats(cuda)[:20]
    proc = background(pylint_duplicate_code)
    assert proc.returncode == 0 and "R0801" not in proc.stdout, proc.stdout[-6000:]


def test_modules_stay_small():
    too_long = {}
    for path in sorted([*LIBRARY.rglob("*.py"), *KERNELS.rglob("*.py")]):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES and path not in ONE_KERNEL:
            too_long[str(path.relative_to(ROOT))] = lines
    assert not too_long, f"modules over {MAX_LINES} lines (split them by concern): {too_long}"
