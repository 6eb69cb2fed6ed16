"""Execute a chapter headless, as CI and ``python -m kvwall execute`` do: papermill on the MyST text.

papermill cannot read text notebooks itself, so the chapter is parsed with jupytext first. Before
anything runs, the path must be a chapter (``book/NN_slug.md``) and every parameter must be one its
``parameters`` cell defines (papermill itself only warns about unknown ones and runs on defaults).
The chapter's own ``finish()`` record (how it ran, what it computed) is returned.

The executed notebook appears atomically, as result files do: papermill writes (and re-saves, cell by cell)
a hidden temporary file in the output folder, renamed over ``<stem>.ipynb`` when the run ends, failed or not;
a reader, or a second run sharing the folder, never sees half a notebook.
"""

from __future__ import annotations

import ast
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import jupytext
import nbformat
import papermill

from kvwall.results import PROJECT_ROOT

__all__ = ["BOOK_DIR", "ChapterError", "chapter_files", "chapter_parameters", "execute_chapter"]

BOOK_DIR = PROJECT_ROOT / "book"
#: A chapter, ``NN_slug.md``, or a chapter's appendix page, ``NNa_slug.md`` (chapter 5's lab page).
_CHAPTER_NAME = re.compile(r"\d\d[a-z]?_[A-Za-z0-9_]+\.md")


class ChapterError(ValueError):
    """Not a chapter, or parameters the chapter does not take: found before anything runs."""


def chapter_files(book: Path = BOOK_DIR) -> list[Path]:
    """The chapters and their appendix pages, in order: ``book/NN_slug.md``, ``book/NNa_slug.md``."""
    return sorted(p for p in book.glob("*.md") if _CHAPTER_NAME.fullmatch(p.name))


def _chapter_notebook(path: Path) -> nbformat.NotebookNode:
    choices = ", ".join(p.name for p in chapter_files())
    if path.is_dir():
        raise ChapterError(f"{path} is a folder; give one chapter file, book/NN_slug.md ({choices}).")
    if not path.is_file():
        raise ChapterError(f"{path}: no such file; the chapters are {choices} in {BOOK_DIR}.")
    if not _CHAPTER_NAME.fullmatch(path.name):
        raise ChapterError(f"{path} is not a chapter: only book/NN_slug.md files execute ({choices}).")
    return jupytext.read(path)


def chapter_parameters(notebook: nbformat.NotebookNode) -> dict[str, str]:
    """Names the chapter's ``parameters`` cell assigns, with the source of each default value."""
    found: dict[str, str] = {}
    for cell in notebook.cells:
        if cell.cell_type == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            for node in ast.parse(cell.source).body:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                    node, ast.AnnAssign) else []
                found.update({t.id: ast.unparse(node.value) for t in targets
                              if isinstance(t, ast.Name) and node.value is not None})
    return found


def execute_chapter(path: Path, out_dir: Path, *, timeout_s: int = 900, progress_bar: bool = False,
                    **parameters: Any) -> dict[str, Any]:
    """Run chapter ``path`` with ``parameters`` injected; write ``<out_dir>/<stem>.ipynb`` and the execution record.

    Raises :class:`ChapterError` before running anything if ``path`` is not a chapter or a parameter is not
    in its ``parameters`` cell; a failing cell raises papermill's ``PapermillExecutionError``.
    """
    path, out_dir = Path(path), Path(out_dir)
    notebook = _chapter_notebook(path)
    known = chapter_parameters(notebook)
    unknown = sorted(set(parameters) - set(known))
    if unknown:
        takes = ", ".join(f"{k} (default {v})" for k, v in known.items())
        raise ChapterError(f"{path.name} has no parameter {', '.join(unknown)}; it takes: {takes}.")
    exec_dir = out_dir / "execution"
    target = out_dir / f"{path.stem}.ipynb"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=out_dir, prefix=f".{path.stem}.", suffix=".tmp.ipynb")
        os.close(fd)
    except OSError as exc:
        raise ChapterError(f"{out_dir}: cannot write the executed notebook there ({exc.strerror or exc}); give a "
                           "folder you can write in.") from None
    partial = Path(name)
    umask = os.umask(0)
    os.umask(umask)
    previous = os.environ.get("KVWALL_EXECUTION_DIR")
    os.environ["KVWALL_EXECUTION_DIR"] = str(exec_dir)
    try:
        papermill.execute_notebook(
            notebook, str(partial), parameters=parameters, kernel_name="python3",
            cwd=str(BOOK_DIR), progress_bar=progress_bar, execution_timeout=timeout_s,
        )
    finally:
        if previous is None:
            os.environ.pop("KVWALL_EXECUTION_DIR", None)
        else:
            os.environ["KVWALL_EXECUTION_DIR"] = previous
        if partial.stat().st_size:  # written, finished or failed (papermill saves a failed run's notebook too)
            os.chmod(partial, 0o666 & ~umask)
            os.replace(partial, target)
        else:
            partial.unlink()
    return json.loads((exec_dir / f"{path.stem}.json").read_text())
