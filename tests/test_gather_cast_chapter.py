"""Chapter 4 under papermill on CPU, as CI runs it: the values it computed, and its time budget; and the
numbers chapter 4's sentences are written from (which strategies are host-bound, in which unit memory is)."""

import re

import pytest

import kvwall.experiments  # noqa: F401 - registers the row schemas
from conftest import BOOK
from kvwall.reports import gather_report, gather_step_report
from kvwall.results import Provenance, Result, load_result
from kvwall.model.geometry import GLM5
from kvwall.model.original import ORIGINAL
from kvwall.model.roofline import full_pool_cast_bytes, gather_cast_bytes
from kvwall.results import RESULTS_DIR

CHAPTER = BOOK / "04_gather_then_cast.md"


def glued_keys(chapter, notebook) -> tuple[set[str], dict[str, str]]:
    """The glue keys ``chapter``'s Markdown names (roles and directives, code cells left out), and what its executed
    ``notebook`` glued (key: text/plain)."""
    import nbformat

    md = re.sub(r"```\{code-cell\}.*?\n```", "", chapter.read_text(), flags=re.S)
    named = set(re.findall(r"\{glue(?::\w*)?\}`([^`:]+)", md)) | set(re.findall(r"```\{glue(?::\w*)?\} (\S+)", md))
    glued = {
        o["metadata"]["scrapbook"]["name"]: o["data"].get("application/papermill.record/text/plain")
        for cell in nbformat.read(notebook, as_version=4).cells
        for o in cell.get("outputs", [])
        if "scrapbook" in o.get("metadata", {})
    }
    return named, glued


@pytest.mark.slow
def test_chapter_4_on_cpu(executed):
    rec = executed(CHAPTER)
    v = rec["values"]
    assert rec["mode"] == "cpu" and rec["scale"] == "small"
    assert rec["duration_s"] < 180, "chapter 4 must run in 3 minutes on a 2-core CPU"
    # Live: the Triton kernels pass the whole suite in the interpreter; the step model's attention is right.
    assert v["live_validation_all_ok"] and v["live_validation_cases"] >= 15
    assert v["live_strategies"] == ["full_pool_cast", "index_then_cast", "index_then_cast_capacity"]
    assert v["live_rel_err"] < 1e-2
    # The prediction is computed from the geometry, not typed.
    assert v["predicted_gather_bytes_per_layer"] == gather_cast_bytes(8192) == 8192 * 576 * 3 + 8192 * 4
    assert v["full_pool_cast_bytes_per_layer"] == full_pool_cast_bytes(GLM5, ORIGINAL.pool_tokens)["total"]
    # Recorded GPU runs are shown when present (and counted as used), and their absence is said, not hidden.
    used = {u["experiment"] for u in rec["recorded_used"]}
    for key, name in (
        ("validation", "gather_cast_validation"),
        ("bench", "gather_cast_bench"),
        ("profile", "gather_cast_profile"),
    ):
        present = (RESULTS_DIR / f"{name}.json").is_file()
        assert v["recorded"][key] == present and (name in used) == present


@pytest.mark.slow
def test_chapter_4_glues_every_number_its_text_names(executed):
    """The book is built with -W: every glue key chapter 4's Markdown names must be glued by its run; on a CPU with
    the recorded results present, none of them is the "not recorded" placeholder."""
    named, glued = glued_keys(CHAPTER, executed.notebook(CHAPTER))
    assert len(named) > 50 and named <= set(glued), sorted(named - set(glued))
    assert [k for k in named if glued[k] == repr("not recorded")] == []


def test_chapter_4_smaller_knobs_run_its_live_step():
    """Chapter 4 at a reader's smaller knobs (``-p pool_tokens=6000 -p layers=1 -p context_len=700``, once a whole
    chapter run): the knobs are the run's, and its live step, called as the chapter calls it, fits them (the
    capacity clamped to the pool, the sweep cut at it) and runs with every strategy. Its validation does not take the
    knobs (the session's run checks it); that every parameter reaches start_chapter in the first cell is checked for
    every chapter in test_chapters.py."""
    import torch

    from kvwall.experiments import EXPERIMENTS, run_experiment
    from kvwall.reports.chapter import start_chapter, step_knobs

    run = start_chapter(
        "04_gather_then_cast",
        mode="cpu",
        record=False,
        defaults=step_knobs("gather_cast_profile"),
        pool_tokens=6000,
        layers=1,
        context_len=700,
    )
    assert run.knobs == {"pool_tokens": 6000, "layers": 1, "context_len": 700}
    params = gather_step_report.live_profile_params(run.knobs, EXPERIMENTS["gather_cast_profile"].small)
    assert params["capacity"] <= 6000 and all(c <= 6000 for c in params["capacity_sweep"])
    live = run_experiment("gather_cast_profile", torch.device("cpu"), "small", **params)
    assert (live.params["pool_tokens"], live.params["layers"], live.params["context_lens"]) == (6000, 1, [700])
    rows = gather_step_report.gain_rows(live)
    assert rows and len(live.table("strategies")) == len(rows) and all(r["name"] and r["step_ms"] for r in rows)


def _profile(strategies: list[tuple[str, float, float, float]]) -> Result:
    """A gather_cast_profile result with (strategy, host enqueue ms, unmarked eager step ms, graph step ms) rows."""
    rows = [
        {
            "section": "strategies",
            "strategy": k,
            "name": k,
            "host_enqueue_ms": host,
            "unmarked_step_ms": eager,
            "graph_step_ms": graph,
            "graph_phase_sum_ms": graph + 0.01,
        }
        for k, host, eager, graph in strategies
    ]
    provenance = Provenance(
        date="2026-11-30T00:00:00+00:00",
        device="cuda",
        gpu="NVIDIA H200",
        driver=None,
        cuda="13.0",
        torch="2.11.0",
        triton="3.6.0",
        flashinfer=None,
        python="3.11",
        git_commit="0" * 40,
        git_dirty=False,
        sources={},
    )
    return Result("gather_cast_profile", {}, rows, provenance)


def test_host_bound_is_an_enqueue_longer_than_the_device_work():
    profile = _profile([("full_pool_cast", 12.0, 89.7, 88.8), ("gather_cast", 30.4, 30.6, 24.5)])
    assert [s["strategy"] for s in gather_step_report.host_bound(profile)] == ["gather_cast"]
    host = gather_step_report.host_summary(profile)
    assert host["strategies"] == 2 and [s["strategy"] for s in host["bound"]] == ["gather_cast"]
    assert host["share"] == pytest.approx(12.0 / 88.8) and host["eager_excess_ms"] == pytest.approx(89.7 - 88.8)
    assert host["phase_sum_gap_ms"] == pytest.approx(0.01)
    calm = gather_step_report.host_summary(_profile([("full_pool_cast", 12.0, 89.7, 88.8)]))
    assert calm["bound"] == [] and f"{calm['share']:.0%}" == "14%"
    everyone = gather_step_report.host_summary(_profile([("gather_cast", 30.4, 30.6, 24.5)]))
    assert everyone["share"] is None and everyone["eager_excess_ms"] is None  # no strategy keeps the GPU ahead


def test_the_recorded_steps_host_bound_numbers_follow_the_recording():
    profile = load_result("gather_cast_profile")
    host = gather_step_report.host_summary(profile)
    graphed = [s for s in profile.table("strategies") if s["graph_step_ms"] is not None]
    assert {s["strategy"] for s in host["bound"]} == {
        s["strategy"] for s in graphed if s["host_enqueue_ms"] > s["graph_step_ms"]
    }
    others = [s for s in graphed if s["host_enqueue_ms"] <= s["graph_step_ms"]]
    assert host["share"] == pytest.approx(max(s["host_enqueue_ms"] / s["graph_step_ms"] for s in others))
    stalls = gather_step_report.stalls(profile)
    marked = [r for r in profile.rows if r["section"] == "marked_steps"]
    graph = {s["strategy"]: s["graph_step_ms"] for s in graphed}
    slow = [r for r in marked if r["step_ms"] > gather_step_report.SLOW_STEP * graph[r["strategy"]]]
    assert (stalls["marked"], stalls["slow"]) == (len(marked), len(slow))
    assert stalls["slow_strategies"] == sorted({r["strategy"] for r in slow})


def test_memory_is_in_decimal_megabytes():
    """One unit for memory in chapters 2-4: MB = 10^6 bytes (the original's "857 MB"), said where first used."""
    p = gather_report.predict(context=8192, capacity=131072, copy_gbps=None, before=None)
    assert f"{p.full_pool_bytes / 1e6:,.1f}" == "855.4"  # 495,000 slots × 576 × (1 B read + 2 B written)
    text = CHAPTER.read_text()
    # chapter 4 glues byte counts divided by 10^6 (pred_*_mb) and says MB after each
    keys = set(re.findall(r"\{glue:text\}`(pred_\w+_mb)[^`]*`", text))
    assert keys >= {"pred_full_mb", "pred_gather_mb", "pred_torch_mb", "pred_attention_mb"}
    for key in keys:
        assert re.search(r"\{glue:text\}`" + key + r"[^`]*`\** MB", text), key
    assert re.search(r"p\.full_pool_bytes\s*/\s*1e6\b", text)  # the whole pool's bytes, in MB
    for path in (BOOK / "02_the_wall.md", BOOK / "03_the_other_doors.md", CHAPTER):
        assert "MiB" not in path.read_text(), path
