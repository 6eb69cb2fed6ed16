"""The code's style, as `make test` checks it: `ruff check` and `ruff format --check` on the Python (pyproject.toml's
[tool.ruff]), `clang-format` on the CUDA sources (.clang-format), with the environment's pinned tools
(requirements.txt). A failure prints what to run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

#: The environment's scripts (ruff, clang-format), beside the Python running the tests.
BIN = Path(sys.executable).parent
PYTHON = ["lib", "kernels", "tests"]
CUDA = sorted(str(p.relative_to(ROOT)) for pattern in ("*.cu", "*.cuh") for p in (ROOT / "kernels").rglob(pattern))


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    assert (BIN / tool).exists(), f"{tool} is not in {BIN.parent}: run `make setup` (requirements.txt pins it)"
    return subprocess.run([str(BIN / tool), *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize(
    "args,fix",
    [
        (["check", "--no-fix", "--output-format", "concise", *PYTHON], "fix each finding (ruff check names the rule)"),
        (["format", "--check", *PYTHON], "make format"),
    ],
    ids=["ruff-check", "ruff-format"],
)
def test_python(args, fix):
    proc = _run("ruff", *args)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}{proc.stderr[-2000:]}\nto fix: {fix}"


def test_cuda():
    assert CUDA, "no CUDA sources found under kernels/"
    proc = _run("clang-format", "--dry-run", "-Werror", *CUDA)
    assert proc.returncode == 0, f"{proc.stderr[-6000:]}\nto fix: make format"


#: The most asserts on wording the suite may hold (issue 36): each checks a message a user acts on.
MAX_WORDING_ASSERTS = 20


def wording_asserts(tests: Path) -> list[str]:
    """``file:line`` of every assert whose expression holds a string literal of three or more words, and every
    ``pytest.raises(match=...)`` of three or more words, in the test files under ``tests``. An assert on another
    tool's words (nvcc's log, FlashInfer's source, a profiler's kernel name) is a fact, not our wording: the line
    above it says so, ``# quoted: <whose words>``."""
    import ast

    def words(node: ast.AST) -> bool:
        return any(
            isinstance(n, ast.Constant) and isinstance(n.value, str) and len(n.value.split()) >= 3
            for n in ast.walk(node)
        )

    found = []
    for path in sorted(tests.glob("test_*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.Assert) and words(node.test):
                if not lines[node.lineno - 2].strip().startswith("# quoted:"):
                    found.append(f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "raises":
                if any(k.arg == "match" and words(k.value) for k in node.keywords):
                    found.append(f"{path.name}:{node.lineno}")
    return found


def test_tests_assert_values_not_wording(tmp_path):
    found = wording_asserts(ROOT / "tests")
    assert len(found) <= MAX_WORDING_ASSERTS, (
        f"{len(found)} asserts on wording (at most {MAX_WORDING_ASSERTS}: messages a user acts on): {found}; "
        "assert the values the code returns, or mark another tool's words with '# quoted: <whose>' on the line above"
    )
    (tmp_path / "test_x.py").write_text(
        'import pytest\n\n\ndef test_x():\n    assert "a whole sentence here" in s\n    # quoted: nvcc\n'
        '    assert "static assertion failed" in log\n    with pytest.raises(ValueError, match="three words here"):\n'
        "        f()\n"
    )
    assert wording_asserts(tmp_path) == ["test_x.py:5", "test_x.py:8"]


#: The most lines of the report modules that may hold a string literal, docstrings apart (issue 36): the sentences
#: a page shows are written in its chapter (myst-nb glue), the wording of tables in book/*.yml.
MAX_REPORT_STRING_LINES = 700


def string_lines(path: Path) -> int:
    """The lines of a Python file holding a string literal or f-string, its docstrings left out."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }
    lines: set[int] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) or isinstance(node, ast.JoinedStr)) and id(
            node
        ) not in docs:
            lines.update(range(node.lineno, node.end_lineno + 1))
    return len(lines)


def test_reports_return_numbers_not_prose(tmp_path):
    counts = {p.name: string_lines(p) for p in sorted((ROOT / "lib" / "kvwall" / "reports").glob("*.py"))}
    total = sum(counts.values())
    worst = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
    assert total <= MAX_REPORT_STRING_LINES, (
        f"lib/kvwall/reports holds {total} lines of string literals (at most {MAX_REPORT_STRING_LINES}; the most: "
        f"{worst}): write sentences in the chapter with glue, table wording in book/*.yml"
    )
    (tmp_path / "m.py").write_text('"""doc"""\n\nx = "a"\n\n\ndef f():\n    """doc"""\n    return f"{x}"\n')
    assert string_lines(tmp_path / "m.py") == 2
