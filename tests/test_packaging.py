"""A non-editable install carries what the kernels read at run time: CUDA sources, tuned and measured tables."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvwall.results import PROJECT_ROOT

#: Every data file a kernel folder ships: what its code compiles or reads.
SHIPPED_SUFFIXES = (".cu", ".cuh", ".json")


@pytest.mark.slow
def test_a_non_editable_install_ships_every_kernel_source_and_table(tmp_path):
    source, target = tmp_path / "source", tmp_path / "site"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for folder in ("lib", "kernels"):  # a copy: building in the checkout would leave build/ behind
        shutil.copytree(PROJECT_ROOT / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(PROJECT_ROOT / name, source / name)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-compile",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    kernels = PROJECT_ROOT / "kernels"
    expected = sorted(
        p.relative_to(kernels).as_posix()
        for p in kernels.rglob("*")
        if p.suffix in SHIPPED_SUFFIXES and "__pycache__" not in p.parts
    )
    assert any(e.endswith(".cu") for e in expected) and any(e.endswith(".cuh") for e in expected)
    installed = target / "kvwall" / "kernels"
    missing = [e for e in expected if not (installed / e).is_file()]
    assert not missing, f"a non-editable install lacks {missing}: add them to pyproject's package-data"
    # And the installed package finds them where its code looks (not in the source tree).
    probe = (
        "import kvwall.kernels.mla_decode.wgmma as w, kvwall.kernels.gather.cuda as g; "
        "print(w.WGMMA_SOURCE.is_file(), g.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    found, where = out.stdout.split()
    assert found == "True" and Path(where).is_relative_to(target)
