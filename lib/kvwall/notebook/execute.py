"""Execute a chapter headless, as CI and ``python -m kvwall execute`` do: papermill on the MyST text.

papermill cannot read text notebooks itself, so the chapter is parsed with jupytext first. The
chapter's own ``finish()`` record (how it ran, what it computed) is returned.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvwall.results import PROJECT_ROOT

__all__ = ["execute_chapter"]


def execute_chapter(path: Path, out_dir: Path, *, timeout_s: int = 900, **parameters: Any) -> dict[str, Any]:
    """Run ``path`` with ``parameters`` injected; write ``<out_dir>/<stem>.ipynb`` and the execution record."""
    import jupytext
    import papermill

    path, out_dir = Path(path), Path(out_dir)
    exec_dir = out_dir / "execution"
    out_dir.mkdir(parents=True, exist_ok=True)
    previous = os.environ.get("KVWALL_EXECUTION_DIR")
    os.environ["KVWALL_EXECUTION_DIR"] = str(exec_dir)
    try:
        papermill.execute_notebook(
            jupytext.read(path), str(out_dir / f"{path.stem}.ipynb"), parameters=parameters,
            kernel_name="python3", cwd=str(PROJECT_ROOT / "book"), progress_bar=False, execution_timeout=timeout_s,
        )
    finally:
        if previous is None:
            os.environ.pop("KVWALL_EXECUTION_DIR", None)
        else:
            os.environ["KVWALL_EXECUTION_DIR"] = previous
    return json.loads((exec_dir / f"{path.stem}.json").read_text())
