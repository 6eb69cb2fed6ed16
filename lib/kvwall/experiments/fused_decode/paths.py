"""The measured path table the dispatcher reads: ``python -m kvwall.experiments.fused_decode.paths --write``.

From the recorded ``fused_decode_cuda`` result (:mod:`kvwall.experiments.fused_decode.cuda_path`): at every bench
point, the CUDA path's default variant, the wgmma path (where it ran) and the Triton path, all on page 64 and timed
in the same run; the fastest is the point's path. ``--write`` stores ``{gpu: {"by", "recorded", "points":
[[heads, context, batch, path, cuda_us, triton_us, wgmma_us or null], ...]}}`` in ``kernels/mla_decode/paths.json``,
which :func:`kvwall.kernels.mla_decode.dispatch.choose_path` reads (nearest point in log scale).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvwall.kernels.mla_decode.cuda import DEFAULT_VARIANT
from kvwall.kernels.mla_decode.dispatch import PATHS_FILE
from kvwall.results import Result, load_result
from kvwall.experiments.fused_decode.cuda_path import TRITON_STRATEGY, WGMMA

__all__ = ["path_points", "path_table", "write_path_table"]


def path_points(result: Result, variant: int = DEFAULT_VARIANT) -> list[list[Any]]:
    """``[heads, context, batch, path, cuda_us, triton_us, wgmma_us]`` per bench point where the CUDA and Triton
    paths were timed (``wgmma_us`` None where the wgmma path was not); ``path`` is the fastest."""
    cuda_name, wgmma_name = f"cuda_v{variant}", f"cuda_{WGMMA}"
    by_point: dict[tuple[int, int, int], dict[str, float]] = {}
    for row in result.rows:
        if (row.get("section") == "bench" and row.get("us")
                and row["strategy"] in (cuda_name, TRITON_STRATEGY, wgmma_name)):
            by_point.setdefault((row["heads"], row["context"], row["batch"]), {})[row["strategy"]] = row["us"]
    points = []
    for (h, ctx, b), us in sorted(by_point.items()):
        if cuda_name in us and TRITON_STRATEGY in us:
            timed = {"cuda": us[cuda_name], "triton": us[TRITON_STRATEGY], WGMMA: us.get(wgmma_name)}
            path = min((p for p in timed if timed[p]), key=lambda p: timed[p])
            points.append([h, ctx, b, path, round(us[cuda_name], 2), round(us[TRITON_STRATEGY], 2),
                           round(us[wgmma_name], 2) if wgmma_name in us else None])
    return points


def path_table(result: Result) -> dict[str, Any]:
    """One GPU's entry of ``paths.json`` from a ``fused_decode_cuda`` result."""
    gpu = next(r["gpu"] for r in result.rows if r.get("section") == "build")
    return {gpu: {"by": "python -m kvwall.experiments.fused_decode.paths --write", "recorded": result.caption(),
                  "variant": DEFAULT_VARIANT, "points": path_points(result)}}


def write_path_table(path: Path = PATHS_FILE) -> dict[str, Any]:
    """Merge the recorded result's entry into ``path`` (other GPUs' entries stay) and return the whole table."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table.update(path_table(load_result("fused_decode_cuda")))
    path.write_text(json.dumps(table, indent=1) + "\n")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvwall.experiments.fused_decode.paths",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {PATHS_FILE.name} from the recorded result")
    args = parser.parse_args(argv)
    if not args.write:
        for gpu, entry in path_table(load_result("fused_decode_cuda")).items():
            print(gpu, entry["recorded"])
            for p in entry["points"]:
                print("  ", p)
        return 0
    table = write_path_table()
    print(f"wrote {PATHS_FILE} ({', '.join(table)})")
    return 0


if __name__ == "__main__":
    import kvwall.experiments  # noqa: F401  (registers the row schemas the result loads with)

    raise SystemExit(main())
