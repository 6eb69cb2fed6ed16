"""Carry recorded results across a change of how sources are fingerprinted, without re-measuring and without
touching a number: ``python -m kvwall.results.migrate cuda-hashes [FILE ...]``.

CUDA sources (``*.cu``, ``*.cuh``) used to be hashed by their raw bytes; they are now hashed after
:func:`~kvwall.results.fingerprint.normalized_cuda`. For each such entry of a result's ``provenance.sources``, the
file as it was at the result's recorded commit (``git show <commit>:<path>``) is read: only when its raw-bytes hash
is exactly the recorded hash -- the recording compiled that very file -- is the entry replaced by the normalized
hash of that same content. Anything else (a dirty tree at recording time, a commit git does not have) is left as it
was, so a result can only stay as fresh or as stale as it really is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

from kvwall.results.fingerprint import CUDA_SUFFIXES, normalized_cuda
from kvwall.results.paths import PROJECT_ROOT, RESULTS_DIR

__all__ = ["migrate_cuda_hashes"]


def _short(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _at_commit(commit: str, rel: str, root: Path) -> bytes | None:
    proc = subprocess.run(["git", "-C", str(root), "show", f"{commit}:{rel}"], capture_output=True, check=False)
    return proc.stdout if proc.returncode == 0 else None


def migrate_cuda_hashes(path: Path, root: Path = PROJECT_ROOT) -> dict[str, str]:
    """Rewrite ``path``'s raw-byte CUDA source hashes as normalized hashes where the recorded commit proves them;
    returns ``{source: what happened}`` for every CUDA entry. The file is rewritten atomically, and only if an entry
    changed."""
    data = json.loads(path.read_text())
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
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                         delete=False) as tmp:
            tmp.write(json.dumps(data, indent=1) + "\n")
        os.chmod(tmp.name, path.stat().st_mode & 0o777)
        os.replace(tmp.name, path)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvwall.results.migrate", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["cuda-hashes"])
    parser.add_argument("files", nargs="*", type=Path, help=f"result files (default: every file in {RESULTS_DIR})")
    args = parser.parse_args(argv)
    for path in args.files or sorted(RESULTS_DIR.glob("*.json")):
        for rel, what in migrate_cuda_hashes(path).items():
            print(f"{path.name}: {rel}: {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
