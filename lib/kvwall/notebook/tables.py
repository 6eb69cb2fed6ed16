"""Small Markdown tables and sentences for notebooks (rendered in JupyterLab and the built book)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

__all__ = ["markdown_table", "show_table", "show_markdown"]

Column = str | tuple[str, Callable[[Any], str]]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value).replace("|", "\\|")


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, Column]) -> str:
    """``columns`` maps a header to a row key, or to ``(key, formatter)``."""
    head = "| " + " | ".join(columns) + " |\n| " + " | ".join("---" for _ in columns) + " |\n"
    body = []
    for row in rows:
        cells = []
        for spec in columns.values():
            key, fmt = (spec, _cell) if isinstance(spec, str) else spec
            cells.append(fmt(row.get(key, "")) if key in row else "")
        body.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(body)


def show_markdown(text: str) -> None:
    try:
        from IPython.display import Markdown, display

        display(Markdown(text))
    except ImportError:
        print(text)


def show_table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, Column], caption: str) -> None:
    show_markdown(markdown_table(rows, columns) + f"\n\n*{caption}*")
