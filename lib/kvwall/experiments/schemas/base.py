"""What every row model shares, and the sections two kernels' validations share (bad inputs, compute-sanitizer)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["ErrorCheck", "MaybeRaised", "Row", "SanitizerRun"]


class Row(BaseModel):
    """One row of a result: its ``section`` names the table it belongs to.

    Types are strict (a string is not a number, 1 is not True). A field every row of a section carries
    is required; one that only some rows carry, or that error paths leave out, is optional. Rows may
    carry further diagnostic fields (an ``error`` where a case failed): they are kept as recorded.
    """

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


class MaybeRaised(Row):
    """A call into a peer library that may have raised: then ``exc_type``, ``message`` and ``where`` say what."""

    exc_type: str | None = None
    message: str | None = None
    where: str | None = None


class SanitizerRun(Row):
    """compute-sanitizer memcheck over the kernel's edge cases (``ran`` False where the tool is missing)."""

    section: Literal["sanitizer"]
    tool: str
    ran: bool
    returncode: int | None
    summary: str
    output_tail: str
    seconds: float | None = None
    command: str | None = None
    passed: bool | None = None


class ErrorCheck(Row):
    """A deliberately bad input: the exception ``expected``, the one ``raised`` (or "nothing"), and whether
    the output buffer was left untouched."""

    section: Literal["errors"]
    input: str
    expected: str
    raised: str
    message: str
    out_untouched: bool
