"""``gpu_tests``: the suite's GPU tier (``make gpu-test``: ``pytest -m gpu``) run on a GPU, its outcome recorded per
test file, so the reproducibility page can say when and where the GPU tests last passed.

A row per test file (passed, failed, errors, skipped, seconds, the failing tests' ids, the skip reasons and the file's
sha256 as it ran: the page compares it with the file as it is now) and a setup row (the command, its exit status). The
code the GPU tests exercise is imported below, so this result's fingerprint covers the kernels: an edit to them stales
the record, as it stales a measurement.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import torch

import kvwall.kernels.gather.sanitize  # fingerprint: the code the GPU tests run
import kvwall.kernels.mla_decode.dispatch
import kvwall.kernels.mla_decode.sanitize  # noqa: F401
from kvwall.experiments.registry import Experiment
from kvwall.results import PROJECT_ROOT, Result, collect_provenance

__all__ = ["EXPERIMENTS", "run_gpu_tests", "file_sha256", "junit_rows"]


def file_sha256(path: Path) -> str | None:
    """sha256 of a test file as it is now; None where it is gone."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def junit_rows(xml_text: str, root: Path = PROJECT_ROOT) -> list[dict]:
    """A row per test file from pytest's JUnit XML report, with the file's sha256 (files under ``root``)."""
    files: dict[str, dict] = defaultdict(
        lambda: dict(passed=0, failed=0, errors=0, skipped=0, seconds=0.0, failures=[], skip_reasons=[])
    )
    for case in ET.fromstring(xml_text).iter("testcase"):
        parts = case.get("classname", "").split(".")
        name = "/".join(parts[:2]) + ".py" if len(parts) >= 2 else case.get("classname", "?")
        row = files[name]
        row["seconds"] += float(case.get("time", 0.0))
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        if outcome in ("failure", "error"):
            row["failed" if outcome == "failure" else "errors"] += 1
            message = (case.find(outcome).get("message") or "").splitlines()
            row["failures"].append(f"{case.get('name', '?')}: {message[0][:200] if message else ''}")
        elif outcome == "skipped":
            row["skipped"] += 1
            reason = (case.find("skipped").get("message") or "")[:200]
            if reason not in row["skip_reasons"]:
                row["skip_reasons"].append(reason)
        else:
            row["passed"] += 1
    return [
        {
            "section": "file",
            "file": f,
            "sha256": file_sha256(root / f),
            **{k: (round(v, 1) if k == "seconds" else v) for k, v in r.items()},
        }
        for f, r in sorted(files.items())
    ]


def _pytest(marker: str) -> list[str]:
    """The command that runs the tests ``-m marker`` selects (a file or pytest option appended)."""
    return [sys.executable, "-m", "pytest", "-m", marker, "-q", "-p", "no:cacheprovider"]


def _gpu_test_files(marker: str, timeout_s: float) -> list[str]:
    """The test files holding tests ``-m marker`` selects (pytest's own collection; a module that cannot be imported
    here holds none that could run)."""
    proc = subprocess.run(
        [*_pytest(marker), "--collect-only", "--continue-on-collection-errors"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    return sorted({line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line})


def run_gpu_tests(device: torch.device, *, marker: str, timeout_s: int) -> Result:
    """See the module docstring. ``marker``: the pytest marker expression (``gpu``). Each test file runs in a
    process of its own, so a CUDA error that poisons a process's context fails one file, not the rest."""
    if device.type != "cuda":
        raise RuntimeError("gpu_tests runs the GPU tier of the tests: it needs an NVIDIA GPU.")
    command = _pytest(marker)
    start = time.perf_counter()
    files = _gpu_test_files(marker, timeout_s)
    rows: list[dict] = []
    rcs: list[int | None] = []
    errors: list[str] = []
    for name in files:
        left = timeout_s - (time.perf_counter() - start)
        if left < 10:
            errors.append(f"{name}: not run (the {timeout_s} s budget was spent)")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "junit.xml"
            try:
                proc = subprocess.run(
                    [*command, f"--junitxml={report}", name],
                    cwd=PROJECT_ROOT,
                    capture_output=True,
                    text=True,
                    timeout=left,
                    check=False,
                )
                rcs.append(proc.returncode)
                if proc.returncode not in (0, 1, 5):
                    errors.append(f"{name}: exit {proc.returncode}: {(proc.stdout + proc.stderr)[-400:]}")
            except subprocess.TimeoutExpired:
                rcs.append(None)
                errors.append(f"{name}: stopped at the budget's end ({timeout_s} s)")
            if report.is_file():
                rows.extend(junit_rows(report.read_text()))
    setup = {
        "section": "setup",
        "gpu": torch.cuda.get_device_name(device),
        "command": " ".join(command[1:]) + " FILE (a process per file)",
        "rc": max((rc for rc in rcs if rc is not None), default=None) if None not in rcs else None,
        "seconds_total": round(time.perf_counter() - start, 1),
        "error": "; ".join(errors) or None,
    }
    return Result(
        "gpu_tests", dict(marker=marker, timeout_s=timeout_s), [setup, *rows], collect_provenance(device, __name__)
    )


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "gpu_tests",
        run_gpu_tests,
        full=dict(marker="gpu", timeout_s=420),
        small=dict(marker="gpu", timeout_s=540),
        about="the GPU tier of the tests (pytest -m gpu), its outcome per test file",
        requires=("cuda",),
    ),
]


def main() -> int:
    """``make gpu-test``: each file of the GPU tier in a pytest process of its own, its output shown; exit 1 if any
    file failed. One process for the whole tier failed on the H200 (2026-12-03): after ``tests/test_fused_decode.py``'s
    two tiny experiment runs, every later file's CUDA tests failed."""
    files = _gpu_test_files("gpu", 600)
    failed = [
        name
        for name in files
        if subprocess.run([*_pytest("gpu"), name], cwd=PROJECT_ROOT, check=False).returncode not in (0, 5)
    ]
    print(
        f"gpu-test: {len(files) - len(failed)} of {len(files)} files passed" + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
