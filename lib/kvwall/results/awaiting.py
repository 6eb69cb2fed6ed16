"""Results known to be stale, each with the reason it was not re-recorded: ``book/results/AWAITING_RERECORD.txt``.

A session that changes the code a GPU result depends on re-records it in the same session; when the device time
ran out first, the result stays as it was recorded -- shown everywhere with its visible *stale* warning -- and is
listed here, one ``experiment: why`` a line (``#`` starts a comment). The list is a checked contract, not an
escape hatch: the tests require it to name exactly the stale results (a fresh result listed, or a stale one not
listed, fails), and ``make record`` on a GPU empties it by making them fresh.
"""

from __future__ import annotations

from pathlib import Path

from kvwall.results.locations import RESULTS_DIR

__all__ = ["AWAITING_FILE", "awaiting_rerecord"]

AWAITING_FILE = "AWAITING_RERECORD.txt"


def awaiting_rerecord(directory: Path = RESULTS_DIR) -> dict[str, str]:
    """``{experiment: why it is stale}`` from ``<directory>/AWAITING_RERECORD.txt`` (empty when there is none)."""
    path = Path(directory) / AWAITING_FILE
    if not path.is_file():
        return {}
    found: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        name, sep, why = text.partition(":")
        if not sep or not name.strip() or not why.strip():
            raise ValueError(f"{path}:{number}: expected `experiment: why it waits`, got {line!r}")
        found[name.strip()] = why.strip()
    return found
