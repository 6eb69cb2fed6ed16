"""Execute a chapter headless, as CI and ``python -m kvwall execute`` do: papermill on the MyST text.

papermill cannot read text notebooks itself, so the chapter is parsed with jupytext first. Before
anything runs, the path must be a chapter (``book/NN_slug.md``) that names itself in its ``start_chapter``
call, every parameter must be one its ``parameters`` cell defines (papermill itself only warns about unknown
ones and runs on defaults), and every output target must be writable: ``<out>/<stem>.ipynb`` and
``<out>/execution/<stem>.json``, ``out`` taken against the current directory (the chapter itself runs in
``book/``) and outside ``book/`` (a notebook there would be built as a page beside its chapter).
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

__all__ = ["BOOK_DIR", "ChapterError", "ChapterRunError", "chapter_files", "chapter_parameters", "execute_chapter",
           "output_targets"]

BOOK_DIR = PROJECT_ROOT / "book"
#: A chapter, ``NN_slug.md``, or a chapter's appendix page, ``NNa_slug.md`` (chapter 5's lab page).
_CHAPTER_NAME = re.compile(r"\d\d[a-z]?_[A-Za-z0-9_]+\.md")
#: What the chapter's process reads as paths; made absolute before it runs in ``book/``.
_PATH_VARIABLES = ("KVWALL_RESULTS_DIR",)


class ChapterError(ValueError):
    """Not a chapter, parameters the chapter does not take, or outputs that cannot be written: found before
    anything runs."""


class ChapterRunError(RuntimeError):
    """The chapter ran but its outputs could not be put in place (the notebook, or its execution record)."""


def chapter_files(book: Path = BOOK_DIR) -> list[Path]:
    """The chapters and their appendix pages, in order: ``book/NN_slug.md``, ``book/NNa_slug.md``."""
    return sorted(p for p in book.glob("*.md") if _CHAPTER_NAME.fullmatch(p.name))


def _chapter_notebook(path: Path) -> nbformat.NotebookNode:
    choices = ", ".join(p.name for p in chapter_files())
    if path.is_dir():
        raise ChapterError(f"{path} is a folder; give one chapter file, book/NN_slug.md ({choices}).")
    if not path.exists():
        raise ChapterError(f"{path}: no such file; the chapters are {choices} in {BOOK_DIR}.")
    if not path.is_file():
        raise ChapterError(f"{path} is not a plain file (a device or a pipe); give one of {choices} in {BOOK_DIR}.")
    if not _CHAPTER_NAME.fullmatch(path.name):
        raise ChapterError(f"{path} is not a chapter: only book/NN_slug.md files execute ({choices}).")
    try:
        return jupytext.read(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ChapterError(f"{path} cannot be read as a MyST chapter ({exc}); give one of {choices}.") from None


def _code(notebook: nbformat.NotebookNode, path: Path) -> list[ast.Module]:
    """Every code cell of the chapter, parsed (IPython's ``%`` and ``!`` lines left out)."""
    trees = []
    for number, cell in enumerate(notebook.cells, 1):
        if cell.cell_type != "code":
            continue
        source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in cell.source.splitlines())
        try:
            trees.append(ast.parse(source))
        except SyntaxError as exc:
            raise ChapterError(f"{path}: cell {number} is not valid Python ({exc.msg}, line {exc.lineno}); fix the "
                               "chapter before running it.") from None
    return trees


def _declared_name(trees: list[ast.Module], path: Path) -> str:
    """The name the chapter gives itself in ``start_chapter("NN_slug", ...)``: its execution record's name.
    Raises :class:`ChapterError` unless that is the file's own name and the chapter calls ``finish``."""
    calls = [node for tree in trees for node in ast.walk(tree) if isinstance(node, ast.Call)]
    names = [c.args[0].value for c in calls if isinstance(c.func, ast.Name) and c.func.id == "start_chapter"
             and c.args and isinstance(c.args[0], ast.Constant) and isinstance(c.args[0].value, str)]
    finishes = any(isinstance(c.func, ast.Attribute) and c.func.attr == "finish" for c in calls)
    if not names or not finishes:
        raise ChapterError(f"{path} does not call start_chapter(\"{path.stem}\", ...) and finish(): it would write "
                           "no execution record. Only the book's chapters execute; copy one and keep those calls.")
    if names[0] != path.stem:
        raise ChapterError(f"{path} calls itself {names[0]!r} (its start_chapter call), so its record would be "
                           f"execution/{names[0]}.json, not {path.stem}.json: change the name in that call to "
                           f"{path.stem!r}, or name the file {names[0]}.md.")
    return names[0]


def chapter_parameters(notebook: nbformat.NotebookNode) -> dict[str, str]:
    """Names the chapter's ``parameters`` cell assigns, with the source of each default value."""
    found: dict[str, str] = {}
    for cell in notebook.cells:
        if cell.cell_type == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            try:
                body = ast.parse(cell.source).body
            except SyntaxError as exc:
                raise ChapterError(f"the parameters cell is not valid Python ({exc.msg}, line {exc.lineno}); "
                                   "fix the chapter before running it.") from None
            for node in body:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                    node, ast.AnnAssign) else []
                found.update({t.id: ast.unparse(node.value) for t in targets
                              if isinstance(t, ast.Name) and node.value is not None})
    return found


def output_targets(path: Path, out_dir: Path) -> tuple[Path, Path]:
    """The executed notebook and the execution record that running chapter ``path`` into ``out_dir`` writes
    (absolute: ``out_dir`` is taken against the current directory). Raises :class:`ChapterError` if either
    cannot be written there; creates nothing."""
    out = Path(os.path.abspath(out_dir))
    notebook, record = out / f"{path.stem}.ipynb", out / "execution" / f"{path.stem}.json"
    try:
        if out.resolve() == BOOK_DIR or out.resolve().is_relative_to(BOOK_DIR):
            raise ChapterError(f"{out_dir}: the book's sources ({BOOK_DIR}) are no place for an executed notebook "
                               "(it would be built as a page); give a folder outside book/.")
        for target, kind in ((out, "a folder"), (record.parent, "a folder"), (notebook, "a file"),
                             (record, "a file")):
            if target.exists() and target.is_dir() != (kind == "a folder"):
                raise ChapterError(f"{target} is there and is not {kind}, so the run's output could not be put in "
                                   "place; move it away or give another output folder.")
            if target.is_symlink() and not target.exists():
                raise ChapterError(f"{target} is a link to nothing ({os.readlink(target)}); remove it or "
                                   "give another output folder.")
    except OSError as exc:
        raise ChapterError(f"{out_dir}: cannot write the executed notebook there ({exc.strerror or exc}); give a "
                           "folder you can write in.") from None
    return notebook, record


def _stat(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def execute_chapter(path: Path, out_dir: Path, *, timeout_s: int = 900, progress_bar: bool = False,
                    **parameters: Any) -> dict[str, Any]:
    """Run chapter ``path`` with ``parameters`` injected; write ``<out_dir>/<stem>.ipynb`` and the execution record
    ``<out_dir>/execution/<stem>.json`` (``out_dir`` taken against the current directory).

    Raises :class:`ChapterError` before running anything if ``path`` is not a chapter, a parameter is not
    in its ``parameters`` cell, or an output cannot be written (:func:`output_targets`); a failing cell raises
    papermill's ``PapermillExecutionError``, and a run whose outputs could not be put in place
    :class:`ChapterRunError`.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1:
        raise ChapterError(f"timeout_s={timeout_s!r}: give a positive whole number of seconds per cell.")
    path = Path(os.path.abspath(path))
    notebook = _chapter_notebook(path)
    known = chapter_parameters(notebook)
    unknown = sorted(set(parameters) - set(known))
    if unknown:
        takes = ", ".join(f"{k} (default {v})" for k, v in known.items())
        raise ChapterError(f"{path.name} has no parameter {', '.join(unknown)}; it takes: {takes}.")
    _declared_name(_code(notebook, path), path)
    target, record = output_targets(path, out_dir)
    out_dir = target.parent
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
    before = _stat(record)
    environment = {"KVWALL_EXECUTION_DIR": str(record.parent),
                   **{v: os.path.abspath(os.environ[v]) for v in _PATH_VARIABLES if os.environ.get(v)}}
    previous = {k: os.environ.get(k) for k in environment}
    os.environ.update(environment)
    try:
        papermill.execute_notebook(
            notebook, str(partial), parameters=parameters, kernel_name="python3",
            cwd=str(BOOK_DIR), progress_bar=progress_bar, execution_timeout=timeout_s,
        )
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _put_in_place(partial, target, umask)
    if _stat(record) in (None, before):
        raise ChapterRunError(f"{path.name} ran to its end but wrote no execution record at {record} (does it still "
                              f"call finish()?); the executed notebook is {target}.")
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError) as exc:
        raise ChapterRunError(f"{path.name} ran, but its execution record {record} cannot be read ({exc}).") from None


def _put_in_place(partial: Path, target: Path, umask: int) -> None:
    """Rename the notebook papermill wrote (finished or failed: it saves a failed run's notebook too) over
    ``target``; drop it if nothing was written."""
    if not partial.stat().st_size:
        partial.unlink()
        return
    os.chmod(partial, 0o666 & ~umask)
    try:
        os.replace(partial, target)
    except OSError as exc:
        raise ChapterRunError(f"the executed notebook could not be renamed to {target} ({exc.strerror or exc}); it "
                              f"is kept as {partial}.") from None
