"""Rows of ``gpu_tests``: the GPU tier of the test suite (``pytest -m gpu``) run on a GPU, summed per test file."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kvwall.experiments.schemas.base import Row

__all__ = ["GpuTestsRow"]


class GpuTestsSetup(Row):
    section: Literal["setup"]
    gpu: str
    command: str
    rc: int | None
    seconds_total: float
    error: str | None = None


class GpuTestsFile(Row):
    section: Literal["file"]
    file: str
    sha256: str | None  # the file as it ran (None: gone)
    passed: int
    failed: int
    errors: int
    skipped: int
    seconds: float
    failures: list[str] = []
    skip_reasons: list[str] = []


GpuTestsRow = Annotated[GpuTestsSetup | GpuTestsFile, Field(discriminator="section")]
