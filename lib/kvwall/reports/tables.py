"""Small Markdown tables and sentences for notebooks (rendered in JupyterLab and the built book).

A chapter's report module builds a :class:`Table` (rows, columns, caption); the chapter shows it with
:func:`show_table`. The formatters below are the book's few ways of printing a number, so that a
column says what it formats instead of carrying a lambda.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

__all__ = ["Column", "Table", "CHECK_COLUMNS", "MAX_INLINE_ROWS", "markdown_table", "show_table", "show_markdown", "number", "percent", "times",
           "scientific", "ms_as_us", "plain", "fmt_range", "breakable", "dtype"]

Formatter = Callable[[Any], str]
#: A column maps its header to a row key, or to ``(key, formatter)``.
Column = str | tuple[str, Formatter]
#: What a formatter prints for a missing value (None).
MISSING = "—"
#: The most rows a table shows inline; a longer one is folded (:meth:`Table.markdown`): show a summary beside it.
MAX_INLINE_ROWS = 30
#: The columns of every pass/fail summary of a validation run: rows with ``what``, ``passed`` and ``detail``.
CHECK_COLUMNS: dict[str, Column] = {"check": "what", "passed": "passed", "detail": "detail"}


def number(decimals: int = 1) -> Formatter:
    """Thousands separators and ``decimals`` decimals: ``number(0)(4223.3) == "4,223"``; None prints a dash."""
    return lambda v: MISSING if v is None else f"{v:,.{decimals}f}"


def percent(v: float | None) -> str:
    """A fraction as a whole percentage: ``percent(0.734) == "73%"``."""
    return MISSING if v is None else f"{v:.0%}"


def times(decimals: int = 1) -> Formatter:
    """A ratio: ``times(2)(1.5) == "1.50×"``."""
    return lambda v: MISSING if v is None else f"{v:,.{decimals}f}×"


def scientific(v: float | None) -> str:
    """An error or other small magnitude: ``scientific(0.00042) == "4.2e-04"``."""
    return MISSING if v is None else f"{v:.1e}"


def ms_as_us(v: float | None) -> str:
    """A time stored in ms, shown in µs with one decimal."""
    return MISSING if v is None else f"{v * 1e3:,.1f}"


def fmt_range(lo: float, hi: float, d: int = 1) -> str:
    """A predicted range, ``"12.3–14.5"``, or one number when it is a point (``d`` decimals)."""
    if math.isclose(lo, hi, rel_tol=1e-3):
        return f"{lo:,.{d}f}"
    return f"{lo:,.{d}f}–{hi:,.{d}f}"


#: How a table names a torch dtype: short, so a column of them stays narrow.
DTYPE_NAMES = {"float8_e4m3fn": "fp8 e4m3", "float8_e5m2": "fp8 e5m2", "bfloat16": "bf16", "float16": "fp16",
               "float32": "fp32"}


def dtype(v: Any) -> str:
    """A dtype's short name: ``dtype("float8_e4m3fn") == "fp8 e4m3"`` (``torch.`` dropped; others as they are)."""
    return MISSING if v is None else DTYPE_NAMES.get(str(v).removeprefix("torch."), str(v))


def plain(v: Any) -> str:
    """A value as it is (None as a dash)."""
    return MISSING if v is None else str(v)


#: A word longer than this (an exception name, a path, a call chain) gets break opportunities, so that a table
#: cell holding it wraps inside the page instead of widening the table past it (the book's CSS lets inline code
#: in a table wrap at them).
LONG_WORD = 20
_BREAK_AFTER = re.compile(r"(?<=[^\s/._:,()=])([/._:,()=]+)(?=[^\s])")
#: ... and a run without any separator longer than this (a commit hash; not a class name) breaks every as many.
LONG_RUN = 32
_ZWSP = "\u200b"


def breakable(text: str) -> str:
    """``text`` with a zero-width space after the separators (``/ . _ : , ( ) =``) of each word longer than
    :data:`LONG_WORD` characters (``flashinfer/mla/_core.py:4498`` may break after a ``/``); inline code, links
    and HTML are left alone -- a path or a command copied from a table must be exactly that path (the book's CSS
    lets inline code in a table wrap anywhere instead). Short words, numbers included, never break."""
    def word(w: str) -> str:
        pieces = _BREAK_AFTER.sub(lambda m: m.group(1) + _ZWSP, w).split(_ZWSP)
        # A run with no separator at all longer than LONG_RUN (a hash) breaks every LONG_RUN characters.
        return _ZWSP.join(_ZWSP.join(p[i:i + LONG_RUN] for i in range(0, len(p), LONG_RUN)) for p in pieces)

    def words(segment: str) -> str:
        return " ".join(word(w) if len(w) > LONG_WORD and "](" not in w and "://" not in w else w
                        for w in segment.split(" "))

    # HTML tags (``<br>``, ``<small>``) and inline code are kept whole; the text between them is broken word by word.
    return "".join(part if part.startswith(("<", "`")) else words(part)
                   for part in re.split(r"(<[^>]*>|`[^`]*`)", text))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value).replace("|", "\\|")


@dataclass(frozen=True)
class Table:
    """Rows to show, the columns to show of them, and the caption saying where the numbers came from."""

    rows: Sequence[Mapping[str, Any]]
    columns: Mapping[str, Column]
    caption: str
    #: Fold the table whatever its length, under this summary line ('' folds only a long table).
    fold: str = ""

    def markdown(self) -> str:
        """The table and its caption; a table of more than :data:`MAX_INLINE_ROWS` rows, or one with :attr:`fold`
        (a few rows of long text), is folded into a closed ``<details>`` block (its caption stays in view), so that it
        does not run a page thousands of pixels long."""
        table = markdown_table(self.rows, self.columns)
        if self.fold or len(self.rows) > MAX_INLINE_ROWS:
            summary = self.fold or f"The full table: {len(self.rows)} rows"
            table = f"<details><summary>{summary} (click to open)</summary>\n\n{table}\n\n</details>"
        return table + f"\n\n*{self.caption}*"

    def column(self, header: str) -> list[str]:
        """The formatted cells of one column, as the reader sees them."""
        spec = self.columns[header]
        key, fmt = (spec, _cell) if isinstance(spec, str) else spec
        return [fmt(row[key]) if key in row else "" for row in self.rows]


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, Column]) -> str:
    """``columns`` maps a header to a row key, or to ``(key, formatter)``."""
    head = "| " + " | ".join(columns) + " |\n| " + " | ".join("---" for _ in columns) + " |\n"
    body = []
    for row in rows:
        cells = []
        for spec in columns.values():
            key, fmt = (spec, _cell) if isinstance(spec, str) else spec
            cells.append(breakable(fmt(row.get(key, ""))) if key in row else "")
        body.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(body)


def show_markdown(text: str) -> None:
    try:
        from IPython.display import Markdown, display

        display(Markdown(text))
    except ImportError:
        print(text)


def show_table(table: Table | Sequence[Mapping[str, Any]], columns: Mapping[str, Column] | None = None,
               caption: str | None = None) -> None:
    """Show a :class:`Table`, or ``rows`` with ``columns`` and ``caption``."""
    if not isinstance(table, Table):
        if columns is None or caption is None:
            raise TypeError("show_table(rows, columns, caption): pass a Table, or rows with their columns and caption.")
        table = Table(table, columns, caption)
    show_markdown(table.markdown())
