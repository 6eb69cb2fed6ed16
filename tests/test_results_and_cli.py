import json
import shutil

import pytest
import torch

from kvwall import cli
from kvwall.experiments import EXPERIMENTS, run_experiment, short_kernel_name
from kvwall.results import PROJECT_ROOT, Result, ResultFileError, collect_provenance, load_result, save_result

SOURCES = ("kernels", "lib/kvwall/model/pool.py")


def _tiny_result():
    return Result("cast_sweep", {"pool_tokens": [8]}, [{"section": "sweep", "pool_tokens": 8, "ms": 0.1}],
                  collect_provenance(torch.device("cpu"), SOURCES))


def test_save_load_round_trip(tmp_path):
    path = save_result(_tiny_result(), tmp_path)
    back = load_result("cast_sweep", tmp_path)
    assert back.rows == [{"section": "sweep", "pool_tokens": 8, "ms": 0.1}] and back.path == path
    assert back.table("sweep")[0]["ms"] == 0.1
    assert not back.stale and "Recorded on" in back.caption()
    with pytest.raises(KeyError, match="no rows in section 'nope'"):
        back.table("nope")


@pytest.mark.parametrize("edit,words", [
    (lambda t: t[: len(t) // 2], "not valid JSON"),
    (lambda t: "[1, 2]", "not a JSON object"),
    (lambda t: t.replace('"rows"', '"roes"'), "field 'rows'"),
    (lambda t: t.replace('"experiment": "cast_sweep"', '"experiment": "other"'), "expected 'cast_sweep'"),
    (lambda t: t.replace('"schema": 1', '"schema": 7'), "schema 7"),
    (lambda t: t.replace('"section": "sweep"', '"section": 3'), "row 0"),
    (lambda t: t.replace('"git_commit"', '"commit"'), "provenance"),
])
def test_corrupt_or_hand_edited_file_names_the_file(tmp_path, edit, words):
    path = save_result(_tiny_result(), tmp_path)
    path.write_text(edit(path.read_text()))
    with pytest.raises(ResultFileError, match=words) as info:
        load_result("cast_sweep", tmp_path)
    assert str(path) in str(info.value) and info.value.path == path


def test_missing_file(tmp_path):
    with pytest.raises(ResultFileError, match="no such result file"):
        load_result("decode_profile", tmp_path)


def test_stale_when_a_measured_source_changes(tmp_path):
    root = tmp_path / "project"
    for entry in SOURCES:
        src = PROJECT_ROOT / entry
        (root / entry).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, root / entry)
    result = _tiny_result()
    assert result.changed_sources(root) == []
    (root / "kernels" / "mla_reference.py").write_text("# edited\n")
    (root / "lib/kvwall/model/pool.py").unlink()
    (root / "kernels" / "new_kernel.py").write_text("# a kernel added later does not stale old results\n")
    assert result.changed_sources(root) == ["kernels/mla_decode/reference.py", "lib/kvwall/model/pool.py"]


def test_every_committed_result_loads_and_is_fresh():
    for name, exp in EXPERIMENTS.items():
        result = load_result(name)
        if exp.needs == "cuda":
            assert result.provenance.gpu, f"{name}: a GPU experiment's recorded result must come from a GPU"
        assert result.provenance.git_commit != "unknown"
        assert not result.stale, f"{name} is stale: {result.changed_sources()}; re-record with make record"


def test_record_refuses_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal only happens without one")
    assert cli.main(["record", "cast_sweep"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_record_rejects_unknown_experiments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["record", "decode_profil"])
    assert "unknown experiment" in capsys.readouterr().err


def test_cli_list_and_check(capsys):
    assert cli.main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in EXPERIMENTS)
    assert cli.main(["check"]) == 0


def test_run_experiment_rejects_unknown_parameters():
    with pytest.raises(TypeError, match="no parameters"):
        run_experiment("cast_sweep", torch.device("cpu"), "small", pool_size=[3])
    with pytest.raises(ValueError, match="scale"):
        run_experiment("cast_sweep", torch.device("cpu"), "medium")


def test_short_kernel_names():
    assert short_kernel_name("void at::native::unrolled_elementwise_kernel<at::native::x<1> >(int)") == \
        "unrolled_elementwise_kernel"
    assert short_kernel_name("at::cuda::(anonymous namespace)::spin_kernel(long)") == "spin_kernel"
    assert short_kernel_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"
