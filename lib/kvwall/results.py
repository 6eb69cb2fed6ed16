"""Recorded GPU runs: one JSON file per experiment, ``{experiment, params, rows, provenance}``.

These files in ``book/results/`` are the only numbers the book does not compute live. Loading
validates the schema and names the file in every error; a result whose measured sources (the
kernels and the library modules that run on the measured path) changed since the run is
*stale*, and chapters show that with a visible warning. Each experiment names the files its
numbers depend on; their hashes are part of the provenance.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

__all__ = [
    "PROJECT_ROOT", "RESULTS_DIR", "Provenance", "Result", "ResultFileError", "ResultMissingError",
    "collect_provenance", "measured_sources_hashes", "save_result", "load_result",
]

PROJECT_ROOT = Path(__file__).resolve().parents[2]
#: Where recorded results live; KVWALL_RESULTS_DIR points chapters elsewhere (tests use it).
RESULTS_DIR = Path(os.environ.get("KVWALL_RESULTS_DIR", PROJECT_ROOT / "book" / "results"))
SCHEMA = 1


class ResultFileError(ValueError):
    """A result file that is missing, unreadable or not in the expected shape."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(
            f"{path}: {problem}. Result files are written by `python -m kvwall record <experiment>` "
            "(on a GPU for GPU measurements); re-record it, or restore it with `git checkout -- book/results/`."
        )
        self.path = path


def measured_sources_hashes(sources: Iterable[str], root: Path = PROJECT_ROOT) -> dict[str, str]:
    """sha256 of each source file (folders: every source file inside), by path relative to ``root``."""
    out: dict[str, str] = {}
    for entry in sources:
        p = root / entry
        files = sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in {".py", ".cu", ".cuh", ".h"}
                       and "__pycache__" not in q.parts) if p.is_dir() else [p]
        for f in files:
            if not f.is_file():
                continue
            out[str(f.relative_to(root))] = hashlib.sha256(f.read_bytes()).hexdigest()[:16]
    return out


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


@dataclass
class Provenance:
    date: str
    device: str
    gpu: str | None
    driver: str | None
    cuda: str | None
    torch: str
    triton: str | None
    flashinfer: str | None
    python: str
    git_commit: str
    git_dirty: bool | None
    sources: dict[str, str] = field(default_factory=dict)

    def short(self) -> str:
        """One caption line: where, when, with what."""
        where = self.gpu or ("a CPU machine (no GPU)" if self.device == "cpu" else self.device)
        parts = [where, self.date[:10], f"torch {self.torch}"]
        if self.triton:
            parts.append(f"triton {self.triton}")
        if self.flashinfer:
            parts.append(f"flashinfer {self.flashinfer}")
        if self.cuda:
            parts.append(f"CUDA {self.cuda}")
        parts.append(f"commit {self.git_commit[:10]}" + ("+dirty" if self.git_dirty else ""))
        return ", ".join(parts)


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - absent or broken: recorded as unknown
        return None


def collect_provenance(device: torch.device, sources: Iterable[str]) -> Provenance:
    """Where, when and with what a result is measured; ``sources``: the files its numbers depend on."""
    gpu = driver = None
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            driver = None
    # On a machine that got a copy of the tree (the lent GPU), the caller states commit and state:
    # KVWALL_GIT_COMMIT / KVWALL_GIT_DIRTY win over whatever git finds there.
    commit = os.environ.get("KVWALL_GIT_COMMIT") or _git("rev-parse", "HEAD") or "unknown"
    dirty: bool | None = {"0": False, "1": True}.get(os.environ.get("KVWALL_GIT_DIRTY", ""))
    if dirty is None:
        status = _git("status", "--porcelain", "--untracked-files=no")
        dirty = (status != "") if status is not None else None
    return Provenance(
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        device=str(device), gpu=gpu, driver=driver, cuda=torch.version.cuda,
        torch=torch.__version__, triton=_version("triton"), flashinfer=_version("flashinfer"),
        python=platform.python_version(), git_commit=commit, git_dirty=dirty,
        sources=measured_sources_hashes(sources),
    )


@dataclass
class Result:
    experiment: str
    params: dict[str, Any]
    rows: list[dict[str, Any]]
    provenance: Provenance
    path: Path | None = None

    def table(self, section: str) -> list[dict[str, Any]]:
        rows = [r for r in self.rows if r.get("section") == section]
        if not rows:
            sections = sorted({str(r.get("section")) for r in self.rows})
            raise KeyError(f"{self.path or self.experiment}: no rows in section {section!r}; it has {sections}.")
        return rows

    def changed_sources(self, root: Path = PROJECT_ROOT) -> list[str]:
        """Source files this result depends on that differ now (or are gone) from when it was recorded."""
        then = self.provenance.sources
        now = measured_sources_hashes(then, root)
        return sorted(k for k in then if now.get(k) != then[k])

    @property
    def stale(self) -> bool:
        return bool(self.changed_sources())

    def caption(self) -> str:
        text = f"Recorded on {self.provenance.short()} ({self.path.name if self.path else self.experiment})."
        if self.stale:
            text += (" STALE: measured sources changed since this run ("
                     + ", ".join(self.changed_sources()) + "); re-record with `make record`.")
        return text

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "experiment": self.experiment, "params": self.params,
                "rows": self.rows, "provenance": asdict(self.provenance)}


def save_result(result: Result, directory: Path = RESULTS_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result.experiment}.json"
    path.write_text(json.dumps(result.to_json(), indent=1, sort_keys=False) + "\n")
    result.path = path
    return path


class ResultMissingError(ResultFileError):
    """No result file at all (not yet recorded); anything else wrong with a file stays a ResultFileError."""


_TOP_KEYS = {"schema": int, "experiment": str, "params": dict, "rows": list, "provenance": dict}


def load_result(experiment: str, directory: Path = RESULTS_DIR) -> Result:
    """Load and validate ``<directory>/<experiment>.json``."""
    path = Path(directory) / f"{experiment}.json"
    if not path.is_file():
        raise ResultMissingError(path, "no such result file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultFileError(path, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ResultFileError(path, "top level is not a JSON object")
    for key, kind in _TOP_KEYS.items():
        if not isinstance(data.get(key), kind):
            raise ResultFileError(path, f"field {key!r} missing or not a {kind.__name__}")
    if data["schema"] != SCHEMA:
        raise ResultFileError(path, f"schema {data['schema']} but this code reads schema {SCHEMA}")
    if data["experiment"] != experiment:
        raise ResultFileError(path, f"says experiment {data['experiment']!r}, expected {experiment!r}")
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict) or not isinstance(row.get("section"), str):
            raise ResultFileError(path, f"row {i} is not an object with a 'section' string")
    try:
        prov = Provenance(**data["provenance"])
    except TypeError as exc:
        raise ResultFileError(path, f"provenance does not match the expected fields ({exc})") from None
    if not isinstance(prov.sources, dict) or not prov.git_commit or not prov.date:
        raise ResultFileError(path, "provenance lacks sources, git_commit or date")
    return Result(data["experiment"], data["params"], data["rows"], prov, path)
