"""``fused_decode_ncu`` (GPU, Nsight Compute): where the fused kernel's split launch spends its time -- DRAM and L2
bytes, occupancy, issue, stall reasons -- for one launch of the tuned shape per ``[heads, tokens]`` point, batch 1,
random slots of the 495K pool (the program profiled is ``python -m kvwall.tuning.fused --profile-one``). ncu locks
clocks to base, so its durations are longer than the benchmark's.
"""

from __future__ import annotations

from typing import Any

import torch

from kvwall.measure.ncu import ncu_path, profile_kernel
from kvwall.model.roofline import decode_flops, kv_read_bytes
from kvwall.results import Result, collect_provenance
from kvwall.tuning import fused as profiled_program
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "run_fused_decode_ncu"]

#: The program ncu runs: three warm-up calls, then the profiled one (``--launch-skip 3``). Imported, not only
#: named, so that it and the kernel it launches are in this experiment's provenance.
PROFILED_MODULE = profiled_program.__name__


def run_fused_decode_ncu(device: torch.device, *, points: list[list[int]], timeout_s: int) -> Result:
    """One ``profile`` row per point: the metrics of :data:`kvwall.measure.ncu.NCU_METRICS`, the fewest bytes the
    launch must read (``min_bytes``: :func:`kvwall.model.roofline.kv_read_bytes`) and its FLOPs; a failed profile is
    the row's ``error``."""
    if device.type != "cuda":
        raise RuntimeError("fused_decode_ncu profiles a GPU kernel: it needs a CUDA device.")
    rows: list[dict[str, Any]] = []
    for heads, tokens in points:
        row: dict[str, Any] = {"section": "profile", "heads": heads, "tokens": tokens,
                               "min_bytes": kv_read_bytes(tokens)}
        if ncu_path() is None:
            row["error"] = "ncu (Nsight Compute) is not installed here"
            rows.append(row)
            continue
        try:
            row.update(profile_kernel(PROFILED_MODULE, ["--profile-one", str(heads), str(tokens)],
                                      kernel_regex="_mla_split_kernel", launch_skip=3, timeout_s=timeout_s))
            row["flops"] = decode_flops(heads, tokens)
        except Exception as exc:  # noqa: BLE001 - a failed profile is a row, not a crash
            row["error"] = f"{type(exc).__name__}: {str(exc)[-600:]}"
        rows.append(row)
    return Result("fused_decode_ncu", {"points": points, "timeout_s": timeout_s}, rows,
                  collect_provenance(device, __name__))


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "fused_decode_ncu", run_fused_decode_ncu,
        full=dict(points=[[16, 131072], [128, 131072]], timeout_s=120),
        small=dict(points=[[16, 4096]], timeout_s=120),
        about="Nsight Compute on the fused kernel's split launch: DRAM/L2 bytes, occupancy, issue, stall reasons.",
        requires=("cuda", "ncu"),
    ),
]
