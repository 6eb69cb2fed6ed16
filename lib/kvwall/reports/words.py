"""The book's words that are data: a chapter's YAML file beside it (``book/answer.yml`` for chapter 6,
``book/fused.yml`` for chapter 5 and its lab page) read as mappings whose keys also read as attributes, and the
columns of a table written there (header -> ``[field]`` or ``[field, formatter, its argument]``)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import yaml

from kvwall.reports import tables
from kvwall.results import PROJECT_ROOT


class Words(dict):
    """A mapping read from a chapter's YAML file whose keys also read as attributes (``WORDS.paths.ours.name``)."""

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        raise AttributeError(name)


def _words(value: Any) -> Any:
    if isinstance(value, dict):
        return Words({k: _words(v) for k, v in value.items()})
    return [_words(v) for v in value] if isinstance(value, list) else value


def read_words(name: str) -> Words:
    """``book/<name>``, read as :class:`Words`."""
    return _words(yaml.safe_load((PROJECT_ROOT / "book" / name).read_text(encoding="utf-8")))


def columns(spec: Mapping[str, Sequence[Any]], **values: Any) -> dict[str, tables.Column]:
    """A table's columns from a chapter's YAML: ``[field]`` or ``[field, formatter, its argument]`` (a formatter of
    :mod:`kvwall.reports.tables`); given ``values``, each header is a template they fill (``{heads} heads``)."""
    return {
        head.format(**values) if values else head: (
            (c[0], getattr(tables, c[1])(*c[2:]) if c[2:] else getattr(tables, c[1])) if c[1:] else c[0]
        )
        for head, c in spec.items()
    }
