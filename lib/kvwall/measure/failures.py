"""A failure as a recorded row holds it: one line naming the exception, and the tail of its traceback.

Experiments turn a failing strategy, peer or case into a row with these fields, never a crash of the whole run.
"""

from __future__ import annotations

import traceback

__all__ = ["error_text", "traceback_tail"]


def error_text(exc: BaseException, limit: int = 400) -> str:
    """``"TypeName: message"``, the message cut to ``limit`` characters."""
    return f"{type(exc).__name__}: {str(exc)[:limit]}"


def traceback_tail(limit: int = 1200) -> str:
    """The last ``limit`` characters of the traceback being handled (call inside ``except``)."""
    return traceback.format_exc()[-limit:]
