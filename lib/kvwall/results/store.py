"""Result files: write them atomically, read them back only if they are exactly what was recorded.

A file (format :data:`SCHEMA` = 4) is one JSON object::

    {"schema": 4, "experiment": ..., "params": {...}, "rows": [...],
     "provenance": {"date": ..., "gpu": ..., "sources": {path: hash}, ..., "scale": ..., "missing": [...],
                    "digest": {"seal": <sha256>, "parts": {<part>: <sha256>, ...}}}}

It is sealed as one whole (:mod:`kvwall.results.seal`): one sha256 over everything but the digest -- schema,
experiment, params, rows and the provenance, ``sources`` (the code fingerprint) included -- and per-part hashes keyed
by it, which name the part that differs: an edit, or a genuine part of another recording spliced in with its own
hash, is refused naming the file and the field. The seal is a digest, not a signature, so nothing a sealed file
holds is trusted to be harmless either: every field's type is checked, source paths must lie inside the project.

Loading (:func:`load_result`) reads only a plain file (never a symbolic link, folder, named pipe or device), of
bounded size and depth, without duplicate keys (:func:`kvwall.results.files.read_json`); then checks
the shape, the seal (naming the file and the field that differs), the provenance's fields and the experiment's row
schema. Every refusal is a :class:`ResultFileError` naming the file. Files of older formats are refused with the
advice to re-record them. Writing (:func:`save_result`) validates the rows against the experiment's registered row
schema, refuses a target that is not a plain file (:func:`check_writable_target`, which a caller can run before
spending time on a measurement) and replaces the file atomically (a temporary file in the same folder, fsynced, then
renamed): a reader, or a killed ``record``, sees the previous file or the new one, never half of one; a refused
write leaves the previous file as it was. Row schemas are registered by the layer that defines experiments
(:func:`register_row_schema`); this module does not know any experiment itself.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from kvwall.results.errors import ResultFileError, ResultMissingError, ResultTargetError, RowSchemaError, shown
from kvwall.results.files import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    check_writable_target,
    read_json,
    too_deep,
    write_atomically,
)
from kvwall.results.fingerprint import source_hashes
from kvwall.results.locations import PROJECT_ROOT, RESULTS_DIR
from kvwall.results.provenance import SCALES, Provenance
from kvwall.results.seal import content_digest, digest_problem

__all__ = [
    "SCHEMA",
    "MAX_FILE_BYTES",
    "MAX_DEPTH",
    "Result",
    "ResultFileError",
    "ResultMissingError",
    "ResultTargetError",
    "RowSchemaError",
    "check_writable_target",
    "content_digest",
    "digest_problem",
    "read_json",
    "write_atomically",
    "result_text",
    "recorded_scale",
    "register_row_schema",
    "validate_rows",
    "save_result",
    "load_result",
]

#: Version of the file format; files of another version are refused (re-record them).
#: 4: one seal (sha256) over the whole file, with per-part hashes keyed by it. 3: one sha256 per part, each on its
#: own (genuine parts of two recordings could be spliced into one file that passed). 2: one sha256 of params + rows.
SCHEMA = 4
_MAX_ERRORS_SHOWN = 5
_ROW_SCHEMAS: dict[str, TypeAdapter[list[Any]]] = {}


def register_row_schema(experiment: str, row_type: Any) -> None:
    """Declare the type one row of ``experiment`` must have (a pydantic model or a union of them)."""
    _ROW_SCHEMAS[experiment] = TypeAdapter(list[row_type])


def _describe(error: dict[str, Any], rows: list[Any]) -> str:
    loc = list(error["loc"])
    index = loc.pop(0) if loc and isinstance(loc[0], int) else None
    where = f"row {index}" if index is not None else "rows"
    if index is not None and isinstance(rows[index], dict) and "section" in rows[index]:
        where += f" (section {shown(rows[index]['section'])})"
        if loc and loc[0] == rows[index]["section"]:
            loc.pop(0)  # the union member's tag repeats the section
    field_name = f", field {'.'.join(map(str, loc))!r}" if loc else ""
    return f"{where}{field_name}: {error['msg']}"


def _as_stored(value: Any, what: str) -> Any:
    """``value`` as a result file holds it: tuples become lists, dict keys strings."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError, RecursionError) as exc:
        raise RowSchemaError(
            f"{what} cannot be stored as JSON ({exc}); convert such values to int, float or str before returning them"
        ) from None


def validate_rows(experiment: str, rows: list[Any]) -> None:
    """Raise :class:`RowSchemaError` naming each bad row, its section and field, if ``rows`` (as a file would
    hold them) do not match the experiment's registered row schema."""
    adapter = _ROW_SCHEMAS.get(experiment)
    if adapter is None:
        raise LookupError(
            f"no row schema registered for experiment {experiment!r} (known: {sorted(_ROW_SCHEMAS)}); "
            "import kvwall.experiments, which registers every experiment's schema, before "
            "saving or loading its results."
        )
    rows = _as_stored(rows, f"rows of {experiment!r}")
    try:
        adapter.validate_python(rows)
    except ValidationError as exc:
        problems = [_describe(e, rows) for e in exc.errors()]
        more = f"; and {len(problems) - _MAX_ERRORS_SHOWN} more" if len(problems) > _MAX_ERRORS_SHOWN else ""
        raise RowSchemaError(
            f"rows do not match the schema of {experiment!r}: " + "; ".join(problems[:_MAX_ERRORS_SHOWN]) + more
        ) from None


def result_text(data: dict[str, Any]) -> str:
    """A result file's text, as :func:`save_result` writes it."""
    return json.dumps(data, indent=1) + "\n"


@dataclass
class Result:
    """One experiment's run: its parameters, its rows (each with a ``section``), where it came from, and the
    file it was loaded from or saved to."""

    experiment: str
    params: dict[str, Any]
    rows: list[dict[str, Any]]
    provenance: Provenance
    path: Path | None = None

    def table(self, section: str) -> list[dict[str, Any]]:
        """The rows of one section (a KeyError naming the file and the sections it has, if there are none)."""
        rows = [r for r in self.rows if r.get("section") == section]
        if not rows:
            sections = sorted({str(r.get("section")) for r in self.rows})
            raise KeyError(f"{self.path or self.experiment}: no rows in section {section!r}; it has {sections}.")
        return rows

    def changed_sources(self, root: Path = PROJECT_ROOT) -> list[str]:
        """Files this result depends on whose code differs now (or that are gone) from when it was recorded."""
        then = self.provenance.sources
        now = source_hashes(then, root)
        return sorted(k for k in then if now[k] != then[k])

    @property
    def stale(self) -> bool:
        """True when the code this result depends on changed since it was recorded."""
        return bool(self.changed_sources())

    def caption(self) -> str:
        text = f"Recorded on {self.provenance.short()} ({self.path.name if self.path else self.experiment})."
        changed = self.changed_sources()
        if changed:
            text += (
                " STALE: the code it depends on changed since this run ("
                + ", ".join(changed)
                + "); re-record with `make record`."
            )
        return text


def save_result(result: Result, directory: Path = RESULTS_DIR) -> Path:
    """Validate ``result`` and write ``<directory>/<experiment>.json`` atomically (a reader never sees half a file).

    The seal is computed over exactly what the file holds and stored in the provenance. Refused -- the file that
    was there left as it was -- where the scale is not one of :data:`SCALES`, the rows do not match their schema,
    the file would be one :func:`load_result` refuses (too big, too deep), or something other than a plain file is
    at the path (:func:`check_writable_target`). The file gets the mode a plain ``open()`` would give it (0666 less
    the umask).
    """
    directory = Path(directory)
    path = directory / f"{result.experiment}.json"
    if result.provenance.scale not in SCALES:
        raise ValueError(
            f"{path}: provenance.scale={result.provenance.scale!r}, expected one of {SCALES}; "
            "results are made by kvwall.experiments.run_experiment, which stamps the scale."
        )
    try:
        params, rows = _as_stored([result.params, result.rows], "params and rows")
        validate_rows(result.experiment, rows)
    except RowSchemaError as exc:
        raise RowSchemaError(f"{path} not written: {exc}") from None
    check_writable_target(path)
    provenance = _as_stored({**asdict(result.provenance), "digest": None}, "provenance")
    data = {"schema": SCHEMA, "experiment": result.experiment, "params": params, "rows": rows, "provenance": provenance}
    digest = content_digest(data)  # over exactly what the file holds
    provenance["digest"] = digest
    text = result_text(data)
    size = len(text.encode())
    if size > MAX_FILE_BYTES or too_deep(text):
        why = (
            f"{size:,} bytes, more than {MAX_FILE_BYTES:,}"
            if size > MAX_FILE_BYTES
            else f"nested more than {MAX_DEPTH} deep"
        )
        raise RowSchemaError(
            f"{path} not written: the file would be {why}, which loading refuses; keep less in the rows"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomically(path, text)
    except OSError as exc:
        raise ResultTargetError(path, f"cannot be written ({exc.strerror or exc})") from None
    result.provenance.digest = digest
    result.path = path
    return path


_TOP_KEYS = {"schema": int, "experiment": str, "params": dict, "rows": list, "provenance": dict}
_OPTIONAL = (str, type(None))
#: The type of each provenance field (``sources``, ``missing``, ``digest`` and ``scale`` are checked further).
_PROVENANCE_TYPES: dict[str, tuple[type, ...]] = {
    "date": (str,),
    "device": (str,),
    "gpu": _OPTIONAL,
    "driver": _OPTIONAL,
    "cuda": _OPTIONAL,
    "torch": (str,),
    "triton": _OPTIONAL,
    "flashinfer": _OPTIONAL,
    "python": (str,),
    "git_commit": (str,),
    "git_dirty": (bool, type(None)),
    "sources": (dict,),
    "scale": _OPTIONAL,
    "missing": (list,),
    "digest": (dict,),
}
assert set(_PROVENANCE_TYPES) == {f.name for f in fields(Provenance)}


def _read(path: Path, experiment: str) -> dict[str, Any]:
    """The file's JSON object, checked for the format, the top-level shape and the seal."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise ResultFileError(path, "top level is not a JSON object")
    schema = data.get("schema")
    provenance = data.get("provenance")
    digest = provenance.get("digest") if isinstance(provenance, dict) else None
    if schema != SCHEMA and not (isinstance(digest, dict) and "seal" in digest):
        raise ResultFileError(
            path,
            f"written in file format {shown(schema)}, this code reads format {SCHEMA} only (one "
            "seal over the whole file); older files cannot be vouched for as one recording",
            f"Re-record it: `python -m kvwall record {experiment}` (on a GPU for GPU "
            "measurements), or restore it with `git checkout -- book/results/`.",
        )
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise ResultFileError(
            path, f"unknown top-level field(s) {shown(unknown)} (not part of a result file: added by hand?)"
        )
    for key, kind in _TOP_KEYS.items():
        if not isinstance(data.get(key), kind) or (kind is int and isinstance(data.get(key), bool)):
            raise ResultFileError(path, f"field {key!r} missing or not a {kind.__name__}")
    problem = digest_problem(data)
    if problem:
        raise ResultFileError(path, problem)
    if data["experiment"] != experiment:
        raise ResultFileError(
            path,
            f"says experiment {shown(data['experiment'])}, expected {experiment!r} (the file's "
            "name): a result copied under another name",
        )
    return data


def _source_problem(sources: dict[str, Any]) -> str | None:
    for rel, value in sources.items():
        parts = rel.split("/")
        if not rel or rel.startswith("/") or "\\" in rel or "\0" in rel or any(p in ("", ".", "..") for p in parts):
            return f"provenance.sources names {shown(rel)}, not a path inside the project"
        if not isinstance(value, str):
            return f"provenance.sources[{shown(rel)}] is not a hash string"
    return None


def _provenance(path: Path, raw: dict[str, Any]) -> Provenance:
    if set(raw) != set(_PROVENANCE_TYPES):
        missing, extra = sorted(set(_PROVENANCE_TYPES) - set(raw)), sorted(set(raw) - set(_PROVENANCE_TYPES))
        raise ResultFileError(
            path, f"provenance does not have the expected fields (missing {missing}, unknown {shown(extra)})"
        )
    for name, kinds in _PROVENANCE_TYPES.items():
        if not isinstance(raw[name], kinds):
            raise ResultFileError(
                path,
                f"provenance.{name} is {type(raw[name]).__name__}, expected "
                + " or ".join("null" if k is type(None) else k.__name__ for k in kinds),
            )
    prov = Provenance(**raw)
    if not prov.sources or not prov.git_commit or not prov.date:
        raise ResultFileError(path, "provenance lacks sources, git_commit or date")
    problem = _source_problem(prov.sources)
    if problem:
        raise ResultFileError(path, problem)
    if prov.scale not in SCALES:
        raise ResultFileError(path, f"provenance.scale is {shown(prov.scale)}, expected one of {SCALES}")
    if not all(isinstance(m, str) for m in prov.missing):
        raise ResultFileError(path, "provenance.missing is not a list of names")
    return prov


def recorded_scale(experiment: str, directory: Path = RESULTS_DIR) -> str | None:
    """The scale ``<directory>/<experiment>.json`` was recorded at, for the guard that keeps a small-scale run from
    replacing a full-scale result; None if there is no readable file (read as :func:`read_json` does: a pipe or a
    device there is not read, it is refused later by :func:`check_writable_target`).

    Files from before scales were recorded say nothing: only full-scale runs were committed, so they are "full".
    Any other scale is believed only where the file's seal vouches for it: a file whose seal does not match (its
    scale edited from full to small, say), or of an older format, counts as "full".
    """
    try:
        data = read_json(Path(directory) / f"{experiment}.json")
        claimed = str(data["provenance"].get("scale") or "full")
    except (ResultFileError, KeyError, TypeError, AttributeError):
        return None
    if claimed != "full" and (data.get("schema") != SCHEMA or digest_problem(data)):
        return "full"
    return claimed


def load_result(experiment: str, directory: Path = RESULTS_DIR) -> Result:
    """Load ``<directory>/<experiment>.json``: refused, naming the file (and the field), unless it is exactly as
    recorded -- one sealed whole -- and its rows match the experiment's schema."""
    path = Path(directory) / f"{experiment}.json"
    data = _read(path, experiment)
    prov = _provenance(path, data["provenance"])
    try:
        validate_rows(experiment, data["rows"])
    except RowSchemaError as exc:
        raise ResultFileError(path, str(exc)) from None
    return Result(experiment, data["params"], data["rows"], prov, path)
