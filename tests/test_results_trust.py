"""Issue 37 ("Trust, round three"), the results store: a hostile user's trials, kept as tables.

Each table is one entry point -- ``load_result`` (what chapters read through), ``python -m kvwall check``,
``save_result`` (what ``record`` writes through), ``recorded_scale`` (``record``'s full-scale guard) -- and each
row one hostile (or genuine but unusual) file with its expected outcome: ``OK`` (read, and correct), or refused
with a message that names the file and the words given (the field, where one was edited). Every trial runs under an
alarm, so a hang fails the test instead of stalling it, and no entry point may let any exception but the store's own
escape.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvwall import cli
from kvwall.experiments import EXPERIMENTS
from kvwall.results import (
    Result,
    ResultFileError,
    ResultMissingError,
    ResultTargetError,
    RowSchemaError,
    check_writable_target,
    collect_provenance,
    content_digest,
    load_result,
    recorded_scale,
    save_result,
)
from kvwall.results import files, seal, store

OK = None
ROWS = [
    {"section": "sweep", "pool_tokens": 8, "ms": 0.1, "bytes": 1536, "gbps": 15.36},
    {"section": "sweep", "pool_tokens": 16, "ms": 0.2, "bytes": 3072, "gbps": 15.36},
]
AS_ROOT = os.geteuid() == 0


@pytest.fixture(autouse=True)
def no_hang():
    """A trial that blocks (a FIFO opened for reading, /dev/zero read to the end) fails after 60 s, never hangs."""

    def hung(signum, frame):
        raise TimeoutError("the trial hung")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@functools.lru_cache(maxsize=1)
def _provenance():
    return collect_provenance(torch.device("cpu"), "kvwall.experiments.decode_profile")


def _result(experiment="cast_sweep", rows=None, date="2026-01-01T00:00:00+00:00", scale="full", ms=0.1):
    prov = dataclasses.replace(_provenance(), sources=dict(_provenance().sources), missing=[], digest=None)
    prov.scale, prov.date = scale, date
    rows = [dict(r, ms=r["ms"] * ms * 10) if ms != 0.1 else dict(r) for r in ROWS] if rows is None else rows
    return Result(experiment, {"pool_tokens": [8, 16]}, rows, prov)


@pytest.fixture
def recordings(tmp_path):
    """Two genuine recordings of cast_sweep (other rows, other date): ``tmp/cast_sweep.json`` (the one under
    trial) and the parsed other one, whose parts are spliced in."""
    other_dir = tmp_path / "other"
    save_result(_result(ms=0.3, date="2026-02-02T00:00:00+00:00"), other_dir)
    path = save_result(_result(), tmp_path / "trial")
    return path, json.loads((other_dir / "cast_sweep.json").read_text())


def _edit(change):
    def make(path: Path, other: dict) -> None:
        data = json.loads(path.read_text())
        change(data, other)
        path.write_text(json.dumps(data, indent=1))

    return make


def _text(change):
    def make(path: Path, other: dict) -> None:
        path.write_bytes(change(path.read_bytes()))

    return make


def _replace(create):
    def make(path: Path, other: dict) -> None:
        path.unlink()
        create(path)

    return make


def _resealed(change):
    """An edit whose seal was recomputed (as someone who read this module could): the seal is a digest, not a
    signature, so what is refused here is what no sealed file may hold."""

    def make(path: Path, other: dict) -> None:
        data = json.loads(path.read_text())
        change(data, other)
        data["provenance"]["digest"] = content_digest(data)
        path.write_text(json.dumps(data, indent=1))

    return make


def _digest(data):
    return data["provenance"]["digest"]


def _splice_rows_with_hash(data, other):
    data["rows"] = other["rows"]
    _digest(data)["parts"]["rows"] = _digest(other)["parts"]["rows"]


def _splice_provenance(data, other):
    data["provenance"] = other["provenance"]  # its digest (seal and part hashes) along with it


def _splice_provenance_fields(data, other):
    digest = _digest(data)
    data["provenance"] = {**other["provenance"], "digest": digest}


def _splice_rows_with_seal(data, other):
    data["rows"] = other["rows"]
    _digest(data)["seal"] = _digest(other)["seal"]
    _digest(data)["parts"]["rows"] = _digest(other)["parts"]["rows"]


def _fix_part_hash_by_hand(data, other):
    data["rows"][0]["ms"] = 0.01
    stored = _digest(data)["seal"]
    _digest(data)["parts"]["rows"] = seal._part_hash(stored, "rows", data["rows"])


def _nan_in(data, other):
    data["rows"][0]["ms"] = float("nan")


def _mkfifo(path):
    os.mkfifo(path)


def _sparse(size):
    def create(path):
        with open(path, "wb") as f:
            f.truncate(size)

    return create


def _char_device(path):
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # what /dev/zero is
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a character device here ({exc})")


def _unreadable(path: Path, other: dict) -> None:
    if AS_ROOT:
        pytest.skip("root reads a chmod 000 file")
    path.chmod(0)


def _symlink_to_genuine(path: Path, other: dict) -> None:
    genuine = path.with_name("genuine.data")
    path.rename(genuine)
    path.symlink_to(genuine.name)


#: (id, how the file under trial is made from the genuine one, expected: OK or words its refusal must hold).
LOAD_CASES = [
    ("genuine", lambda path, other: None, OK),
    ("edited rows", _edit(lambda d, o: d["rows"][1].update(ms=0.25)), r"field\(s\) rows differ from what was recorded"),
    ("edited params", _edit(lambda d, o: d["params"].update(pool_tokens=[8])), r"field\(s\) params differ"),
    (
        "edited provenance field",
        _edit(lambda d, o: d["provenance"].update(gpu="NVIDIA B200")),
        r"field\(s\) provenance\.gpu differ",
    ),
    (
        "edited sources (fingerprint)",
        _edit(lambda d, o: d["provenance"]["sources"].update({"kernels/x.py": "0" * 16})),
        r"field\(s\) provenance\.sources differ",
    ),
    ("edited schema", _edit(lambda d, o: d.update(schema=5)), r"field\(s\) schema differ"),
    ("edited experiment", _edit(lambda d, o: d.update(experiment="cast_kernels")), r"field\(s\) experiment differ"),
    (
        "added provenance field",
        _edit(lambda d, o: d["provenance"].update(note="fine")),
        r"field\(s\) provenance\.note differ",
    ),
    ("added top-level field", _edit(lambda d, o: d.update(note="fine")), r"unknown top-level field\(s\) \['note'\]"),
    ("NaN edited into rows", _edit(_nan_in), r"field\(s\) rows differ"),
    (
        "spliced rows, their part hash copied along",
        _edit(_splice_rows_with_hash),
        r"field\(s\) rows differ from what was recorded.*spliced in from another recording",
    ),
    ("spliced provenance, its digest along", _edit(_splice_provenance), r"field\(s\) rows differ"),  # params alike
    (
        "spliced provenance fields, this file's digest",
        _edit(_splice_provenance_fields),
        r"field\(s\) provenance\.date differ",
    ),  # the rest alike
    (
        "spliced rows, their seal and hash along",
        _edit(_splice_rows_with_seal),
        r"field\(s\) experiment, params, provenance\..*schema differ",
    ),
    (
        "rows edited, part hash fixed by hand",
        _edit(_fix_part_hash_by_hand),
        r"seal \(provenance\.digest\.seal\) does not match the content",
    ),
    (
        "part hashes edited",
        _edit(lambda d, o: _digest(d)["parts"].update(params="0" * 64)),
        r"provenance\.digest\.parts was edited \(the hashes of params",
    ),
    ("seal edited", _edit(lambda d, o: _digest(d).update(seal="0" * 64)), r"the seal .* matches none of the parts"),
    ("seal removed", _edit(lambda d, o: _digest(d).pop("seal")), r"provenance\.digest is not a digest of this format"),
    ("digest removed", _edit(lambda d, o: d["provenance"].pop("digest")), r"provenance has no digest"),
    (
        "format 3 file",
        _edit(lambda d, o: (d.update(schema=3), d["provenance"].update(digest={"rows": "0" * 64}))),
        r"file format 3, this code reads format 4.*Re-record it: `python -m kvwall record cast_sweep`",
    ),
    ("schema not a number", _edit(lambda d, o: d.update(schema="4")), r"field 'schema' missing or not a int"),
    ("truncated JSON", _text(lambda b: b[: len(b) // 2]), r"not valid JSON .*truncated\?"),
    ("empty file", _text(lambda b: b""), r"not valid JSON"),
    ("non-object JSON", _text(lambda b: b"[1, 2]"), r"top level is not a JSON object"),
    ("deep nesting (100000 '[')", _text(lambda b: b"[" * 100_000), r"nests more than 64 levels deep"),
    ("deep nesting, closed", _text(lambda b: b"[" * 100_000 + b"]" * 100_000), r"nests more than 64 levels deep"),
    (
        "deep nesting in a value",
        _text(lambda b: b.replace(b'"params": {', b'"params": {"x": ' + b"[" * 5000 + b"]" * 5000 + b", ", 1)),
        r"nests more than 64",
    ),
    (
        "brackets inside strings are not nesting",
        _edit(lambda d, o: d["provenance"].update(gpu="[" * 5000)),
        r"field\(s\) provenance\.gpu differ",
    ),
    (
        "duplicate keys",
        _text(lambda b: b.replace(b'"rows": [', b'"rows": [], "rows": [', 1)),
        r"the key 'rows' appears twice",
    ),
    ("not UTF-8", _text(lambda b: b"\xff\xfe" + b), r"not UTF-8 text"),
    ("UTF-8 BOM", _text(lambda b: "\ufeff".encode() + b), r"not valid JSON"),
    (
        "a number of 5000 digits",
        _text(lambda b: b.replace(b'"params": {', b'"params": {"x": ' + b"9" * 5000 + b", ", 1)),
        r"not valid JSON",
    ),
    (
        "huge file (sparse, over the bound)",
        _replace(_sparse(store.MAX_FILE_BYTES + 1)),
        r"is 8,388,609 bytes, more than the 8,388,608 bytes a result file may have",
    ),
    ("FIFO", _replace(_mkfifo), r"is a named pipe \(FIFO\), not a plain file"),
    ("symlink to /dev/zero", _replace(lambda p: p.symlink_to("/dev/zero")), r"is a symbolic link"),
    ("character device (as /dev/zero)", _replace(_char_device), r"is a character device, not a plain file"),
    ("directory named like a result", _replace(lambda p: p.mkdir()), r"is a folder, not a plain file"),
    ("symlink to a genuine file", _symlink_to_genuine, r"is a symbolic link"),
    ("dangling symlink", _replace(lambda p: p.symlink_to("nowhere.json")), r"is a symbolic link"),
    ("unreadable (chmod 000)", _unreadable, r"cannot be read \(Permission denied\)"),
    (
        "resealed: sources outside the project",
        _resealed(lambda d, o: d["provenance"]["sources"].update({"../../../dev/zero": "0" * 16})),
        r"provenance\.sources names '\.\./\.\./\.\./dev/zero'",
    ),
    (
        "resealed: absolute source path",
        _resealed(lambda d, o: d["provenance"]["sources"].update({"/dev/zero": "0" * 16})),
        r"not a path inside the project",
    ),
    (
        "resealed: date not a string",
        _resealed(lambda d, o: d["provenance"].update(date=5)),
        r"provenance\.date is int, expected str",
    ),
    (
        "resealed: git_dirty not a bool",
        _resealed(lambda d, o: d["provenance"].update(git_dirty="no")),
        r"provenance\.git_dirty is str, expected bool or null",
    ),
    (
        "resealed: rows off schema",
        _resealed(lambda d, o: d["rows"][0].update(ms="fast")),
        r"row 0 \(section 'sweep'\), field 'ms'",
    ),
    (
        "genuine file of another experiment",
        _resealed(lambda d, o: d.update(experiment="cast_kernels")),
        r"says experiment 'cast_kernels', expected 'cast_sweep'",
    ),
    (
        "field name of 100000 characters added",
        _edit(lambda d, o: d["provenance"].update({"x" * 100_000: 1})),
        r"field\(s\) provenance\.x+\.\.\. differ",
    ),
    (
        "1000 fields added",
        _edit(lambda d, o: d["provenance"].update({f"f{i}": i for i in range(1000)})),
        r"field\(s\) provenance\.f0, .* and 976 more differ",
    ),
    (
        "resealed: an experiment name of 100000 characters",
        _resealed(lambda d, o: d.update(experiment="e" * 100_000)),
        r"says experiment 'e+\.\.\., expected 'cast_sweep'",
    ),
    ("genuine NaN and Infinity", _resealed(lambda d, o: d["rows"][0].update(ms=float("nan"), gbps=float("inf"))), OK),
    ("genuine, reformatted (no indent)", _text(lambda b: json.dumps(json.loads(b)).encode()), OK),
]
_IDS = [case[0] for case in LOAD_CASES]


def _make(case, recordings):
    path, other = recordings
    _, make, expected = case
    make(path, other)
    return path, expected


def _state(path: Path):
    """What is at ``path``, to see that no command changed it: its type and, for a plain file, its bytes."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    content = path.read_bytes() if stat.S_ISREG(info.st_mode) and os.access(path, os.R_OK) else None
    return stat.S_IFMT(info.st_mode), info.st_size, content


@pytest.mark.parametrize("case", LOAD_CASES, ids=_IDS)
def test_load_result_table(recordings, case):
    """The entry point of chapters: every hostile file is refused naming file and field; a genuine one loads."""
    path, expected = _make(case, recordings)
    before = _state(path)
    if expected is OK:
        result = load_result("cast_sweep", path.parent)
        assert result.rows and result.path == path and not result.stale
        return
    with pytest.raises(ResultFileError) as info:
        load_result("cast_sweep", path.parent)
    assert not isinstance(info.value, ResultMissingError)  # not "not recorded yet": chapters must not skip it
    message = str(info.value)
    assert message.startswith(f"{path}: ") and info.value.path == path and len(message) < 2000  # quoted, not pasted
    assert re.search(expected, message), message
    assert _state(path) == before  # refused, and left as it was


@pytest.mark.parametrize("case", LOAD_CASES, ids=_IDS)
def test_check_table(recordings, capsys, case):
    """`python -m kvwall check` (in process): one line per result, INVALID naming file and field for each hostile
    file, and it goes on to the next; exit 1 (the other experiments are missing here); the file is left as it was."""
    path, expected = _make(case, recordings)
    before = _state(path)
    assert cli.main(["check", "--dir", str(path.parent)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(EXPERIMENTS)  # every experiment reported, none skipped after the bad file
    line = next(line for line in lines if "cast_sweep.json" in line)
    if expected is OK:
        assert line.startswith("ok ")
    else:
        assert line.startswith(f"INVALID {path}: ") and re.search(expected, line), line
    assert sum(line.startswith("MISSING") for line in lines) == len(EXPERIMENTS) - 1
    assert _state(path) == before


def test_check_reports_every_bad_file_and_goes_on_without_a_traceback(tmp_path):
    """A folder of hostile files, through the real command: exit 1, each named, no traceback, no hang."""
    folder = tmp_path / "results"
    save_result(_result(experiment="wall_on_gpu", rows=[]), folder)
    spliced = save_result(_result(), folder)
    save_result(_result(ms=0.5), tmp_path / "other")
    data, other = json.loads(spliced.read_text()), json.loads((tmp_path / "other" / "cast_sweep.json").read_text())
    _splice_rows_with_hash(data, other)
    spliced.write_text(json.dumps(data))
    os.mkfifo(folder / "decode_profile.json")
    (folder / "cast_kernels.json").write_text("[" * 100_000)
    (folder / "attention_sweep.json").mkdir()
    (folder / "wall_timeline.json").symlink_to("/dev/zero")
    with open(folder / "doors_checks.json", "wb") as f:
        f.truncate(store.MAX_FILE_BYTES * 4)
    proc = subprocess.run(
        [sys.executable, "-m", "kvwall", "check", "--dir", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = proc.stdout.splitlines()
    for name, words in [
        ("cast_sweep", "field(s) rows differ"),
        ("decode_profile", "named pipe"),
        ("cast_kernels", "nests more than"),
        ("attention_sweep", "is a folder"),
        ("wall_timeline", "symbolic link"),
        ("doors_checks", "bytes, more than"),
    ]:
        assert any(line.startswith(f"INVALID {folder / name}.json: ") and words in line for line in lines), name
    assert any(line.startswith("ok ") and "wall_on_gpu.json" in line for line in lines)
    assert "6 invalid" in proc.stderr and stat.S_ISFIFO(os.lstat(folder / "decode_profile.json").st_mode)


def test_chapters_refuse_a_spliced_file_and_a_fifo(recordings, monkeypatch):
    """Chapters load through load_result: a spliced file raises, and a FIFO is not "not recorded yet"."""
    import kvwall.reports.chapter as chapter_module
    from kvwall.reports.chapter import start_chapter

    path, other = recordings
    _edit(_splice_rows_with_hash)(path, other)
    monkeypatch.setattr(chapter_module, "load_result", lambda name: load_result(name, path.parent))
    run = start_chapter("x", mode="cpu", record=False, defaults={"gpu": {}, "cpu": {}})
    with pytest.raises(ResultFileError, match=r"field\(s\) rows\b"):  # the part that differs
        run.recorded("cast_sweep")
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(ResultFileError, match="named pipe"):
        run.recorded_or_none("cast_sweep")
    path.unlink()
    assert run.recorded_or_none("cast_sweep") is None  # only a missing file is "not recorded yet"


# --- record's guard: recorded_scale ----------------------------------------------------------------------

SCALE_CASES = [
    ("genuine full", lambda p: save_result(_result(), p.parent), "full"),
    ("genuine small", lambda p: save_result(_result(scale="small"), p.parent), "small"),
    (
        "small claimed by an edit",
        lambda p: (save_result(_result(), p.parent), _edit(lambda d, o: d["provenance"].update(scale="small"))(p, {})),
        "full",
    ),
    ("older format", lambda p: p.write_text(json.dumps({"schema": 1, "provenance": {"gpu": "H200"}})), "full"),
    ("none", lambda p: None, None),
    ("FIFO", _mkfifo, None),
    ("folder", lambda p: p.mkdir(), None),
    ("symlink to /dev/zero", lambda p: p.symlink_to("/dev/zero"), None),
    ("deep nesting", lambda p: p.write_text("[" * 100_000), None),
    ("non-object JSON", lambda p: p.write_text("[]"), None),
    ("huge sparse file", _sparse(store.MAX_FILE_BYTES * 2), None),
]


@pytest.mark.parametrize("make,expected", [c[1:] for c in SCALE_CASES], ids=[c[0] for c in SCALE_CASES])
def test_recorded_scale_table(tmp_path, make, expected):
    """The full-scale guard reads what is there without hanging; it believes a small scale only if sealed."""
    path = tmp_path / "cast_sweep.json"
    make(path)
    assert recorded_scale("cast_sweep", tmp_path) == expected


# --- record's writes: save_result and check_writable_target ----------------------------------------------


def _to_genuine_elsewhere(path):
    elsewhere = save_result(_result(ms=0.7), path.parent / "elsewhere")
    path.symlink_to(elsewhere)


#: (what is in the way, how to make it, what kind of file the refusal names)
TARGET_CASES = [
    ("FIFO", _mkfifo, "named pipe"),
    ("folder", lambda p: p.mkdir(), "folder"),
    ("folder with a file in it", lambda p: (p.mkdir(), (p / "keep").write_text("x")), "folder"),
    ("character device", _char_device, "character device"),
    ("symlink to /dev/null", lambda p: p.symlink_to("/dev/null"), "symbolic link"),
    ("symlink to a genuine result elsewhere", _to_genuine_elsewhere, "symbolic link"),
    ("dangling symlink", lambda p: p.symlink_to("nowhere.json"), "symbolic link"),
]


@pytest.mark.parametrize("make,words", [c[1:] for c in TARGET_CASES], ids=[c[0] for c in TARGET_CASES])
def test_save_result_target_table(tmp_path, make, words):
    """A target that is not a plain file is refused before anything is written (``check_writable_target``, for
    ``record`` to call before it measures, and again by save_result); nothing there is replaced or left behind."""
    path = tmp_path / "cast_sweep.json"
    make(path)
    before = sorted((p.name, _state(p)) for p in tmp_path.rglob("*"))
    with pytest.raises(ResultTargetError, match=re.escape(words)) as info:
        check_writable_target(path)
    assert str(info.value).startswith(f"{path}: ")  # the path in the way, then what it is
    with pytest.raises(ResultTargetError, match=re.escape(words)):
        save_result(_result(), tmp_path)
    assert sorted((p.name, _state(p)) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize(
    "make",
    [
        lambda p: None,
        lambda p: save_result(_result(ms=0.9), p.parent),
        lambda p: p.write_text("[" * 100_000),  # a refused file is what re-recording replaces
        lambda p: p.write_text("{"),
    ],
    ids=["no file", "genuine file", "deep nesting", "truncated"],
)
def test_save_result_replaces_a_plain_file(tmp_path, make):
    path = tmp_path / "cast_sweep.json"
    make(path)
    check_writable_target(path)
    save_result(_result(), tmp_path)
    assert load_result("cast_sweep", tmp_path).rows == ROWS and [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.skipif(AS_ROOT, reason="root writes into a read-only folder")
def test_save_result_refuses_a_folder_it_cannot_write(tmp_path):
    save_result(_result(), tmp_path)
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(ResultTargetError, match=re.escape(str(tmp_path)) + ".*writable"):
            save_result(_result(ms=0.5), tmp_path)
    finally:
        tmp_path.chmod(0o755)
    assert load_result("cast_sweep", tmp_path).rows == ROWS


def test_save_result_refuses_what_loading_would_refuse_and_leaves_the_old_file(tmp_path, monkeypatch):
    path = save_result(_result(), tmp_path)
    before = path.read_bytes()
    limit = 1000
    monkeypatch.setattr(store, "MAX_FILE_BYTES", limit)
    with pytest.raises(RowSchemaError, match=rf"\bbytes\b.*\b{limit:,}\b"):  # the file's size, over the limit
        save_result(_result(ms=0.5), tmp_path)
    monkeypatch.undo()
    with pytest.raises(RowSchemaError, match="not written"):
        save_result(_result(rows=[{**ROWS[0], "ms": "fast"}]), tmp_path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [path.name]


_KILLED_RECORD = """
import os, signal, sys, torch
import kvwall.experiments
from kvwall.results import Result, collect_provenance, save_result
prov = collect_provenance(torch.device("cpu"), "kvwall.experiments.decode_profile")
prov.scale = "full"
rows = [{"section": "sweep", "pool_tokens": 8, "ms": 9.9, "bytes": 1536, "gbps": 15.36}]
os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # killed between writing and renaming
save_result(Result("cast_sweep", {"pool_tokens": [8]}, rows, prov), sys.argv[1])
"""


def test_a_killed_record_leaves_the_previous_file(tmp_path):
    path = save_result(_result(), tmp_path)
    before = path.read_bytes()
    proc = subprocess.run([sys.executable, "-c", _KILLED_RECORD, str(tmp_path)], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert path.read_bytes() == before and load_result("cast_sweep", tmp_path).rows == ROWS
    assert [p.name for p in tmp_path.glob("*.json")] == ["cast_sweep.json"]  # a stray .tmp at most, never *.json


# --- the seal itself --------------------------------------------------------------------------------------


def test_the_seal_covers_the_whole_file_and_nothing_else(tmp_path):
    path = save_result(_result(), tmp_path)
    data = json.loads(path.read_text())
    digest = data["provenance"].pop("digest")
    assert digest == content_digest({**data, "provenance": {**data["provenance"], "digest": {"any": "thing"}}})
    import hashlib

    canonical = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    assert digest["seal"] == hashlib.sha256(b"kvwall result, format 4\n" + canonical).hexdigest()
    assert set(digest["parts"]) == {
        "schema",
        "experiment",
        "params",
        "rows",
        *(f"provenance.{k}" for k in data["provenance"]),
    }


def test_brackets_in_strings_do_not_count_as_nesting():
    assert not files.too_deep(json.dumps(["[" * 1000, "{" * 1000, '\\"[[[' * 100]))
    assert files.too_deep("[" * 65) and not files.too_deep("[" * 64 + "]" * 64)
    assert files.too_deep('["\\\\", ' + "[" * 65 + "]")  # an escaped backslash ends the string
