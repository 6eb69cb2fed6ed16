"""Where the project and its recorded results live."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["PROJECT_ROOT", "RESULTS_DIR", "PACKAGE_DIRS"]

PROJECT_ROOT = Path(__file__).resolve().parents[3]
#: Where recorded results live; KVWALL_RESULTS_DIR points chapters elsewhere (tests use it).
RESULTS_DIR = Path(os.environ.get("KVWALL_RESULTS_DIR", PROJECT_ROOT / "book" / "results"))
#: The project's packages and their folders relative to the project root (pyproject's package-dir),
#: most specific first: ``kvwall.kernels`` is installed from ``kernels/``, the rest of ``kvwall`` from ``lib/kvwall``.
PACKAGE_DIRS: tuple[tuple[str, str], ...] = (("kvwall.kernels", "kernels"), ("kvwall", "lib/kvwall"))
