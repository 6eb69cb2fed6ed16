"""Upgrade result files to this code's format without re-measuring anything: ``python -m kvwall migrate-digests``
(digests, :func:`migrate_file`) and ``python -m kvwall.results.migrate cuda-hashes`` (how CUDA sources are
fingerprinted, :func:`migrate_cuda_hashes`).

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

import argparse
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

from kvwall.results.fingerprint import CUDA_SUFFIXES, normalized_cuda
from kvwall.results.paths import PROJECT_ROOT, RESULTS_DIR

from kvwall.results.store import (
    SCHEMA, ResultFileError, content_digest, digest_problem, result_text, write_atomically,
)

__all__ = ["FORMAT_2", "format2_digest", "migrate_file", "migrate_cuda_hashes"]

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


# ----------------------------------------------------------------------------------------------------------------
# CUDA sources: raw bytes -> normalized (comments and layout whitespace stripped)
# ----------------------------------------------------------------------------------------------------------------

def _short(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _at_commit(commit: str, rel: str, root: Path) -> bytes | None:
    proc = subprocess.run(["git", "-C", str(root), "show", f"{commit}:{rel}"], capture_output=True, check=False)
    return proc.stdout if proc.returncode == 0 else None


def migrate_cuda_hashes(path: Path, root: Path = PROJECT_ROOT) -> dict[str, str]:
    """CUDA sources (``*.cu``, ``*.cuh``) used to be fingerprinted by their raw bytes; they are now hashed after
    :func:`~kvwall.results.fingerprint.normalized_cuda`. For each such entry of ``path``'s ``provenance.sources``,
    the file as it was at the result's recorded commit (``git show <commit>:<path>``) is read: only when its raw-bytes
    hash is exactly the recorded hash -- the recording compiled that very file -- is the entry replaced by the
    normalized hash of that same content. Anything else (a dirty tree at recording time, a commit git does not have)
    is left as it was, so a result stays as fresh or as stale as it really is. A file of this format whose digest
    does not match is refused (never re-sealed); after the change its digest is recomputed over exactly what it holds.
    Returns ``{source: what happened}`` for every CUDA entry."""
    path = Path(path)
    data = _read(path)
    if data.get("schema") == SCHEMA and (problem := digest_problem(data)):
        raise ResultFileError(path, f"{problem}; not migrated")
    prov = data["provenance"]
    report: dict[str, str] = {}
    for rel, recorded in prov["sources"].items():
        if not rel.endswith(CUDA_SUFFIXES):
            continue
        then = _at_commit(prov["git_commit"], rel, root)
        if then is None:
            report[rel] = f"left: {rel} is not in commit {prov['git_commit'][:10]}"
        elif _short(normalized_cuda(then).encode()) == recorded:
            report[rel] = "already normalized"
        elif _short(then) != recorded:
            report[rel] = f"left: the recorded hash is not commit {prov['git_commit'][:10]}'s file (dirty tree?)"
        else:
            prov["sources"][rel] = _short(normalized_cuda(then).encode())
            report[rel] = "migrated"
    if any(v == "migrated" for v in report.values()):
        if data.get("schema") == SCHEMA:
            prov["digest"] = content_digest(data.get("params"), data.get("rows"), prov)
        write_atomically(path, result_text(data))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvwall.results.migrate",
                                     description="Carry recorded results across a change of how sources are "
                                                 "fingerprinted (no number is touched).")
    parser.add_argument("what", choices=["cuda-hashes"])
    parser.add_argument("files", nargs="*", type=Path, help=f"result files (default: every file in {RESULTS_DIR})")
    args = parser.parse_args(argv)
    for path in args.files or sorted(RESULTS_DIR.glob("*.json")):
        for rel, what in migrate_cuda_hashes(path).items():
            print(f"{path.name}: {rel}: {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
