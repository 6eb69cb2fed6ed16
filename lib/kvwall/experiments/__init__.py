"""The experiments of the book, by name: what ``python -m kvwall record`` runs and chapters call.

Each chapter's experiments live in their own module of this package, which lists them in a
module-level ``EXPERIMENTS: list[Experiment]``; :data:`CHAPTER_MODULES` names those modules
explicitly, in the order the book (and ``record all``) takes them. Importing this package registers
every experiment's row schema with :mod:`kvwall.results`, so results load and save validated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvwall.experiments import (
    accuracy,
    answer,
    chapters,
    chapters_rest,
    decode_profile,
    doors,
    dsa,
    dsa_forced,
    fused_decode,
    gather_cast,
    gpu_tests,
    multi_token,
    sglang_patch,
    wall,
)
from kvwall.experiments.registry import PREREQUISITES, Experiment, missing_prerequisites
from kvwall.results import SCALES, Result, register_row_schema, validate_rows

__all__ = [
    "CHAPTER_MODULES",
    "EXPERIMENTS",
    "PREREQUISITES",
    "Experiment",
    "missing_prerequisites",
    "run_experiment",
    "short_kernel_name",
]

#: The experiment modules (or packages), in chapter order: what ``record all`` runs, in this order.
CHAPTER_MODULES = (
    decode_profile,
    wall,
    doors,
    gather_cast,
    fused_decode,
    multi_token,
    accuracy,
    dsa,
    dsa_forced,
    answer,
    sglang_patch,
    chapters,
    chapters_rest,
    gpu_tests,
)


def _registered() -> dict[str, Experiment]:
    found: dict[str, Experiment] = {}
    for module in CHAPTER_MODULES:
        for exp in module.EXPERIMENTS:
            if exp.name in found:
                raise RuntimeError(f"experiment {exp.name!r} is defined twice (second time in {module.__name__}).")
            found[exp.name] = exp
            register_row_schema(exp.name, exp.rows)
    return found


EXPERIMENTS: dict[str, Experiment] = _registered()
short_kernel_name = decode_profile.short_kernel_name


def run_experiment(name: str, device: torch.device, scale: str = "full", **overrides: Any) -> Result:
    """Run experiment ``name`` on ``device`` with its ``scale`` parameters (and ``overrides``).

    The result's provenance says the scale; its rows are validated against the experiment's schema
    here, so a change to what an experiment writes fails where it runs (a CPU test), not at save time.
    """
    if name not in EXPERIMENTS:
        raise KeyError(f"unknown experiment {name!r}; known: {sorted(EXPERIMENTS)}.")
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r} is not one of {SCALES}.")
    exp = EXPERIMENTS[name]
    unknown = set(overrides) - set(exp.full)
    if unknown:
        raise TypeError(f"experiment {name!r} has no parameters {sorted(unknown)}; it takes {sorted(exp.full)}.")
    result = exp.run(device, **{**getattr(exp, scale), **overrides})
    validate_rows(name, result.rows)
    result.provenance = dataclasses.replace(result.provenance, scale=scale)
    return result
