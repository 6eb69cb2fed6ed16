"""gather_cast / full_cast against the torch reference, bit for bit, in Triton's interpreter on CPU tensors.

No TRITON_INTERPRET needed: the kernel module builds an interpreted kernel for CPU tensors itself
(``triton.runtime.interpreter.InterpretedFunction``) and a compiled one for CUDA tensors, so the
result does not depend on which test imported triton first or what the environment says. FP8 NaNs are
checked here too: the interpreter path keeps them NaN, as the GPU does.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwall.kernels.gather.cases import VALIDATION_CASES, check_case, compare_rows
from kvwall.model.strategies import GatherCast, IndexThenCast, compact_batch
from kvwall.model.geometry import GLM5
from kvwall.kernels import (
    compact_kv_indices,
    full_cast,
    gather_cast,
    gather_cast_cuda,
    gather_cast_reference,
    make_gather_inputs,
    nvcc_compile_check,
)
from kvwall.kernels.gather import kernel as gc_module
from kvwall.kernels.gather import sanitize
from kvwall.kernels.gather.reference import POISON_BITS, bits, fp8_bytes
from kvwall.model.pool import TokenPool, make_decode_batch


@pytest.mark.parametrize("nan", [False, True], ids=["finite", "with_fp8_nan"])
@pytest.mark.parametrize("case", VALIDATION_CASES, ids=lambda c: c.name)
def test_bit_exact_against_reference(case, nan):
    row = check_case(gather_cast, case, "cpu", nan=nan)
    assert row["ok"], row


def _variant(name, config=None):
    def run(pool, idx, indptr=None, *, out=None, scale=None):
        plan = gc_module.plan_gather(pool, idx, indptr, out=out, scale=scale)
        return gc_module.launch_gather(plan, variant=name, config=config)

    return run


@pytest.mark.parametrize("variant", ["chunks", "tiles"])
@pytest.mark.parametrize("case", VALIDATION_CASES, ids=lambda c: c.name)
def test_both_kernel_variants_bit_exact(case, variant):
    """The chunked kernel on every case (odd D too: 1-value chunks), and the first version's tile kernel."""
    row = check_case(_variant(variant), case, "cpu")
    assert row["ok"], row


def test_launch_for_another_layer_checks_the_layout():
    inp = make_gather_inputs(num_slots=64, dim=576, context_lens=[20], seed=5)
    plan = gc_module.plan_gather(inp.pool, inp.kv_indices)
    other = inp.pool.clone()
    got = gc_module.launch_gather(plan, pool=other)
    assert torch.equal(bits(got), bits(gather_cast_reference(other, inp.kv_indices)))
    given, planned = (re.escape(str(tuple(p.shape))) for p in (inp.pool[:-1], inp.pool))
    with pytest.raises(ValueError, match=f"^gather_cast: pool {given} .*{planned}"):  # the layout given, the planned
        gc_module.launch_gather(plan, pool=inp.pool[:-1])


def test_config_table_and_chunk_width(tmp_path, monkeypatch):
    assert [gc_module.chunk_width(d) for d in (576, 512, 1000, 70, 33, 1)] == [64, 128, 8, 2, 1, 1]
    table = tmp_path / "tuned.json"
    table.write_text(
        '{"GPU X": {"small": {"block": 64, "num_warps": 2, "programs_per_sm": 0}, '
        '"large": {"block": 512, "num_warps": 8, "programs_per_sm": 4, "load_vec": 16}, "small_rows": 99}}'
    )
    monkeypatch.setattr(gc_module, "TUNED_CONFIG_FILE", table)
    gc_module._device_configs.cache_clear()
    try:
        configs, small_rows = gc_module._device_configs("GPU X")
        assert small_rows == 99 and configs["large"] == gc_module.GatherConfig(512, 8, 4, True, False, 16)
        assert gc_module._device_configs("GPU Y") == (gc_module.DEFAULT_CONFIGS, gc_module.SMALL_ROWS)
    finally:
        gc_module._device_configs.cache_clear()


def _same_or_both_nan(got, want):
    return bool(((bits(got) == bits(want)) | (torch.isnan(got) & torch.isnan(want))).all())


@pytest.mark.parametrize("variant", ["chunks", "tiles"])
def test_every_fp8_value_converts_exactly_nan_included(variant):
    pool = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(-1, 1)
    idx = torch.arange(pool.shape[0], dtype=torch.int32).flip(0)
    assert _same_or_both_nan(_variant(variant)(pool, idx), pool[idx.long()].to(torch.bfloat16))
    assert torch.isnan(_variant(variant)(pool, idx)[[255 - 0x7F, 255 - 0xFF]]).all()  # e4m3 NaN -> NaN, not 480
    scale = 0.3  # rounding of the product: nearest even, as torch
    assert _same_or_both_nan(_variant(variant)(pool, idx, scale=scale), gather_cast_reference(pool, idx, scale=scale))


# ---- the checker must reject wrong implementations (otherwise a passing suite proves nothing) ----------


def _truncating(pool, idx, indptr=None, *, out, scale=None):
    gather_cast_reference(pool, idx, indptr, out=out)
    n = int(indptr[-1]) if indptr is not None else idx.numel()
    if scale is not None:
        s = float(scale) if not isinstance(scale, torch.Tensor) else float(scale.item())
        f = pool.index_select(0, idx[:n].long()).float() * s
        bits(out)[:n] = (f.view(torch.int32) >> 16).to(torch.int16)  # truncates instead of rounding
    return out


def _ignores_indptr(pool, idx, indptr=None, *, out, scale=None):
    return gather_cast_reference(pool, idx.clamp(0, pool.shape[0] - 1), None, out=out, scale=scale)


def _off_by_one(pool, idx, indptr=None, *, out, scale=None):
    return gather_cast_reference(pool, (idx + 1) % pool.shape[0], indptr, out=out, scale=scale)


def _drops_last_row(pool, idx, indptr=None, *, out, scale=None):
    n = int(indptr[-1]) if indptr is not None else idx.numel()
    keep = torch.zeros(1, dtype=torch.int32) + max(n - 1, 0)
    return gather_cast_reference(pool, idx, keep, out=out, scale=scale)


@pytest.mark.parametrize(
    "wrong,case_name",
    [
        (_truncating, "scale_float"),
        (_ignores_indptr, "capacity_over_real"),
        (_off_by_one, "mla_sglang_int32"),
        (_drops_last_row, "odd_dim_33_repeats"),
    ],
)
def test_checker_rejects_wrong_implementations(wrong, case_name):
    case = next(c for c in VALIDATION_CASES if c.name == case_name)
    assert not check_case(wrong, case, "cpu")["ok"]


# ---- properties over shapes and index patterns ----------------------------------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    dim=st.integers(1, 700),
    slots=st.integers(1, 64),
    page=st.sampled_from([1, 1, 2, 5]),
    layout=st.sampled_from(["flat", "sglang", "paged"]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    extra_capacity=st.integers(0, 9),
    scaled=st.booleans(),
)
def test_property_matches_reference(data, dim, slots, page, layout, index_dtype, extra_capacity, scaled):
    page = page if layout == "paged" else 1
    lens = data.draw(st.lists(st.integers(0, 12), max_size=4), label="request lengths")
    n = sum(lens)
    idx = data.draw(st.lists(st.integers(0, slots - 1), min_size=n, max_size=n), label="slots")
    gen = torch.Generator().manual_seed(dim * 131 + slots)
    shape = {"flat": (slots, dim), "sglang": (slots, 1, dim), "paged": (slots, page, dim)}[layout]
    pool = fp8_bytes(shape, generator=gen)
    kv_indices = torch.tensor(idx + [slots + 99] * extra_capacity, dtype=index_dtype)
    indptr = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.empty((kv_indices.numel(), *shape[1:]), dtype=torch.bfloat16)
    bits(out).fill_(POISON_BITS)
    scale = data.draw(st.floats(1e-3, 1e3), label="scale") if scaled else None
    gather_cast(pool, kv_indices, indptr, out=out, scale=scale)
    counts = compare_rows(out, gather_cast_reference(pool, kv_indices, indptr, scale=scale), n)
    assert counts == {"mismatched_values": 0, "overwritten_poison": 0}


# ---- errors before any launch -----------------------------------------------------------------------------


def _args():
    inp = make_gather_inputs(num_slots=50, dim=576, context_lens=[10, 20], seed=1)
    return {
        "pool": inp.pool,
        "kv_indices": inp.kv_indices,
        "kv_indptr": inp.kv_indptr,
        "out": torch.empty((30, 1, 576), dtype=torch.bfloat16),
        "scale": None,
    }


def _set(**changes):
    return lambda a: a.update({k: (v(a) if callable(v) else v) for k, v in changes.items()})


BAD_INPUTS = [
    (_set(pool=lambda a: a["pool"].to(torch.bfloat16)), TypeError, "must be torch.float8_e4m3fn"),
    (_set(pool=lambda a: a["pool"].view(torch.uint8)), TypeError, "must be torch.float8_e4m3fn"),
    (_set(pool=lambda a: a["pool"].reshape(50, 1, 1, 576)), ValueError, "expected \\(num_slots, D\\)"),
    (_set(pool=lambda a: a["pool"].transpose(0, 2)), ValueError, "rows of a page must be contiguous"),
    (_set(pool=lambda a: a["pool"].to("meta")), ValueError, "pool is on meta"),
    (_set(kv_indices=lambda a: a["kv_indices"].to(torch.int16)), TypeError, "use torch.int32 or torch.int64"),
    (_set(kv_indices=lambda a: a["kv_indices"].float()), TypeError, "use torch.int32 or torch.int64"),
    (_set(kv_indices=lambda a: a["kv_indices"].reshape(2, 15)), ValueError, "must be 1-D"),
    (_set(kv_indices=lambda a: torch.arange(60, dtype=torch.int32)[::2]), ValueError, "not contiguous"),
    (_set(kv_indices=lambda a: a["kv_indices"].to("meta")), ValueError, "kv_indices is on meta"),
    (_set(out=lambda a: a["out"][:29]), ValueError, "out is too small"),
    (_set(out=lambda a: a["out"].float()), TypeError, "out has dtype torch.float32"),
    (_set(out=lambda a: torch.empty((30, 576), dtype=torch.bfloat16)), ValueError, "must be \\(capacity, 1, 576\\)"),
    (_set(out=lambda a: torch.empty((30, 1, 1152), dtype=torch.bfloat16)[..., ::2]), ValueError, "out strides"),
    (
        _set(out=lambda a: torch.zeros((1, 1, 576), dtype=torch.bfloat16).expand(30, 1, 576)),
        ValueError,
        "overlaps itself",
    ),
    (
        _set(out=lambda a: torch.zeros(576 * 16, dtype=torch.bfloat16).as_strided((30, 1, 576), (288, 576, 1))),
        ValueError,
        "overlaps itself",
    ),
    (_set(kv_indices=lambda a: a["kv_indices"] + 50), IndexError, "outside the pool's 50 slots"),
    (_set(kv_indices=lambda a: a["kv_indices"] - 50), IndexError, "outside the pool's 50 slots"),
    (_set(kv_indptr=torch.tensor([0, 10, 31], dtype=torch.int32)), ValueError, "ends at 31 but kv_indices has only 30"),
    (_set(kv_indptr=torch.tensor([0, 20, 10], dtype=torch.int32)), ValueError, "never decrease"),
    (_set(kv_indptr=torch.tensor([0.0, 30.0])), TypeError, "kv_indptr has dtype torch.float32"),
    (_set(scale="2"), TypeError, "give a number"),
    (_set(scale=torch.tensor([1.0, 2.0])), TypeError, "one float32 value"),
    (_set(scale=torch.tensor([2.0], dtype=torch.float64)), TypeError, "one float32 value"),
    # issue 24, finding 11: the rule of mla_decode_fp8's scales (kvwall.kernels._args.scale_number)
    (_set(scale=float("nan")), ValueError, "scale=nan is not finite"),
    (_set(scale=float("-inf")), ValueError, "scale=-inf is not finite"),
    (_set(scale=1e39), ValueError, "scale=1e\\+39 is not finite \\(as float32\\)"),
]


@pytest.mark.parametrize("edit,exc,words", BAD_INPUTS, ids=[w for _, _, w in BAD_INPUTS])
def test_bad_input_raises_before_launch(monkeypatch, edit, exc, words):
    monkeypatch.setattr(gc_module, "_kernel", lambda *a: pytest.fail("launched despite bad input"))
    args = _args()
    edit(args)
    with pytest.raises(exc, match=words) as info:
        gather_cast(args["pool"], args["kv_indices"], args["kv_indptr"], out=args["out"], scale=args["scale"])
    assert str(info.value).startswith("gather_cast: ")


def test_out_sharing_memory_with_an_input_is_refused(monkeypatch):
    monkeypatch.setattr(gc_module, "_kernel", lambda *a: pytest.fail("launched despite bad input"))
    args = _args()
    storage = torch.zeros(2 * 50 * 576, dtype=torch.uint8)
    pool = storage[: 50 * 576].view(torch.float8_e4m3fn).view(50, 1, 576)
    over_pool = storage.view(torch.bfloat16)[: 30 * 576].view(30, 1, 576)  # starts at the pool's first byte
    with pytest.raises(ValueError, match=r"\bout\b.*\bpool\b"):  # the two tensors that overlap
        gather_cast(pool, args["kv_indices"], args["kv_indptr"], out=over_pool)
    words = torch.zeros(30 * 576, dtype=torch.int32)
    indices = words[:30]  # the page table lives in the first bytes of the out buffer
    with pytest.raises(ValueError, match=r"\bout\b.*\bkv_indices\b"):
        gather_cast(args["pool"], indices, out=words.view(torch.bfloat16)[: 30 * 576].view(30, 1, 576))


def test_unchecked_out_of_range_gives_nan_rows_and_never_writes_past_capacity():
    inp = make_gather_inputs(num_slots=40, dim=70, context_lens=[12], seed=2)
    idx = inp.kv_indices.clone()
    idx[::4] = 1000
    idx[1] = -3
    out = torch.empty((14, 1, 70), dtype=torch.bfloat16)
    bits(out).fill_(POISON_BITS)
    indptr = torch.tensor([0, 50], dtype=torch.int32)  # claims more rows than the capacity holds
    gather_cast(inp.pool, idx, indptr, out=out[:12], check_range=False)
    nan_rows = torch.isnan(out[:12].float()).all(dim=-1).flatten()
    assert nan_rows.tolist() == [i % 4 == 0 or i == 1 for i in range(12)]
    good = ~nan_rows
    assert torch.equal(bits(out[:12][good]), bits(inp.pool[idx[good].long()].to(torch.bfloat16)))
    assert (bits(out[12:]) == POISON_BITS).all()


def test_full_cast_bit_exact_nan_included():
    gen = torch.Generator().manual_seed(4)
    for shape, block in [((1,), None), ((1001, 1, 577), None), ((3, 70), 64), ((256,), 1)]:
        pool = fp8_bytes(shape, generator=gen, nan=True)
        assert _same_or_both_nan(full_cast(pool, block=block), pool.to(torch.bfloat16))
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert torch.isnan(full_cast(every)[[0x7F, 0xFF]]).all()


def _pool46():
    return fp8_bytes((4, 6), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize(
    "call,exc,words",
    [
        (lambda: full_cast(torch.zeros(4, dtype=torch.bfloat16)), TypeError, "float8_e4m3fn"),
        (lambda: full_cast(_pool46().t()), ValueError, "not contiguous"),
        (lambda: full_cast(_pool46(), out=torch.empty(4, 5, dtype=torch.bfloat16)), ValueError, "out must be"),
        (lambda: full_cast(_pool46(), out=[1, 2]), TypeError, "out must be a torch.bfloat16 tensor, got list"),
        (lambda: full_cast(_pool46(), out=torch.empty(6, 4, dtype=torch.bfloat16).t()), ValueError, "not contiguous"),
        (lambda: full_cast(_pool46(), block=-1), ValueError, "block=-1: give a power of two"),
        (lambda: full_cast(_pool46(), block=0), ValueError, "block=0"),
        (lambda: full_cast(_pool46(), block=100), ValueError, "block=100"),
        (lambda: full_cast(_pool46(), block=True), ValueError, "block=True"),
        (lambda: full_cast(_pool46(), block=1 << 21), ValueError, "from 1 to 1048576"),
        (lambda: full_cast(_pool46(), block=64.0), ValueError, "block=64.0"),
    ],
    ids=[
        "pool_dtype",
        "pool_strided",
        "out_shape",
        "out_list",
        "out_strided",
        "block_-1",
        "block_0",
        "block_100",
        "block_bool",
        "block_huge",
        "block_float",
    ],
)
def test_full_cast_refuses_bad_arguments_before_launch(monkeypatch, call, exc, words):
    monkeypatch.setattr(gc_module, "_kernel", lambda *a: pytest.fail("launched despite bad input"))
    with pytest.raises(exc, match=words) as info:
        call()
    assert str(info.value).startswith("full_cast: ")


def test_full_cast_refuses_an_out_over_the_pool():
    storage = torch.zeros(4 * 6 * 3, dtype=torch.uint8)
    pool = storage[:24].view(torch.float8_e4m3fn).view(4, 6)
    out = storage.view(torch.bfloat16)[:24].view(4, 6)  # its first bytes are the pool's
    with pytest.raises(ValueError, match=r"^full_cast: out\b.*\bpool\b"):
        full_cast(pool, out=out)


def test_sanitizer_program_runs_chosen_cases_on_cpu(capsys):
    chosen = ["dim_1", "paged_3_odd_dim_mixed"]
    assert sanitize.main(["--device", "cpu", "--cases", *chosen]) == 0
    lines = capsys.readouterr().out.splitlines()
    want = [name for name, _ in sanitize.checks(torch.device("cpu"), chosen)]  # the Triton kernel's alone on a CPU
    assert [line.rsplit(None, 1) for line in lines[:-1]] == [[n, "ok"] for n in want]
    assert all(n.split()[0] == "triton" for n in want) and lines[-1].endswith("none")


def test_compact_indices_and_batch():
    batch = make_decode_batch([5, 9], 100, seed=0)
    assert compact_kv_indices(batch.kv_indptr).tolist() == list(range(14))
    # issue 24, finding 6: an empty kv_indptr is refused in words (it was an IndexError)
    for bad in (torch.tensor([], dtype=torch.int32), torch.tensor(3), [0, 5]):
        with pytest.raises(ValueError, match="^compact_kv_indices: kv_indptr"):
            compact_kv_indices(bad)
    cb = compact_batch(batch)
    assert cb.kv_indices.tolist() == list(range(14)) and torch.equal(cb.kv_indptr, batch.kv_indptr)


def test_strategies_agree_and_refuse_a_too_small_capacity():
    pool = TokenPool.random(GLM5, 3000, 2, seed=0)
    batch = make_decode_batch([300, 41], pool.num_slots, seed=0)
    want = pool.key_buffer(1).index_select(0, batch.kv_indices.long()).to(torch.bfloat16)
    for strategy in (
        IndexThenCast(batch),
        IndexThenCast(batch, capacity=512),
        GatherCast(batch, pool),
        GatherCast(batch, pool, capacity=512),
    ):
        ckv, kpe = strategy.prepare_kv(pool, 1, torch.bfloat16)
        got = torch.cat([ckv, kpe], dim=-1)[: batch.total_tokens]
        assert torch.equal(bits(got), bits(want)), strategy.name
    with pytest.raises(ValueError, match=rf"capacity=100\b.*\b{batch.total_tokens}\b"):  # the capacity, the tokens
        IndexThenCast(batch, capacity=100)


def test_cuda_twin_says_what_it_needs_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the GPU tests run the twin")
    inp = make_gather_inputs(num_slots=10, dim=8, context_lens=[3], seed=0)
    with pytest.raises(RuntimeError, match=r"^gather_cast_cuda: .*\bcpu\b.*\bGPU"):  # where they are, where they go
        gather_cast_cuda(inp.pool, inp.kv_indices)


@pytest.mark.skipif(
    shutil.which("nvcc") is None, reason="nvcc is not installed: the CUDA twin cannot be compile-checked"
)
def test_cuda_twin_compiles_for_hopper_without_spills():
    report = nvcc_compile_check("sm_90")
    assert report.ok, report.log[-3000:]
    assert not report.spills and set(report.registers) == {"1", "2", "4", "8", "16"}
