"""What every chapter does first and last: check its parameters, pick its world, and say how it ran.

A chapter's ``parameters`` cell (papermill) sets ``mode`` ("auto", "gpu" or "cpu"), its scale
knobs and ``record``; :func:`start_chapter` validates them before anything else runs, so a bad
value stops the notebook in its first cell with a message naming the allowed values. At the end
:meth:`ChapterRun.finish` writes a small JSON of how the chapter executed and the values it
computed: the tests assert on it and ``book/reproducibility.md`` lists it.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import os
import platform
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kvwall.experiments import EXPERIMENTS, run_experiment
from kvwall.reports.plots import LIVE_CAPTION
from kvwall.reports.tables import show_markdown
from kvwall.results import PROJECT_ROOT, Result, ResultMissingError, load_result, save_result

MODES = ("auto", "gpu", "cpu")


def execution_dir() -> Path:
    """Where chapters write how they executed (``KVWALL_EXECUTION_DIR``, else ``_build/execution``)."""
    return Path(os.environ.get("KVWALL_EXECUTION_DIR", PROJECT_ROOT / "_build" / "execution"))


def _device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


@dataclass
class ChapterRun:
    """One execution of a chapter: its resolved world and knobs, and the recorded results it used."""

    chapter: str
    mode: str  # resolved: "gpu" or "cpu"
    device: torch.device
    record: bool
    knobs: dict[str, Any]
    started: float = field(default_factory=time.time)
    recorded_used: list[dict[str, Any]] = field(default_factory=list)

    @property
    def scale(self) -> str:
        """GPU chapters measure at full scale; CPU chapters at small scale."""
        return "full" if self.mode == "gpu" else "small"

    def live_caption(self, detail: str = "") -> str:
        """The provenance line of a number measured live in this run."""
        detail = f"; {detail}" if detail else ""
        return (
            f"{LIVE_CAPTION}: {_device_description(self.device)}, {self.scale} scale{detail}, "
            f"torch {torch.__version__}."
        )

    def measure(self, experiment: str, **overrides: Any) -> Result:
        """Run an experiment live at this chapter's scale; with ``record=True`` also save it. Where
        ``KVWALL_LIVE_DIR`` names a folder, the live run is also saved there, as a result file (the tests read a
        chapter's live runs from it instead of running the same experiment again: tests/conftest.py)."""
        result = run_experiment(experiment, self.device, self.scale, **overrides)
        if os.environ.get("KVWALL_LIVE_DIR"):  # a copy: saving sets the path (and seal) of what it saves
            save_result(replace(result, provenance=replace(result.provenance)), Path(os.environ["KVWALL_LIVE_DIR"]))
        if self.record:
            save_result(result)
        return result

    def recorded(self, experiment: str) -> Result:
        """Load a recorded GPU run, note that this chapter used it, and warn visibly if stale."""
        result = load_result(experiment)
        path = result.path.relative_to(PROJECT_ROOT) if result.path.is_relative_to(PROJECT_ROOT) else result.path
        self.recorded_used.append(
            dict(experiment=experiment, file=str(path), caption=result.caption(), stale=result.stale)
        )
        if result.stale:
            _show_warning(f"Stale recorded result. {result.caption()}")
        return result

    def recorded_or_none(self, experiment: str) -> Result | None:
        """:meth:`recorded`, or None with a visible note where that experiment has not been recorded yet.

        Only a missing file is "not recorded yet": an edited, truncated or unreadable one still raises
        :class:`~kvwall.results.ResultFileError`, naming the file."""
        try:
            return self.recorded(experiment)
        except ResultMissingError as exc:
            show_markdown(f"**Not recorded yet.** There is no recorded GPU run of `{experiment}`: {exc}")
            return None

    def finish(self, values: dict[str, Any]) -> Path:
        """Write how this chapter executed, and the values it computed, for tests and the status page."""
        out = execution_dir()
        out.mkdir(parents=True, exist_ok=True)
        started = _dt.datetime.fromtimestamp(self.started, _dt.timezone.utc)
        record = dict(
            chapter=self.chapter,
            mode=self.mode,
            device=_device_description(self.device),
            scale=self.scale,
            knobs=self.knobs,
            record=self.record,
            started=started.isoformat(timespec="seconds"),
            duration_s=round(time.time() - self.started, 1),
            torch=torch.__version__,
            recorded_used=self.recorded_used,
            values=values,
        )
        path = out / f"{self.chapter}.json"
        path.write_text(json.dumps(record, indent=1, default=float) + "\n")
        return path


def _show_warning(text: str) -> None:
    """A visible warning box (the theme's admonition style in the book; plain HTML in JupyterLab)."""
    from IPython.display import HTML, display  # pylint: disable=import-outside-toplevel

    display(
        HTML(
            '<div class="admonition warning" style="border-left:4px solid #e0a800;padding:0.4em 0.8em">'
            f'<p class="admonition-title"><b>Warning</b></p><p>{html.escape(text)}</p></div>'
        )
    )


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer (or None for the mode's default).")
    return value


def step_knobs(experiment: str) -> dict[str, dict[str, int]]:
    """The scale knobs of a chapter built on a decode-step experiment (``pool_tokens``, ``layers``,
    ``context_len``), per world, from that experiment's full and small parameters."""
    exp = EXPERIMENTS[experiment]
    return {
        world: {"pool_tokens": p["pool_tokens"], "layers": p["layers"], "context_len": p["context_lens"][0]}
        for world, p in (("gpu", exp.full), ("cpu", exp.small))
    }


def start_chapter(
    chapter: str, *, mode: str, record: bool, defaults: dict[str, dict[str, Any]], **knobs: Any
) -> ChapterRun:
    """Validate a chapter's parameters and resolve its world.

    ``defaults`` maps "gpu"/"cpu" to the scale knobs' defaults; a knob given as None takes the
    mode's default. Knobs must be positive integers.
    """
    if mode not in MODES:
        raise ValueError(
            f"mode={mode!r} is not allowed: use one of {', '.join(map(repr, MODES))} "
            "('auto' picks 'gpu' when a CUDA device is present, else 'cpu')."
        )
    if not isinstance(record, bool):
        raise ValueError(f"record={record!r} must be True or False.")
    has_gpu = torch.cuda.is_available()
    if mode == "gpu" and not has_gpu:
        raise ValueError("mode='gpu' but this machine has no CUDA device: use mode='cpu' or 'auto'.")
    resolved = mode if mode != "auto" else ("gpu" if has_gpu else "cpu")
    if record and resolved != "gpu":
        raise ValueError("record=True writes full-scale GPU results into book/results/: it needs mode='gpu'.")
    unknown = set(knobs) - set(defaults[resolved])
    if unknown:
        raise ValueError(f"unknown parameters {sorted(unknown)}; this chapter takes {sorted(defaults[resolved])}.")
    values = {k: _positive_int(k, knobs[k]) if knobs.get(k) is not None else v for k, v in defaults[resolved].items()}
    _setup_plotly()
    device = torch.device("cuda" if resolved == "gpu" else "cpu")
    return ChapterRun(chapter, resolved, device, record, values)


def _setup_plotly() -> None:
    import plotly.io as pio

    # Renders offline in the built site (Jupyter Book) and interactively in JupyterLab.
    pio.renderers.default = "plotly_mimetype+notebook"


def load_execution_records(directory: Path | None = None) -> list[dict[str, Any]]:
    directory = directory or execution_dir()
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))] if directory.is_dir() else []
