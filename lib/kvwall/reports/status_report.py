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

from kvwall.results import PROJECT_ROOT, Result, awaiting_rerecord, load_result

__all__ = ["pins", "recorded_runs", "version_rows", "run_rows", "gpu_versions", "build_time", "gpu_mode_rows"]

#: The requirement files the pins are read from, and the packages pinned.
_PIN_FILES, _PINNED = ("requirements.txt", "requirements-flashinfer.txt", "requirements-triton-cpu.txt"), re.compile(
    r"^\s*(torch|triton|flashinfer-python)==(\S+)")


def pins() -> dict[str, str]:
    """``{package: pinned version}`` for torch, triton (CPU) and flashinfer-python, from the requirement files."""
    paths = [PROJECT_ROOT / name for name in _PIN_FILES]
    return {m.group(1): m.group(2) for path in paths if path.is_file() for line in path.read_text().splitlines()
            for m in [_PINNED.match(line)] if m}


def recorded_runs(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every recorded result the chapters used, once per file, with its provenance and the chapters that used it."""
    by_file: dict[str, dict[str, Any]] = {}
    for r in records:
        for u in r["recorded_used"]:
            entry = by_file.setdefault(u["file"], {**u, "chapters": []})
            entry["chapters"] += [r["chapter"]] if r["chapter"] not in entry["chapters"] else []
    return [{**e, "provenance": load_result(e["experiment"]).provenance} for e in by_file.values()]


def _mark(value: str | None, pin: str | None) -> str:
    """The version, bold with the pin beside it where it differs."""
    differs = value and pin and (value or "").split("+")[0] != pin
    return f"**{value}** (pin {pin})" if differs else value or "—"


def version_rows(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per recorded run, its experiment and provenance, and the versions it ran with as table cells: each against the
    pin where one applies (Triton's only on a CPU machine: on a GPU, torch's CUDA build pins Triton)."""
    p = pins()
    return [{"experiment": r["experiment"], "provenance": r["provenance"], "torch": _mark(r["provenance"].torch, p.get("torch")),
             "triton": _mark(r["provenance"].triton, p.get("triton") if r["provenance"].device == "cpu" else None),
             "flashinfer": _mark(r["provenance"].flashinfer, p.get("flashinfer-python"))} for r in runs]


def run_rows(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per recorded run, with ``awaiting``: why a stale one was not re-recorded yet (AWAITING_RERECORD.txt; None)."""
    awaiting = awaiting_rerecord()
    return [{**r, "awaiting": awaiting.get(Path(r["file"]).stem)} for r in runs]


def gpu_versions(runs: Sequence[Mapping[str, Any]]) -> tuple[int, list[tuple[str, str | None]]]:
    """How many of the recorded runs were made on a GPU, and the (torch, Triton) pairs they used."""
    gpu = [r["provenance"] for r in runs if r["provenance"].device != "cpu"]
    return len(gpu), sorted({(g.torch, g.triton) for g in gpu}, key=str)


def build_time(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """How long the chapters took to execute in this build (each measured from its first cell): their number, the
    total seconds, and the slowest chapter's record; None without records."""
    if not records:
        return None
    return {"chapters": len(records), "total_s": sum(r["duration_s"] for r in records),
            "slowest": max(records, key=lambda r: r["duration_s"])}


def gpu_mode_rows(result: Result) -> list[dict[str, Any]]:
    """Each chapter as ``chapters_gpu_mode`` ran it in GPU mode on a GPU, with ``same``: whether the chapter's
    source is still the one that ran (its sha256 then against the file now)."""
    book, out = PROJECT_ROOT / "book", []
    for r in result.table("chapter"):
        path = book / r["chapter"]
        now = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        out.append({**r, "same": now == r["source_sha256"]})
    return out
