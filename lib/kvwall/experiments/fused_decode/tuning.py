"""``fused_decode_tuning`` (GPU): runs :func:`kvwall.tuning.fused.tune` and keeps every candidate's screen row
(launch shape, registers, spills, shared memory, error against float32, µs at 128K tokens) and the splits sweep of
the best, against the roofline measured in the same run. With ``write_table=True`` (the ``full`` parameters) it
also stores the winners in ``kernels/mla_decode/tuned.json``, the table the launcher reads, so the benchmark
recorded after it runs the shapes this run picked.
"""

from __future__ import annotations

from typing import Any

import torch

from kvwall.results import Result, collect_provenance
from kvwall.tuning.fused import tune, write_table as write_tuned_table
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "run_fused_decode_tuning"]


def _flat(row: dict[str, Any], section: str) -> dict[str, Any]:
    out = {"section": section, **{k: v for k, v in row.items() if k not in ("config", "kernels_us")}}
    out.update({f"cfg_{k}": v for k, v in row["config"].items()})
    for name, us in (row.get("kernels_us") or {}).items():
        out["split_kernel_us" if "split" in name else "combine_kernel_us" if "combine" in name else name] = us
    return out


def run_fused_decode_tuning(
    device: torch.device,
    *,
    heads: list[int],
    screen_tokens: int,
    contexts: list[int],
    splits: list[int],
    keep: int,
    write_table: bool,
) -> Result:
    if device.type != "cuda":
        raise RuntimeError("fused_decode_tuning times compiled kernels: it needs a CUDA device.")
    report = tune(heads, screen_tokens=screen_tokens, contexts=contexts, splits=splits, keep=keep, log=lambda m: None)
    rows = [{"section": "ceilings", "copy_gbps": report["copy_gbps"], "bf16_tflops": report["bf16_tflops"]}]
    rows += [_flat(r, "screen") for r in report["screen"]]
    rows += [_flat(r, "sweep") for r in report["sweep"]]
    rows += [_flat(r, "winner") for w in report["winners"].values() for r in w.values()]
    rows += [_flat(r, "fastest_any") for r in report.get("fastest_any", {}).values() if r]
    if write_table:
        write_tuned_table(report)
    params = {
        "heads": heads,
        "screen_tokens": screen_tokens,
        "contexts": contexts,
        "splits": splits,
        "keep": keep,
        "write_table": write_table,
        "seconds": round(report["seconds"], 1),
    }
    return Result("fused_decode_tuning", params, rows, collect_provenance(device, __name__))


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "fused_decode_tuning",
        run_fused_decode_tuning,
        full=dict(
            heads=[16, 64, 128],
            screen_tokens=131072,
            contexts=[4096, 32768, 131072],
            splits=[0, 66, 132, 264],
            keep=2,
            write_table=True,
        ),
        small=dict(heads=[16], screen_tokens=4096, contexts=[4096], splits=[0], keep=1, write_table=False),
        about="Launch shapes of the fused FP8 MLA decode kernel screened and swept on the GPU; writes the tuned table.",
        requires=("cuda",),
    ),
]
