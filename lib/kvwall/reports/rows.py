"""Recorded rows as the reports read them: fields as attributes (``r.us`` is ``r.get("us")``, None where a row has
none), so a report reads ``r.us`` instead of ``r["us"]`` and a field a row lacks reads as missing."""

from __future__ import annotations

from kvwall.results import Result


class Row(dict):
    """A recorded row whose fields also read as attributes (None where it has none)."""

    __getattr__ = dict.get


def rows_of(result: Result, section: str) -> list[Row]:
    """The rows of one section of ``result`` (none where it has no such section), fields readable as attributes."""
    return [Row(r) for r in result.rows if r.get("section") == section]
