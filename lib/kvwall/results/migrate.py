"""Upgrade result files to this code's format without re-measuring anything: ``python -m kvwall migrate-digests``.

Format 2 stored one sha256 over params and rows, so an edit of the provenance (GPU, date, versions, scale,
``missing``) went unseen. Format 3 (:data:`kvwall.results.store.SCHEMA`) stores a digest of every part, the
provenance's fields included (:func:`kvwall.results.store.content_digest`). :func:`migrate_file` rewrites a
format-2 file as format 3 only where its old digest still matches its params and rows (a file edited since it was
recorded is refused, not laundered); the numbers are copied, never re-typed, and every other byte the writer
produces is what :func:`kvwall.results.store.save_result` would have written. A file already of this format is
checked and left as it is, so the command can run again on a folder (after recording with an older checkout, say).

What format 2 never covered cannot be vouched for after the fact: migrate files whose provenance you trust (the
committed ones: ``git diff book/results/`` shows an edit).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kvwall.results.store import (
    SCHEMA, ResultFileError, content_digest, digest_problem, result_text, write_atomically,
)

__all__ = ["FORMAT_2", "format2_digest", "migrate_file"]

#: The format this module upgrades from.
FORMAT_2 = 2


def format2_digest(params: Any, rows: Any) -> str:
    """Format 2's digest: sha256 of params and rows as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps({"params": params, "rows": rows}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultFileError(path, f"not readable as JSON ({exc}); not migrated") from None
    if not isinstance(data, dict) or not isinstance(data.get("provenance"), dict):
        raise ResultFileError(path, "not a result file (no provenance object); not migrated")
    return data


def migrate_file(path: Path) -> str:
    """Upgrade the result file ``path`` to format :data:`~kvwall.results.store.SCHEMA` in place (atomically).

    Returns ``"migrated"`` or ``"current"`` (already of this format, digest checked); raises
    :class:`~kvwall.results.ResultFileError` naming the file where it cannot be migrated: another format, an old
    digest that does not match (edited after recording), or a current-format file whose digest does not match.
    """
    path = Path(path)
    data = _read(path)
    schema = data.get("schema")
    if schema == SCHEMA:
        problem = digest_problem(data)
        if problem:
            raise ResultFileError(path, f"{problem}; not migrated")
        return "current"
    if schema != FORMAT_2:
        raise ResultFileError(path, f"file format {schema!r}: only format {FORMAT_2} files are migrated to "
                                    f"format {SCHEMA}; not migrated")
    provenance = data["provenance"]
    if provenance.get("digest") != format2_digest(data.get("params"), data.get("rows")):
        raise ResultFileError(path, "its params or rows differ from what was recorded (the format-2 digest does "
                                    "not match: edited by hand?); not migrated")
    provenance["digest"] = content_digest(data.get("params"), data.get("rows"), provenance)
    data["schema"] = SCHEMA
    write_atomically(path, result_text(data))
    return "migrated"
