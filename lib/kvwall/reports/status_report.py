"""The reproducibility page's numbers: how each chapter executed in this build, and every recorded run it used,
with the versions each run was made with beside the project's pins. The page writes the sentences and tables.

The pins are read from the requirement files: ``requirements.txt`` (torch), ``requirements-flashinfer.txt``
(FlashInfer) and ``requirements-triton-cpu.txt`` (the Triton a CPU machine gets; on a GPU machine torch's CUDA build
brings its own). Recorded GPU runs used the GPU machine's torch and Triton, which each file's provenance names.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvwall.experiments.gpu_tests import file_sha256
from kvwall.reports.rows import Row as _Row
from kvwall.results import PROJECT_ROOT, Result, awaiting_rerecord, load_result

#: The requirement files the pins are read from, and the packages pinned.
_PIN_FILES, _PINNED = (
    ("requirements.txt", "requirements-flashinfer.txt", "requirements-triton-cpu.txt"),
    re.compile(r"^\s*(torch|triton|flashinfer-python)==(\S+)"),
)


def pins() -> dict[str, str]:
    """``{package: pinned version}`` for torch, triton (CPU) and flashinfer-python, from the requirement files."""
    paths = [PROJECT_ROOT / name for name in _PIN_FILES]
    return {
        m.group(1): m.group(2)
        for path in paths
        if path.is_file()
        for line in path.read_text().splitlines()
        for m in [_PINNED.match(line)]
        if m
    }


def recorded_runs(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every recorded result the chapters used, once per file, with its provenance and the chapters that used it."""
    by_file: dict[str, _Row] = {}
    for r in map(_Row, records):
        for u in map(_Row, r.recorded_used):
            entry = by_file.setdefault(u.file, _Row(u, chapters=[]))
            entry.chapters += [r.chapter] if r.chapter not in entry.chapters else []
    return [_Row(e, provenance=load_result(e.experiment).provenance) for e in by_file.values()]


def _mark(value: str | None, pin: str | None) -> str:
    """The version, bold with the pin beside it where it differs."""
    differs = value and pin and value.split("+")[0] != pin
    return f"**{value}** (pin {pin})" if differs else value or "—"


def version_rows(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per recorded run, its experiment and provenance, and the versions it ran with as table cells (``torch``,
    ``triton``, ``flashinfer``): each against the pin where one applies (Triton's only on a CPU machine: on a GPU,
    torch's CUDA build pins Triton)."""
    torch_pin, triton_pin, flashinfer_pin = (pins().get(k) for k in ("torch", "triton", "flashinfer-python"))
    return [
        _Row(
            r,
            torch=_mark(r.provenance.torch, torch_pin),
            triton=_mark(r.provenance.triton, triton_pin if r.provenance.device == "cpu" else None),
            flashinfer=_mark(r.provenance.flashinfer, flashinfer_pin),
        )
        for r in map(_Row, runs)
    ]


def run_rows(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per recorded run, with ``awaiting``: why a stale one was not re-recorded yet (AWAITING_RERECORD.txt; None)."""
    awaiting = awaiting_rerecord()
    return [_Row(r, awaiting=awaiting.get(Path(r.file).stem)) for r in map(_Row, runs)]


def gpu_versions(runs: Sequence[Mapping[str, Any]]) -> tuple[int, list[tuple[str, str | None]]]:
    """How many of the recorded runs were made on a GPU, and the (torch, Triton) pairs they used."""
    gpu = [p for p in (_Row(r).provenance for r in runs) if p.device != "cpu"]
    return len(gpu), sorted({(g.torch, g.triton) for g in gpu}, key=str)


def build_time(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """How long the chapters took to execute in this build (each measured from its first cell): their number
    (``chapters``), the total seconds (``total_s``), and the slowest chapter's record (``slowest``); None without
    records."""
    rows = [_Row(r) for r in records]
    if not rows:
        return None
    return dict(
        chapters=len(rows), total_s=sum(r.duration_s for r in rows), slowest=max(rows, key=lambda r: r.duration_s)
    )


def gpu_mode_rows(result: Result) -> list[dict[str, Any]]:
    """Each chapter as ``chapters_gpu_mode`` ran it in GPU mode on a GPU, with ``same``: whether the chapter's
    source is still the one that ran (its sha256 then against the file now)."""
    book = PROJECT_ROOT / "book"
    rows = [(r, book / r.chapter) for r in map(_Row, result.table("chapter"))]
    return [
        _Row(r, same=path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == r.source_sha256)
        for r, path in rows
    ]


def gpu_test_rows(result: Result) -> list[dict[str, Any]]:
    """Each test file as ``gpu_tests`` ran it on a GPU, with ``same``: True or False where the run kept the file's
    sha256 (as it ran, against the file now), None where it did not."""
    return [
        _Row(r, same=None if r.sha256 is None else file_sha256(PROJECT_ROOT / r.file) == r.sha256)
        for r in map(_Row, result.table("file"))
    ]


def gpu_test_totals(result: Result) -> dict[str, int]:
    """Tests passed, failed (errors included) and skipped over every file of a ``gpu_tests`` run."""
    rows = result.table("file")
    return {k: sum(r[k] for r in rows) for k in ("passed", "failed", "errors", "skipped")}
