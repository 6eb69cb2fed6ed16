"""Issue 37 (trust, round three): the command line as a careful, hostile user drives it.

One table per entry point: the arguments, the exit status, and a fragment of what it says. Every refusal
comes before anything runs (experiments and chapters are replaced by fakes that note whether they ran),
names the argument and what to do, and is never a traceback; nothing a refused command found in its way is
changed. Exit status: 0 done, 2 refused before running, 1 a run that failed, 130 interrupted, 141 the
reader of standard output went away.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import papermill
import pytest
import torch

import kvwall.experiments.registry as registry
from kvwall import cli
from kvwall.reports import execute as execute_module
from kvwall.results import PROJECT_ROOT, Result, collect_provenance, load_result

BOOK = PROJECT_ROOT / "book"
CHAPTER = BOOK / "01_the_86ms_profile.md"
ROWS = [{"section": "sweep", "pool_tokens": 8, "ms": 0.1, "bytes": 1536, "gbps": 15.36}]


def _main(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse's usage errors and --help
        rc = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err + out
    return rc, out, err


def _argv(args: list[str], tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)).replace("{chapter}", str(CHAPTER)) for a in args]


def _book_listing() -> list[str]:
    return sorted(str(p.relative_to(BOOK)) for p in BOOK.rglob("*") if "__pycache__" not in p.parts)


# --- python -m kvwall, list, answer ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,rc,words",
    [
        ([], 2, "the following arguments are required: command"),
        (["frob"], 2, "invalid choice: 'frob'"),
        (["--help"], 0, "Exit status"),
        (["list"], 0, "decode_profile"),
        (["list", "extra"], 2, "unrecognized arguments: extra"),
        (["answer"], 0, "|"),
        (["answer", "--readme", "extra"], 2, "unrecognized arguments: extra"),
    ],
)
def test_top_level(capsys, args, rc, words):
    got, out, err = _main(capsys, args)
    assert got == rc and words in (out + err)


# --- record ------------------------------------------------------------------------------------------------


def _tiny_result(name, device, scale):
    prov = collect_provenance(torch.device("cpu"), "kvwall.experiments.decode_profile")
    prov.scale = scale
    return Result("cast_sweep", {"pool_tokens": [8]}, [dict(r) for r in ROWS], prov)


def _in_the_way(make):
    def setup(tmp: Path) -> Path:
        (tmp / "r").mkdir()
        make(tmp / "r" / "cast_sweep.json")
        return tmp / "r" / "cast_sweep.json"

    return setup


@pytest.mark.parametrize(
    "args,setup,rc,words",
    [
        (["record"], None, 2, "the following arguments are required: experiments"),
        (["record", "nope"], None, 2, "argument experiments: invalid choice: 'nope'"),
        (["record", ""], None, 2, "argument experiments: invalid choice: ''"),
        (["record", "x" * 5000], None, 2, "argument experiments: invalid choice"),
        (["record", "all", "cast_sweep"], None, 2, "give 'all' alone"),
        (["record", "cast_sweep", "--scale", "huge"], None, 2, "argument --scale: invalid choice: 'huge'"),
        (["record", "cast_sweep", "--out", ""], None, 2, "argument --out: '' is not a path"),
        (["record", "cast_sweep", "--out", "a\0b"], None, 2, "argument --out: 'a\\x00b' is not a path"),
        (["record", "cast_sweep", "--out", "{tmp}/file"], lambda t: (t / "file").write_text("x"), 2, "is not a folder"),
        (
            ["record", "cast_sweep", "--out", "{tmp}/file/below"],
            lambda t: (t / "file").write_text("x"),
            2,
            "is not a folder",
        ),
        (["record", "cast_sweep", "--out", "{tmp}/" + "y" * 300], None, 2, "argument --out"),
        (["record", "cast_sweep", "--out", "/proc/nope"], None, 2, "cannot write there"),
        (["record", "cast_sweep", "--force", "--out", "{tmp}/r"], _in_the_way(Path.mkdir), 2, "is a folder"),
        (["record", "cast_sweep", "--force", "--out", "{tmp}/r"], _in_the_way(os.mkfifo), 2, "named pipe"),
        (
            ["record", "cast_sweep", "--force", "--out", "{tmp}/r"],
            _in_the_way(lambda p: p.symlink_to("/dev/null")),
            2,
            "symbolic link",
        ),
        (["record", "cast_sweep", "--out", "{tmp}/new/folder"], None, 0, "into {tmp}/new/folder"),
        (["record", "cast_sweep", "--out", "rel/out"], None, 0, "into {tmp}/rel/out"),
        (["record", "cast_sweep", "--out", "{tmp}/a", "--out", "{tmp}/b"], None, 0, "into {tmp}/b"),  # the last wins
    ],
)
def test_record(monkeypatch, capsys, tmp_path, args, setup, rc, words):
    ran = []
    monkeypatch.setattr(cli, "run_experiment", lambda *a: (ran.append(a[0]), _tiny_result(*a))[1])
    monkeypatch.setattr(registry, "PREREQUISITES", {k: (lambda: None) for k in registry.PREREQUISITES})
    monkeypatch.chdir(tmp_path)
    obstacle = setup(tmp_path) if setup else None
    obstacle = obstacle if isinstance(obstacle, Path) else None
    before = obstacle.lstat() if obstacle else None
    got, out, err = _main(capsys, _argv(args, tmp_path))
    assert got == rc and words.replace("{tmp}", str(tmp_path)) in out + err, err
    if rc:
        assert ran == [] and len(err.strip().splitlines()) <= 6
        assert obstacle is None or obstacle.lstat() == before  # what was in the way is left as it was
    else:
        out_dir = Path(_argv(args, tmp_path)[-1]).absolute()
        assert ran == ["cast_sweep"] and load_result("cast_sweep", out_dir).rows == ROWS


def test_record_missing_prerequisites_are_refused_and_force_lifts_them(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "run_experiment", _tiny_result)
    monkeypatch.setattr(registry, "PREREQUISITES", {k: (lambda: "absent-in-test") for k in registry.PREREQUISITES})
    got, _, err = _main(capsys, ["record", "cast_sweep", "--out", str(tmp_path)])
    assert got == 2 and "cuda (absent-in-test)" in err and "--force" in err  # what is missing, why, and the way past
    assert _main(capsys, ["record", "cast_sweep", "--force", "--out", str(tmp_path)])[0] == 0


# --- execute -----------------------------------------------------------------------------------------------


def _fake_chapter_run(behaviour: str):
    """papermill.execute_notebook as a chapter uses the file system: the notebook at ``output_path``, its record
    in ``$KVWALL_EXECUTION_DIR`` taken against ``cwd`` (the chapter runs in book/)."""

    def execute_notebook(notebook, output_path, *, parameters, cwd, **kwargs):
        execute_notebook.ran = True
        if behaviour == "interrupt":
            raise KeyboardInterrupt
        Path(output_path).write_text('{"cells": []}')
        if behaviour == "fails":
            raise papermill.PapermillExecutionError(3, 3, "x", "ValueError", "mode='fast' is not allowed", [])
        if behaviour == "no record":
            return
        record = Path(cwd, os.environ["KVWALL_EXECUTION_DIR"]) / "01_the_86ms_profile.json"
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(
            json.dumps(
                {"chapter": "01_the_86ms_profile", "mode": "cpu", "device": "cpu", "scale": "small", "duration_s": 0.1}
            )
        )

    execute_notebook.ran = False
    return execute_notebook


def _copy(name: str, edit=lambda text: text):
    def setup(tmp: Path) -> None:
        (tmp / "copy").mkdir(exist_ok=True)
        (tmp / "copy" / name).write_text(edit(CHAPTER.read_text()))

    return setup


def _make(*parts, kind="dir"):
    def setup(tmp: Path) -> None:
        path = tmp.joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir() if kind == "dir" else path.write_text("in the way")

    return setup


def _earlier_record(tmp: Path) -> None:
    (tmp / "out" / "execution").mkdir(parents=True)
    (tmp / "out" / "execution" / "01_the_86ms_profile.json").write_text('{"chapter": "earlier-run"}')


_OUT = ["--out", "{tmp}/out"]


@pytest.mark.parametrize(
    "args,setup,behaviour,rc,words",
    [
        # usage
        (["{chapter}"], None, "runs", 2, "the following arguments are required: --out"),
        (["", *_OUT], None, "runs", 2, "argument chapter: '' is not a path"),
        (["{chapter}", "--out", ""], None, "runs", 2, "argument --out: '' is not a path"),
        (["{chapter}", *_OUT, "-p", "mode"], None, "runs", 2, "argument -p/--param: 'mode' is not NAME=VALUE"),
        (["{chapter}", *_OUT, "-p", "=3"], None, "runs", 2, "'=3' is not NAME=VALUE"),
        (["{chapter}", *_OUT, "-p", "la-yers=2"], None, "runs", 2, "is not NAME=VALUE"),
        (["{chapter}", *_OUT, "-p", "mode=cpu", "-p", "mode=gpu"], None, "runs", 2, "mode given more than once"),
        (["{chapter}", *_OUT, "-p", "layer=2"], None, "runs", 2, "has no parameter layer; it takes: mode"),
        # the chapter
        (["{tmp}/nosuch/01_x.md", *_OUT], None, "runs", 2, "no such file"),
        (["/dev/null", *_OUT], None, "runs", 2, "is not a plain file"),
        (
            ["{tmp}/copy/01_fifo.md", *_OUT],
            lambda t: ((t / "copy").mkdir(), os.mkfifo(t / "copy" / "01_fifo.md")),
            "runs",
            2,
            "is not a plain file",
        ),
        (["{tmp}", *_OUT], None, "runs", 2, "is a folder"),
        (["{tmp}/copy/README.md", *_OUT], _copy("README.md"), "runs", 2, "is not a chapter"),
        (
            ["{tmp}/copy/01_mine.md", *_OUT],
            _copy("01_mine.md"),
            "runs",
            2,
            "its start_chapter names '01_the_86ms_profile'",
        ),
        (["{tmp}/copy/01_the_86ms_profile.md", *_OUT], _copy("01_the_86ms_profile.md"), "runs", 0, '"chapter"'),
        (
            ["{tmp}/copy/02_bytes.md", *_OUT],
            lambda t: ((t / "copy").mkdir(), (t / "copy" / "02_bytes.md").write_bytes(b"\xff\xfe")),
            "runs",
            2,
            "cannot be read as a MyST chapter",
        ),
        (
            ["{tmp}/copy/01_the_86ms_profile.md", *_OUT],
            _copy("01_the_86ms_profile.md", lambda s: s.replace("mode = ", "mode = (", 1)),
            "runs",
            2,
            "is not valid Python",
        ),
        (
            ["{tmp}/copy/01_the_86ms_profile.md", *_OUT],
            _copy("01_the_86ms_profile.md", lambda s: s.replace("start_chapter(", "begin(")),
            "runs",
            2,
            "must call start_chapter('01_the_86ms_profile', ...) and finish()",
        ),
        # the outputs
        (
            ["{chapter}", *_OUT],
            _make("out", "01_the_86ms_profile.ipynb"),
            "runs",
            2,
            "01_the_86ms_profile.ipynb is not a file",
        ),
        (["{chapter}", *_OUT], _make("out", "execution", kind="file"), "runs", 2, "execution is not a folder"),
        (
            ["{chapter}", *_OUT],
            _make("out", "execution", "01_the_86ms_profile.json"),
            "runs",
            2,
            "01_the_86ms_profile.json is not a file",
        ),
        (["{chapter}", *_OUT], _make("out", kind="file"), "runs", 2, "is not a folder"),
        (["{chapter}", *_OUT], lambda t: (t / "out").symlink_to(t / "nowhere"), "runs", 2, "is a link to nothing"),
        (["{chapter}", "--out", "{tmp}/file/below"], _make("file", kind="file"), "runs", 2, "is not a folder"),
        (["{chapter}", "--out", "{tmp}/" + "y" * 300], None, "runs", 2, "cannot write"),
        (["{chapter}", "--out", "/proc/nope"], None, "runs", 2, "cannot write"),
        (["{chapter}", "--out", str(BOOK)], None, "runs", 2, "give a folder outside book/"),
        (["{chapter}", "--out", str(BOOK / "results")], None, "runs", 2, "give a folder outside book/"),
        # runs
        (["{chapter}", "--out", "out"], None, "runs", 0, '"record": "{tmp}/out/execution/01_the_86ms_profile.json"'),
        (["{chapter}", "--out", "rel/out"], None, "runs", 0, '"notebook": "{tmp}/rel/out/01_the_86ms_profile.ipynb"'),
        ([os.path.relpath(CHAPTER, "/"), *_OUT], None, "runs", 0, '"chapter": "01_the_86ms_profile"'),  # from /
        (["{chapter}", *_OUT, "-p", "mode={[]: 1}"], None, "runs", 0, '"chapter"'),  # not a literal: the text
        (["{chapter}", *_OUT], _earlier_record, "no record", 1, "wrote no execution record"),
        (["{chapter}", *_OUT], None, "fails", 1, "stopped in cell 3 (full traceback in {tmp}/out/01_the_86ms_profile"),
        (["{chapter}", *_OUT], None, "interrupt", 130, "interrupted"),
    ],
)
def test_execute(monkeypatch, capsys, tmp_path, args, setup, behaviour, rc, words):
    fake = _fake_chapter_run(behaviour)
    monkeypatch.setattr(execute_module.papermill, "execute_notebook", fake)
    monkeypatch.chdir("/" if args[0].startswith(os.path.relpath(BOOK, "/")) else tmp_path)
    if setup:
        setup(tmp_path)
    book, before = _book_listing(), sorted(os.listdir(tmp_path))
    got, out, err = _main(capsys, ["execute", *_argv(args, tmp_path)])
    assert got == rc and words.replace("{tmp}", str(tmp_path)) in out + err, err
    assert _book_listing() == book  # nothing is ever written into the book's sources
    if rc == 2:
        assert not fake.ran and sorted(os.listdir(tmp_path)) == before  # refused before running, creating nothing
    if behaviour == "no record":
        assert json.loads((tmp_path / "out/execution/01_the_86ms_profile.json").read_text()) == {
            "chapter": "earlier-run"
        }  # an earlier run's record is never passed off as this run's


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"timeout_s": 0}, "timeout_s=0: give a positive whole number"),
        ({"timeout_s": "10"}, "timeout_s='10'"),
        ({"layer": 2}, "has no parameter layer"),
    ],
)
def test_execute_chapter_refuses_before_running(monkeypatch, tmp_path, kwargs, words):
    fake = _fake_chapter_run("runs")
    monkeypatch.setattr(execute_module.papermill, "execute_notebook", fake)
    with pytest.raises(execute_module.ChapterError, match=words.replace("(", r"\(")):
        execute_module.execute_chapter(CHAPTER, tmp_path / "out", **kwargs)
    assert not fake.ran and not (tmp_path / "out").exists()


# --- cost --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,rc,words",
    [
        ([], 0, "KV work per step"),
        (["--gpu", "all", "--rule", "per-SM-rate"], 0, "rule: per-SM rate"),
        (["--tp", "0"], 2, "argument --tp: '0' is not a positive whole number"),
        (["--tp", "-1"], 2, "argument --tp: '-1' is not a positive whole number"),
        (["--tp", "eight"], 2, "argument --tp: 'eight' is not a positive whole number"),
        (["--tp", "3"], 2, "give a --tp that divides 64"),
        (["--heads", "7", "--tp", "2"], 2, "give a --tp that divides 7"),
        (["--context", "0"], 2, "argument --context"),
        (["--batch", ""], 2, "argument --batch"),
        (["--pool", "-5"], 2, "argument --pool"),
        (["--layers", "0"], 2, "argument --layers"),
        (["--context", "10000000000000"], 2, "raise --pool or lower --batch / --context"),
        (["--gpu", "h100x"], 2, "argument --gpu: invalid choice"),
        (["--gpu", ""], 2, "argument --gpu: invalid choice"),
        (["--model", "gpt"], 2, "argument --model: invalid choice"),
        (["--rule", "fastest"], 2, "argument --rule: invalid choice"),
    ],
)
def test_cost(capsys, args, rc, words):
    got, out, err = _main(capsys, ["cost", *args])
    assert got == rc and words in out + err, err


# --- standard streams (child processes: what a shell does) -------------------------------------------------


def _child(args, **popen):
    return subprocess.Popen(
        [sys.executable, "-m", "kvwall", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )


@pytest.mark.parametrize(
    "args,popen,close_stdout,rc,stream,words",
    [
        (["cost", "--gpu", "all"], {}, True, 141, "err", ""),  # `| head -1`: quiet
        (["list"], {"preexec_fn": lambda: os.close(2)}, False, 2, "out", "standard error is closed"),
        (["list"], {"preexec_fn": lambda: os.close(1)}, False, 2, "err", "standard output is closed"),
    ],
)
def test_streams(args, popen, close_stdout, rc, stream, words):
    proc = _child(args, **popen)
    if close_stdout:
        proc.stdout.close()
        out, err = "", proc.stderr.read()
        proc.wait(timeout=120)
    else:
        out, err = proc.communicate(timeout=120)
    said = {"out": out, "err": err}[stream]
    assert proc.returncode == rc and "Traceback" not in out + err
    assert words in said if words else said == ""


@pytest.mark.skipif(not hasattr(signal, "SIGINT"), reason="no SIGINT here")
def test_interrupting_a_command_is_one_line_not_a_traceback(tmp_path):
    """Ctrl-C while `record` waits (a fake experiment that sleeps): exit 130, one line, nothing half-written."""
    script = (
        # Python ignores Ctrl-C in a process started with SIGINT ignored (a background job of a non-interactive shell,
        # as CI may run the tests): restore the terminal's default, as a reader's shell has it.
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "import sys, time; from kvwall import cli; import kvwall.experiments.registry as r; "
        "r.PREREQUISITES = {k: (lambda: None) for k in r.PREREQUISITES}; "
        "cli.run_experiment = lambda *a: (print('running', file=sys.stderr, flush=True), time.sleep(60)); "
        f"sys.exit(cli.main(['record', 'cast_sweep', '--out', {str(tmp_path)!r}]))"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    while "running" not in proc.stderr.readline():
        assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "kvwall: interrupted" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
