"""``chapters_gpu_mode_rest``: the chapters ``chapters_gpu_mode``'s run on the H200 left for lack of time (its budget
is one 10-minute device call; the first run took 440 s for five chapters), run the same way in a call of their own."""

from __future__ import annotations

import dataclasses

import torch

from kvwall.results import Result
from kvwall.experiments.chapters import run_chapters_gpu_mode
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "REST"]

#: The chapters of the second call.
REST = ["06a_vllm.md", "03_the_other_doors.md", "05a_fused_decode_lab.md", "02_the_wall.md"]


def run_rest(device: torch.device, *, chapters: list[str], timeout_s: int, budget_s: int) -> Result:
    result = run_chapters_gpu_mode(device, chapters=chapters, timeout_s=timeout_s, budget_s=budget_s)
    return dataclasses.replace(result, experiment="chapters_gpu_mode_rest")


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "chapters_gpu_mode_rest",
        run_rest,
        full=dict(chapters=list(REST), timeout_s=420, budget_s=540),
        small=dict(chapters=["06a_vllm.md"], timeout_s=120, budget_s=120),
        about="the chapters chapters_gpu_mode had no time for, in GPU mode (full scale, live), each timed",
        requires=("cuda",),
    ),
]
