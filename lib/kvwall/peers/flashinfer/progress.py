"""Progress of long FlashInfer work (installs, JIT builds): a tqdm bar on a terminal, silence elsewhere.

An install or a build can take minutes. When stderr is a terminal, :func:`progress` shows a bar
whose elapsed time moves even while one step runs (a background refresh every second); under
papermill, in a notebook or in CI (stderr not a terminal) it shows nothing.
"""

from __future__ import annotations

import re
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

from tqdm import tqdm

__all__ = ["progress", "on_a_terminal", "follow_ninja"]

_NINJA_STATUS = re.compile(r"^\[(\d+)/(\d+)\]")


def on_a_terminal() -> bool:
    """Whether stderr is a terminal (a person is watching)."""
    return bool(getattr(sys.stderr, "isatty", None) and sys.stderr.isatty())


@contextmanager
def progress(description: str, total: Optional[int] = None, unit: str = "step") -> Iterator[tqdm]:
    """A tqdm bar for ``description`` (disabled when stderr is not a terminal), refreshed every
    second while the ``with`` block runs, and closed after it."""
    bar = tqdm(total=total, desc=description, unit=unit, disable=not on_a_terminal(), leave=False, dynamic_ncols=True)
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(1.0):
            bar.refresh()

    ticker = threading.Thread(target=refresh, daemon=True)
    if not bar.disable:
        ticker.start()
    try:
        yield bar
    finally:
        stop.set()
        bar.close()


def follow_ninja(bar: tqdm, line: str) -> None:
    """Move ``bar`` to ninja's ``[k/N]`` when ``line`` is one of its status lines."""
    m = _NINJA_STATUS.match(line)
    if m:
        done, total = int(m.group(1)), int(m.group(2))
        bar.total = total
        bar.n = done
        bar.refresh()
