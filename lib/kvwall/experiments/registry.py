"""What an experiment is: a measuring function, its parameters at two scales, and what it needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from kvwall.results import Result

NEEDS = ("cuda", "any")


@dataclass(frozen=True)
class Experiment:
    """``full``: the parameters ``python -m kvwall record`` uses (GLM-5 scale); ``small``: what a CPU
    runs live in seconds. ``needs``: "cuda" (recorded only on a GPU) or "any" (e.g. nvcc builds)."""

    name: str
    run: Callable[..., Result]
    full: dict[str, Any]
    small: dict[str, Any]
    about: str
    needs: str = "cuda"

    def __post_init__(self) -> None:
        if self.needs not in NEEDS:
            raise ValueError(f"Experiment {self.name}: needs={self.needs!r} is not one of {NEEDS}.")
