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
from unittest import mock

import jupytext
import nbformat
import papermill

from kvwall.results import PROJECT_ROOT

BOOK_DIR = PROJECT_ROOT / "book"
#: A chapter, ``NN_slug.md``, or a chapter's appendix page, ``NNa_slug.md`` (chapter 5's lab page).
_CHAPTER_NAME = re.compile(r"\d\d[a-z]?_[A-Za-z0-9_]+\.md")
#: What the chapter's process reads as paths; made absolute before it runs in ``book/``.
_PATH_VARIABLES = ("KVWALL_RESULTS_DIR",)
#: IPython's ``%`` and ``!`` lines, left out when a cell is parsed as Python.
_MAGIC = re.compile(r"^\s*[%!].*$", re.M)


class ChapterError(ValueError):
    """Not a chapter, parameters the chapter does not take, or outputs that cannot be written: found before
    anything runs."""


class ChapterRunError(RuntimeError):
    """The chapter ran but its outputs could not be put in place (the notebook, or its execution record)."""


def chapter_files(book: Path = BOOK_DIR) -> list[Path]:
    """The chapters and their appendix pages, in order: ``book/NN_slug.md``, ``book/NNa_slug.md``."""
    return sorted(p for p in book.glob("*.md") if _CHAPTER_NAME.fullmatch(p.name))


def _chapter_notebook(path: Path) -> nbformat.NotebookNode:
    """``path`` read by jupytext, or :class:`ChapterError` saying why it is not a chapter and naming the chapters."""
    problem = (
        "is a folder"
        if path.is_dir()
        else "no such file"
        if not path.exists()
        else "is not a plain file (a device or a pipe)"
        if not path.is_file()
        else "is not a chapter"
        if not _CHAPTER_NAME.fullmatch(path.name)
        else None
    )
    try:
        if problem is None:
            return jupytext.read(path)
    except (OSError, UnicodeDecodeError) as exc:
        problem = f"cannot be read as a MyST chapter ({exc})"
    chapters = ", ".join(p.name for p in chapter_files())
    raise ChapterError(f"{path}: {problem}; give one chapter file, book/NN_slug.md ({chapters}).")


def _check_declared_name(notebook: nbformat.NotebookNode, path: Path) -> None:
    """Raise :class:`ChapterError` unless every code cell parses (IPython's ``%`` and ``!`` lines left out) and the
    chapter calls ``start_chapter("<its file's stem>", ...)`` (its execution record's name) and ``finish()``."""
    calls = []
    for number, cell in enumerate((c for c in notebook.cells if c.cell_type == "code"), 1):
        try:
            calls += [n for n in ast.walk(ast.parse(_MAGIC.sub("", cell.source))) if isinstance(n, ast.Call)]
        except SyntaxError as exc:
            raise ChapterError(
                f"{path}: code cell {number} is not valid Python ({exc.msg}, line {exc.lineno})."
            ) from None
    names = [
        ast.literal_eval(c.args[0])
        for c in calls
        if ast.unparse(c.func) == "start_chapter" and c.args and isinstance(c.args[0], ast.Constant)
    ]
    if names[:1] != [path.stem] or not any(ast.unparse(c.func).endswith(".finish") for c in calls):
        raise ChapterError(
            f"{path} must call start_chapter({path.stem!r}, ...) and finish() to write its execution "
            f"record (its start_chapter names {names[0] if names else None!r}); copy a chapter's calls."
        )


def chapter_parameters(notebook: nbformat.NotebookNode) -> dict[str, str]:
    """Names the chapter's ``parameters`` cell assigns, with the source of each default value."""
    cells = [c for c in notebook.cells if c.cell_type == "code" and "parameters" in c.metadata.get("tags", [])]
    assigns = [
        node for c in cells for node in ast.parse(c.source).body if isinstance(node, (ast.Assign, ast.AnnAssign))
    ]
    return {
        t.id: ast.unparse(node.value)
        for node in assigns
        if node.value is not None
        for t in getattr(node, "targets", [getattr(node, "target", None)])
        if isinstance(t, ast.Name)
    }


def _outputs(path: Path, out_dir: Path) -> tuple[Path, Path, Path]:
    """Where running chapter ``path`` into ``out_dir`` (taken against the current directory) writes: the hidden
    notebook papermill writes, created here, the executed notebook it is renamed to, and the execution record.
    Raises :class:`ChapterError`, creating nothing, if any of them cannot be written."""
    out = Path(os.path.abspath(out_dir))
    notebook, record = out / f"{path.stem}.ipynb", out / "execution" / f"{path.stem}.json"
    try:
        if out.resolve().is_relative_to(BOOK_DIR):
            raise ChapterError(
                f"{out_dir} is in the book's sources, where a notebook is built as a page; give a folder outside book/."
            )
        for target, folder in ((out, True), (record.parent, True), (notebook, False), (record, False)):
            dangling = target.is_symlink() and not target.exists()
            if dangling or target.exists() and target.is_dir() != folder:
                what = "a link to nothing" if dangling else f"not a {('file', 'folder')[folder]}"
                raise ChapterError(f"{target} is {what}; move it away or give another output folder.")
        out.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=out, prefix=f".{path.stem}.", suffix=".tmp.ipynb")
        os.close(fd)
    except OSError as exc:
        raise ChapterError(f"{out_dir}: cannot write the executed notebook there ({exc.strerror or exc}).") from None
    return Path(partial), notebook, record


def _stat(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def execute_chapter(
    path: Path, out_dir: Path, *, timeout_s: int = 900, progress_bar: bool = False, **parameters: Any
) -> dict[str, Any]:
    """Run chapter ``path`` with ``parameters`` injected; write ``<out_dir>/<stem>.ipynb`` and the execution record
    ``<out_dir>/execution/<stem>.json`` (``out_dir`` taken against the current directory).

    Raises :class:`ChapterError` before running anything if ``path`` is not a chapter, a parameter is not
    in its ``parameters`` cell, or an output cannot be written; a failing cell raises
    papermill's ``PapermillExecutionError``, and a run whose outputs could not be put in place
    :class:`ChapterRunError`.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1:
        raise ChapterError(f"timeout_s={timeout_s!r}: give a positive whole number of seconds per cell.")
    path = Path(os.path.abspath(path))
    notebook = _chapter_notebook(path)
    _check_declared_name(notebook, path)
    known = chapter_parameters(notebook)
    if unknown := sorted(set(parameters) - set(known)):
        takes = ", ".join(f"{k} (default {v})" for k, v in known.items())
        raise ChapterError(f"{path.name} has no parameter {', '.join(unknown)}; it takes: {takes}.")
    partial, target, record = _outputs(path, out_dir)
    before = _stat(record)
    environment = {
        "KVWALL_EXECUTION_DIR": str(record.parent),
        **{v: os.path.abspath(os.environ[v]) for v in _PATH_VARIABLES if os.environ.get(v)},
    }
    try:
        with mock.patch.dict(os.environ, environment):
            papermill.execute_notebook(
                notebook,
                str(partial),
                parameters=parameters,
                kernel_name="python3",
                cwd=str(BOOK_DIR),
                progress_bar=progress_bar,
                execution_timeout=timeout_s,
            )
    finally:
        _put_in_place(partial, target)
    if _stat(record) in (None, before):
        raise ChapterRunError(
            f"{path.name} ran to its end but wrote no execution record at {record} (does it still "
            f"call finish()?); the executed notebook is {target}."
        )
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError) as exc:
        raise ChapterRunError(f"{path.name} ran, but its execution record {record} cannot be read ({exc}).") from None


def _put_in_place(partial: Path, target: Path) -> None:
    """Rename the notebook papermill wrote (finished or failed: it saves a failed run's notebook too) over
    ``target``, with the mode a plain ``open()`` would give it; drop it if nothing was written."""
    if not partial.stat().st_size:
        partial.unlink()
        return
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(partial, 0o666 & ~umask)
    try:
        os.replace(partial, target)
    except OSError as exc:
        raise ChapterRunError(
            f"the executed notebook could not be renamed to {target} ({exc.strerror or exc}); it is kept as {partial}."
        ) from None
