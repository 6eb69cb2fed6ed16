"""Tables for notebooks (rendered in JupyterLab and the built book), written by ``tabulate``.

A chapter's report module builds a :class:`Table` (rows, columns, caption); the chapter shows it with
:func:`show_table`. The formatters below are the book's few ways of printing a number, so that a
column says what it formats instead of carrying a lambda.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from tabulate import tabulate

Formatter = Callable[[Any], str]
#: A column maps its header to a row key, or to ``(key, formatter)``.
Column = str | tuple[str, Formatter]
#: What a formatter prints for a missing value (None).
MISSING = "—"
#: The most rows a table shows inline; a longer one is folded (:meth:`Table.markdown`): show a summary beside it.
MAX_INLINE_ROWS = 30
#: The columns of every pass/fail summary of a validation run: rows with ``what``, ``passed`` and ``detail``.
CHECK_COLUMNS: dict[str, Column] = {"check": "what", "passed": "passed", "detail": "detail"}


def _formatter(spec: str, suffix: str = "", scale: float = 1.0) -> Formatter:
    """``format(v * scale, spec) + suffix``; None prints :data:`MISSING`."""
    return lambda v: MISSING if v is None else format(v * scale, spec) + suffix


def number(decimals: int = 1) -> Formatter:
    """Thousands separators and ``decimals`` decimals: ``number(0)(4223.3) == "4,223"``; None prints a dash."""
    return _formatter(f",.{decimals}f")


def times(decimals: int = 1) -> Formatter:
    """A ratio: ``times(2)(1.5) == "1.50×"``."""
    return _formatter(f",.{decimals}f", "×")


#: A fraction as a whole percentage: ``percent(0.734) == "73%"``.
percent = _formatter(".0%")
#: An error or other small magnitude: ``scientific(0.00042) == "4.2e-04"``.
scientific = _formatter(".1e")
#: A time stored in ms, shown in µs with one decimal.
ms_as_us = _formatter(",.1f", scale=1e3)
#: A change as a signed whole percentage: ``signed_percent(0.034) == "+3%"``.
signed_percent = _formatter("+.0%")


def fmt_range(lo: float, hi: float, d: int = 1) -> str:
    """A predicted range, ``"12.3–14.5"``, or one number when it is a point (``d`` decimals)."""
    return number(d)(lo) + ("" if math.isclose(lo, hi, rel_tol=1e-3) else "–" + number(d)(hi))


#: How a table names a torch dtype: short, so a column of them stays narrow.
DTYPE_NAMES = {
    "float8_e4m3fn": "fp8 e4m3",
    "float8_e5m2": "fp8 e5m2",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
}


def dtype(v: Any) -> str:
    """A dtype's short name: ``dtype("float8_e4m3fn") == "fp8 e4m3"`` (``torch.`` dropped; others as they are)."""
    return MISSING if v is None else DTYPE_NAMES.get(str(v).removeprefix("torch."), str(v))


def plain(v: Any) -> str:
    """A value as it is (None as a dash)."""
    return MISSING if v is None else str(v)


#: A word longer than this (an exception name, a path, a call chain) gets break opportunities, so that a table
#: cell holding it wraps inside the page instead of widening the table past it; a run without any separator longer
#: than LONG_RUN (a commit hash) breaks every LONG_RUN characters.
LONG_WORD, LONG_RUN = 20, 32
#: After the separators of a long word; not before whitespace; HTML tags and inline code are kept whole.
_SEPARATORS = re.compile(r"(?<=[^\s/._:,()=])([/._:,()=]+)(?=[^\s])")
_KEEP_WHOLE = re.compile(r"(<[^>]*>|`[^`]*`)")
_ZWSP = "\u200b"


def breakable(text: str) -> str:
    """``text`` with a zero-width space after the separators (``/ . _ : , ( ) =``) of each word longer than
    :data:`LONG_WORD` characters (``flashinfer/mla/_core.py:4498`` may break after a ``/``); inline code, links
    and HTML are left alone -- a path or a command copied from a table must be exactly that path (the book's CSS
    lets inline code in a table wrap anywhere instead). Short words, numbers included, never break."""

    def word(w: str) -> str:
        if len(w) <= LONG_WORD or "](" in w or "://" in w:
            return w
        pieces = _SEPARATORS.sub(r"\1" + _ZWSP, w).split(_ZWSP)
        return _ZWSP.join(p[i : i + LONG_RUN] for p in pieces for i in range(0, len(p), LONG_RUN))

    return "".join(
        part if _KEEP_WHOLE.fullmatch(part) else " ".join(map(word, part.split(" ")))
        for part in _KEEP_WHOLE.split(text)
    )


def _cell(value: Any) -> str:
    """A cell of a column without a formatter."""
    if isinstance(value, float):
        return format(value, ",.3f" if abs(value) < 100 else ",.1f")
    return str(value).replace("|", r"\|")


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, Column]) -> str:
    """A GitHub-flavoured Markdown table; ``columns`` maps a header to a row key, or to ``(key, formatter)``."""
    specs = [(spec, _cell) if isinstance(spec, str) else spec for spec in columns.values()]
    cells = [[breakable(fmt(row[key])) if key in row else "" for key, fmt in specs] for row in rows]
    return tabulate(cells, headers=list(columns), tablefmt="github", stralign=None, disable_numparse=True)


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
        return f"{table}\n\n*{self.caption}*"

    def column(self, header: str) -> list[str]:
        """The formatted cells of one column, as the reader sees them."""
        spec = self.columns[header]
        key, fmt = (spec, _cell) if isinstance(spec, str) else spec
        return [fmt(row[key]) if key in row else "" for row in self.rows]


def show_markdown(text: str) -> None:
    """Display Markdown ``text`` in the notebook."""
    from IPython.display import Markdown, display  # pylint: disable=import-outside-toplevel

    display(Markdown(text))


def show_table(table: Table) -> None:
    """Show a :class:`Table`: its Markdown, caption under it."""
    show_markdown(table.markdown())
