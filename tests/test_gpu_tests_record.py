"""The ``gpu_tests`` record: pytest's JUnit report summed per test file, and the tests' hash that dates it."""

from __future__ import annotations

from kvwall.experiments.gpu_tests import file_sha256, junit_rows

REPORT = """<testsuites><testsuite>
<testcase classname="tests.test_a" name="t1" time="1.25"/>
<testcase classname="tests.test_a" name="t2" time="0.5"><skipped message="no nvcc"/></testcase>
<testcase classname="tests.test_a" name="t3" time="0"><skipped message="no nvcc"/></testcase>
<testcase classname="tests.test_b.TestX" name="t4[wgmma]" time="2"><failure message="boom"/></testcase>
<testcase classname="tests.test_b" name="t5" time="0.1"><error message="setup"/></testcase>
</testsuite></testsuites>"""


def test_junit_rows_sum_each_file():
    a, b = junit_rows(REPORT)
    assert (a["file"], a["passed"], a["skipped"], a["failed"], a["seconds"]) == ("tests/test_a.py", 1, 2, 0, 1.8)
    assert a["skip_reasons"] == ["no nvcc"]
    assert (b["file"], b["failed"], b["errors"], b["failures"]) == (
        "tests/test_b.py",
        1,
        1,
        ["t4[wgmma]: boom", "t5: setup"],
    )


def test_each_file_row_carries_the_hash_of_the_file_as_it_ran(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test(): pass\n")
    a, b = junit_rows(REPORT, root=tmp_path)
    assert a["sha256"] == file_sha256(tmp_path / "tests" / "test_a.py") and b["sha256"] is None
    (tmp_path / "tests" / "test_a.py").write_text("def test(): assert 1\n")
    assert file_sha256(tmp_path / "tests" / "test_a.py") != a["sha256"]
