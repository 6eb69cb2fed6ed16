"""What a reader sees in an executed chapter, checked: no unformatted placeholder, every ratio column says its
direction, no long table inline, every CPU-live figure says so in its title.

:func:`notebook_problems` reads an executed notebook (``execute_chapter``'s ``<stem>.ipynb``) and returns the
sentences a failing test prints; ``conftest.run_chapter`` calls it after every chapter a test executes. Each check
is also a function of its own, tested on broken inputs in ``test_rendered_conventions.py``.

The book's conventions, as checked here:

- **Placeholders**: no ``{name}`` / ``{name:,}`` / ``{a.b[0]!r:>4}`` left in rendered text (a string that lost its
  ``f``), glued values (myst-nb ``glue``, shown where the chapter's Markdown names them) included. Code (fenced or
  inline) and LaTeX groups (``\\frac{a}{b}``, ``x^{2}``) are not text.
- **Ratios**: a column whose cells are ratios (``1.50×``, ``0.5–1.2×``), or whose header says "ratio", names its
  direction as ``numerator / denominator`` in the header (``FlashMLA BF16 µs / ours' µs (>1: ours faster)``);
  "vs" never names a ratio's direction ("error vs float64" is a comparison, not a ratio).
- **Long tables**: at most :data:`kvwall.reports.tables.MAX_INLINE_ROWS` rows inline; a longer table is in a
  ``<details>`` block (``Table.markdown`` folds it) or in a cell whose output is hidden (``hide-output``).
- **CPU-live figures**: a figure of measurements whose caption says it was measured live on a CPU starts its title
  with :data:`kvwall.reports.plots.CPU_LIVE_TITLE` (a figure of checks, ``measured=False``, is exempt).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvwall.reports.plots import CPU_LIVE_CAPTION, CPU_LIVE_TITLE
from kvwall.reports.tables import MAX_INLINE_ROWS

#: ``{name}``, ``{name:,}``, ``{a.b}``, ``{x['k']}``, ``{v!r}``: what an f-string without its ``f`` leaves behind.
PLACEHOLDER = re.compile(r"(?<![\\\w^_}$])\{[A-Za-z_][\w.]*(?:\[[^\]{}]*\])*(?:![rsa])?(?::[^{}\s]*)?\}")
_FENCED = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_MATH = re.compile(r"\$\$.*?\$\$|\$[^$\n]+\$", re.S)
#: A cell that is a ratio: ``1.50×``, ``0.50–1.20×``, ``**2.1×**`` (thousands separators allowed).
RATIO_CELL = re.compile(r"\*{0,2}\d[\d,]*(?:\.\d+)?(?:–\d[\d,]*(?:\.\d+)?)?×\*{0,2}")
_ZWSP = "\u200b"


def placeholders(text: str) -> list[str]:
    """The unformatted placeholders in rendered Markdown ``text`` (code and math left out)."""
    for pattern in (_FENCED, _INLINE_CODE, _MATH):
        text = pattern.sub(" ", text)
    return PLACEHOLDER.findall(text)


def markdown_tables(text: str) -> list[dict[str, Any]]:
    """The pipe tables of ``text``: ``{"headers", "rows" (cells), "folded"}``; ``folded``: inside ``<details>``."""
    tables, lines, i = [], text.split("\n"), 0
    open_details = 0
    while i < len(lines):
        line = lines[i]
        open_details += line.count("<details") - line.count("</details>")
        if line.startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            headers = _cells(line)
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            tables.append({"headers": headers, "rows": rows, "folded": open_details > 0})
            continue
        i += 1
    return tables


def _cells(line: str) -> list[str]:
    parts = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [p.strip().replace(_ZWSP, "") for p in parts]


def is_ratio_column(header: str, cells: Iterable[str]) -> bool:
    return re.search(r"\bratio\b", header, re.I) is not None or any(RATIO_CELL.fullmatch(c) for c in cells if c)


def ratio_direction_problems(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Ratio columns whose header does not name numerator / denominator, or names it with 'vs'."""
    out = []
    for j, header in enumerate(headers):
        if not is_ratio_column(header, (r[j] for r in rows if j < len(r))):
            continue
        if " / " not in header:
            out.append(f"ratio column '{header}' does not say which way it divides (write 'A / B')")
        elif " vs " in header:
            out.append(f"ratio column '{header}' says 'vs': name the direction as 'A / B' only")
    return out


def long_table_problems(text: str, *, hidden: bool = False) -> list[str]:
    """Tables of more than MAX_INLINE_ROWS rows shown inline (not in <details>, not in a hidden output)."""
    if hidden:
        return []
    return [
        f"a {len(t['rows'])}-row table ({', '.join(t['headers'][:3])}, ...) is inline: more than "
        f"{MAX_INLINE_ROWS} rows must be folded (Table.markdown folds it; or hide the output)"
        for t in markdown_tables(text)
        if len(t["rows"]) > MAX_INLINE_ROWS and not t["folded"]
    ]


def _text_of(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else str(value or "")


def figure_texts(figure: dict[str, Any]) -> list[str]:
    """A plotly figure's reader-facing text: title, axis titles, annotations (not hover templates)."""
    layout = figure.get("layout", {})
    texts = [_title(layout.get("title"))]
    texts += [
        _title(v.get("title")) for k, v in layout.items() if k.startswith(("xaxis", "yaxis")) and isinstance(v, dict)
    ]
    texts += [a.get("text", "") for a in layout.get("annotations", [])]
    return [t for t in texts if t]


def _title(title: Any) -> str:
    return title.get("text", "") if isinstance(title, dict) else str(title or "")


def cpu_figure_problems(figure: dict[str, Any]) -> list[str]:
    """A figure whose caption says 'measured live on this CPU' and whose title does not say so."""
    layout = figure.get("layout", {})
    captions = [a.get("text", "") for a in layout.get("annotations", [])]
    title = _title(layout.get("title"))
    if (layout.get("meta") or {}).get("measured") is False:  # a figure of checks, not measurements
        return []
    if any(CPU_LIVE_CAPTION in c for c in captions) and CPU_LIVE_TITLE not in title:
        return [f"figure '{title[:60]}' was measured live on a CPU, and its title does not say so ('{CPU_LIVE_TITLE}')"]
    return []


def notebook_problems(path: Path) -> list[str]:
    """Every problem of the executed notebook at ``path``, each a sentence naming the cell."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    out = []
    for n, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        hidden = bool({"hide-output", "remove-output", "remove-cell"} & set(cell.get("metadata", {}).get("tags", [])))
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            where = f"{path.name}, cell {n}"
            glued = output.get("metadata", {}).get("scrapbook")
            if glued:  # a myst-nb glue: its value is what the page shows where a sentence names the key
                prefix = glued.get("mime_prefix", "")
                data = {k.removeprefix(prefix): v for k, v in data.items()}
                where += f", glue {glued.get('name')!r}"
                out += [
                    f"{where}: unformatted placeholder {p}" for p in placeholders(_text_of(data.get("text/plain", "")))
                ]
            if "text/markdown" in data:
                text = _text_of(data["text/markdown"])
                out += [f"{where}: unformatted placeholder {p}" for p in placeholders(text)]
                for table in markdown_tables(text):
                    out += [f"{where}: {p}" for p in ratio_direction_problems(table["headers"], table["rows"])]
                out += [f"{where}: {p}" for p in long_table_problems(text, hidden=hidden)]
            figure = data.get("application/vnd.plotly.v1+json")
            if isinstance(figure, dict):
                for text in figure_texts(figure):
                    out += [f"{where}: unformatted placeholder {p} in a figure" for p in placeholders(text)]
                out += [f"{where}: {p}" for p in cpu_figure_problems(figure)]
    return out
