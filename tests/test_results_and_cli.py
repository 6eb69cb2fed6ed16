import ast
import dataclasses
import errno
import json
import os
import re
import subprocess
from pathlib import Path
import sys

import pytest
import torch

import kvwall.experiments.registry as registry
from kvwall import cli
from kvwall.experiments import EXPERIMENTS, Experiment, run_experiment, short_kernel_name
from kvwall.experiments.schemas import ROW_SCHEMAS
from kvwall.results import (
    AWAITING_FILE,
    awaiting_rerecord,
    PROJECT_ROOT,
    RESULTS_DIR,
    Result,
    ResultFileError,
    ResultMissingError,
    RowSchemaError,
    collect_provenance,
    content_digest,
    load_result,
    recorded_scale,
    save_result,
    validate_rows,
)
from kvwall.results.store import SCHEMA

ROWS = [
    {"section": "sweep", "pool_tokens": 8, "ms": 0.1, "bytes": 1536, "gbps": 15.36},
    {"section": "sweep", "pool_tokens": 16, "ms": 0.2, "bytes": 3072, "gbps": 15.36},
]


def _tiny_result(scale="full", rows=None):
    prov = collect_provenance(torch.device("cpu"), "kvwall.experiments.decode_profile")
    prov.scale = scale
    return Result("cast_sweep", {"pool_tokens": [8, 16]}, [dict(r) for r in rows or ROWS], prov)


def test_save_load_round_trip(tmp_path):
    path = save_result(_tiny_result(), tmp_path)
    back = load_result("cast_sweep", tmp_path)
    assert back.rows == ROWS and back.path == path and back.provenance.scale == "full"
    assert back.provenance.digest == content_digest(json.loads(path.read_text()))
    assert {
        "params",
        "rows",
        "schema",
        "experiment",
        "provenance.gpu",
        "provenance.scale",
        "provenance.sources",
    } <= set(back.provenance.digest["parts"])
    assert back.table("sweep")[1]["ms"] == 0.2
    assert not back.stale and "Recorded on" in back.caption()
    assert [p.name for p in tmp_path.iterdir()] == ["cast_sweep.json"]  # no temporary file left behind
    with pytest.raises(KeyError, match="'nope'"):
        back.table("nope")


def _scale_floats(data):
    for row in data["rows"]:
        row.update({k: v * 10 for k, v in row.items() if isinstance(v, float)})


def _drop_column(data):
    for row in data["rows"]:
        row.pop("ms")


def _drop_digest(data):
    data["provenance"]["digest"] = None


def _old_format(data):
    data["schema"] = 1


@pytest.mark.parametrize(
    "edit,words",
    [
        (_scale_floats, r"differ from what was recorded.*edited by hand\?"),
        (_drop_column, "edited by hand"),
        (_drop_digest, "provenance has no digest"),
        (_old_format, "field.s. schema differ from what was recorded"),
        (lambda d: d.update(experiment="other"), "field.s. experiment differ from what was recorded"),
        (lambda d: d.pop("rows"), "field 'rows'"),
        (lambda d: d["provenance"].pop("git_commit"), "provenance"),
        (lambda d: d["provenance"].update(scale="medium"), "scale"),
    ],
)
def test_edited_file_is_refused_naming_the_file(tmp_path, edit, words):
    path = save_result(_tiny_result(), tmp_path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ResultFileError, match=words) as info:
        load_result("cast_sweep", tmp_path)
    assert str(path) in str(info.value) and info.value.path == path


@pytest.mark.parametrize(
    "field,value",
    [
        ("gpu", "NVIDIA B200"),
        ("date", "2020-01-01T00:00:00+00:00"),
        ("torch", "2.0.0"),
        ("missing", ["cuda"]),
        ("scale", "small"),
        ("git_commit", "0" * 40),
        ("sources", {"lib/kvwall/cli.py": "0" * 16}),
    ],
)
def test_an_edited_provenance_is_refused_naming_file_and_field(tmp_path, capsys, field, value):
    """Issue 24, finding 1: the digest covers the provenance; `check` names the file and the field, exits 1."""
    path = save_result(_tiny_result(), tmp_path)
    data = json.loads(path.read_text())
    data["provenance"][field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ResultFileError, match=f"provenance\\.{field} differ from what was recorded") as info:
        load_result("cast_sweep", tmp_path)
    assert str(path) in str(info.value)
    assert cli.main(["check", "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert any(
        line.startswith("INVALID") and str(path) in line and f"provenance.{field}" in line for line in out.splitlines()
    )


def test_an_edited_scale_does_not_lift_the_full_scale_guard(tmp_path):
    path = save_result(_tiny_result("full"), tmp_path)
    data = json.loads(path.read_text())
    data["provenance"]["scale"] = "small"
    path.write_text(json.dumps(data))
    assert recorded_scale("cast_sweep", tmp_path) == "full"
    save_result(_tiny_result("small"), tmp_path)  # a genuine small-scale file is believed
    assert recorded_scale("cast_sweep", tmp_path) == "small"


def test_files_of_an_older_format_are_refused_with_the_advice_to_re_record(tmp_path, capsys):
    """Issue 37: format 3 sealed each part on its own (splices passed); there is no migration: re-record."""
    path = save_result(_tiny_result(), tmp_path)
    data = json.loads(path.read_text())
    data["schema"] = 3
    data["provenance"]["digest"] = {"params": "0" * 64, "rows": "0" * 64}  # format 3's digest: one hash per part
    path.write_text(json.dumps(data, indent=1) + "\n")
    before = path.read_text()
    # the format found, and the command that re-records it
    with pytest.raises(ResultFileError, match="format 3.*`python -m kvwall record cast_sweep`"):
        load_result("cast_sweep", tmp_path)
    assert cli.main(["check", "--dir", str(tmp_path)]) == 1
    (line,) = [line for line in capsys.readouterr().out.splitlines() if str(path) in line]
    assert line.startswith(f"INVALID {path}:") and "format 3" in line and path.read_text() == before
    with pytest.raises(SystemExit):
        cli.main(["migrate-digests"])  # gone with kvwall.results.migrate
    assert "'migrate-digests'" in capsys.readouterr().err  # argparse's unknown command


def test_every_committed_result_is_of_this_format():
    for path in sorted(RESULTS_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        assert data["schema"] == SCHEMA, f"{path}: re-record it (`python -m kvwall record {path.stem}`)"
        assert data["provenance"]["digest"] == content_digest(data), path


def test_result_files_get_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        path = save_result(_tiny_result(), tmp_path)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize(
    "text,words", [(lambda t: t[: len(t) // 2], "not valid JSON"), (lambda t: "[1, 2]", "not a JSON object")]
)
def test_truncated_file_is_refused_naming_the_file(tmp_path, text, words):
    path = save_result(_tiny_result(), tmp_path)
    path.write_text(text(path.read_text()))
    with pytest.raises(ResultFileError, match=words) as info:
        load_result("cast_sweep", tmp_path)
    assert str(path) in str(info.value)


def test_rows_that_drift_from_the_schema_are_refused_naming_row_and_field(tmp_path):
    """A file whose digest is right but whose rows do not match the schema (written by code that drifted)."""
    path = save_result(_tiny_result(), tmp_path)
    data = json.loads(path.read_text())
    data["rows"][1]["ms"] = "fast"
    del data["rows"][0]["bytes"]
    data["provenance"]["digest"] = content_digest(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ResultFileError) as info:
        load_result("cast_sweep", tmp_path)
    message = str(info.value)
    # the file, and each bad row by number and field
    assert str(path) in message and re.search(r"row 0\b.*'bytes'", message) and re.search(r"row 1\b.*'ms'", message)


def test_save_refuses_rows_off_schema_and_leaves_the_old_file(tmp_path):
    path = save_result(_tiny_result(), tmp_path)
    before = path.read_text()
    with pytest.raises(RowSchemaError, match=r"row 0\b.*'pool_tokens'"):
        save_result(_tiny_result(rows=[{**ROWS[0], "pool_tokens": 8.5}]), tmp_path)
    with pytest.raises(RowSchemaError, match=r"'sweeep'.*'section'.*'sweep'"):  # the value, the field, the one allowed
        save_result(_tiny_result(rows=[{**ROWS[0], "section": "sweeep"}]), tmp_path)
    with pytest.raises(RowSchemaError, match=r"row 1\b.*'steps'"):
        validate_rows("decode_profile", [{"section": "step", "step": 0, "ms": 1.0}, {"section": "steps"}])
    with pytest.raises(ValueError, match="scale"):
        save_result(_tiny_result(scale=None), tmp_path)
    assert path.read_text() == before and len(list(tmp_path.iterdir())) == 1


def test_missing_file(tmp_path):
    with pytest.raises(ResultMissingError, match=re.escape(str(tmp_path / "decode_profile.json"))):
        load_result("decode_profile", tmp_path)


def test_schemas_cover_every_experiment_and_accept_the_committed_rows():
    assert set(ROW_SCHEMAS) == set(EXPERIMENTS)
    for name, exp in EXPERIMENTS.items():
        assert exp.rows is ROW_SCHEMAS[name] and set(exp.requires) <= set(registry.PREREQUISITES)
        path = RESULTS_DIR / f"{name}.json"
        if path.is_file():
            validate_rows(name, json.loads(path.read_text())["rows"])


def test_experiments_must_name_known_prerequisites():
    run = EXPERIMENTS["cast_sweep"].run
    with pytest.raises(ValueError, match="requires \\['gpu'\\]"):
        Experiment("cast_sweep", run, {}, {}, "x", ("gpu",))
    with pytest.raises(ValueError, match=r"no_such_experiment\b.*kvwall\.experiments\.schemas"):
        Experiment("no_such_experiment", run, {}, {}, "x", ())


def test_results_imports_nothing_above_it():
    """kvwall.results is the layer just above the kernels: it may import only itself and kvwall.kernels."""
    for path in (PROJECT_ROOT / "lib/kvwall/results").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                if name.startswith("kvwall"):
                    assert name.startswith(("kvwall.results", "kvwall.kernels")), f"{path.name} imports {name}"


def test_every_committed_result_loads_and_is_fresh_unless_listed_as_awaiting_a_rerecord():
    """Fresh, or named with its reason in book/results/AWAITING_RERECORD.txt -- and that list names exactly the stale
    ones: a result that became fresh must leave it, one that went stale must be re-recorded or join it."""
    awaiting = awaiting_rerecord()
    assert set(awaiting) <= set(EXPERIMENTS), (
        f"{AWAITING_FILE} names unknown experiments: {set(awaiting) - set(EXPERIMENTS)}"
    )
    for name, exp in EXPERIMENTS.items():
        result = load_result(name)
        if "cuda" in exp.requires:
            assert result.provenance.gpu, f"{name}: a GPU experiment's recorded result must come from a GPU"
        assert result.provenance.scale == "full" and not result.provenance.missing, name
        assert result.provenance.git_commit != "unknown"
        if name in awaiting:
            assert result.stale, f"{name} is fresh: remove it from {AWAITING_FILE}"
        else:
            assert not result.stale, f"{name} is stale: {result.changed_sources()}; re-record with make record"


def test_the_awaiting_list_is_read_strictly(tmp_path):
    assert awaiting_rerecord(tmp_path) == {}
    why = "the GPU was busy"
    (tmp_path / AWAITING_FILE).write_text(f"# a comment\n\ncast_sweep: {why}  # trailing\n")
    assert awaiting_rerecord(tmp_path) == {"cast_sweep": why}
    (tmp_path / AWAITING_FILE).write_text("cast_sweep\n")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / AWAITING_FILE}:1:") + ".*'cast_sweep"):
        awaiting_rerecord(tmp_path)


# --- record ------------------------------------------------------------------------------------------------


@pytest.fixture
def no_runs(monkeypatch):
    """Any experiment run fails the test: refusals must come before running anything."""
    monkeypatch.setattr(cli, "run_experiment", lambda *a, **k: pytest.fail("an experiment ran"))


@pytest.fixture
def fake_run(monkeypatch):
    """Experiments return the tiny cast_sweep result at once."""
    monkeypatch.setattr(cli, "run_experiment", lambda name, device, scale: _tiny_result(scale))
    monkeypatch.setattr(registry, "PREREQUISITES", {k: (lambda: None) for k in registry.PREREQUISITES})


@pytest.mark.usefixtures("no_runs")
def test_record_refuses_before_running_when_prerequisites_are_missing(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(registry.PREREQUISITES, "cuda", lambda: "no-GPU-here")
    monkeypatch.setitem(registry.PREREQUISITES, "nvcc", lambda: "no-nvcc-here")
    gpu = [n for n, e in EXPERIMENTS.items() if "cuda" in e.requires]
    assert gpu, "some experiments must require a GPU"
    assert cli.main(["record", "all", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    # one refusal a missing prerequisite, naming it, why, and what needs it; nothing else stands in the way
    listed = [line.split() for line in err.splitlines() if line.startswith("  - ")]
    needed = {
        r
        for r, lacks in registry.PREREQUISITES.items()
        if lacks() and any(r in e.requires for e in EXPERIMENTS.values())
    }
    assert {words[2] for words in listed} == needed and len(listed) == len(needed)
    assert re.search(rf"cuda \(no-GPU-here\).*\b{re.escape(', '.join(gpu))}$", err, re.M)
    assert list(tmp_path.iterdir()) == []
    assert cli.main(["record", "all", "--out", str(tmp_path / "new" / "folder")]) == 2
    assert list(tmp_path.iterdir()) == []  # a refused record creates no --out


@pytest.mark.usefixtures("fake_run")
def test_record_refuses_to_replace_full_scale_with_small(capsys, tmp_path):
    save_result(_tiny_result("full"), tmp_path)
    assert cli.main(["record", "cast_sweep", "--scale", "small", "--out", str(tmp_path)]) == 2
    assert re.search(rf"cast_sweep in {re.escape(str(tmp_path))} .*full-scale", capsys.readouterr().err)
    assert load_result("cast_sweep", tmp_path).provenance.scale == "full"
    assert cli.main(["record", "cast_sweep", "--scale", "small", "--force", "--out", str(tmp_path)]) == 0
    assert load_result("cast_sweep", tmp_path).provenance.scale == "small"


@pytest.mark.usefixtures("fake_run")
def test_record_refuses_small_over_committed_files_of_the_old_format(capsys, tmp_path):
    (tmp_path / "cast_sweep.json").write_text(json.dumps({"schema": 1, "provenance": {"gpu": "NVIDIA H200"}}))
    assert cli.main(["record", "cast_sweep", "--scale", "small", "--out", str(tmp_path)]) == 2
    assert "full-scale results" in capsys.readouterr().err


@pytest.mark.usefixtures("fake_run")
def test_record_with_force_notes_what_was_missing(monkeypatch, tmp_path):
    monkeypatch.setitem(registry.PREREQUISITES, "cuda", lambda: "no CUDA GPU (test)")
    name = next(n for n, e in EXPERIMENTS.items() if "cuda" in e.requires)
    assert cli.main(["record", name, "--out", str(tmp_path)]) == 2
    assert cli.main(["record", name, "--force", "--out", str(tmp_path)]) == 0
    prov = load_result("cast_sweep", tmp_path).provenance  # what the fake run returns, whatever the name
    assert prov.missing == ["cuda"] and prov.short().endswith("without cuda")


@pytest.mark.parametrize("make_out", [lambda p: p / "a_file", lambda p: p / "a_file" / "below"])
@pytest.mark.usefixtures("no_runs")
def test_record_checks_out_before_running(capsys, tmp_path, make_out):
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(SystemExit) as stop:
        cli.main(["record", "cast_sweep", "--out", str(make_out(tmp_path))])
    assert stop.value.code == 2 and "argument --out" in capsys.readouterr().err


@pytest.mark.usefixtures("fake_run")
def test_record_writes_each_result_and_reports_progress(capsys, tmp_path):
    assert cli.main(["record", "cast_sweep", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"^\[1/1\] cast_sweep.*\bfull\b", err, re.M) and re.search(r"^recorded 1\b", err, re.M)
    assert re.search(rf"^recorded cast_sweep\b.*{re.escape(str(tmp_path / 'cast_sweep.json'))}$", out, re.M)
    assert load_result("cast_sweep", tmp_path).rows == ROWS


@pytest.mark.usefixtures("fake_run")
def test_record_says_what_was_recorded_when_an_experiment_fails(monkeypatch, capsys, tmp_path):
    def run(name, device, scale):
        if name == "attention_sweep":
            raise RuntimeError("out-of-memory-in-test")
        return _tiny_result(scale)

    monkeypatch.setattr(cli, "run_experiment", run)
    assert cli.main(["record", "gather_cast_bench", "attention_sweep", "cast_sweep", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err  # run in dependency order: cast_sweep, attention_sweep, gather_cast_bench
    # which failed, its error, what was recorded before it and what was not run
    assert re.search(r"\battention_sweep\b.*out-of-memory-in-test\b.*\bcast_sweep\b.*\bgather_cast_bench\b", err, re.M)
    assert "RuntimeError: out-of-memory-in-test" in err
    assert "Traceback" not in err
    log = Path(err.split("its traceback: ")[1].split(")")[0])
    assert "out-of-memory-in-test" in log.read_text()
    assert (tmp_path / "cast_sweep.json").is_file()


def test_record_rejects_unknown_experiments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["record", "decode_profil"])
    assert "'decode_profil'" in capsys.readouterr().err  # argparse's invalid choice


# --- list, check, execute ----------------------------------------------------------------------------------


def test_cli_list(capsys):
    assert cli.main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in EXPERIMENTS) and "[requires" in listed


def test_check_reports_each_file(capsys, tmp_path):
    save_result(_tiny_result(), tmp_path)
    (tmp_path / "decode_profile.json").write_text("{")
    assert cli.main(["check", "--dir", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("ok") and "cast_sweep.json" in line for line in lines)
    assert any(line.startswith("INVALID") and "decode_profile.json" in line for line in lines)
    assert any(line.startswith("MISSING") and "cast_kernels.json" in line for line in lines)


def test_check_exits_1_when_a_result_is_stale(capsys, tmp_path):
    """Issue 24, finding 9: `check` is a gate: stale results make it exit non-zero."""
    result = _tiny_result()
    assert cli.main(["check", "--dir", str(tmp_path)]) == 1  # all missing
    capsys.readouterr()
    for name in EXPERIMENTS:
        save_result(dataclasses.replace(result, experiment=name, rows=[]), tmp_path)
    assert cli.main(["check", "--dir", str(tmp_path)]) == 0
    result.provenance.sources = {"lib/kvwall/cli.py": "0" * 16}
    save_result(dataclasses.replace(result, experiment="cast_sweep"), tmp_path)
    assert cli.main(["check", "--dir", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert any(line.startswith("STALE") and "cast_sweep.json" in line for line in out.splitlines())
    assert "1 of" in err and "1 stale" in err


def test_check_of_a_missing_folder_is_one_line(capsys):
    assert cli.main(["check", "--dir", "/nonexistent"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "/nonexistent" in err


@pytest.mark.parametrize("command", [["list"], ["check"]])
def test_output_into_a_closed_pipe_exits_quietly(command):
    proc = subprocess.Popen([sys.executable, "-m", "kvwall", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # as `| head` does once it has its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == ""


def _run_cli(args, **popen):
    proc = subprocess.run(
        [sys.executable, "-m", "kvwall", *args], stderr=subprocess.PIPE, text=True, timeout=180, **popen
    )
    return proc.returncode, proc.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_output_into_a_full_disk_is_one_line():
    with open("/dev/full", "w") as full:
        rc, err = _run_cli(["list"], stdout=full)
    assert rc == 2 and os.strerror(errno.ENOSPC) in err and "Traceback" not in err  # the OS's reason
    assert len(err.strip().splitlines()) == 1


def test_output_with_stdout_closed_is_one_line():
    rc, err = _run_cli(["list"], stdout=subprocess.DEVNULL, preexec_fn=lambda: os.close(1))
    assert rc == 2 and "standard output" in err and "Traceback" not in err


@pytest.mark.parametrize("out", ["README.md", "/proc/nope"])
def test_execute_refuses_an_out_it_cannot_write(capsys, out):
    chapter = PROJECT_ROOT / "book/01_the_86ms_profile.md"
    try:
        rc = cli.main(["execute", str(chapter), "--out", str(PROJECT_ROOT / out)])
    except SystemExit as stop:  # refused by argparse, naming --out
        rc = stop.code
    err = capsys.readouterr().err
    assert rc == 2 and ("argument --out" in err or "cannot write" in err) and "Traceback" not in err


@pytest.mark.parametrize(
    "chapter,words",
    [
        ("book/nosuch.md", "no such file"),
        ("book", "is a folder"),
        ("README.md", "is not a chapter"),
    ],
)
def test_execute_refuses_what_is_not_a_chapter(capsys, tmp_path, chapter, words):
    assert cli.main(["execute", str(PROJECT_ROOT / chapter), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert words in err and "01_the_86ms_profile.md" in err and len(err.strip().splitlines()) == 1


def test_execute_refuses_unknown_parameters_before_running(capsys, tmp_path):
    chapter = PROJECT_ROOT / "book/01_the_86ms_profile.md"
    assert cli.main(["execute", str(chapter), "--out", str(tmp_path), "-p", "layer=2"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"\blayer\b.*\bmode\b.*'auto'", err) and "layers" in err  # the offending name, those it takes
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_execute_with_a_bad_value_prints_the_cause_last(capsys, tmp_path):
    chapter = PROJECT_ROOT / "book/01_the_86ms_profile.md"
    assert cli.main(["execute", str(chapter), "--out", str(tmp_path), "-p", "mode=fast"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ValueError: mode='fast'") and "Traceback" not in "\n".join(err)


def test_run_experiment_stamps_the_scale_and_validates_the_rows(monkeypatch):
    exp = EXPERIMENTS["cast_sweep"]
    fake = dataclasses.replace(exp, run=lambda device, **params: _tiny_result(scale=None))
    monkeypatch.setitem(EXPERIMENTS, "cast_sweep", fake)
    assert run_experiment("cast_sweep", torch.device("cpu"), "small").provenance.scale == "small"
    drifted = dataclasses.replace(exp, run=lambda device, **params: _tiny_result(rows=[{**ROWS[0], "gbps": "15"}]))
    monkeypatch.setitem(EXPERIMENTS, "cast_sweep", drifted)
    with pytest.raises(RowSchemaError, match=r"row 0\b.*'gbps'"):
        run_experiment("cast_sweep", torch.device("cpu"), "small")
    with pytest.raises(LookupError, match="import kvwall.experiments"):
        validate_rows("never_registered", [])


def test_run_experiment_rejects_unknown_parameters():
    with pytest.raises(TypeError, match="no parameters"):
        run_experiment("cast_sweep", torch.device("cpu"), "small", pool_size=[3])
    with pytest.raises(ValueError, match="scale"):
        run_experiment("cast_sweep", torch.device("cpu"), "medium")


def test_short_kernel_names():
    # quoted: a kernel name as torch.profiler prints it
    assert (
        short_kernel_name("void at::native::unrolled_elementwise_kernel<at::native::x<1> >(int)")
        == "unrolled_elementwise_kernel"
    )
    assert short_kernel_name("at::cuda::(anonymous namespace)::spin_kernel(long)") == "spin_kernel"
    # quoted: a kernel name as torch.profiler prints it
    assert short_kernel_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"


@pytest.mark.usefixtures("fake_run")
def test_record_runs_in_dependency_order_and_derives_tables_after_full_scale_runs(monkeypatch, capsys, tmp_path):
    order = list(EXPERIMENTS)
    first, later = order[0], order[-1]
    derived: list[str] = []

    def derive(result):
        derived.append(result.experiment)
        return [tmp_path / "derived.json"]

    monkeypatch.setitem(EXPERIMENTS, first, dataclasses.replace(EXPERIMENTS[first], after_record=derive))
    ran: list[str] = []
    monkeypatch.setattr(cli, "run_experiment", lambda name, device, scale: (ran.append(name), _tiny_result(scale))[1])
    assert cli.main(["record", later, first, "--out", str(tmp_path)]) == 0
    assert ran == [first, later]  # the table a later experiment reads is derived before it runs
    assert derived == ["cast_sweep"] and f"wrote {tmp_path / 'derived.json'}" in capsys.readouterr().out
    derived.clear()
    assert cli.main(["record", first, "--scale", "small", "--out", str(tmp_path / "small")]) == 0
    assert derived == []  # a small-scale run never rewrites what the kernels read


@pytest.mark.usefixtures("fake_run")
def test_record_fails_when_what_it_wrote_is_already_stale(monkeypatch, capsys, tmp_path):
    table = "kernels/mla_decode/kernel_paths.json"
    monkeypatch.setattr(Result, "changed_sources", lambda self, root=PROJECT_ROOT: [table])
    assert cli.main(["record", "cast_sweep", "--out", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert re.search(rf"^\W+cast_sweep:.*{re.escape(table)}$", err, re.M)  # the result, and what changed


@pytest.mark.parametrize("fails", [False, True])
def test_execute_writes_the_notebook_atomically(monkeypatch, tmp_path, fails):
    """Issue 24, finding 12: while a run writes (papermill re-saves after every cell), the notebook at
    <out>/<stem>.ipynb is the previous whole one; the new one replaces it in one rename, failed runs included."""
    from kvwall.reports import execute as execute_module

    chapter = PROJECT_ROOT / "book/01_the_86ms_profile.md"
    target = tmp_path / "01_the_86ms_profile.ipynb"
    target.write_text("previous run")
    seen = []

    def fake_execute_notebook(notebook, output_path, **kwargs):
        Path(output_path).write_text('{"half": ')
        seen.append((output_path, target.read_text()))
        Path(output_path).write_text('{"whole": 1}')
        if fails:
            raise RuntimeError("cell-failed-in-test")
        record = tmp_path / "execution" / "01_the_86ms_profile.json"
        record.parent.mkdir()
        record.write_text('{"chapter": "01_the_86ms_profile"}')

    monkeypatch.setattr(execute_module.papermill, "execute_notebook", fake_execute_notebook)
    if fails:
        with pytest.raises(RuntimeError, match="cell-failed-in-test"):
            execute_module.execute_chapter(chapter, tmp_path)
    else:
        assert execute_module.execute_chapter(chapter, tmp_path) == {"chapter": "01_the_86ms_profile"}
    assert seen and seen[0][0] != str(target) and seen[0][1] == "previous run"
    assert target.read_text() == '{"whole": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["01_the_86ms_profile.ipynb"] + (
        [] if fails else ["execution"]
    )
