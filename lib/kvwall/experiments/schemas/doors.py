"""Row schemas of the ``kvwall.experiments.doors`` experiments: one model per section."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from kvwall.experiments.schemas.base import MaybeRaised, Row

__all__ = ["DoorsChecksRow", "DoorsSm90Row"]


class DoorsChecksCitations(Row):
    section: Literal["citations"]
    door: str
    claim: str
    release: str
    file: str
    line: int | None
    text: str
    excerpt: list[Any]
    families: list[Any]
    pattern: str
    decisive: bool
    where: str
    rendered: str


class DoorCase(MaybeRaised):
    """The fields that name one door case (chapter 3's DoorCase): shared by replays and GPU calls."""

    door: str
    heads: int
    page_size: int
    q_dtype: str
    kv_dtype: str
    family: str


class DoorsChecksReplays(DoorCase):
    section: Literal["replays"]
    release: str
    outcome: str
    kernel: str | None = None


class DoorsChecksBuilds(MaybeRaised):
    section: Literal["builds"]
    release: str
    build: str
    arch: str
    about: str
    seconds: float
    nvcc: str
    status: str
    compile_seconds: float | None = None
    objects: int | None = None
    returncode: int | None = None
    built: list[Any] | None = None
    failed: list[Any] | None = None
    errors: list[Any] | None = None
    sources: list[Any] | None = None


class DoorsChecksMeta(Row):
    section: Literal["meta"]
    release: str
    python: str
    doors: list[Any]
    families: dict[str, Any]


#: One row of ``doors_checks``, by its section.
DoorsChecksRow = Annotated[
    DoorsChecksCitations | DoorsChecksReplays | DoorsChecksBuilds | DoorsChecksMeta,
    Field(discriminator="section"),
]


class DoorsSm90Calls(DoorCase):
    section: Literal["calls"]
    flashinfer: str
    call_seconds: float
    rel_err_vs_float64: float | None = None
    output_shape: list[Any] | None = None
    output_dtype: str | None = None
    ms_with_plan: float | None = None
    ms: float | None = None
    outcome: str


#: One row of ``doors_sm90``.
DoorsSm90Row = DoorsSm90Calls
