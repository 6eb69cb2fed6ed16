"""Show a function of the project's source in a chapter, as it is in its file (no import needed).

Works the same in the built book and in JupyterLab, where MyST's ``literalinclude`` would show as raw
directive text.
"""

from __future__ import annotations

import ast
from pathlib import Path

from kvwall.reports.tables import show_markdown
from kvwall.results import PROJECT_ROOT

__all__ = ["source_of", "show_source"]


def source_of(path: str | Path, name: str, root: Path = PROJECT_ROOT) -> tuple[str, int, int]:
    """The source of the top-level function or class ``name`` in ``path`` (relative to ``root``), decorators
    included, and its first and last line numbers."""
    file = Path(root) / path
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist: give a source file's path relative to {root}.")
    lines = file.read_text().splitlines()
    for node in ast.parse("\n".join(lines)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return "\n".join(lines[first - 1:node.end_lineno]), first, node.end_lineno
    defined = sorted(n.name for n in ast.parse("\n".join(lines)).body
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    raise LookupError(f"{path} defines no top-level {name!r}; it defines {', '.join(defined)}.")


def show_source(path: str | Path, name: str) -> None:
    """Show ``name`` from ``path`` as a Python code block, with where it is."""
    code, first, last = source_of(path, name)
    show_markdown(f"`{Path(path).as_posix()}`, lines {first}–{last}:\n\n```python\n{code}\n```")
