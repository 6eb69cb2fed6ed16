"""Where, when and with what a result was measured, and a fingerprint of the code its numbers depend on."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from typing import Any, Iterable
from dataclasses import dataclass, field

import torch

from kvwall.results.fingerprint import source_fingerprint
from kvwall.results.locations import PROJECT_ROOT

__all__ = ["SCALES", "Provenance", "collect_provenance"]

#: "full": GLM-5 shapes on a GPU (what ``python -m kvwall record`` writes); "small": what a CPU runs in seconds.
SCALES = ("full", "small")


@dataclass
class Provenance:
    """``sources``: ``{path: hash}`` of the code the numbers depend on (:mod:`kvwall.results.fingerprint`).
    ``scale``: one of :data:`SCALES`, set by whoever ran the experiment. ``missing``: prerequisites the run
    lacked (recorded anyway, with ``--force``). ``digest``: ``{"seal": sha256, "parts": {part: sha256}}``, the seal
    over the whole file but this digest (:func:`kvwall.results.store.content_digest`), set when the file is written."""

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
    scale: str | None = None
    missing: list[str] = field(default_factory=list)
    digest: dict[str, Any] | None = None

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
        if self.scale == "small":
            parts.append("small scale")
        if self.missing:
            parts.append("recorded without " + ", ".join(self.missing))
        return ", ".join(parts)


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - absent or broken: recorded as unknown
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def collect_provenance(device: torch.device, module_name: str, *, derives: Iterable[str] = ()) -> Provenance:
    """Where, when and with what a result is measured on ``device``.

    ``module_name``: the experiment module's ``__name__``; the code its numbers depend on is that module's
    import closure (:func:`kvwall.results.fingerprint.source_fingerprint`). ``derives``: files (relative to the
    project root) that are derived *from* this result after it is recorded -- its output, not its input -- and so
    are left out of its fingerprint even where its closure reads them (the measured path table the dispatcher
    reads is made from the run that times both paths forced). The scale is stamped by whoever picked it
    (``kvwall.experiments.run_experiment``).
    """
    on_gpu = device.type == "cuda"
    # On a machine that got a copy of the tree (the lent GPU), the caller states commit and state:
    # KVWALL_GIT_COMMIT / KVWALL_GIT_DIRTY win over whatever git finds there.
    commit = os.environ.get("KVWALL_GIT_COMMIT") or _git("rev-parse", "HEAD") or "unknown"
    dirty: bool | None = {"0": False, "1": True}.get(os.environ.get("KVWALL_GIT_DIRTY", ""))
    if dirty is None:
        status = _git("status", "--porcelain", "--untracked-files=no")
        dirty = (status != "") if status is not None else None
    return Provenance(
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        device=str(device),
        gpu=torch.cuda.get_device_name(device) if on_gpu else None,
        driver=_driver_version() if on_gpu else None,
        cuda=torch.version.cuda,
        torch=torch.__version__,
        triton=_version("triton"),
        flashinfer=_version("flashinfer"),
        python=platform.python_version(),
        git_commit=commit,
        git_dirty=dirty,
        sources={k: v for k, v in source_fingerprint(module_name).items() if k not in set(derives)},
    )
