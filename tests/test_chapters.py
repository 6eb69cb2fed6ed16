"""Every chapter runs under papermill with CPU parameters; we assert on the values it computed."""

import pytest
import torch

from conftest import BOOK, CHAPTERS, run_chapter
from kvwall.notebook.chapter import start_chapter
from kvwall.model.geometry import GLM5
from kvwall.model.roofline import full_pool_cast_bytes
from kvwall.model.original import ORIGINAL
from kvwall.results import load_result

pytestmark = pytest.mark.slow


def test_chapters_are_in_the_toc():
    toc = (BOOK.parent / "_toc.yml").read_text()
    assert CHAPTERS and all(f"book/{p.stem}" in toc for p in CHAPTERS)


def test_chapter_1_on_cpu(tmp_path):
    rec = run_chapter(BOOK / "01_the_86ms_profile.md", tmp_path, mode="cpu")
    v = rec["values"]
    assert rec["mode"] == "cpu" and rec["scale"] == "small"
    assert rec["duration_s"] < 180, "chapter 1 must run in 3 minutes on a 2-core CPU"
    # Live, small scale: the whole-pool cast dominates the step, and attention is right.
    assert v["live_layers"] == 4 and v["live_pool_slots"] == 50_001
    assert v["live_cast_share"] > 0.5
    assert v["live_ops"][0] == "aten::copy_"
    assert v["live_attention_rel_err"] < 1e-2
    assert v["live_cast_gbps"] < v["live_copy_gbps"]
    # The arithmetic, from the geometry.
    assert v["full_pool_cast_bytes_per_layer"] == full_pool_cast_bytes(GLM5, ORIGINAL.pool_tokens)["total"]
    # The recorded full-scale run is the one in book/results/, at GLM-5's full shape.
    recorded = load_result("decode_profile").table("summary")[0]
    assert v["recorded_step_ms"] == recorded["step_ms"]
    assert v["recorded_layers"] == GLM5.num_layers and v["recorded_pool_slots"] == ORIGINAL.pool_tokens + 1
    assert {u["experiment"] for u in rec["recorded_used"]} == {"decode_profile", "cast_kernels", "cast_sweep",
                                                             "attention_sweep"}


def test_chapter_1_smaller_knobs(tmp_path):
    rec = run_chapter(BOOK / "01_the_86ms_profile.md", tmp_path, mode="cpu", pool_tokens=20_000, layers=2,
                      context_len=500)
    assert rec["knobs"] == {"pool_tokens": 20_000, "layers": 2, "context_len": 500}
    assert rec["values"]["live_pool_slots"] == 20_001 and rec["values"]["live_layers"] == 2


@pytest.mark.parametrize("params,words", [
    ({"mode": "tpu"}, "mode='tpu' is not allowed: use one of 'auto', 'gpu', 'cpu'"),
    ({"mode": "cpu", "layers": 0}, "layers=0 must be a positive integer"),
    ({"mode": "cpu", "record": True}, "record=True writes full-scale GPU results"),
])
def test_bad_parameter_stops_in_the_first_cell(tmp_path, params, words):
    import papermill

    with pytest.raises(papermill.PapermillExecutionError) as info:
        run_chapter(BOOK / "01_the_86ms_profile.md", tmp_path, **params)
    assert words in str(info.value)
    assert info.value.exec_count <= 3, "the error must come from the set-up cell, before any work"


def test_start_chapter_validation():
    knobs = {"gpu": {"layers": 78}, "cpu": {"layers": 4}}
    with pytest.raises(ValueError, match="'auto', 'gpu', 'cpu'"):
        start_chapter("x", mode="GPU", record=False, defaults=knobs, layers=None)
    with pytest.raises(ValueError, match="unknown parameters"):
        start_chapter("x", mode="cpu", record=False, defaults=knobs, layer=3)
    with pytest.raises(ValueError, match="True or False"):
        start_chapter("x", mode="cpu", record="yes", defaults=knobs)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            start_chapter("x", mode="gpu", record=False, defaults=knobs)
    assert start_chapter("x", mode="auto", record=False, defaults=knobs, layers=None).knobs["layers"] in (4, 78)


def test_chapters_open_as_notebooks_in_jupyterlab():
    """JupyterLab opens files through jupytext's contents manager: the .md must come back as a notebook."""
    from jupyter_server.services.contents.largefilemanager import LargeFileManager
    from jupytext.sync_contentsmanager import build_sync_jupytext_contents_manager_class

    cm = build_sync_jupytext_contents_manager_class(LargeFileManager)(root_dir=str(BOOK))
    for path in CHAPTERS:
        model = cm.get(path.name, type="notebook")
        cells = model["content"]["cells"]
        assert model["type"] == "notebook" and any(c["cell_type"] == "code" for c in cells)
        assert any("parameters" in c["metadata"].get("tags", []) for c in cells), f"{path.name}: no parameters cell"


@pytest.mark.parametrize("chapter,experiment,params", [
    ("01_the_86ms_profile", "decode_profile", {"layers": 1, "pool_tokens": 5000}),
    ("02_the_wall", "wall_on_gpu", {}),
    ("03_the_other_doors", "doors_sm90", {}),
    ("04_gather_then_cast", "gather_cast_validation", {}),
    ("05_fused_fp8_decode", "fused_decode_bench", {}),
    ("05a_fused_decode_lab", "fused_decode_profile", {}),
    ("06_the_answer", "path_sweep", {}),
])
def test_corrupt_result_file_stops_the_chapter_naming_the_file(tmp_path, monkeypatch, chapter, experiment, params):
    """A hand-edited or truncated result is an error naming the file, never 'not recorded yet'."""
    import shutil

    import papermill

    results = tmp_path / "results"
    shutil.copytree(BOOK / "results", results)
    broken = results / f"{experiment}.json"
    broken.write_text(broken.read_text()[:200])
    monkeypatch.setenv("KVWALL_RESULTS_DIR", str(results))
    with pytest.raises(papermill.PapermillExecutionError) as info:
        run_chapter(BOOK / f"{chapter}.md", tmp_path, mode="cpu", **params)
    assert str(broken) in str(info.value) and "not valid JSON" in str(info.value)
    assert info.value.ename == "ResultFileError"


def test_stale_result_is_shown_with_a_visible_warning(tmp_path, monkeypatch):
    import json

    import IPython.display

    import kvwall.notebook.chapter as chapter_module
    from kvwall.results import content_digest, load_result as real_load

    data = json.loads((BOOK / "results" / "cast_sweep.json").read_text())
    first = next(iter(data["provenance"]["sources"]))
    data["provenance"]["sources"][first] = "0" * 16  # as if the source changed since the run
    # ... recorded so (the digest covers the provenance: an edit alone would be refused, not stale)
    data["provenance"]["digest"] = content_digest(data)
    (tmp_path / "cast_sweep.json").write_text(json.dumps(data))
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    monkeypatch.setattr(chapter_module, "load_result", lambda name: real_load(name, tmp_path))
    run = start_chapter("x", mode="cpu", record=False, defaults={"gpu": {}, "cpu": {}})
    result = run.recorded("cast_sweep")
    assert result.stale and run.recorded_used[0]["stale"]
    assert "STALE" in result.caption() and first in result.caption()
    assert len(shown) == 1 and "Stale recorded result" in shown[0].data and 'class="admonition warning"' in shown[0].data
