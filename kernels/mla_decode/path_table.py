"""The dispatcher's measured table, ``paths.json``: which of ours' paths was fastest where, per GPU model, and the
rule that reads it (:func:`decide_path`). Derived from the recorded ``fused_decode_paths`` result
(:func:`kvwall.experiments.fused_decode.paths.write_path_table`).

``paths.json`` holds only what the dispatcher reads: ``{gpu name: {"capability": [major, minor], "page_size": 1,
"points": [[heads, context, batch, path], ...]}}``, ``path`` the fastest of ours' paths timed at that point
(:func:`path_point` makes a point from the times). So it is fingerprinted by its choices: a recording that re-times
every point and picks the same paths writes the same bytes, and the results that ran the dispatcher stay fresh.

The times themselves, the caption of the run and who wrote the table go to a sidecar beside it that the dispatcher
never reads (written by ``fused_decode_paths``, read by chapter 5's report; it is named only outside this folder, so
it is in no result's fingerprint: :mod:`kvwall.results.fingerprint`). A point of an older table, ``[heads, context,
batch, path, *times]``, names its path at the same place and is read alike.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Literal, Mapping, get_args

__all__ = ["PATHS_FILE", "KernelPath", "KERNEL_PATHS", "TOKENS_MAX_HEADS", "SAID", "fastest", "path_point",
           "measured_choice", "read_table", "reload_table", "table_entry", "decide_path", "table_text"]

#: The measured table (GPU model -> its crossovers), derived from the recorded ``fused_decode_paths`` result.
PATHS_FILE = Path(__file__).with_name("paths.json")
KernelPath = Literal["triton", "wgmma", "wgmma_tokens"]
KERNEL_PATHS: tuple[KernelPath, ...] = get_args(KernelPath)
#: With no measured table: the tokens-on-M wgmma path up to this many heads (its instantiations: 16 and 32 heads per
#: CTA), the heads-on-M wgmma path above.
TOKENS_MAX_HEADS = 32
#: How the dispatcher's reasons name each path.
SAID: dict[KernelPath, str] = {"triton": "Triton", "wgmma": "wgmma", "wgmma_tokens": "tokens-on-M wgmma"}


def fastest(times: Mapping[KernelPath, float | None]) -> KernelPath:
    """The fastest of the timed paths in ``times`` (None: not timed); a tie goes to the earlier of
    :data:`KERNEL_PATHS` (the Triton path first)."""
    timed = {p: us for p, us in times.items() if us is not None}
    if not timed:
        raise ValueError("no path was timed at this point")
    return min(timed, key=lambda p: (timed[p], KERNEL_PATHS.index(p)))


def path_point(heads: int, context: int, batch: int, triton_us: float, wgmma_us: float | None,
               wgmma_tokens_us: float | None = None) -> list:
    """A ``paths.json`` point, ``[heads, context, batch, path]``: ``path`` the fastest of the timed paths
    (:func:`fastest`), compared at 0.01 µs (the sidecar's rounding, so the choice can be re-derived from it)."""
    times = dict(zip(KERNEL_PATHS, (triton_us, wgmma_us, wgmma_tokens_us)))
    return [heads, context, batch, fastest({p: None if us is None else round(us, 2) for p, us in times.items()})]


def measured_choice(entry: dict, heads: int, batch: int, max_len: int) -> tuple[KernelPath, list] | None:
    """The path measured fastest at the point of ``entry`` (one GPU's table) nearest to (heads, batch, max_len) in
    log scale, and that point; None for an entry without points."""
    points = entry.get("points") or []
    if not points:
        return None

    def distance(p: list) -> float:
        return (abs(math.log2(p[0] / max(heads, 1))) + abs(math.log2(p[2] / max(batch, 1)))
                + abs(math.log2(p[1] / max(max_len, 1))))

    best = min(points, key=distance)
    return best[3], best


@functools.cache
def read_table(path: Path) -> dict:
    """The table in ``path`` (read once per process: :func:`reload_table`); ``{}`` where it is missing or not a
    JSON object."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def reload_table() -> None:
    """Forget the tables read so far: the next :func:`choose_path` reads ``paths.json`` (or its ``table_file``) again
    (after ``fused_decode_paths`` rewrote it, in the process that recorded it)."""
    read_table.cache_clear()


def table_entry(table: dict, gpu: str, capability: tuple[int, int] | None) -> tuple[str, dict] | None:
    """``(measured GPU, its entry)``: the entry for ``gpu`` itself, else the first entry measured on a GPU of the same
    ``capability`` (an entry's ``"capability": [major, minor]``); None where neither exists."""
    if isinstance(table.get(gpu), dict):
        return gpu, table[gpu]
    if capability is not None:
        for name, entry in table.items():
            if isinstance(entry, dict) and tuple(entry.get("capability") or ()) == tuple(capability):
                return name, entry
    return None


def decide_path(heads: int, batch: int, max_len: int, *, gpu: str, capability: tuple[int, int] | None,
                refusal: str | None, table: dict) -> tuple[KernelPath, str]:
    """:func:`choose_path`'s rule without a device: ``gpu`` / ``capability`` the GPU's model and compute capability,
    ``refusal`` why the wgmma paths cannot run this call (None: they can; both refuse the same calls), ``table`` the
    whole ``paths.json``. The reason names the path measured fastest at the nearest point and the GPU measured
    (not the times: they are not in the table)."""
    if refusal:
        return "triton", f"Triton: the wgmma paths cannot run this call ({refusal})"
    found = table_entry(table, gpu, capability)
    choice = measured_choice(found[1], heads, batch, max_len) if found else None
    if choice is None:
        path: KernelPath = "wgmma_tokens" if heads <= TOKENS_MAX_HEADS else "wgmma"
        return path, (f"{SAID[path]}: no measured table for {gpu} nor for its compute capability "
                      f"{'.'.join(map(str, capability or ()))}, so the capability rule: where the wgmma paths can run "
                      f"(sm_90a, latent 512 / rope 64, 16-byte aligned rows), the tokens-on-M wgmma path up to "
                      f"{TOKENS_MAX_HEADS} heads, the wgmma path above ({heads} heads)")
    path, point = choice
    where = found[0] if found[0] == gpu else f"{found[0]} (the same compute capability as this {gpu})"
    return path, (f"{SAID[path]}: measured fastest at the nearest point "
                  f"({point[0]} heads, {point[1]} tokens, batch {point[2]}) on {where}")


def table_text(table: Mapping[str, Mapping]) -> str:
    """A table's file text (``paths.json`` or its sidecar): an entry's fields one per line, each point on a line of
    its own (so a changed choice is a one-line diff), GPUs in the order given."""
    def value(key: str, v: object) -> str:
        if key == "points":
            return "[\n" + ",\n".join("   " + json.dumps(p, ensure_ascii=False) for p in v) + "\n  ]"
        return json.dumps(v, ensure_ascii=False)

    entries = [f" {json.dumps(gpu)}: {{\n" + ",\n".join(f"  {json.dumps(k)}: {value(k, v)}" for k, v in entry.items())
               + "\n }" for gpu, entry in table.items()]
    return "{\n" + ",\n".join(entries) + "\n}\n"
