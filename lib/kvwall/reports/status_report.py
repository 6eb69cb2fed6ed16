"""The reproducibility page's tables: how each chapter executed in this build, and every recorded run it used,
with the versions each run was made with beside the project's pins.

The pins are read from the requirement files: ``requirements.txt`` (torch), ``requirements-flashinfer.txt``
(FlashInfer) and ``requirements-triton-cpu.txt`` (the Triton a CPU machine gets; on a GPU machine torch's CUDA build
brings its own). Recorded GPU runs used the GPU machine's torch and Triton, which each file's provenance names.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvwall.reports.tables import Table, number
from kvwall.results import AWAITING_FILE, PROJECT_ROOT, Result, awaiting_rerecord, load_result

__all__ = ["executions_table", "pins", "recorded_runs", "versions_table", "runs_table", "versions_text", "build_time_text"]


def pins() -> dict[str, str]:
    """``{package: pinned version}`` for torch, triton (CPU) and flashinfer-python, from the requirement files."""
    out: dict[str, str] = {}
    for name in ("requirements.txt", "requirements-flashinfer.txt", "requirements-triton-cpu.txt"):
        path = PROJECT_ROOT / name
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            m = re.match(r"^\s*(torch|triton|flashinfer-python)==(\S+)", line)
            if m:
                out[m.group(1)] = m.group(2)
    return out


def recorded_runs(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every recorded result the chapters used, once per file, with its provenance and the chapters that used it."""
    by_file: dict[str, dict[str, Any]] = {}
    for r in records:
        for u in r["recorded_used"]:
            entry = by_file.setdefault(u["file"], {**u, "chapters": []})
            if r["chapter"] not in entry["chapters"]:
                entry["chapters"].append(r["chapter"])
    for entry in by_file.values():
        entry["provenance"] = load_result(entry["experiment"]).provenance
    return list(by_file.values())


def _base(version: str | None) -> str:
    return (version or "").split("+")[0]


def _mark(value: str | None, pin: str | None) -> str:
    """The version, bold with the pin beside it where it differs."""
    if not value:
        return "—"
    return value if not pin or _base(value) == pin else f"**{value}** (pin {pin})"


def versions_table(runs: Sequence[Mapping[str, Any]]) -> Table:
    """Per recorded run: the machine and the versions it ran with, each against the pin where one applies."""
    p = pins()
    rows = []
    for r in runs:
        prov = r["provenance"]
        triton_pin = p.get("triton") if prov.device == "cpu" else None  # on a GPU, torch's CUDA build pins Triton
        rows.append({"file": f"`{r['experiment']}`", "machine": prov.gpu or "CPU (no GPU)",
                     "torch": _mark(prov.torch, p.get("torch")), "triton": _mark(prov.triton, triton_pin),
                     "flashinfer": _mark(prov.flashinfer, p.get("flashinfer-python")), "python": prov.python,
                     "cuda": prov.cuda or "—"})
    return Table(rows, {"result": "file", "recorded on": "machine", "torch": "torch", "triton": "triton",
                        "flashinfer": "flashinfer", "python": "python", "CUDA": "cuda"},
                 f"Versions of each recorded run, from its provenance; bold where it differs from the pins "
                 f"(torch {p.get('torch')}, FlashInfer {p.get('flashinfer-python')}; Triton {p.get('triton')} on a "
                 "CPU machine, the Triton torch's CUDA build brings on a GPU machine).")


def executions_table(records: Sequence[Mapping[str, Any]]) -> Table:
    """How each chapter executed in this build: mode and scale, device, start time, seconds; the date, torch and any
    non-default parameters in the caption (so the table stays narrow enough not to clip)."""
    rows = [{"chapter": r["chapter"], "mode": f"{r['mode']}, {r['scale']} scale", "device": r["device"],
             "started": r["started"][11:19], "seconds": r["duration_s"]} for r in records]
    knobs = "; ".join(f"{r['chapter']}: " + ", ".join(f"{k}={v:,}" for k, v in r["knobs"].items())
                      for r in records if r["knobs"])
    caption = (f"Execution of each chapter in this build, {records[0]['started'][:10] if records else '—'} (UTC), "
               f"torch {', '.join(sorted({r['torch'] for r in records})) or '—'}; scale knobs: {knobs or 'none'}.")
    return Table(rows, {"chapter": "chapter", "mode": "mode", "device": "device", "started (UTC)": "started",
                        "seconds": ("seconds", number(1))}, caption)


def runs_table(runs: Sequence[Mapping[str, Any]]) -> Table:
    """Per recorded run: scale, date, commit, staleness and the chapters that used it."""
    awaiting = awaiting_rerecord()

    def stale(r: Mapping[str, Any]) -> str:
        why = awaiting.get(Path(r["file"]).stem)
        return ("**STALE**" + (f": awaiting a re-record ({why})" if why else "")) if r["stale"] else "no"

    rows = [{"file": f"`{r['file']}`", "scale": r["provenance"].scale or "—", "date": r["provenance"].date[:10],
             "commit": f"`{r['provenance'].git_commit[:10]}`" + (" (dirty)" if r["provenance"].git_dirty else ""),
             "stale": stale(r), "chapters": ", ".join(r["chapters"])} for r in runs]
    return Table(rows, {"result file": "file", "scale": "scale", "recorded (UTC)": "date", "commit": "commit",
                        "stale": "stale", "used by": "chapters"},
                 "Recorded runs the chapters loaded, once per file (each file in book/results/); a stale file's code "
                 f"changed since it was recorded (its chapter shows the warning and the files); {AWAITING_FILE} says "
                 "why a stale one was not re-recorded yet.",
                 fold=f"{len(rows)} recorded runs, {sum(1 for r in rows if r['stale'] not in ('', 'no'))} of them stale")


def versions_text(runs: Sequence[Mapping[str, Any]]) -> str:
    """Which torch / Triton the recorded GPU runs used, against the pins, as Markdown."""
    p = pins()
    gpu = [r["provenance"] for r in runs if r["provenance"].device != "cpu"]
    if not gpu:
        return "No recorded GPU run was used in this build."
    pairs = sorted({(g.torch, g.triton or "—") for g in gpu})
    used = "; ".join(f"torch {t} with Triton {tr}" for t, tr in pairs)
    return (f"The {len(gpu)} recorded GPU runs were made with the GPU machine's own {used}, not the pinned torch "
            f"{p.get('torch')} (whose CUDA build brings its own Triton): the pins in `requirements.txt` are what a "
            "reader's machine installs and what the live CPU runs use. Kernel code generated by different Triton "
            "releases can differ (registers, spills), so a GPU number re-measured with the pins may differ from the "
            "recorded one.")


def build_time_text(records: Sequence[Mapping[str, Any]]) -> str:
    """How long the chapters took to execute in this build (measured by each chapter, from its first cell)."""
    total = sum(r["duration_s"] for r in records)
    slowest = max(records, key=lambda r: r["duration_s"])
    return (f"The {len(records)} chapters executed in **{total:,.0f} s** in all in this build (the slowest, "
            f"{slowest['chapter']}, {slowest['duration_s']:,.0f} s), on {slowest['device']}; `make book` adds the "
            "Sphinx build and, on a machine that has never installed them, the FlashInfer releases chapters 2 and 3 "
            "install (the README lists measured times).")


def gpu_mode_table(result: Result) -> Table:
    """Each chapter as ``chapters_gpu_mode`` ran it in GPU mode on a GPU: exit status, seconds, and whether the
    chapter's source changed since (its sha256 then against the file now)."""
    book = PROJECT_ROOT / "book"
    rows = []
    for r in result.rows:
        if r["section"] != "chapter":
            continue
        path = book / r["chapter"]
        now = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        rows.append({"chapter": r["chapter"].removesuffix(".md"), "params": r["params"] or "(prose: none)",
                     "rc": "—" if r["rc"] is None else str(r["rc"]), "seconds": r["seconds"],
                     "ok": ("ran" if r["rc"] == 0 else (r.get("error") or "failed").splitlines()[-1][:120]),
                     "same": "yes" if now == r["source_sha256"] else "edited since"})
    return Table(rows, {"chapter": "chapter", "parameters": "params", "exit status": "rc",
                        "seconds": ("seconds", number(0)), "outcome": "ok", "source as run": "same"},
                 "Every chapter executed headless (`python -m kvwall execute book/<chapter> -p mode=gpu`) on the GPU, "
                 "at full scale, live, one after another. 'edited since': the chapter's source is not the one that "
                 "ran. " + result.caption())
