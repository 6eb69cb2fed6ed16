"""Chapter 6's cost explorer and `python -m kvwall cost`: the grid is the cost model's predictions, the page draws
exactly the grid's values in a browser, and the CLI prints the same rows."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import tempfile
import time

import pytest

import kvwall.experiments  # noqa: F401  (registers the row schemas load_result checks)
from kvwall import cli
from kvwall.model.cost import GPUS, MODEL_PRESETS, OFF_REFERENCE, PATHS, TRANSFER_RULES, Point, paths_on
from kvwall.model.original import ORIGINAL
from kvwall.reports import cost_explorer as ce
from kvwall.reports.answer_report import fit_sweep
from kvwall.reports.original_gpu_report import rest_without_attention_ms
from kvwall.reports.tables import fmt_range
from kvwall.results import load_result

SIZE_BOUND = 300_000


@pytest.fixture(scope="module")
def sweep():
    return load_result("path_sweep")


@pytest.fixture(scope="module")
def model(sweep):
    return fit_sweep(sweep).model


@pytest.fixture(scope="module")
def grid(model):
    return ce.explorer_grid(model)


@pytest.fixture(scope="module")
def datasheet(model):
    """The note of every GPU the sweep did not run on (its rates transferred from the reference GPU's)."""
    return ce.rates_note(model, GPUS["b200"])


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 5e-3 * abs(b)  # the grid keeps 3 significant digits


# ---------------------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "state",
    [
        ce.ORIGINAL_STATE,
        ce.State("glm-5", "h200", 4, 8192, 1, 495_000),
        ce.State("deepseek-v3", "b200", 8, 32768, 32, 1_048_576),
        ce.State("kimi-k2", "rtx-5090", 1, 1024, 64, 495_000),
    ],
)
def test_grid_values_are_the_cost_model_times_layers(model, grid, state):
    got = ce.grid_values(grid, state)
    gpu, geometry = GPUS[state.gpu], MODEL_PRESETS[state.model].with_tensor_parallel(state.tp)
    heads = geometry.num_heads // state.tp
    assert set(got) == set(paths_on(gpu.arch, heads)), "a path missing, or one that does not exist there"
    p = Point(heads, state.batch, state.batch * state.context, state.pool, geometry)
    for path, (lo, hi) in got.items():
        want_lo, want_hi = model.layer_range_us(path, p, gpu)
        assert _close(lo, geometry.num_layers * want_lo / 1e3) and _close(hi, geometry.num_layers * want_hi / 1e3), path
        if state.gpu == model.reference.key:
            assert lo == hi, "on the reference GPU the two transfer rules coincide"


def test_grid_leaves_out_paths_that_do_not_exist(grid):
    # SM120 at 32 heads per GPU: no fa3, no FlashInfer FP8, no FlashMLA; ours (the Triton path) has a shape that fits.
    got = ce.grid_values(grid, ce.State("glm-5", "rtx-pro-6000", 2, 8192, 1, 495_000))
    assert "ours" in got and not {"full_pool_cast", "flashinfer_fp8", "flashmla_bf16", "bf16_cache"} & set(got)
    assert "gather_cast_fa2" in got
    assert "ours" in ce.grid_values(grid, ce.State("glm-5", "rtx-pro-6000", 4, 8192, 1, 495_000))
    # Every path on the H200, but the Triton path timed alone: it is what ours runs off Hopper, no choice.
    assert set(ce.grid_values(grid, ce.State("glm-5", "h200", 1, 8192, 1, 495_000))) == set(PATHS) - {
        *OFF_REFERENCE.values()
    }


def test_grid_flags_states_that_do_not_fit_and_covers_every_state(grid):
    states = ce.explorer_states()
    assert (
        len(grid["states"])
        == len(states)
        == (
            len(MODEL_PRESETS)
            * len(GPUS)
            * len(ce.TENSOR_PARALLEL)
            * len(ce.CONTEXTS)
            * len(ce.BATCHES)
            * len(ce.POOLS)
        )
    )
    oversize = ce.State("glm-5", "h200", 4, 131072, 8, 495_000)
    assert not oversize.fits and ce.grid_values(grid, oversize) is None
    # why: the batch, context and their tokens against the pool
    numbers = [int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*", oversize.problem())]
    assert numbers == [8, 131072, oversize.tokens, 495_000] and oversize.tokens > oversize.pool
    assert ce.grid_values(grid, ce.State("glm-5", "h200", 4, 131072, 8, 1_048_576)) is not None  # exactly fits
    assert all((grid["states"][s.key] == 0) == (not s.fits) for s in states)
    with pytest.raises(ValueError, match="do not fit"):
        ce.cost_rows(None, oversize)  # type: ignore[arg-type]


def test_page_is_small_self_contained_and_unique_per_call(model, sweep):
    a, b = ce.explorer_html(model, sweep.caption()), ce.explorer_html(model, sweep.caption())
    assert len(json.dumps(ce.explorer_grid(model), separators=(",", ":"))) < SIZE_BOUND
    assert len(a.encode()) < SIZE_BOUND
    ids_a, ids_b = set(re.findall(r'id="([^"]+)"', a)), set(re.findall(r'id="([^"]+)"', b))
    assert len(ids_a) >= 8 and not ids_a & ids_b, "element ids must differ between two explorers on one page"
    assert "src=" not in a and "cdn" not in a.lower(), "the explorer must load nothing (the page brings plotly.js)"
    assert "path_sweep.json" in a
    assert ce.cost_explorer(model, "x").data.startswith('<div id="kvx-')


def test_the_default_state_is_the_originals_and_a_choice_of_every_control():
    s = ce.ORIGINAL_STATE
    assert (s.model, s.gpu, s.tp, s.context, s.batch, s.pool) == ("glm-5", "rtx-pro-6000", 4, 8192, 1, 495_000)
    assert s in ce.explorer_states()


def test_rates_and_memory_notes(model, datasheet):
    fitted = ce.rates_note(model, GPUS[model.reference.key])
    assert fitted != datasheet and all(ce.rates_note(model, GPUS[k]) == datasheet for k in GPUS if k != "h200")
    m = ce.memory("glm-5")
    # One definition with chapter 6's step table (kvwall.model.step_paths): 576 values x 78 layers + a 4-byte index.
    assert (m["fp8"], m["bf16"], m["fp8_tokens"], m["bf16_tokens"]) == (44_932, 89_860, 495_000, 247_511)
    assert f"{m['fp8']:,}" in ce.memory_note("glm-5") and f"{m['bf16_tokens']:,}" in ce.memory_note("glm-5")


def test_one_rule_gives_one_value(model):
    for rule in TRANSFER_RULES:
        rows = ce.cost_rows(model, ce.ORIGINAL_STATE, rule)
        assert all(r.layer_lo_us == r.layer_hi_us for r in rows)
    both = {r.path: r for r in ce.cost_rows(model, ce.ORIGINAL_STATE)}
    one = {r.path: r for r in ce.cost_rows(model, ce.ORIGINAL_STATE, TRANSFER_RULES[0])}
    assert all(both[p].layer_lo_us <= one[p].layer_lo_us <= both[p].layer_hi_us for p in both)
    assert {r.cache for r in both.values()} == {"FP8", "BF16"}
    assert both["bf16_cache_fa2"].kv_bytes_per_token == 2 * both["ours"].kv_bytes_per_token - 4  # one index


# ---------------------------------------------------------------------------------------------------------
# python -m kvwall cost
# ---------------------------------------------------------------------------------------------------------


def test_cli_cost_prints_every_available_path(model, datasheet, capsys):
    assert cli.main(["cost"]) == 0
    out = capsys.readouterr().out
    assert ce.rates_note(model, GPUS["h200"]) in out and "path_sweep.json" in out
    assert datasheet in out
    rows = {r.path: r for r in ce.cost_rows(model, ce.ORIGINAL_STATE)}
    for path, r in rows.items():
        line = next(ln for ln in out.splitlines() if ln.split()[:1] == [path])
        assert f"{r.step_lo_ms:,.2f}–{r.step_hi_ms:,.2f}" in line and r.cache in line
    assert not {"full_pool_cast", "flashinfer_fp8"} & {ln.split()[0] for ln in out.splitlines() if ln.startswith("  ")}
    # the original's rest-of-step note: its step and cast, and what remains without them (predicted here)
    lo, hi = rest_without_attention_ms(model, ce.ORIGINAL_STATE.point, GPUS[ce.ORIGINAL_STATE.gpu])
    note = f"{ORIGINAL.step_ms} ms, {ORIGINAL.cast_ms} ms"
    assert note in out and f"{fmt_range(lo, hi)} ms" in out, "the original's rest-of-step note is missing"


def test_cli_cost_takes_a_users_own_shape(model, capsys):
    state = ce.State("glm-5", "h200", 2, 32768, 1, 495_000, layers=40, heads=32)
    assert state.geometry.num_layers == 40 and state.geometry.heads_per_gpu == 16 and state.problem() is None
    argv = ["cost", "--gpu", "h200", "--layers", "40", "--heads", "32", "--tp", "2", "--context", "32768"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "(user shape)" in out and f"all {state.geometry.num_layers} layers" in out
    gather = next(r for r in ce.cost_rows(model, state) if r.path == "gather_cast")
    assert f"{gather.step_lo_ms:.2f}" in out  # 40 layers x the model's µs per layer, as printed
    problem = ce.State("glm-5", "h200", 3, 8192, 1, 495_000, heads=32).problem()
    numbers = re.findall(r"\d+", problem)  # the TP and the user's heads (not the preset's 64)
    assert numbers[0] == "3" and numbers[-1] == "32"
    with pytest.raises(SystemExit) as stop:  # refused by argparse, naming the option, before anything runs
        cli.main(["cost", "--heads", "0"])
    assert stop.value.code == 2 and "--heads" in capsys.readouterr().err


def test_cli_cost_all_gpus_and_one_rule(capsys):
    assert cli.main(["cost", "--gpu", "all", "--model", "deepseek-v3", "--tp", "8", "--rule", "per-SM-rate"]) == 0
    out = capsys.readouterr().out
    for gpu in GPUS.values():
        assert f"{gpu.name} ({gpu.arch})" in out
    assert "flashmla_fp8" in out and "–" not in out.split("\n", 2)[2], "one rule: single values, no ranges"
    assert f"{ORIGINAL.step_ms} ms, {ORIGINAL.cast_ms} ms" not in out  # not the original's state: no note


@pytest.mark.parametrize(
    "argv, message",
    [
        (["cost", "--model", "glm5"], "invalid choice: 'glm5' (choose from 'glm-5'"),
        (["cost", "--gpu", "h300"], "invalid choice: 'h300' (choose from 'h200'"),
    ],
)
def test_cli_cost_rejects_unknown_model_and_gpu(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_cost_rejects_states_it_cannot_predict(capsys):
    # each refusal says the state's problem and the option that fixes it
    for argv, change, option in (
        (["--tp", "3"], {"tp": 3}, "--tp"),
        (["--batch", "64", "--context", "131072"], {"batch": 64, "context": 131072}, "--pool"),
    ):
        assert cli.main(["cost", *argv]) == 2
        err = capsys.readouterr().err
        problem = ce.State(**{**ce.ORIGINAL_STATE.__dict__, **change}).problem()
        assert problem and problem in err and option in err.split(problem)[1]


# ---------------------------------------------------------------------------------------------------------
# The page in a browser
# ---------------------------------------------------------------------------------------------------------


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip(
        "no Chromium on this machine (.ci/run installs Debian's chromium; it could not here): "
        "the browser check of the cost explorer did not run"
    )


#: A reader's choice, made after the first draw: the GPU select set to the H200, and its change event.
PICK_H200 = """<script>(function pick() {
  var root = document.querySelector(".kvwall-cost-explorer");
  if (!root.getAttribute("data-drawn")) { return setTimeout(pick, 100); }
  var gpu = root.querySelector("select[data-field=gpu]");
  gpu.value = "h200";
  gpu.dispatchEvent(new Event("change"));
})();</script>"""


def _write_page(path, model, sweep, extra: str = ""):
    """A standalone page: the explorer first, plotly.js after it (the explorer must wait for it), no network."""
    from plotly.offline import get_plotlyjs

    path.write_text(
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>cost explorer</title></head><body>'
        + ce.explorer_html(model, sweep.caption())
        + f"<script>{get_plotlyjs()}</script>{extra}</body></html>",
        encoding="utf-8",
    )
    return path


@pytest.fixture(scope="module")
def page(model, sweep, tmp_path_factory):
    return _write_page(tmp_path_factory.mktemp("explorer") / "explorer.html", model, sweep)


def _drawn(browser: str, url: str, tmp_path) -> tuple[dict, str]:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}",
        "--virtual-time-budget=20000",
        "--window-size=1300,1400",
    ]
    dom = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    found = re.search(r'data-drawn="([^"]*)"', dom.stdout)
    assert found, "the explorer wrote no data-drawn attribute: its script did not run or did not draw"
    return json.loads(html.unescape(found.group(1))), dom.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "state",
    [
        ce.State("glm-5", "rtx-pro-6000", 4, 8192, 1, 495_000),
        ce.State("deepseek-v3", "h200", 8, 32768, 8, 1_048_576),
        ce.State("kimi-k2", "b200", 2, 131072, 64, 495_000),  # does not fit: a message, no chart
    ],
)
def test_explorer_draws_the_models_prediction_in_headless_chromium(page, model, grid, state, tmp_path):
    browser = _chromium()
    hash_ = (
        f"#explorer:model={state.model}&gpu={state.gpu}&tp={state.tp}&context={state.context}"
        f"&batch={state.batch}&pool={state.pool}"
    )
    started = time.time()
    drawn, dom = _drawn(browser, page.as_uri() + hash_, tmp_path)
    print(f"chromium drew {state.key} in {time.time() - started:.1f} s")
    assert drawn["key"] == state.key, f"the page drew {drawn['key']}, not the state in the hash"
    want = ce.grid_values(grid, state)
    if want is None:
        assert drawn["fits"] is False and drawn["values"] == {}
        assert f"{state.tokens:,} tokens" in dom and f"{state.pool:,} tokens" in dom  # the message says why
        return
    assert drawn["values"] == want, "the page drew other numbers than the cost model's grid"
    rows = {r.path: r for r in ce.cost_rows(model, state)}
    assert set(drawn["values"]) == set(rows)
    for path, (lo, hi) in drawn["values"].items():
        assert _close(lo, rows[path].step_lo_ms) and _close(hi, rows[path].step_hi_ms), path
    assert drawn["gpu_rates"] == ce.rates_note(model, GPUS[state.gpu]) and drawn["gpu_rates"] in drawn["title"]
    assert 'class="main-svg"' in dom and ('class="bars"' in dom or 'class="trace bars"' in dom), "no bar chart"
    assert dom.count('class="point"') >= len(want), "fewer bars than paths"


@pytest.mark.slow
def test_explorer_without_a_hash_draws_the_originals_state(page, grid, datasheet, tmp_path):
    drawn, _ = _drawn(_chromium(), page.as_uri(), tmp_path)
    assert drawn["key"] == ce.ORIGINAL_STATE.key and drawn["values"] == ce.grid_values(grid, ce.ORIGINAL_STATE)
    assert drawn["gpu_rates"] == datasheet


@pytest.mark.slow
def test_explorer_redraws_when_a_control_changes(model, sweep, grid, tmp_path):
    page = _write_page(tmp_path / "pick.html", model, sweep, PICK_H200)
    drawn, _ = _drawn(_chromium(), page.as_uri(), tmp_path)
    state = ce.State(**{**ce.ORIGINAL_STATE.__dict__, "gpu": "h200"})
    assert drawn["key"] == state.key and drawn["values"] == ce.grid_values(grid, state)
    assert drawn["gpu_rates"] == ce.rates_note(model, GPUS["h200"])
