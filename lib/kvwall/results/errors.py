"""The store's errors: each names the file (or the place a file would go) and says what to do."""

from __future__ import annotations

from pathlib import Path

__all__ = ["ResultFileError", "ResultMissingError", "ResultTargetError", "RowSchemaError", "shown"]

_HINT = (
    "Result files are written by `python -m kvwall record <experiment>` (on a GPU for GPU measurements); "
    "re-record it, or restore it with `git checkout -- book/results/`."
)


class ResultFileError(ValueError):
    """A result file that is missing, unreadable, edited or not in the expected shape."""

    def __init__(self, path: Path, problem: str, hint: str = _HINT) -> None:
        super().__init__(f"{path}: {problem}. {hint}")
        self.path = path
        self.problem = problem


class ResultMissingError(ResultFileError):
    """No result file at all (not yet recorded); anything else wrong with a file stays a ResultFileError."""


class ResultTargetError(ResultFileError):
    """A place a result cannot be written to (a folder, a named pipe, a device or a link where the file would go)."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(
            path,
            problem,
            "Nothing was written there and nothing was replaced: move it out of the way, "
            "or record into another folder (`--out`).",
        )


class RowSchemaError(ValueError):
    """Rows that do not match their experiment's row schema (the message names row, section and field)."""


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: what a hostile file holds is quoted, never pasted whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
