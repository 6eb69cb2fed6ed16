"""The decode-step model at small scale on this machine: the cast must dominate here too."""

import torch

from kvwall.model.attention import make_mla_decode
from kvwall.model.decode_step import PHASES, STANDIN_LABEL, DecodeStepModel, RestOfLayerStandIn
from kvwall.experiments import run_experiment
from kvwall.model.geometry import GLM5
from kvwall.model.original import ORIGINAL
from kvwall.model.pool import TokenPool, make_decode_batch
from kvwall.measure.profiler import CAST_OP, profile_ops
from kvwall.measure.timing import PhaseClock
from kvwall.model.strategies import FullPoolCast


def test_standin_spends_the_originals_non_cast_time():
    standin = RestOfLayerStandIn.from_original(GLM5.num_layers, torch.device("cpu"))
    assert abs(standin.ms_per_layer * GLM5.num_layers - (ORIGINAL.step_ms - ORIGINAL.cast_ms)) < 1e-9


def test_step_phases_and_profile():
    cpu = torch.device("cpu")
    pool = TokenPool.random(GLM5, 80_001, 2, seed=5)  # large enough that the cast leads even on a loaded machine
    batch = make_decode_batch([300, 17], pool.num_slots, seed=5)
    model = DecodeStepModel(
        pool, batch, FullPoolCast(), make_mla_decode("auto", GLM5, batch), RestOfLayerStandIn(0.2, cpu), seed=5
    )
    rows = model.timed_step()
    assert [(r["layer"], r["phase"]) for r in rows] == [(layer, p) for layer in range(2) for p in PHASES]
    assert all(r["ms"] >= 0 for r in rows)
    assert min(r["ms"] for r in rows if r["phase"] == STANDIN_LABEL) >= 0.2
    # The new token was written into its slot in every layer.
    for layer in range(2):
        got = pool.key_buffer(layer)[batch.new_token_slots].to(torch.float32)
        assert torch.equal(got, model.new_kv.to(torch.float8_e4m3fn).to(torch.float32))
    ops = profile_ops(model.step, cpu, steps=1)["ops"]
    assert ops[0]["name"] == CAST_OP, f"the whole-pool cast should top the CPU profile, got {ops[:3]}"


def test_small_decode_profile_experiment():
    result = run_experiment(
        "decode_profile", torch.device("cpu"), "small", layers=2, pool_tokens=80_000, timed_steps=2, profile_steps=1
    )
    summary = result.table("summary")[0]
    assert summary["cast_share"] > 0.5, "the cast dominates the step on a CPU too"
    assert result.table("check")[0]["rel_err_vs_float64"] < 1e-2
    breakdown = {r["phase"]: r["ms_per_step"] for r in result.table("breakdown")}
    assert breakdown["kv_strategy"] == max(breakdown.values())


def test_phase_clock_reads_device_and_host_intervals():
    clock = PhaseClock(torch.device("cpu"))
    for label in ("a", "b", "end"):
        clock.mark(label)
    device, host = clock.intervals_ms(), clock.host_intervals_ms()
    assert [label for label, _, _ in device] == [label for label, _ in host] == ["a", "b"]
    assert device[0][1] == 0.0 and device[1][1] == device[0][2]  # starts from the first mark
    assert all(ms >= 0 for _, ms in host) and [d for _, _, d in device] == [h for _, h in host]  # CPU: one clock
