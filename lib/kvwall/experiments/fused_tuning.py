"""Chapter 5's tuning record: ``fused_decode_tuning`` runs :func:`kvwall.tuning.fused.tune` on the GPU and keeps
every candidate's screen row (launch shape, registers, spills, shared memory, error against float32, µs at
128K tokens) and the splits sweep of the best, against the roofline measured in the same run. With
``write_table=True`` (the ``full`` parameters) it also stores the winners in ``kernels/mla_decode/tuned.json``,
the table the launcher reads, so the benchmark recorded after it runs the shapes this run picked.
"""

from __future__ import annotations

from typing import Any

import torch

from kvwall.results import Result, collect_provenance
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "run_fused_decode_tuning"]

SOURCES = ("kernels/mla_decode/kernel.py", "lib/kvwall/tuning/fused.py", "lib/kvwall/measure/timing.py",
           "lib/kvwall/experiments/fused_tuning.py")


def _flat(row: dict[str, Any], section: str) -> dict[str, Any]:
    out = {"section": section, **{k: v for k, v in row.items() if k not in ("config", "kernels_us")}}
    out.update({f"cfg_{k}": v for k, v in row["config"].items()})
    for name, us in (row.get("kernels_us") or {}).items():
        out["split_kernel_us" if "split" in name else "combine_kernel_us" if "combine" in name else name] = us
    return out


def run_fused_decode_tuning(device: torch.device, *, heads: list[int], screen_tokens: int, contexts: list[int],
                            splits: list[int], keep: int, write_table: bool) -> Result:
    if device.type != "cuda":
        raise RuntimeError("fused_decode_tuning times compiled kernels: it needs a CUDA device.")
    from kvwall.tuning import fused as fused_tune

    report = fused_tune.tune(heads, screen_tokens=screen_tokens, contexts=contexts, splits=splits, keep=keep,
                             log=lambda m: None)
    rows = [{"section": "ceilings", "copy_gbps": report["copy_gbps"], "bf16_tflops": report["bf16_tflops"]}]
    rows += [_flat(r, "screen") for r in report["screen"]]
    rows += [_flat(r, "sweep") for r in report["sweep"]]
    rows += [_flat(r, "winner") for w in report["winners"].values() for r in w.values()]
    if write_table:
        fused_tune.write_table(report)
    params = {"heads": heads, "screen_tokens": screen_tokens, "contexts": contexts, "splits": splits, "keep": keep,
              "write_table": write_table, "seconds": round(report["seconds"], 1)}
    return Result("fused_decode_tuning", params, rows, collect_provenance(device, SOURCES))


EXPERIMENTS = [
    Experiment(
        "fused_decode_tuning", run_fused_decode_tuning,
        full=dict(heads=[16, 64, 128], screen_tokens=131072, contexts=[4096, 32768, 131072],
                  splits=[0, 16, 33, 66, 132, 264, 396], keep=4, write_table=True),
        small=dict(heads=[16], screen_tokens=4096, contexts=[4096], splits=[0], keep=1, write_table=False),
        about="Launch shapes of the fused FP8 MLA decode kernel screened and swept on the GPU; writes the tuned table.",
    ),
]


# ----------------------------------------------------------------------------------------------
# Nsight Compute: where the split kernel's time goes
# ----------------------------------------------------------------------------------------------

#: Nsight Compute metrics read for the split kernel (name -> what the chapter calls it).
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


def parse_ncu_csv(text: str) -> dict[str, float]:
    """``ncu --csv`` output (one kernel) -> {our name: value}. Raises if no metric row is found."""
    import csv
    import io

    lines = [l for l in text.splitlines() if l.startswith('"')]
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


def run_fused_decode_ncu(device: torch.device, *, points: list[list[int]], timeout_s: int) -> Result:
    """Nsight Compute over one launch of the (tuned) split kernel per ``[heads, tokens]`` point, batch 1,
    random slots of the 495K pool. ncu locks clocks to base, so its durations are longer than the timings."""
    import os
    import shutil
    import subprocess
    import sys

    if device.type != "cuda":
        raise RuntimeError("fused_decode_ncu profiles a GPU kernel: it needs a CUDA device.")
    from kvwall.tuning.fused import D, DC

    ncu = shutil.which("ncu")
    rows: list[dict[str, Any]] = []
    for heads, tokens in points:
        row: dict[str, Any] = {"section": "profile", "heads": heads, "tokens": tokens, "min_bytes": tokens * D}
        if ncu is None:
            row["error"] = "ncu (Nsight Compute) is not installed here"
            rows.append(row)
            continue
        cmd = [ncu, "--csv", "--print-units", "base", "--kernel-name", "regex:_mla_split_kernel", "--launch-skip", "3", "--launch-count", "1",
               "--metrics", ",".join(NCU_METRICS), sys.executable, "-m", "kvwall.tuning.fused", "--profile-one",
               str(heads), str(tokens)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))
            row.update(parse_ncu_csv(proc.stdout))
            row["flops"] = 2 * heads * tokens * (DC + D)
        except Exception as exc:  # noqa: BLE001 - a failed profile is a row, not a crash
            row["error"] = f"{type(exc).__name__}: {str(exc)[-600:]}"
        rows.append(row)
    return Result("fused_decode_ncu", {"points": points, "timeout_s": timeout_s}, rows,
                  collect_provenance(device, SOURCES + ("kernels/mla_decode/tuned.json",)))


EXPERIMENTS.append(
    Experiment(
        "fused_decode_ncu", run_fused_decode_ncu,
        full=dict(points=[[16, 131072], [128, 131072]], timeout_s=120),
        small=dict(points=[[16, 4096]], timeout_s=120),
        about="Nsight Compute on the fused kernel's split launch: DRAM/L2 bytes, occupancy, issue, stall reasons.",
    ))
