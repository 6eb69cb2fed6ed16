"""Nsight Compute (``ncu``) over one kernel launch of a program, reduced to the metrics the book reads.

:data:`NCU_METRICS` names the metrics asked for and what the chapters call them; :func:`profile_kernel` runs
``ncu --csv`` on a Python module and :func:`parse_ncu_csv` reads its output. ncu locks clocks to base, so its
durations are longer than the stopwatches' (:mod:`kvwall.measure.timing`).
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
from typing import Sequence

__all__ = ["NCU_METRICS", "parse_ncu_csv", "profile_kernel", "ncu_path"]

#: Nsight Compute metrics read for a kernel (ncu's name -> the name in the recorded rows).
NCU_METRICS = {
    "gpu__time_duration.sum": "duration_ns",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "lts__t_bytes.sum": "l2_bytes",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct_of_peak",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical_occupancy_pct",
    "launch__registers_per_thread": "registers_per_thread",
    "launch__shared_mem_per_block_dynamic": "dynamic_smem_bytes",
    "launch__grid_size": "grid_size",
    "launch__block_size": "block_size",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_active_pct",
    "sm__inst_executed.sum": "warp_instructions",
    **{f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio": f"stall_{r}"
       for r in ("long_scoreboard", "short_scoreboard", "mio_throttle", "wait", "barrier", "lg_throttle",
                 "math_pipe_throttle", "not_selected", "dispatch_stall", "no_instruction")},
}


def ncu_path() -> str | None:
    """Where ``ncu`` is on PATH (None when Nsight Compute is not installed)."""
    return shutil.which("ncu")


def parse_ncu_csv(text: str) -> dict[str, float]:
    """``ncu --csv --print-units base`` output (one kernel) -> {our name: value}. Raises ValueError if no metric
    row of :data:`NCU_METRICS` is found (the output's tail is in the message)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    out: dict[str, float] = {}
    for rec in csv.DictReader(io.StringIO("\n".join(lines))):
        name = rec.get("Metric Name")
        if name in NCU_METRICS:
            value = (rec.get("Metric Value") or "").replace(",", "")
            try:
                out[NCU_METRICS[name]] = float(value)
            except ValueError:
                continue
    if not out:
        raise ValueError("no Nsight Compute metric rows in the output:\n" + text[-2000:])
    return out


def profile_kernel(module: str, args: Sequence[str], *, kernel_regex: str, launch_skip: int, timeout_s: int,
                   launch_count: int = 1) -> dict[str, float]:
    """Run ``python -m module *args`` under ``ncu`` and read :data:`NCU_METRICS` of the launches of the kernels
    matching ``kernel_regex`` (after skipping ``launch_skip`` of them). Raises FileNotFoundError without ncu,
    subprocess.TimeoutExpired past ``timeout_s``, ValueError when no metric came back."""
    ncu = ncu_path()
    if ncu is None:
        raise FileNotFoundError("ncu (Nsight Compute) is not installed here: put it on PATH to profile kernels.")
    cmd = [ncu, "--csv", "--print-units", "base", "--kernel-name", f"regex:{kernel_regex}",
           "--launch-skip", str(launch_skip), "--launch-count", str(launch_count), "--metrics", ",".join(NCU_METRICS),
           sys.executable, "-m", module, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))
    return parse_ncu_csv(proc.stdout)
