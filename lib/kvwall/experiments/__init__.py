"""The experiments of the book, by name: what ``python -m kvwall record`` runs and chapters call.

Each chapter's experiments live in their own module of this package, which lists them in a
module-level ``EXPERIMENTS: list[Experiment]``; every such module is picked up here.
"""

from __future__ import annotations

from typing import Any

import torch

import importlib
import pkgutil

from kvwall.results import Result
from kvwall.experiments import decode_profile
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "Experiment", "run_experiment", "short_kernel_name"]

def _discover() -> dict[str, Experiment]:
    found: dict[str, Experiment] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for exp in getattr(module, "EXPERIMENTS", []):
            if exp.name in found:
                raise RuntimeError(f"experiment {exp.name!r} is defined twice (second time in {module.__name__}).")
            found[exp.name] = exp
    return found


EXPERIMENTS: dict[str, Experiment] = _discover()
short_kernel_name = decode_profile.short_kernel_name


def run_experiment(name: str, device: torch.device, scale: str = "full", **overrides: Any) -> Result:
    if name not in EXPERIMENTS:
        raise KeyError(f"unknown experiment {name!r}; known: {sorted(EXPERIMENTS)}.")
    if scale not in ("full", "small"):
        raise ValueError(f"scale {scale!r} is not one of ('full', 'small').")
    exp = EXPERIMENTS[name]
    unknown = set(overrides) - set(exp.full)
    if unknown:
        raise TypeError(f"experiment {name!r} has no parameters {sorted(unknown)}; it takes {sorted(exp.full)}.")
    return exp.run(device, **{**getattr(exp, scale), **overrides})
