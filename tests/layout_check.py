"""The layout check of built pages, in headless Chromium: no clipped table, no two text boxes of a figure overlapping.

:func:`check_page` copies a page beside itself with ``layout_check.js`` appended (so its relative links, plotly.js
included, still resolve), lets Chromium draw it at the reader's window size and returns the script's JSON report;
:func:`problems` turns a report into the sentences a failing test prints.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).with_name("layout_check.js")
#: The window the book is checked at (the issue's screenshots): 1300 × 900.
WINDOW = (1300, 900)
#: The tallest a table may be drawn, in px (four screens): a longer one is folded (``Table.markdown`` puts a table of
#: more than ``MAX_INLINE_ROWS`` rows in a closed ``<details>``) or scrolls in a box of its own. Chapter 3's 72-row
#: replay table, inline, ran its page about 10,000 px long; its tallest table left inline (26 rows of source lines)
#: is about 2,700 px.
MAX_TABLE_PX = 4 * WINDOW[1]


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def flags(profile: Path, window: tuple[int, int] = WINDOW) -> list[str]:
    return [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=30000",
        f"--window-size={window[0]},{window[1]}",
    ]


def check_page(page: Path, browser: str, *, window: tuple[int, int] = WINDOW) -> dict[str, Any]:
    """Draw ``page`` in ``browser`` and return the layout report (see ``layout_check.js``)."""
    html = page.read_text()
    script = f"<script>{SCRIPT.read_text()}</script>"
    probe = page.with_name(f".layout-check-{page.name}")
    probe.write_text(html.replace("</body>", script + "</body>") if "</body>" in html else html + script)
    found: list[str] = []
    try:
        # A heavy page on a busy machine is sometimes dumped before the script reports: try again, up to 3 times.
        # (The theme's script may add attributes to the report's <pre>, such as tabindex.)
        for _ in range(3):
            with tempfile.TemporaryDirectory() as profile:
                proc = subprocess.run(
                    [browser, *flags(Path(profile), window), "--dump-dom", probe.as_uri()],
                    capture_output=True,
                    text=True,
                    timeout=240,
                )
            found = re.findall(r'<pre id="kvwall-layout-report"[^>]*>(\{.*?)</pre>', proc.stdout, re.S)
            if found:
                break
    finally:
        probe.unlink(missing_ok=True)
    if not found:
        raise AssertionError(
            f"the layout check did not report on {page.name} (rc {proc.returncode}, "
            f"{len(proc.stdout)} characters of DOM, ending {proc.stdout[-300:]!r}): "
            f"{proc.stderr[-1500:]}"
        )
    import html as html_lib

    report = json.loads(html_lib.unescape(found[-1]))
    if "error" in report:
        raise AssertionError(f"the layout check failed inside {page.name}: {report['error']}")
    return report


def screenshot(page: Path, browser: str, shot: Path, *, window: tuple[int, int] = WINDOW) -> Path:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [browser, *flags(Path(profile), window), f"--screenshot={shot}", page.as_uri()],
            capture_output=True,
            timeout=240,
        )
    return shot


def problems(report: dict[str, Any], *, visible_headers: dict[str, str] | None = None) -> list[str]:
    """What a reader would see wrong on the page: each overlap, each text box outside its figure, heatmap text
    under 11 px, each table wider than the content column that does not scroll inside it, each table drawn taller
    than :data:`MAX_TABLE_PX`. ``visible_headers``:
    ``{header text: why}`` for columns that must be in view without scrolling."""
    out = []
    for f in report["figures"]:
        name = f"figure {f['index'] + 1} ({f['title'][:50] or 'untitled'})"
        out += [f"{name}: '{a}' overlaps '{b}'" for a, b in f["overlaps"]]
        out += [f"{name}: '{b}' is drawn outside the figure (clipped)" for b in f["outside"]]
        if f["small_heatmap_text"]:
            out.append(f"{name}: heatmap text under 11 px: {f['small_heatmap_text'][:3]}")
    for t in report["tables"]:
        name = f"table {t['index'] + 1} ({', '.join(h['text'] for h in t['headers'][:4])[:60]})"
        if t["clipped"]:
            out.append(
                f"{name}: {t['width']:.0f} px wide in a {t['column_width']:.0f} px column, and nothing scrolls it"
            )
        if t.get("height", 0) > MAX_TABLE_PX:
            out.append(
                f"{name}: {t['height']:.0f} px tall ({t.get('rows', '?')} rows) inline, over {MAX_TABLE_PX} px: "
                "fold it (a summary in view, the full table in <details>)"
            )
        for header, why in (visible_headers or {}).items():
            for h in t["headers"]:
                if h["text"] == header and not h["visible"]:
                    out.append(f"{name}: column '{header}' is out of view without scrolling ({why})")
    return out
