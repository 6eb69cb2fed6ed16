"""Install the book's JupyterLab settings into an environment without clobbering the user's own.

``make setup`` runs ``python -m kvwall.reports.lab_settings book/lab-overrides.json <env>``: the book's
overrides (open ``.md`` files as Jupytext notebooks) are merged into ``<env>/share/jupyter/lab/settings/
overrides.json``. A setting the environment already has keeps its value (the user's choice wins, and
the command says which it kept); a file that is not valid JSON is left as it is, with a message.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["merge_settings", "install_overrides", "main"]


def merge_settings(ours: dict[str, Any], theirs: dict[str, Any], path: str = "") -> tuple[dict[str, Any], list[str]]:
    """``theirs`` with every setting of ``ours`` it lacks added; returns the merge and the settings where ``theirs``
    kept a different value (as dotted paths)."""
    merged = dict(theirs)
    kept = []
    for key, value in ours.items():
        where = f"{path}.{key}" if path else key
        if key not in theirs:
            merged[key] = value
        elif isinstance(value, dict) and isinstance(theirs[key], dict):
            merged[key], inner = merge_settings(value, theirs[key], where)
            kept += inner
        elif theirs[key] != value:
            kept.append(where)
    return merged, kept


def install_overrides(source: Path, env: Path) -> str:
    """Merge ``source`` into ``env``'s JupyterLab ``overrides.json``; returns what was done, in one line."""
    target = Path(env) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    ours = json.loads(Path(source).read_text(encoding="utf-8"))
    if target.is_file():
        try:
            theirs = json.loads(target.read_text(encoding="utf-8") or "{}")
        except json.JSONDecodeError as exc:
            return (f"{target} is not valid JSON ({exc}); left it unchanged. To open the book's .md chapters as "
                    f"notebooks, merge {source} into it by hand.")
        if not isinstance(theirs, dict):
            return f"{target} does not hold a JSON object; left it unchanged. Merge {source} into it by hand."
    else:
        theirs = {}
    merged, kept = merge_settings(ours, theirs)
    if merged == theirs:
        done = f"{target} already has the book's JupyterLab settings"
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(merged, indent=2) + "\n", encoding="utf-8")
        done = f"merged the book's JupyterLab settings into {target}"
    if kept:
        done += f"; kept this environment's own value for {', '.join(kept)}"
    return done + "."


def main(argv: list[str] | None = None) -> int:
    """``python -m kvwall.reports.lab_settings SOURCE ENV``: merge and say what was done."""
    parser = argparse.ArgumentParser(prog="python -m kvwall.reports.lab_settings", description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("source", type=Path, help="the book's overrides (book/lab-overrides.json)")
    parser.add_argument("env", type=Path, help="the environment's prefix (the venv, or $CONDA_PREFIX)")
    args = parser.parse_args(argv)
    print(install_overrides(args.source, args.env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
