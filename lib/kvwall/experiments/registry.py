"""What an experiment is: a measuring function, its parameters at two scales, what it needs, what it writes.

Besides its result file, an experiment may write files others read (the dispatcher's ``kernel_paths.json``):
``after_record(result)`` writes them right after the result is recorded and returns their paths, so that
``python -m kvwall record`` (which calls it) records what depends on them after it, in the same run.

``requires`` names the prerequisites a run needs from :data:`PREREQUISITES`; :func:`missing_prerequisites`
says which of them this machine lacks, so ``python -m kvwall record`` can refuse before running anything.
Each experiment's rows have a typed schema (:mod:`kvwall.experiments.schemas`), looked up by its name.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import urlparse

import torch

from kvwall.experiments.schemas import ROW_SCHEMAS
from kvwall.results import Result

__all__ = ["PREREQUISITES", "Experiment", "missing_prerequisites"]


def _cuda() -> str | None:
    return None if torch.cuda.is_available() else "no CUDA GPU visible to torch"


def _on_path(tool: str) -> Callable[[], str | None]:
    return lambda: None if shutil.which(tool) else f"`{tool}` not found on PATH"


def _flashinfer() -> str | None:
    return None if importlib.util.find_spec("flashinfer") else "the flashinfer package is not installed"


def _network() -> str | None:
    if os.environ.get("KVWALL_WHEELHOUSE"):
        return None  # installs come from a local folder of wheels
    url = urlparse(os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple"))
    host, port = url.hostname or "pypi.org", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=5).close()
        return None
    except OSError as exc:
        return f"the package index {host}:{port} is unreachable ({exc}); set KVWALL_WHEELHOUSE to install offline"


#: Prerequisite -> a check that returns None when this machine has it, else why not.
PREREQUISITES: dict[str, Callable[[], str | None]] = {
    "cuda": _cuda,
    "nvcc": _on_path("nvcc"),
    "flashinfer": _flashinfer,
    "network": _network,
    "ncu": _on_path("ncu"),
    "compute-sanitizer": _on_path("compute-sanitizer"),
}


@dataclass(frozen=True)
class Experiment:
    """``full``: the parameters ``python -m kvwall record`` uses (GLM-5 scale); ``small``: what a CPU runs
    live in seconds. ``requires``: prerequisites from :data:`PREREQUISITES` ("cuda" for GPU measurements;
    an experiment that needs none, e.g. source citations, runs anywhere). ``after_record``: what ``record`` calls
    with the recorded result to write the files other code reads (it returns their paths); None: nothing."""

    name: str
    run: Callable[..., Result]
    full: dict[str, Any]
    small: dict[str, Any]
    about: str
    requires: tuple[str, ...]
    after_record: Callable[[Result], list[Path]] | None = None

    def __post_init__(self) -> None:
        unknown = [r for r in self.requires if r not in PREREQUISITES]
        if unknown:
            raise ValueError(f"Experiment {self.name}: requires {unknown}, not among {sorted(PREREQUISITES)}.")
        if self.name not in ROW_SCHEMAS:
            raise ValueError(f"Experiment {self.name} has no row schema: add one to kvwall.experiments.schemas.")

    @property
    def rows(self) -> Any:
        """The type of one row of this experiment's result (a union of section models)."""
        return ROW_SCHEMAS[self.name]


def missing_prerequisites(requires: Iterable[str]) -> dict[str, str]:
    """``{prerequisite: why it is missing}`` for each of ``requires`` this machine lacks (each checked once)."""
    found = {r: PREREQUISITES[r]() for r in dict.fromkeys(requires)}
    return {r: why for r, why in found.items() if why is not None}
