"""Every chapter runs under papermill with CPU parameters; we assert on the values it computed.

Each chapter is executed once per test session (``conftest.executed``), and the book is built from those runs. What a
second run with other knobs, and runs stopped by a bad parameter or a corrupt result file, proved besides is proved
on every chapter's code (its parameters reach ``start_chapter``, called in its first cell; no ``try`` in it catches a
corrupt result) and on the functions that code calls, with one end-to-end run of each error path kept."""

import ast

import jupytext
import pytest
import torch

from conftest import BOOK, CHAPTERS, run_chapter
from kvwall.reports.chapter import start_chapter, step_knobs
from kvwall.model.geometry import GLM5
from kvwall.model.roofline import full_pool_cast_bytes
from kvwall.model.original import ORIGINAL
from kvwall.results import load_result


def _code_cells(path):
    """The code cells of a chapter, as papermill and myst-nb read them."""
    return [c for c in jupytext.read(path).cells if c.cell_type == "code"]


def _chapters_with_parameters():
    from kvwall.reports.execute import chapter_files, chapter_parameters

    return [p for p in chapter_files() if chapter_parameters(jupytext.read(p))]


def test_chapters_are_in_the_toc():
    toc = (BOOK.parent / "_toc.yml").read_text()
    assert CHAPTERS and all(f"book/{p.stem}" in toc for p in CHAPTERS)


@pytest.mark.slow
def test_chapter_1_on_cpu(executed):
    rec = executed(BOOK / "01_the_86ms_profile.md")
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
    assert {u["experiment"] for u in rec["recorded_used"]} == {
        "decode_profile",
        "cast_kernels",
        "cast_sweep",
        "attention_sweep",
    }


@pytest.mark.parametrize("chapter", _chapters_with_parameters(), ids=lambda p: p.stem)
def test_parameters_reach_start_chapter_in_the_first_cell(chapter):
    """What runs with other knobs (``-p layers=2``) and with a bad value proved, on every chapter's code: the
    parameters cell is the first code cell and the next one calls ``start_chapter`` (so a bad value stops the run
    there, before any work: under papermill the injected parameters are the second cell executed, that call the
    third), and every parameter reaches that call by its own name (``layers=layers``): nothing a reader sets is
    dropped or replaced."""
    from kvwall.reports.execute import chapter_parameters

    cells = _code_cells(chapter)
    assert "parameters" in cells[0].metadata.get("tags", []), f"{chapter.name}: the parameters cell must come first"
    calls = [
        node
        for node in ast.walk(ast.parse(cells[1].source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "start_chapter"
    ]
    assert len(calls) == 1, f"{chapter.name}: the cell after the parameters must call start_chapter, once"
    assert calls[0].args and getattr(calls[0].args[0], "value", None) == chapter.stem
    passed = {k.arg: getattr(k.value, "id", None) for k in calls[0].keywords}
    for name in chapter_parameters(jupytext.read(chapter)):
        assert passed.get(name) == name, f"{chapter.name}: {name} is not passed to start_chapter as {name}={name}"


def test_a_readers_knobs_replace_the_defaults():
    """Chapters 1 and 4 with smaller knobs (what ``-p pool_tokens=20000 -p layers=2`` gives them): each given knob
    replaces the mode's default, the others keep it."""
    for experiment in ("decode_profile", "gather_cast_profile"):
        defaults = step_knobs(experiment)
        run = start_chapter(
            "x", mode="cpu", record=False, defaults=defaults, pool_tokens=20_000, layers=2, context_len=None
        )
        assert run.knobs == {**defaults["cpu"], "pool_tokens": 20_000, "layers": 2}


def test_chapter_1s_live_profile_at_smaller_knobs():
    """Chapter 1's live measurement at a reader's knobs, as its cell calls it (``chapter.knobs`` passed on): the
    pool has pool_tokens + 1 slots and the step the layers asked for."""
    from kvwall.experiments import run_experiment

    run = start_chapter(
        "01_the_86ms_profile",
        mode="cpu",
        record=False,
        defaults=step_knobs("decode_profile"),
        pool_tokens=20_000,
        layers=2,
        context_len=500,
    )
    assert run.knobs == {"pool_tokens": 20_000, "layers": 2, "context_len": 500}
    live = run_experiment(
        "decode_profile",
        torch.device("cpu"),
        "small",
        pool_tokens=run.knobs["pool_tokens"],
        layers=run.knobs["layers"],
        context_lens=[run.knobs["context_len"]],
    )
    summary = live.table("summary")[0]
    assert summary["pool_slots"] == 20_001 and summary["layers"] == 2


@pytest.mark.slow
def test_bad_parameter_stops_in_the_first_cell(tmp_path):
    """End to end, once: papermill stops the chapter in its set-up cell with start_chapter's message. The other bad
    values are start_chapter's own checks (test_start_chapter_validation), and every chapter calls it in that cell
    (test_parameters_reach_start_chapter_in_the_first_cell)."""
    import papermill

    with pytest.raises(papermill.PapermillExecutionError) as info:
        run_chapter(BOOK / "01_the_86ms_profile.md", tmp_path, mode="cpu", layers=0)
    assert info.value.ename == "ValueError" and "layers=0" in info.value.evalue  # start_chapter's, naming the value
    assert info.value.exec_count <= 3, "the error must come from the set-up cell, before any work"


def test_start_chapter_validation():
    knobs = {"gpu": {"layers": 78}, "cpu": {"layers": 4}}
    with pytest.raises(ValueError, match=r"'auto'.*'gpu'.*'cpu'"):
        start_chapter("x", mode="GPU", record=False, defaults=knobs, layers=None)
    with pytest.raises(ValueError, match="unknown parameters"):
        start_chapter("x", mode="cpu", record=False, defaults=knobs, layer=3)
    with pytest.raises(ValueError, match="True or False"):
        start_chapter("x", mode="cpu", record="yes", defaults=knobs)
    # What a chapter run with each bad value stops with, in its first cell (test_bad_parameter_stops_in_the_first_cell
    # runs one end to end; test_parameters_reach_start_chapter_in_the_first_cell: every chapter calls it there).
    with pytest.raises(ValueError) as info:
        start_chapter("x", mode="tpu", record=False, defaults=knobs)
    assert "mode='tpu'" in str(info.value) and all(repr(m) in str(info.value) for m in ("auto", "gpu", "cpu"))
    with pytest.raises(ValueError) as info:
        start_chapter("x", mode="cpu", record=False, defaults=knobs, layers=0)
    assert "layers=0 must be a positive integer" in str(info.value)
    with pytest.raises(ValueError) as info:
        start_chapter("x", mode="cpu", record=True, defaults=knobs)
    assert "record=True" in str(info.value) and "mode='gpu'" in str(info.value)  # the mode it needs
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


#: Each chapter and a recorded result it reads (a corrupt copy of it must stop the chapter, naming the file).
CORRUPTIBLE = [
    ("01_the_86ms_profile", "decode_profile"),
    ("02_the_wall", "wall_on_gpu"),
    ("03_the_other_doors", "doors_sm90"),
    ("04_gather_then_cast", "gather_cast_validation"),
    ("05_fused_fp8_decode", "fused_decode_bench"),
    ("05a_fused_decode_lab", "fused_decode_profile"),
    ("06_the_answer", "path_sweep"),
]


def _corrupt_copy(folder, monkeypatch, experiment):
    """A copy of book/results/ with ``experiment``'s file truncated, read instead of book/results/."""
    import shutil

    results = folder / "results"
    shutil.copytree(BOOK / "results", results)
    broken = results / f"{experiment}.json"
    broken.write_text(broken.read_text()[:200])
    monkeypatch.setenv("KVWALL_RESULTS_DIR", str(results))
    return broken


@pytest.mark.slow
def test_corrupt_result_file_stops_the_chapter_naming_the_file(tmp_path, monkeypatch):
    """End to end, once: a hand-edited or truncated result is an error naming the file, never 'not recorded yet',
    and papermill reports the chapter's ResultFileError. The other chapters read their results the same way with
    nothing in between (test_a_corrupt_result_is_never_caught_by_a_chapter,
    test_a_corrupt_result_raises_naming_the_file)."""
    import papermill

    broken = _corrupt_copy(tmp_path, monkeypatch, "fused_decode_profile")
    with pytest.raises(papermill.PapermillExecutionError) as info:
        run_chapter(BOOK / "05a_fused_decode_lab.md", tmp_path, mode="cpu")
    assert str(broken) in str(info.value) and "JSON" in str(info.value)
    assert info.value.ename == "ResultFileError"


@pytest.mark.parametrize("read", ["recorded", "recorded_or_none"])
def test_a_corrupt_result_raises_naming_the_file(tmp_path, monkeypatch, read):
    """What a chapter's own ``chapter.recorded(...)`` / ``chapter.recorded_or_none(...)`` does with each truncated
    file the chapters used to be run on: a ResultFileError naming it, never 'not recorded yet'."""
    import kvwall.reports.chapter as chapter_module
    from kvwall.results import ResultFileError, ResultMissingError, load_result as real_load

    for _, experiment in CORRUPTIBLE:
        broken = _corrupt_copy(tmp_path / experiment, monkeypatch, experiment)
        # KVWALL_RESULTS_DIR is read when kvwall.results is imported (in a chapter's kernel: at its start)
        monkeypatch.setattr(chapter_module, "load_result", lambda name, d=broken.parent: real_load(name, d))
        run = start_chapter("x", mode="cpu", record=False, defaults={"gpu": {}, "cpu": {}})
        with pytest.raises(ResultFileError) as info:
            getattr(run, read)(experiment)
        assert info.value.path == broken and str(broken) in str(info.value) and "JSON" in info.value.problem
        assert not isinstance(info.value, ResultMissingError), "a corrupt file is not 'not recorded yet'"


def _tries(tree):
    """Each ``try`` of ``tree``: the names of the exceptions its handlers catch ('' for a bare except), and the
    calls in its body."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            names = []
            for handler in node.handlers:
                kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                names += ["" if k is None else ast.unparse(k).rsplit(".", 1)[-1] for k in kinds]
            yield names, [n for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Call)]


@pytest.mark.parametrize("chapter,experiment", CORRUPTIBLE)
def test_a_corrupt_result_is_never_caught_by_a_chapter(chapter, experiment):
    """Each chapter reads the result itself (``chapter.recorded`` / ``recorded_or_none``: a ResultFileError naming a
    corrupt file), and no ``try`` in the chapter around any read of a result catches that error or a class it
    derives from (ValueError, Exception, a bare except): it stops the chapter, as the end-to-end run shows."""
    from kvwall.results import ResultFileError

    catches_it = {c.__name__ for c in ResultFileError.__mro__} | {""}
    trees = [
        ast.parse("\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in c.source.splitlines()))
        for c in _code_cells(BOOK / f"{chapter}.md")
    ]
    reads = [
        n
        for t in trees
        for n in ast.walk(t)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in ("recorded", "recorded_or_none")
        and n.args
        and getattr(n.args[0], "value", None) == experiment
    ]
    assert reads, f"{chapter} does not read {experiment} with chapter.recorded / recorded_or_none"
    for tree in trees:
        for names, calls in _tries(tree):
            loads = [
                c
                for c in calls
                if isinstance(c.func, ast.Attribute) and c.func.attr in ("recorded", "recorded_or_none")
            ]
            caught = sorted(set(names) & catches_it)
            assert not (loads and caught), (
                f"{chapter}: a try around {ast.unparse(loads[0])} catches {caught}: a "
                "corrupt result file would not stop the chapter"
            )


def test_stale_result_is_shown_with_a_visible_warning(tmp_path, monkeypatch):
    import json

    import html

    import IPython.display

    import kvwall.reports.chapter as chapter_module
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
    # one warning box, quoting the stale result's caption
    assert len(shown) == 1 and 'class="admonition warning"' in shown[0].data
    assert html.escape(result.caption()) in shown[0].data
