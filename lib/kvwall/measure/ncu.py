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
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")

__all__ = [
    "NCU_METRICS",
    "NCU_OPTIONAL_METRICS",
    "parse_ncu_csv",
    "parse_ncu_kernels",
    "profile_kernel",
    "profile_window",
    "ncu_path",
    "unknown_metrics",
]

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
    **{
        f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio": f"stall_{r}"
        for r in (
            "long_scoreboard",
            "short_scoreboard",
            "mio_throttle",
            "wait",
            "barrier",
            "lg_throttle",
            "math_pipe_throttle",
            "not_selected",
            "dispatch_stall",
            "no_instruction",
        )
    },
}

#: Metrics asked for too where this ncu knows them: the tensor pipe (on Hopper ``sm__pipe_tensor_cycles_active``
#: counts wgmma and mma.sync; the ``sm__ops_path_tensor_*`` counters do not count wgmma), the wgmma instructions, the
#: shared-memory wavefronts of loads and stores (wgmma's operand reads from shared memory are not in them) and their
#: bank conflicts, and the stall on wgmma completion. A name the installed ncu does not know is dropped and the run
#: repeated without it (:func:`profile_kernel`), so a renamed counter costs its column, not the profile.
NCU_OPTIONAL_METRICS = {
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed": "tensor_pipe_pct",
    "sm__inst_executed_pipe_tensor_op_gmma.sum": "wgmma_instructions",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed": "shared_lsu_pct",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum": "shared_bank_conflicts",
    "smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio": "stall_gmma",
    # The L1 / shared-memory data path split by traffic (designs/2026-12-03-pv-under-scores.md asks whether the FP8
    # gather's global loads and the score wgmma contend there): shared-memory load and store wavefronts apart,
    # global-load requests and their sectors (sectors per request: how many 32-byte pieces a warp's load touches),
    # and the L1's busiest sub-unit as a share of its peak.
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": "shared_ld_wavefronts",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum": "shared_st_wavefronts",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": "global_ld_requests",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": "global_ld_sectors",
    "l1tex__throughput.avg.pct_of_peak_sustained_elapsed": "l1_throughput_pct",
}
_ALL_METRICS = {**NCU_METRICS, **NCU_OPTIONAL_METRICS}


def ncu_path() -> str | None:
    """Where ``ncu`` is on PATH (None when Nsight Compute is not installed)."""
    return shutil.which("ncu")


def parse_ncu_csv(text: str) -> dict[str, float]:
    """``ncu --csv --print-units base`` output (one kernel) -> {our name: value}. Raises ValueError if no metric
    row of :data:`NCU_METRICS` or :data:`NCU_OPTIONAL_METRICS` is found (the output's tail is in the message)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    out: dict[str, float] = {}
    for rec in csv.DictReader(io.StringIO("\n".join(lines))):
        name = rec.get("Metric Name")
        if name in _ALL_METRICS:
            value = (rec.get("Metric Value") or "").replace(",", "")
            try:
                out[_ALL_METRICS[name]] = float(value)
            except ValueError:
                continue
    if not out:
        raise ValueError("no Nsight Compute metric rows in the output:\n" + text[-2000:])
    return out


def parse_ncu_kernels(text: str) -> list[dict[str, float | str]]:
    """``ncu --csv --print-units base`` output of several kernel launches -> one dict per launch, in launch order:
    ``kernel`` (its name, template arguments cut at 160 characters) and {our name: value} of :data:`NCU_METRICS` and
    :data:`NCU_OPTIONAL_METRICS`. Raises ValueError if no metric row is found (the output's tail is in the message)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    launches: dict[str, dict[str, float | str]] = {}
    for rec in csv.DictReader(io.StringIO("\n".join(lines))):
        name = rec.get("Metric Name")
        if name not in _ALL_METRICS:
            continue
        launch = launches.setdefault(rec.get("ID") or "0", {"kernel": (rec.get("Kernel Name") or "?")[:160]})
        try:
            launch[_ALL_METRICS[name]] = float((rec.get("Metric Value") or "").replace(",", ""))
        except ValueError:
            continue
    if not launches:
        raise ValueError("no Nsight Compute metric rows in the output:\n" + text[-2000:])
    return [launches[k] for k in sorted(launches, key=lambda k: int(k) if k.isdigit() else 0)]


def unknown_metrics(text: str, asked: Sequence[str]) -> list[str]:
    """The names of ``asked`` that an ncu run's output says it does not know (``==ERROR== Failed to find metric``)."""
    errors = [line for line in text.splitlines() if "ERROR" in line and "metric" in line.lower()]
    return [m for m in asked if any(m in line or m.split(".")[0] in line for line in errors)]


def _run_ncu(metrics: Sequence[str], selection: Sequence[str], module: str, args: Sequence[str], timeout_s: int) -> str:
    ncu = ncu_path()
    if ncu is None:
        raise FileNotFoundError("ncu (Nsight Compute) is not installed here: put it on PATH to profile kernels.")
    cmd = [ncu, "--csv", "--print-units", "base", *selection, "--metrics", ",".join(metrics)]
    proc = subprocess.run(
        [*cmd, sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=dict(os.environ),
    )
    return proc.stdout + "\n" + proc.stderr


def _with_optional(run: Callable[[Sequence[str]], str], parse: Callable[[str], T]) -> tuple[T, list[str]]:
    """``parse(run(every metric))``; where an optional metric is unknown to this ncu, the run repeated without it.
    Returns the parsed output and the names (ours) of the optional metrics dropped."""
    optional = list(NCU_OPTIONAL_METRICS)
    text = run([*NCU_METRICS, *optional])
    try:
        return parse(text), []
    except ValueError:
        missing = unknown_metrics(text, optional) or optional  # unnamed: retry with the required set only
        if not any("ERROR" in line and "metric" in line.lower() for line in text.splitlines()):
            raise
    parsed = parse(run([*NCU_METRICS, *(m for m in optional if m not in missing)]))
    return parsed, [NCU_OPTIONAL_METRICS[m] for m in missing]


def profile_kernel(
    module: str, args: Sequence[str], *, kernel_regex: str, launch_skip: int, timeout_s: int, launch_count: int = 1
) -> dict[str, float | list[str]]:
    """Run ``python -m module *args`` under ``ncu`` and read :data:`NCU_METRICS` and :data:`NCU_OPTIONAL_METRICS` of
    the launches of the kernels matching ``kernel_regex`` (after skipping ``launch_skip`` of them). An optional metric
    this ncu does not know is dropped and the run repeated without it; the names dropped are in ``ncu_missing``.
    Raises FileNotFoundError without ncu, subprocess.TimeoutExpired past ``timeout_s``, ValueError when no metric
    came back."""
    selection = [
        "--kernel-name",
        f"regex:{kernel_regex}",
        "--launch-skip",
        str(launch_skip),
        "--launch-count",
        str(launch_count),
    ]
    parsed, missing = _with_optional(lambda m: _run_ncu(m, selection, module, args, timeout_s), parse_ncu_csv)
    out: dict[str, float | list[str]] = dict(parsed)
    if missing:
        out["ncu_missing"] = missing
    return out


def profile_window(
    module: str, args: Sequence[str], *, timeout_s: int
) -> tuple[list[dict[str, float | str]], list[str]]:
    """Run ``python -m module *args`` under ``ncu --profile-from-start off`` and read :data:`NCU_METRICS` and
    :data:`NCU_OPTIONAL_METRICS` of every kernel launched between the program's ``cudaProfilerStart`` and
    ``cudaProfilerStop`` (``torch.cuda.profiler.start()`` / ``stop()``): whatever kernels a call launches, whoever
    wrote them. Returns (one dict per launch, :func:`parse_ncu_kernels`; the optional metrics this ncu did not know).
    Raises as :func:`profile_kernel`."""
    selection = ["--profile-from-start", "off"]
    return _with_optional(lambda m: _run_ncu(m, selection, module, args, timeout_s), parse_ncu_kernels)
