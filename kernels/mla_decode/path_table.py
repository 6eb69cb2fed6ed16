"""The dispatcher's measured table, ``kernel_paths.json``: which of ours' paths was fastest where, per GPU model, and
the rule that reads it (:func:`decide_path`). Derived from the recorded ``fused_decode_paths`` result
(:func:`kvwall.experiments.fused_decode.kernel_paths.write_path_table`).

``kernel_paths.json`` holds only what the dispatcher reads: ``{gpu name: {"capability": [major, minor], "page_size": 1,
"points": [[heads, context, batch, path, tokens, max_len], ...]}}`` (:data:`POINT_COLUMNS`), ``path`` the fastest of
ours' paths timed at that point (:func:`path_point` makes a point from the times). A point is keyed by what a call
knows when it is planned -- its ``heads`` (query rows a request), ``batch``, ``tokens`` (the batch's tokens) and
``max_len`` (its longest request) -- so a call of the recorded shape finds its point exactly; ``context`` is the
grid's name for the point (one request of ``context`` tokens at batch 1; at larger batches ``fused_decode_bench``'s
mixed lengths, :func:`kvwall.experiments.fused_decode.strategies.bench_lengths`), said in the dispatcher's reasons.
So the table is fingerprinted by its choices: a recording that re-times every point and picks the same paths writes
the same bytes, and the results that ran the dispatcher stay fresh. One table serves pages of 1 and of 64: the
recordings time both, and each choice is the path whose worst ratio to the fastest over both is least
(:func:`kvwall.experiments.fused_decode.kernel_paths.choose_path`; ``tests/test_dispatch_rule.py`` holds the table
within 5 % of the fastest on each, on the recorded run).

The times themselves, the caption of the run and who wrote the table go to a sidecar beside it that the dispatcher
never reads (written by ``fused_decode_paths``, read by chapter 5's report; it is named only outside this folder, so
it is in no result's fingerprint: :mod:`kvwall.results.fingerprint`). A point of an older table, ``[heads, context,
batch, path, *times]``, is read as ``batch`` requests of ``context`` tokens each (what it was taken to be before
points carried their shape).

**The rule** (:func:`decide_path`), in this order:

1. where the wgmma paths cannot run: the Triton path;
2. the entry of this GPU model, else one measured on a GPU of the same compute capability (:func:`table_entry`);
   among its points *of the same head count*: the point of this very shape (heads, batch, tokens, longest request),
   else the nearest in (batch, tokens) in log scale, the longest request breaking ties (:func:`measured_choice`);
3. a head count the entry never measured (say 20, 48, 256), a GPU with no entry for it or its capability, or a table
   refused as malformed (:func:`table_problem`: it is named in a warning, once, and in the reason): the capability
   rule -- the tokens-on-M wgmma path up to :data:`TOKENS_MAX_HEADS` heads, the heads-on-M wgmma path above. Never
   the nearest point of another head count.

The reason the dispatcher gives says which step decided, on which point or why none.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from pathlib import Path
from typing import Literal, Mapping, get_args

__all__ = [
    "PATHS_FILE",
    "KernelPath",
    "KERNEL_PATHS",
    "TOKENS_MAX_HEADS",
    "SAID",
    "POINT_COLUMNS",
    "fastest",
    "path_point",
    "table_problem",
    "measured_choice",
    "read_table",
    "table_refusal",
    "reload_table",
    "table_entry",
    "decide_path",
    "capability_rule",
    "table_text",
]

#: The measured table (GPU model -> its crossovers), derived from the recorded ``fused_decode_paths`` result.
PATHS_FILE = Path(__file__).with_name("kernel_paths.json")
KernelPath = Literal["triton", "wgmma", "wgmma_tokens"]
KERNEL_PATHS: tuple[KernelPath, ...] = get_args(KernelPath)
#: With no measured point for the head count: the tokens-on-M wgmma path up to this many heads (its instantiations:
#: 16 and 32 heads per CTA), the wgmma path above.
TOKENS_MAX_HEADS = 32
#: How the dispatcher's reasons name each path.
SAID: dict[KernelPath, str] = {"triton": "Triton", "wgmma": "wgmma", "wgmma_tokens": "tokens-on-M wgmma"}
#: What a point of ``kernel_paths.json`` holds, in order.
POINT_COLUMNS = ("heads", "context", "batch", "path", "tokens", "max_len")
#: How the tables' fixer is run (said where a table is refused).
_REDERIVE = "python -m kvwall.experiments.fused_decode.kernel_paths --write re-derives it from the recorded run"


def fastest(times: Mapping[KernelPath, float | None]) -> KernelPath:
    """The fastest of the timed paths in ``times`` (None: not timed); a tie goes to the earlier of
    :data:`KERNEL_PATHS` (the Triton path first)."""
    timed = {p: us for p, us in times.items() if us is not None}
    if not timed:
        raise ValueError("no path was timed at this point")
    return min(timed, key=lambda p: (timed[p], KERNEL_PATHS.index(p)))


def path_point(
    heads: int,
    context: int,
    batch: int,
    triton_us: float | None,
    wgmma_us: float | None,
    wgmma_tokens_us: float | None = None,
    *,
    tokens: int | None = None,
    max_len: int | None = None,
) -> list:
    """A ``kernel_paths.json`` point, ``[heads, context, batch, path, tokens, max_len]`` (:data:`POINT_COLUMNS`):
    ``path`` the fastest of the timed paths (:func:`fastest`), compared at 0.01 µs (the sidecar's rounding, so the
    choice can be re-derived from it); ``tokens`` / ``max_len`` the batch's tokens and longest request as timed
    (default: ``batch`` requests of ``context`` tokens each)."""
    times = dict(zip(KERNEL_PATHS, (triton_us, wgmma_us, wgmma_tokens_us)))
    path = fastest({p: None if us is None else round(us, 2) for p, us in times.items()})
    return [
        heads,
        context,
        batch,
        path,
        context * batch if tokens is None else tokens,
        context if max_len is None else max_len,
    ]


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _older(p: list) -> bool:
    """A point of a table written before points carried their shape: ``[heads, context, batch, path]``, times (or
    None) after it."""
    return len(p) == 4 or (len(p) > 4 and any(x is None or isinstance(x, float) for x in p[4:]))


def _point_problem(p: object) -> str | None:
    if not isinstance(p, list):
        return f"is a {type(p).__name__}, not a list {list(POINT_COLUMNS)}"
    older = _older(p)
    if not older and len(p) != len(POINT_COLUMNS):
        return f"has {len(p)} fields, not {len(POINT_COLUMNS)} {list(POINT_COLUMNS)}"
    for name, v in zip(POINT_COLUMNS, p[:4] if older else p):
        if name == "path":
            if v not in KERNEL_PATHS:
                return f"names the path {v!r}, not one of {', '.join(map(repr, KERNEL_PATHS))}"
        elif not _count(v):
            return f"has {name} {v!r}: not a positive integer"
    if older:
        bad = [
            x
            for x in p[4:]
            if not (
                x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0)
            )
        ]
        return f"has the time {bad[0]!r} after its path: not a positive number or null" if bad else None
    _, _, batch, _, tokens, max_len = p
    if not max_len <= tokens <= batch * max_len:
        return (
            f"has {tokens} tokens in {batch} requests of at most {max_len}: not between the longest request and "
            "batch x the longest"
        )
    return None


def _shaped(p: list) -> list:
    """A well-formed point as :data:`POINT_COLUMNS`: an older point (:func:`_older`) read as ``batch`` requests of
    ``context`` tokens each (what its grid was taken to be)."""
    return [*p[:4], p[1] * p[2], p[1]] if _older(p) else p


def table_problem(table: object) -> str | None:
    """What is wrong with ``table`` (a whole ``kernel_paths.json`` as read), in words naming the bad entry; None where
    it is well formed: a JSON object of GPU names to objects, each with ``capability`` (two non-negative integers),
    ``page_size`` where given (a positive integer) and ``points`` (a list of :data:`POINT_COLUMNS` lists: positive
    integers, a path of :data:`KERNEL_PATHS`, tokens between the longest request and batch x the longest; or an older
    point, :func:`_older`, with positive times or nulls after its path), no two points of one shape."""
    if not isinstance(table, dict):
        return f"the table is a JSON {type(table).__name__}, not an object of GPU names"
    for gpu, entry in table.items():
        where = f"entry {gpu!r}"
        if not isinstance(entry, dict):
            return f"{where} is a {type(entry).__name__}, not an object"
        cap = entry.get("capability")
        if not (
            isinstance(cap, list)
            and len(cap) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in cap)
        ):
            return f"{where} has capability {cap!r}: not [major, minor]"
        if "page_size" in entry and not _count(entry["page_size"]):
            return f"{where} has page_size {entry.get('page_size')!r}: not a positive integer"
        points = entry.get("points")
        if not isinstance(points, list):
            return f"{where} has points {type(points).__name__ if points is not None else 'missing'}, not a list"
        seen: dict[tuple, int] = {}
        for i, p in enumerate(points):
            problem = _point_problem(p)
            if problem:
                return f"{where}, point {i} {json.dumps(p) if _jsonable(p) else repr(p)} {problem}"
            p = _shaped(p)
            key = (p[0], p[2], p[4], p[5])
            if key in seen:
                return f"{where}, points {seen[key]} and {i} are the same shape (heads, batch, tokens, max_len) {key}"
            seen[key] = i
    return None


def _jsonable(v: object) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _log_gap(a: int, b: int) -> float:
    return abs(math.log2(max(a, 1) / max(b, 1)))


def measured_choice(
    entry: dict, heads: int, batch: int, max_len: int, tokens: int | None = None
) -> tuple[KernelPath, list] | None:
    """``(path, point)``: the path measured fastest at the point of ``entry`` (one GPU's well-formed table) of
    ``heads`` heads and this very shape (``batch``, ``tokens``, ``max_len``), else at its nearest point of ``heads``
    heads in (batch, tokens) in log scale (ties: the nearer longest request, then the earlier point); None where the
    entry measured no point of ``heads`` heads. ``tokens`` None: ``batch x max_len`` (every request the longest)."""
    tokens = batch * max_len if tokens is None else tokens
    same = [_shaped(p) for p in entry.get("points") or [] if p[0] == heads]
    if not same:
        return None
    best = min(same, key=lambda p: (_log_gap(p[2], batch) + _log_gap(p[4], tokens), _log_gap(p[5], max_len)))
    return best[3], best


_WARNED: set[tuple[str, str]] = set()


def _warn_refused(source: str, problem: str) -> None:
    if (source, problem) in _WARNED:
        return
    _WARNED.add((source, problem))
    warnings.warn(
        f"kvwall: refused the dispatcher's table {source}: {problem}. The dispatcher decides by the "
        f"capability rule until it is fixed ({_REDERIVE}).",
        RuntimeWarning,
        stacklevel=4,
    )


#: Tables :func:`_load` returned, checked (by id, the object kept: its id is not reused while it is here).
_CHECKED: dict[int, dict] = {}


@functools.cache
def _load(path: Path) -> tuple[dict, str | None]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, None
    except OSError as exc:
        problem = f"it cannot be read ({exc})"
    else:
        try:
            table = json.loads(text)
        except ValueError as exc:
            problem = f"it is not JSON ({exc})"
        else:
            problem = table_problem(table)
            if problem is None:
                _CHECKED[id(table)] = table
                return table, None
    _warn_refused(str(path), problem)
    return {}, problem


def read_table(path: Path) -> dict:
    """The table in ``path``, checked (:func:`table_problem`), read once per process (:func:`reload_table`); ``{}``
    where it is missing, or refused: malformed (said in a warning naming the file and the bad entry, once, and by
    :func:`table_refusal`)."""
    return _load(Path(path))[0]


def table_refusal(path: Path) -> str | None:
    """Why the table in ``path`` was refused (:func:`read_table`); None where it was not (or is missing)."""
    return _load(Path(path))[1]


def reload_table() -> None:
    """Forget the tables read so far: the next :func:`choose_path` reads ``kernel_paths.json`` (or its ``table_file``)
    again (after ``fused_decode_paths`` rewrote it, in the process that recorded it)."""
    _load.cache_clear()
    _CHECKED.clear()
    _WARNED.clear()


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


def capability_rule(heads: int) -> KernelPath:
    """The path with no measured point for ``heads``: the tokens-on-M wgmma path up to :data:`TOKENS_MAX_HEADS`
    heads, the wgmma path above."""
    return "wgmma_tokens" if heads <= TOKENS_MAX_HEADS else "wgmma"


def _shape(point: list) -> str:
    heads, context, batch, _, tokens, max_len = point
    if batch == 1:
        return f"{heads} heads, one request of {tokens:,} tokens"
    return (
        f"{heads} heads, batch {batch}, {tokens:,} tokens, the longest {max_len:,}: the grid's {context:,}-token "
        "mixed batch"
    )


def decide_path(
    heads: int,
    batch: int,
    max_len: int,
    *,
    gpu: str,
    capability: tuple[int, int] | None,
    refusal: str | None,
    table: dict,
    tokens: int | None = None,
    source: str | Path | None = None,
    refused: str | None = None,
) -> tuple[KernelPath, str]:
    """:func:`choose_path`'s rule without a device (the module docstring): ``heads`` query rows a request, ``batch``
    requests of ``tokens`` tokens together (None: ``batch x max_len``), the longest ``max_len``; ``gpu`` /
    ``capability`` the GPU's model and compute capability, ``refusal`` why the wgmma paths cannot run this call
    (None: they can; both refuse the same calls), ``table`` the whole ``kernel_paths.json`` (checked here unless it came
    from :func:`read_table`), ``source`` what to call it in a reason (its file), ``refused`` why :func:`read_table`
    refused it. The reason names the step that decided: the point it read and the GPU measured, or why none (not the
    times: they are not in the table)."""
    if refusal:
        return "triton", f"Triton: the wgmma paths cannot run this call ({refusal})"
    named = str(source) if source is not None else "handed to decide_path"
    problem = refused or (None if id(table) in _CHECKED and _CHECKED[id(table)] is table else table_problem(table))
    if problem:
        _warn_refused(named, problem)
        table = {}
    found = table_entry(table, gpu, capability)
    choice = measured_choice(found[1], heads, batch, max_len, tokens) if found else None
    if choice is None:
        path = capability_rule(heads)
        if problem:
            why = f"the measured table {named} was refused ({problem})"
        elif found:
            measured = sorted({p[0] for p in found[1].get("points") or []})
            why = (
                f"{found[0]} measured no point of {heads} heads (its head counts: "
                f"{', '.join(map(str, measured)) or 'none'})"
            )
        else:
            why = (
                f"no measured table for {gpu} nor for its compute capability "
                f"{'.'.join(map(str, capability or ())) or 'unknown'}"
            )
        return path, (
            f"{SAID[path]}: {why}, so the capability rule: where the wgmma paths can run (sm_90a, latent "
            f"512 / rope 64, 16-byte aligned rows), the tokens-on-M wgmma path up to {TOKENS_MAX_HEADS} "
            f"heads, the wgmma path above ({heads} heads)"
        )
    path, point = choice
    where = found[0] if found[0] == gpu else f"{found[0]} (the same compute capability as this {gpu})"
    tokens = batch * max_len if tokens is None else tokens
    if (point[2], point[4], point[5]) == (batch, tokens, max_len):
        return path, f"{SAID[path]}: measured fastest at this shape ({_shape(point)}) on {where}"
    return path, (
        f"{SAID[path]}: measured fastest at the nearest point of {heads} heads in batch and tokens "
        f"({_shape(point)}) on {where}"
    )


def table_text(table: Mapping[str, Mapping]) -> str:
    """A table's file text (``kernel_paths.json`` or its sidecar): an entry's fields one per line, each point on a line
    of its own (so a changed choice is a one-line diff), GPUs in the order given."""

    def value(key: str, v: object) -> str:
        if key == "points":
            return "[\n" + ",\n".join("   " + json.dumps(p, ensure_ascii=False) for p in v) + "\n  ]"
        return json.dumps(v, ensure_ascii=False)

    entries = [
        f" {json.dumps(gpu)}: {{\n" + ",\n".join(f"  {json.dumps(k)}: {value(k, v)}" for k, v in entry.items()) + "\n }"
        for gpu, entry in table.items()
    ]
    return "{\n" + ",\n".join(entries) + "\n}\n"
