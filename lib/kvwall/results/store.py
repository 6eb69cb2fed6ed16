"""Result files: write them atomically, read them back only if they are exactly what was recorded.

A file is ``{schema, experiment, params, rows, provenance}``. Writing validates the rows against the
experiment's registered row schema and stores a sha256 digest of params+rows in the provenance;
loading checks the shape, the digest (a file edited after recording is refused) and the row schema,
and names the file in every error. Row schemas are registered by the layer that defines experiments
(:func:`register_row_schema`); this module does not know any experiment itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from kvwall.results.fingerprint import source_hashes
from kvwall.results.paths import PROJECT_ROOT, RESULTS_DIR
from kvwall.results.provenance import SCALES, Provenance

__all__ = ["SCHEMA", "Result", "ResultFileError", "ResultMissingError", "RowSchemaError", "content_digest",
           "recorded_scale", "register_row_schema", "validate_rows", "save_result", "load_result"]

#: Version of the file format; files of another version are refused (re-record them).
SCHEMA = 2
_MAX_ERRORS_SHOWN = 5


class ResultFileError(ValueError):
    """A result file that is missing, unreadable, edited or not in the expected shape."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(
            f"{path}: {problem}. Result files are written by `python -m kvwall record <experiment>` "
            "(on a GPU for GPU measurements); re-record it, or restore it with `git checkout -- book/results/`."
        )
        self.path = path


class ResultMissingError(ResultFileError):
    """No result file at all (not yet recorded); anything else wrong with a file stays a ResultFileError."""


class RowSchemaError(ValueError):
    """Rows that do not match their experiment's row schema (the message names row, section and field)."""


_ROW_SCHEMAS: dict[str, TypeAdapter[list[Any]]] = {}


def register_row_schema(experiment: str, row_type: Any) -> None:
    """Declare the type one row of ``experiment`` must have (a pydantic model or a union of them)."""
    _ROW_SCHEMAS[experiment] = TypeAdapter(list[row_type])


def _describe(error: dict[str, Any], rows: list[Any]) -> str:
    loc = list(error["loc"])
    index = loc.pop(0) if loc and isinstance(loc[0], int) else None
    where = f"row {index}" if index is not None else "rows"
    if index is not None and isinstance(rows[index], dict) and "section" in rows[index]:
        where += f" (section {rows[index]['section']!r})"
        if loc and loc[0] == rows[index]["section"]:
            loc.pop(0)  # the union member's tag repeats the section
    field_name = f", field {'.'.join(map(str, loc))!r}" if loc else ""
    return f"{where}{field_name}: {error['msg']}"


def _as_stored(value: Any, what: str) -> Any:
    """``value`` as a result file holds it: tuples become lists, dict keys strings."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise RowSchemaError(f"{what} cannot be stored as JSON ({exc}); convert such values to int, float or str "
                             "before returning them") from None


def validate_rows(experiment: str, rows: list[Any]) -> None:
    """Raise :class:`RowSchemaError` naming each bad row, its section and field, if ``rows`` (as a file would
    hold them) do not match the experiment's registered row schema."""
    adapter = _ROW_SCHEMAS.get(experiment)
    if adapter is None:
        raise LookupError(f"no row schema registered for experiment {experiment!r} (known: {sorted(_ROW_SCHEMAS)}); "
                          "import kvwall.experiments, which registers every experiment's schema, before "
                          "saving or loading its results.")
    rows = _as_stored(rows, f"rows of {experiment!r}")
    try:
        adapter.validate_python(rows)
    except ValidationError as exc:
        problems = [_describe(e, rows) for e in exc.errors()]
        more = f"; and {len(problems) - _MAX_ERRORS_SHOWN} more" if len(problems) > _MAX_ERRORS_SHOWN else ""
        raise RowSchemaError(f"rows do not match the schema of {experiment!r}: "
                             + "; ".join(problems[:_MAX_ERRORS_SHOWN]) + more) from None


def content_digest(params: dict[str, Any], rows: list[Any]) -> str:
    """sha256 of params and rows as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps({"params": params, "rows": rows}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


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
            text += (" STALE: the code it depends on changed since this run (" + ", ".join(changed)
                     + "); re-record with `make record`.")
        return text


def save_result(result: Result, directory: Path = RESULTS_DIR) -> Path:
    """Validate ``result`` and write ``<directory>/<experiment>.json`` atomically (a reader never sees half a file).

    The digest of params+rows is computed over exactly what the file holds and stored in the provenance.
    """
    directory = Path(directory)
    path = directory / f"{result.experiment}.json"
    if result.provenance.scale not in SCALES:
        raise ValueError(f"{path}: provenance.scale={result.provenance.scale!r}, expected one of {SCALES}; "
                         "results are made by kvwall.experiments.run_experiment, which stamps the scale.")
    try:
        params, rows = _as_stored([result.params, result.rows], "params and rows")
        validate_rows(result.experiment, rows)
    except RowSchemaError as exc:
        raise RowSchemaError(f"{path} not written: {exc}") from None
    result.provenance.digest = content_digest(params, rows)  # over exactly what the file holds
    text = json.dumps({"schema": SCHEMA, "experiment": result.experiment, "params": params, "rows": rows,
                       "provenance": asdict(result.provenance)}, indent=1) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=directory, prefix=f".{path.name}.", suffix=".tmp",
                                     delete=False) as tmp:
        tmp_path = Path(tmp.name)
        try:
            tmp.write(text)
        except BaseException:
            tmp.close()
            tmp_path.unlink()
            raise
    os.replace(tmp_path, path)
    result.path = path
    return path


_TOP_KEYS = {"schema": int, "experiment": str, "params": dict, "rows": list, "provenance": dict}
_PROVENANCE_FIELDS = {f.name for f in fields(Provenance)}


def _read(path: Path, experiment: str) -> dict[str, Any]:
    """The file's JSON object, checked for the top-level shape and this experiment."""
    if not path.is_file():
        raise ResultMissingError(path, "no such result file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultFileError(path, f"not valid JSON ({exc}); truncated?") from None
    if not isinstance(data, dict):
        raise ResultFileError(path, "top level is not a JSON object")
    if isinstance(data.get("schema"), int) and data["schema"] != SCHEMA:
        raise ResultFileError(path, f"written in file format {data['schema']}, this code reads format {SCHEMA}")
    for key, kind in _TOP_KEYS.items():
        if not isinstance(data.get(key), kind):
            raise ResultFileError(path, f"field {key!r} missing or not a {kind.__name__}")
    if data["experiment"] != experiment:
        raise ResultFileError(path, f"says experiment {data['experiment']!r}, expected {experiment!r}")
    return data


def _provenance(path: Path, raw: dict[str, Any]) -> Provenance:
    if set(raw) != _PROVENANCE_FIELDS:
        missing, extra = sorted(_PROVENANCE_FIELDS - set(raw)), sorted(set(raw) - _PROVENANCE_FIELDS)
        raise ResultFileError(path, f"provenance does not have the expected fields (missing {missing}, "
                                    f"unknown {extra})")
    prov = Provenance(**raw)
    if not isinstance(prov.sources, dict) or not prov.sources or not prov.git_commit or not prov.date:
        raise ResultFileError(path, "provenance lacks sources, git_commit or date")
    if prov.scale not in SCALES:
        raise ResultFileError(path, f"provenance.scale is {prov.scale!r}, expected one of {SCALES}")
    if not isinstance(prov.missing, list):
        raise ResultFileError(path, "provenance.missing is not a list")
    return prov


def recorded_scale(experiment: str, directory: Path = RESULTS_DIR) -> str | None:
    """The scale ``<directory>/<experiment>.json`` says it was recorded at; None if there is no readable file.

    Files from before scales were recorded say nothing: only full-scale runs were committed, so they are "full".
    """
    try:
        provenance = json.loads((Path(directory) / f"{experiment}.json").read_text())["provenance"]
        return str(provenance.get("scale") or "full")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return None


def load_result(experiment: str, directory: Path = RESULTS_DIR) -> Result:
    """Load ``<directory>/<experiment>.json``: refused, naming the file, unless it is exactly as recorded."""
    path = Path(directory) / f"{experiment}.json"
    data = _read(path, experiment)
    prov = _provenance(path, data["provenance"])
    if not prov.digest:
        raise ResultFileError(path, "provenance has no content digest (recorded before digests existed)")
    if content_digest(data["params"], data["rows"]) != prov.digest:
        raise ResultFileError(path, "params or rows differ from what was recorded: the content digest does not "
                                    "match (edited by hand?)")
    try:
        validate_rows(experiment, data["rows"])
    except RowSchemaError as exc:
        raise ResultFileError(path, str(exc)) from None
    return Result(experiment, data["params"], data["rows"], prov, path)
