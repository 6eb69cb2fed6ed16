"""Result files: write them atomically, read them back only if they are exactly what was recorded.

A file is ``{schema, experiment, params, rows, provenance}``. Writing validates the rows against the
experiment's registered row schema and stores a digest in the provenance: a sha256 of each part of the file
-- ``params``, ``rows`` and every provenance field (``provenance.gpu``, ``provenance.date``, ``provenance.scale``,
...) -- so loading can say which part was edited. Loading checks the shape, the digest (a file whose params,
rows or provenance were edited after recording is refused, naming the file and the field) and the row schema,
and names the file in every error. Files of format 2, whose digest covered params and rows only, are upgraded
by :func:`kvwall.results.migrate.migrate_file` (``python -m kvwall migrate-digests``). Row schemas are
registered by the layer that defines experiments (:func:`register_row_schema`); this module does not know any
experiment itself.
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
           "digest_problem", "write_atomically", "result_text",
           "recorded_scale", "register_row_schema", "validate_rows", "save_result", "load_result"]

#: Version of the file format; files of another version are refused (re-record them, or migrate format 2).
#: 3: the digest covers the provenance too, one sha256 per part (format 2: one sha256 of params+rows).
SCHEMA = 3
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


def _sha256(value: Any) -> str:
    """sha256 of ``value`` as canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def content_digest(params: dict[str, Any], rows: list[Any], provenance: dict[str, Any]) -> dict[str, str]:
    """The digest a file of this format stores: ``{part: sha256}`` for ``params``, ``rows`` and each field of
    ``provenance`` but the digest itself (``provenance.gpu``, ...), each hashed with its name as canonical JSON."""
    parts = {"params": params, "rows": rows,
             **{f"provenance.{k}": v for k, v in provenance.items() if k != "digest"}}
    return {name: _sha256({name: value}) for name, value in parts.items()}


def digest_problem(data: dict[str, Any]) -> str | None:
    """Why the digest of a file's JSON object ``data`` (of this format) does not vouch for it; None if it does."""
    provenance = data.get("provenance")
    stored = provenance.get("digest") if isinstance(provenance, dict) else None
    if not isinstance(stored, dict) or not stored:
        return "provenance has no content digest (recorded before digests existed)"
    expected = content_digest(data.get("params"), data.get("rows"), provenance)
    changed = sorted(k for k in expected.keys() | stored.keys() if expected.get(k) != stored.get(k))
    if changed:
        return (f"field(s) {', '.join(changed)} differ from what was recorded: their content digest does not match "
                "(edited by hand?)")
    return None


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its folder and a rename: a reader sees the old file
    or the new one, never half of one. The file gets the mode a plain ``open()`` would (0666 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                     delete=False) as tmp:
        tmp_path = Path(tmp.name)
        try:
            tmp.write(text)
            os.chmod(tmp_path, 0o666 & ~umask)
        except BaseException:
            tmp.close()
            tmp_path.unlink()
            raise
    os.replace(tmp_path, path)


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
            text += (" STALE: the code it depends on changed since this run (" + ", ".join(changed)
                     + "); re-record with `make record`.")
        return text


def save_result(result: Result, directory: Path = RESULTS_DIR) -> Path:
    """Validate ``result`` and write ``<directory>/<experiment>.json`` atomically (a reader never sees half a file).

    The digest of params, rows and provenance is computed over exactly what the file holds and stored in the
    provenance. The file gets the mode a plain ``open()`` would give it (0666 less the umask).
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
    result.provenance.digest = None
    provenance = _as_stored(asdict(result.provenance), "provenance")
    result.provenance.digest = content_digest(params, rows, provenance)  # over exactly what the file holds
    provenance["digest"] = result.provenance.digest
    directory.mkdir(parents=True, exist_ok=True)
    write_atomically(path, result_text({"schema": SCHEMA, "experiment": result.experiment, "params": params,
                                        "rows": rows, "provenance": provenance}))
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
    if data.get("schema") == 2:
        raise ResultFileError(path, f"written in file format 2, this code reads format {SCHEMA} (whose digest covers "
                                    "the provenance too); if the file is as recorded, upgrade it with "
                                    f"`python -m kvwall migrate-digests {path}`")
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
    if not isinstance(prov.digest, dict) or not all(isinstance(v, str) for v in prov.digest.values()):
        raise ResultFileError(path, "provenance has no content digest of this format ({part: sha256})")
    return prov


def recorded_scale(experiment: str, directory: Path = RESULTS_DIR) -> str | None:
    """The scale ``<directory>/<experiment>.json`` was recorded at, for the guard that keeps a small-scale run from
    replacing a full-scale result; None if there is no readable file.

    Files from before scales were recorded say nothing: only full-scale runs were committed, so they are "full".
    Any other scale is believed only where the file's digest vouches for it: a file whose digest does not match
    (its scale edited from full to small, say), or of an older format, counts as "full".
    """
    try:
        data = json.loads((Path(directory) / f"{experiment}.json").read_text())
        claimed = str(data["provenance"].get("scale") or "full")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if claimed != "full" and (data.get("schema") != SCHEMA or digest_problem(data)):
        return "full"
    return claimed


def load_result(experiment: str, directory: Path = RESULTS_DIR) -> Result:
    """Load ``<directory>/<experiment>.json``: refused, naming the file, unless it is exactly as recorded."""
    path = Path(directory) / f"{experiment}.json"
    data = _read(path, experiment)
    if not data["provenance"].get("digest"):
        raise ResultFileError(path, "provenance has no content digest (recorded before digests existed)")
    prov = _provenance(path, data["provenance"])
    problem = digest_problem(data)
    if problem:
        raise ResultFileError(path, problem)
    try:
        validate_rows(experiment, data["rows"])
    except RowSchemaError as exc:
        raise ResultFileError(path, str(exc)) from None
    return Result(experiment, data["params"], data["rows"], prov, path)
