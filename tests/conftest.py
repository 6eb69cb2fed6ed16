"""Shared fixtures: running a chapter under papermill, building the book once per session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvwall.peers.flashinfer.sources import find_definition, include_dir

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
CHAPTERS = sorted(p for p in BOOK.glob("[0-9][0-9]_*.md"))


def run_chapter(path: Path, out_dir: Path, **parameters) -> dict:
    """Execute a MyST chapter with papermill (as CI and readers do) and return its execution record, after checking
    what its outputs show a reader (tests/rendered_checks.py: no unformatted placeholder, ratio columns that say
    their direction, no long table inline, CPU-live figures titled as such)."""
    from kvwall.notebook.execute import execute_chapter
    from rendered_checks import notebook_problems

    record = execute_chapter(path, out_dir, **parameters)
    problems = notebook_problems(Path(out_dir) / f"{Path(path).stem}.ipynb")
    assert not problems, "what the executed chapter shows a reader is wrong:\n" + "\n".join(problems)
    return record


@pytest.fixture(scope="session")
def built_book() -> Path:
    """`make book`, exactly as readers and the publishing workflow run it."""
    env = {**os.environ, "VENV": str(Path(sys.prefix))}
    proc = subprocess.run(["make", "book", f"VENV={sys.prefix}"], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=1200)
    if proc.returncode != 0:
        pytest.fail(f"make book failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    return ROOT / "_build" / "html"


#: Test modules whose CPU tests run the Triton kernels in Triton's interpreter.
INTERPRETER_MODULES = {"test_gather_cast.py", "test_mla_decode_fp8.py", "test_ours.py"}


def _interpreter_gap() -> str:
    """Why this Triton's CPU interpreter cannot run the kernels ('' when it can).

    Triton 3.7's interpreter has no bfloat16 constants (InterpreterBuilder.get_bf16); 3.9 does. On GPU
    machines torch pins its own Triton (torch 2.13.0 -> 3.7.1), so there the interpreter tests skip
    and the GPU tests of the same kernels run instead.
    """
    import triton

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) < (3, 9):
        return (f"Triton {triton.__version__}'s CPU interpreter cannot run these kernels (no bfloat16 constants "
                "before 3.9; requirements-triton-cpu.txt pins 3.9.0 on machines without a GPU)")
    return ""


def pytest_collection_modifyitems(config, items):
    gap = None
    for item in items:
        if item.path.name in INTERPRETER_MODULES and "gpu" not in item.keywords:
            gap = _interpreter_gap() if gap is None else gap
            if gap:
                item.add_marker(pytest.mark.skip(reason=gap))


def static_assert_line(release: str) -> int:
    """The line of ``static_assert(sizeof(DType) == 2`` inside ``m16k16_rowsum_f16f16f32``, read from the
    installed release's own ``mma.cuh`` (never typed into a test)."""
    locs = find_definition(release, "mma::m16k16_rowsum_f16f16f32")
    assert len(locs) == 1 and locs[0].file == "flashinfer/mma.cuh", locs
    src = (include_dir(release) / "flashinfer" / "mma.cuh").read_text().splitlines()
    for n in range(locs[0].line, locs[0].line + 10):
        if "static_assert(sizeof(DType) == 2" in src[n - 1]:
            return n
    raise AssertionError("no static_assert(sizeof(DType) == 2) in m16k16_rowsum_f16f16f32")


def go_offline(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """What a fresh machine without network has: an empty FlashInfer release cache at ``cache``, and a
    pip whose index and proxies refuse every connection (no wheelhouse either)."""
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("KVWALL_CACHE", str(cache))
    monkeypatch.delenv("KVWALL_WHEELHOUSE", raising=False)
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)


def hopper() -> bool:
    """An H100 / H200 is here: the only GPUs sm_90a code (the wgmma paths) runs on."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def on_hopper(test):
    """A GPU test of an sm_90a kernel: marked ``gpu`` and skipped, saying why, without an H100 / H200."""
    return pytest.mark.gpu(pytest.mark.skipif(not hopper(), reason="needs an H100 / H200 (sm_90a code)")(test))
