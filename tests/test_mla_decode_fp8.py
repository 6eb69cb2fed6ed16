"""The fused FP8 MLA decode kernel against the float64 reference on the dequantized cache.

Inputs come from the kernel's seeded generator (:func:`kvwall.kernels.mla_decode.reference.make_mla_inputs`),
cases from its table (:mod:`kvwall.kernels.mla_decode.cases`), the same the recorded run and the sanitizer use.
On CPU the kernels run in Triton's interpreter (built by the module itself, no TRITON_INTERPRET needed) with
float32 dot operands; on a GPU (the ``gpu``-marked tests, skipped elsewhere) they are compiled with float16 dot
operands.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch

from kvwall.kernels import mla_decode_fp8
from kvwall.kernels.mla_decode import sanitize
from kvwall.kernels.mla_decode.cases import (
    SANITIZED_CASES,
    SM_SCALE,
    SMALL_CASES,
    DecodeCase,
    check_case,
    validation_cases,
)
from kvwall.kernels.mla_decode.launch_shape import (
    FALLBACK_SHAPES,
    MLADecodeConfig,
    TUNED_CONFIG_FILE,
    default_config,
    tuned_entry,
)
from kvwall.kernels.mla_decode.reference import MLAInputs, make_mla_inputs, nonempty_requests, reference64
from kvwall.measure.accuracy import relative_error

DC, DR = 512, 64
FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
CPU_POOL = 4096
#: In the interpreter (float32 dots and p) only the BF16 rounding of the output remains: ~2^-9 relative.
CPU_TOL = 3e-3
CPU = torch.device("cpu")
#: Two of the sanitized cases (by their names in the case table), cheap in the interpreter.
CHEAP = ("h1 all empty", "h3 contiguous spare")


def on_gpu(test):
    """A GPU test: marked ``gpu`` and skipped, saying why, where there is no NVIDIA GPU."""
    skip = pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs an NVIDIA GPU (compiled Triton kernel, float16 dots)"
    )
    return pytest.mark.gpu(skip(test))


def run(inp: MLAInputs, sm_scale: float = SM_SCALE, **kw):
    """The kernel on generated inputs (``kv_len`` passed for paged caches); returns (out, lse)."""
    return mla_decode_fp8(
        inp.q_nope,
        inp.q_pe,
        inp.ckv_cache,
        inp.kpe_cache,
        inp.kv_indptr,
        inp.kv_indices,
        sm_scale,
        kv_len=inp.kv_len,
        return_lse=True,
        **kw,
    )


def case(
    heads, lens, *, layout="pool_view", scales=(1.0, 1.0), splits=None, seed=0, index_dtype="int32", page_size=1
) -> DecodeCase:
    return DecodeCase(
        f"h{heads} {layout} {lens}", heads, tuple(lens), layout, *scales, index_dtype, splits, seed, page_size
    )


# ----------------------------------------------------------------------------------------------
# CPU: Triton's interpreter, float32 dot operands
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", SMALL_CASES, ids=lambda c: c.name)
def test_case_table_matches_float64_reference(c):
    row = check_case(mla_decode_fp8, c, "cpu", CPU_POOL, tol=CPU_TOL, lse_atol=1e-4)
    assert row["ok"], row


@pytest.mark.parametrize(
    "c",
    [
        case(16, [1000], scales=(0.8, 1.1), seed=12),  # many tiles per split
        case(16, [5, 0, 64, 65, 1, 129, 0, 200], seed=13),  # tile-boundary lengths, batch 8
        *[case(16, [33, 0, 70], scales=(0.5, 2.0), splits=s, seed=3) for s in (2, 5, 40)],  # 40: mostly empty splits
        case(3, [5, 66], layout="contiguous", index_dtype="int64", seed=4),  # garbage past kv_indptr[-1]
        *[
            case(3, [1, 0, 63, 64, 65, 200], layout="paged", page_size=p, scales=(1.5, 1.0), splits=3, seed=p)
            for p in (2, 16)
        ],
    ],
    ids=lambda c: c.name,
)
def test_edges_match_float64_reference(c):
    row = check_case(mla_decode_fp8, c, "cpu", CPU_POOL, tol=CPU_TOL, lse_atol=1e-4)
    assert row["ok"], row


def _scales_as_tensors(*args, ckv_scale, kpe_scale, **kw):
    return mla_decode_fp8(*args, ckv_scale=torch.tensor([ckv_scale]), kpe_scale=kpe_scale, **kw)


def test_scales_as_tensors():
    # ckv_scale a tensor, kpe_scale a number: both go to the kernel as tensors
    assert check_case(_scales_as_tensors, case(16, [17, 40], scales=(1.5, 0.25), seed=5), "cpu", CPU_POOL)["ok"]


# ---- the checker must reject wrong implementations (otherwise a passing table proves nothing) ----------


def _off_by_one_slot(q_nope, q_pe, ckv, kpe, kv_indptr, kv_indices, sm_scale, **kw):
    return mla_decode_fp8(q_nope, q_pe, ckv, kpe, kv_indptr, (kv_indices + 1) % ckv.shape[0], sm_scale, **kw)


def _ignores_kpe_scale(*args, kpe_scale, **kw):
    return mla_decode_fp8(*args, kpe_scale=1.0, **kw)


def _empty_requests_not_zero(*args, **kw):
    out, lse = mla_decode_fp8(*args, **kw)
    return out.add_(1e-3), lse


def _lse_base_two(*args, **kw):
    out, lse = mla_decode_fp8(*args, **kw)
    return out, lse.mul_(1.4426950408889634)


@pytest.mark.parametrize(
    "wrong,c",
    [
        (_off_by_one_slot, case(3, [7, 20], seed=1)),
        (_ignores_kpe_scale, case(3, [7, 20], scales=(1.0, 64.0), seed=1)),
        (_empty_requests_not_zero, case(3, [0, 20], seed=1)),
        (_lse_base_two, case(3, [7, 20], seed=1)),
    ],
    ids=["off_by_one", "kpe_scale", "empty", "lse_base"],
)
def test_checker_rejects_wrong_implementations(wrong, c):
    assert not check_case(wrong, c, "cpu", CPU_POOL)["ok"]


def test_sharp_softmax_stays_finite():
    # Logits in the thousands: the online softmax must subtract its running maximum (no overflow, no NaN).
    inp = make_mla_inputs([50, 90], 16, seed=14)
    inp = dataclasses.replace(inp, q_nope=inp.q_nope * 40, q_pe=inp.q_pe * 40)
    out, lse = run(inp, 1.0, num_splits=3)
    want, want_lse = reference64(inp, [0, 1], 1.0, 1.0, 1.0, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert relative_error(out, want) <= 1e-2
    assert torch.allclose(lse.double(), want_lse, rtol=1e-5)


def test_three_d_page_size_one_views_give_the_same_bits():
    a, _ = run(make_mla_inputs([9, 20], 4, seed=7, layout="pool_view_3d"), 0.1, num_splits=2)
    b, _ = run(make_mla_inputs([9, 20], 4, seed=7, layout="pool_view"), 0.1, num_splits=2)
    assert torch.equal(a, b)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_zero_length_requests_and_strided_poisoned_out(num_splits):
    inp = make_mla_inputs([0, 12, 0], 3, seed=8)
    base = torch.full((3, 3, 2 * DC), float("nan"), dtype=BF16)
    out = base[:, :, :DC]  # strided out: row stride 2 * DC
    got, lse = run(inp, 0.1, out=out, num_splits=num_splits)
    assert got is out and torch.isfinite(out).all()
    assert torch.isnan(base[:, :, DC:]).all()  # nothing written outside out
    assert (out[0] == 0).all() and (out[2] == 0).all() and torch.isneginf(lse[[0, 2]]).all()
    want, want_lse = reference64(inp, [1], 1.0, 1.0, 0.1, return_lse=True)
    assert relative_error(out[1], want[0]) <= CPU_TOL
    assert torch.allclose(lse[1].double(), want_lse[0], atol=1e-4)


def test_all_requests_empty_with_no_indices():
    inp = make_mla_inputs([0, 0], 2, seed=9)
    out = torch.full((2, 2, DC), float("nan"), dtype=BF16)
    got, lse = mla_decode_fp8(
        inp.q_nope,
        inp.q_pe,
        inp.ckv_cache,
        inp.kpe_cache,
        inp.kv_indptr,
        torch.empty(0, dtype=torch.int32),
        0.1,
        out=out,
        return_lse=True,
    )
    assert (got == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("page_size", [2, 64])
def test_paged_cache_gives_the_bits_of_its_token_slots(page_size):
    lens = [1, 0, 63, 64, 65, 200]
    inp = make_mla_inputs(lens, 3, seed=page_size, layout="paged", page_size=page_size)
    got, _ = run(inp, 0.07, num_splits=3, ckv_scale=1.5)
    ptr, slots, _ = inp.token_batch(range(len(lens)))
    want = mla_decode_fp8(inp.q_nope, inp.q_pe, inp.tok_ckv, inp.tok_kpe, ptr, slots, 0.07, num_splits=3, ckv_scale=1.5)
    assert torch.equal(got, want)  # the same tokens in the same order and splits: the same bits


@pytest.mark.parametrize("q_mul,sm_scale", [(3e4, 1e-6), (1e-5, 2e3), (1.0, 0.05)], ids=["huge_q", "tiny_q", "unit"])
def test_query_magnitudes_beyond_float16(q_mul, sm_scale):
    # q is carried to the float16 dots with a per-head power-of-two scale: |q| = 3e4 * N(0, 1) would overflow
    # float16 (max 65504) and 1e-5 * N(0, 1) would fall into its subnormals without it.
    inp = make_mla_inputs([40, 9], 4, seed=21)
    inp = dataclasses.replace(
        inp, q_nope=(inp.q_nope.float() * q_mul).to(BF16), q_pe=(inp.q_pe.float() * q_mul).to(BF16)
    )
    out, lse = run(inp, sm_scale, num_splits=2)
    want, want_lse = reference64(inp, [0, 1], 1.0, 1.0, sm_scale, return_lse=True)
    assert torch.isfinite(out).all()
    assert relative_error(out, want) <= 4e-3
    assert torch.allclose(lse.double(), want_lse, rtol=1e-5, atol=1e-4)


def every_fp8_code_inputs(device="cpu") -> MLAInputs:
    """One single-token request per finite FP8 code row: with one token the softmax weight is exactly 1, so
    out = the row's value (times ckv_scale) -- every code at every column, through the kernel's conversion."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8, device=device)
    rows = torch.stack([codes.roll(r).repeat(3)[: DC + DR] for r in range(codes.numel())])
    pool = rows.view(FP8).view(-1, 1, DC + DR)
    b = pool.shape[0]
    g = torch.Generator(device=device).manual_seed(22)
    idx = torch.arange(b, dtype=torch.int32, device=device).flip(0)
    return MLAInputs(
        torch.randn(b, 2, DC, generator=g, device=device).to(BF16),
        torch.randn(b, 2, DR, generator=g, device=device).to(BF16),
        pool[:, :, :DC],
        pool[:, :, DC:],
        torch.arange(b + 1, dtype=torch.int32, device=device),
        idx,
        None,
        pool[:, 0, :DC],
        pool[:, 0, DC:],
        pool[:, :, :DC],
        pool[:, :, DC:],
        [idx[i : i + 1].long() for i in range(b)],
    )


def check_every_fp8_code(device, lse_rtol):
    inp = every_fp8_code_inputs(device)
    out, lse = run(inp, 0.1, ckv_scale=0.5)
    want = (inp.tok_ckv[inp.kv_indices.long()].float() * 0.5).to(BF16)
    assert torch.equal(out, want[:, None, :].expand_as(out))
    _, ref_lse = reference64(inp, range(out.shape[0]), 0.5, 1.0, 0.1, return_lse=True)
    assert torch.allclose(lse.double(), ref_lse, rtol=lse_rtol, atol=10 * lse_rtol)  # the logit path, every code


def test_every_fp8_code_dequantizes_exactly():
    check_every_fp8_code("cpu", 1e-5)


# ---- NaN and unchecked calls: the same contract compiled and interpreted ---------------------------------


def check_fp8_nan_makes_its_request_nan(device, num_splits):
    inp = make_mla_inputs([40, 90, 7], 3, seed=40, device=device)
    nan_slot = int(inp.tok_slots[1][17])
    inp.tok_ckv.view(torch.uint8)[nan_slot, 5] = 0x7F  # e4m3 NaN in one value of one token of request 1
    clean = [i for i in (0, 2) if nan_slot not in inp.tok_slots[i].tolist()]
    out, lse = run(inp, num_splits=num_splits)
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    want = reference64(inp, clean, 1.0, 1.0, SM_SCALE)
    assert clean and torch.isfinite(out[clean]).all() and relative_error(out[clean], want) <= 1e-2


def check_nan_in_an_unread_slot_does_not_leak(device):
    # Rows past a split's end repeat its last token: an FP8 NaN in a slot no request owns (slot 0) must not reach
    # the output through p = 0 x NaN.
    inp = make_mla_inputs([77, 1000], 16, seed=32, device=device, pool_slots=5000)
    inp = dataclasses.replace(
        inp, kv_indices=inp.kv_indices.clamp_min(1), tok_slots=[s.clamp_min(1) for s in inp.tok_slots]
    )
    inp.tok_ckv.view(torch.uint8)[0] = 0x7F  # e4m3 NaN in every byte of slot 0 (ckv and kpe share the pool)
    inp.tok_kpe.view(torch.uint8)[0] = 0x7F
    out, _ = run(inp, 0.1, num_splits=3)
    assert torch.isfinite(out).all() and relative_error(out, reference64(inp, [0, 1], 1.0, 1.0, 0.1)) <= 1e-2


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_nan_makes_its_request_nan(num_splits):
    check_fp8_nan_makes_its_request_nan("cpu", num_splits)


def test_nan_in_an_unread_slot_does_not_leak():
    check_nan_in_an_unread_slot_does_not_leak("cpu")


def check_unchecked_out_of_range(device, layout, num_splits):
    """``check_range=False`` with out-of-range indices (huge, negative) in request 1: its output and LSE are NaN,
    the other requests' are what a checked call gives, and no read leaves the cache (a crash in the
    interpreter, a memcheck error under the sanitizer)."""
    page = 16 if layout == "paged" else 1
    inp = make_mla_inputs([30, 50, 9], 3, seed=41, layout=layout, page_size=page, device=device)
    good, good_lse = run(inp, num_splits=num_splits)
    ptr = inp.kv_indptr.tolist()
    bad = inp.kv_indices.clone()
    bad[ptr[1]] = 10**9
    bad[ptr[2] - 1] = -7
    out, lse = run(dataclasses.replace(inp, kv_indices=bad), num_splits=num_splits, check_range=False)
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    assert torch.equal(out[[0, 2]], good[[0, 2]]) and torch.equal(lse[[0, 2]], good_lse[[0, 2]])


@pytest.mark.parametrize("layout,num_splits", [("pool_view", 1), ("pool_view", 3), ("paged", 2)])
def test_unchecked_out_of_range_index_gives_nan_rows(layout, num_splits):
    check_unchecked_out_of_range("cpu", layout, num_splits)


def test_unchecked_indptr_past_the_indices_is_clamped():
    inp = make_mla_inputs([30, 20], 3, seed=42)
    wild = torch.tensor([0, 30, 10**6], dtype=torch.int32)  # the last request "ends" far past kv_indices
    out, _ = run(dataclasses.replace(inp, kv_indptr=wild), num_splits=2, check_range=False)
    want, _ = run(inp, num_splits=2)
    assert torch.equal(out, want)  # clamped to len(kv_indices) = 50: exactly the real batch


def test_unchecked_int64_entries_past_32_bits_are_clamped_not_truncated():
    """Issue 24, finding 2: an int64 kv_indptr entry of 2^32 + 10 (or kv_len of 2^32 + 3) is clamped to the
    buffers, as the docstring promises, not read as 10 (or 3)."""
    inp = make_mla_inputs([30, 20], 3, seed=42, index_dtype=torch.int64)
    wild = torch.tensor([0, 30, 2**32 + 10], dtype=torch.int64)
    out, _ = run(dataclasses.replace(inp, kv_indptr=wild), num_splits=2, check_range=False)
    want, _ = run(inp, num_splits=2)
    assert torch.equal(out, want)  # clamped to len(kv_indices) = 50
    paged = make_mla_inputs([30, 20], 3, seed=43, layout="paged", page_size=16)
    pages = paged.kv_indptr.tolist()
    full = paged.kv_len.clone().long()
    full[0] = (pages[1] - pages[0]) * 16  # every token of request 0's pages
    wild_len = full.clone()
    wild_len[0] = 2**32 + 3
    got, _ = run(
        dataclasses.replace(paged, kv_len=wild_len, kv_indptr=paged.kv_indptr.long()), num_splits=2, check_range=False
    )
    want, _ = run(dataclasses.replace(paged, kv_len=full), num_splits=2)
    assert full[0] != 3 and torch.equal(got, want)


def test_a_huge_sm_scale_stays_finite_or_is_refused():
    """Issue 24, finding 3: the interpreter's 2^8 conversion factor is folded with the power-of-two query scale
    before it meets sm_scale, so sm_scale above 9.2e35 no longer overflows where the float64 reference is finite;
    an sm_scale whose sm_scale * log2(e) is no float32 is refused, saying the limit."""
    inp = make_mla_inputs([20, 9], 2, seed=44)
    q_nope, q_pe = inp.q_nope.clone(), inp.q_pe.clone()
    q_nope[1, 1], q_pe[1, 1] = 0, 0  # a head of zeros: uniform weights, at any scale
    inp = dataclasses.replace(inp, q_nope=q_nope, q_pe=q_pe)
    sm_scale = 1e36
    out, lse = run(inp, sm_scale)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert relative_error(out, reference64(inp, [0, 1], 1.0, 1.0, sm_scale)) <= CPU_TOL
    most = f"{torch.finfo(torch.float32).max / math.log2(math.e):.3g}"  # sm_scale * log2(e) a float32
    with pytest.raises(ValueError, match=rf"sm_scale=1e\+39 .*{re.escape(most)}"):
        run(inp, 1e39)


# ---- the sanitizer program runs the table's cases (here on CPU, one case) --------------------------------


def test_sanitizer_program_reports_each_case(capsys):
    assert {c.name for c in SANITIZED_CASES} >= set(CHEAP)
    assert sanitize.main(["--device", "cpu", "--cases", *CHEAP]) == 0
    lines = capsys.readouterr().out.splitlines()
    # a line per check, the cases and the Triton path's unchecked calls, each ok; then no wrong result
    want = [name for name, _ in sanitize.checks(CPU, CHEAP)]
    assert len(want) > len(CHEAP) and [line.rsplit(None, 1) for line in lines[:-1]] == [[n, "ok"] for n in want]
    assert lines[-1].endswith("none")
    with pytest.raises(SystemExit):
        sanitize.main(["--device", "cpu", "--cases", "no-such-case"])


def test_sanitizer_program_runs_the_triton_path_alone_off_hopper_saying_why(capsys):
    """Off an H100 / H200 (here: the CPU) no --paths runs the Triton path's cases and says why the wgmma paths are
    left out; a case named alone runs its own path."""
    device, paths, names = sanitize.parse_args(["--device", "cpu"])
    assert device.type == "cpu" and paths == ["triton"] and names == [c.name for c in SANITIZED_CASES]
    said = capsys.readouterr().out.splitlines()  # a line per path left out, naming it and why
    assert [line.split(":")[0] for line in said] == ["wgmma", "wgmma_tokens"]
    assert all(str(device) in line and line.endswith(sanitize.path_refusal("wgmma", device)) for line in said)
    assert sanitize.parse_args(["--device", "cpu", "--cases", CHEAP[0]])[1:] == (["triton"], [CHEAP[0]])


#: The CPU's refusal of the wgmma paths, as a usage error quotes it.
_REFUSED = re.escape(f"({sanitize.path_refusal('wgmma', CPU)})")


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--paths", "wgmma"], rf"--paths wgmma: .*cpu {_REFUSED}"),
        (["--paths", "triton", "wgmma_tokens"], rf"--paths wgmma_tokens: .*cpu {_REFUSED}"),
        (["--cases", "wgmma_tokens h32 paged64"], rf"--paths wgmma_tokens: .*cpu {_REFUSED}"),
        (["--paths", "triton", "--cases", "wgmma h64 pool_view"], "--cases 'wgmma h64 pool_view': .*--paths triton"),
        (["--paths", "cuda_graphs"], "invalid choice: 'cuda_graphs'"),  # argparse's words
    ],
    ids=["wgmma", "tokens", "tokens_case", "stray_case", "unknown"],
)
def test_sanitizer_program_refuses_a_wgmma_path_off_hopper_in_words(capsys, argv, words):
    """A usage error (exit 2, no traceback) naming the flag and value to fix; a path this device cannot run: why, and
    the paths that do run here."""
    with pytest.raises(SystemExit) as info:
        sanitize.main(["--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and re.search(words, err) and "Traceback" not in err, err
    if _REFUSED in words:
        assert f"--paths {' '.join(sanitize.runnable_paths(CPU))} " in err


def test_sanitizer_program_builds_each_wgmma_paths_checks(monkeypatch, capsys):
    """As on an H100 / H200 (the refusal lifted): no --paths runs every path -- the wgmma path at 64 heads, the
    tokens-on-M path at 16 and 32 -- each case (odd lengths, an empty request, one token; page 1 and page 64) and an
    unchecked out-of-range call per heads and page size, each check bound to its own path's call."""
    monkeypatch.setattr(sanitize.wgmma_path, "wgmma_refusal", lambda device: None)
    device, paths, names = sanitize.parse_args(["--device", "cpu"])
    assert paths == list(sanitize.PATHS) == ["triton", "wgmma", "wgmma_tokens"]
    assert capsys.readouterr().out == ""  # no path left out
    want_heads = {"wgmma": {64}, "wgmma_tokens": {16, 32}}
    for path, heads in want_heads.items():
        cases = sanitize.path_cases(path)
        assert {c.heads for c in cases} == heads and all(c.num_splits is None for c in cases)
        for h in heads:
            mine = [c for c in cases if c.heads == h]
            assert {c.page_size for c in mine} == {1, 64}, (path, h)
            assert all(0 in c.lens and 1 in c.lens and any(n % 2 and n > 1 for n in c.lens) for c in mine), mine
            assert any(n % 64 for c in mine if c.page_size == 64 for n in c.lens)  # a partial last page
    built = sanitize.checks(device, names, paths)
    got = [n for n, _ in built]
    assert got[: len(SANITIZED_CASES)] == [c.name for c in SANITIZED_CASES] and len(got) == len(set(got))
    mine = {path: [n for n in got if n.split()[0] == path] for path in want_heads}
    # the wgmma path: its cases, then an unchecked call on pages of 1 and of 64
    assert [n for n in mine["wgmma"] if "unchecked" not in n] == [c.name for c in sanitize.path_cases("wgmma")]
    assert sorted(n.rsplit("(", 1)[1] for n in mine["wgmma"] if "unchecked" in n) == ["paged64)", "pool_view)"]
    assert {n.split()[1] for n in mine["wgmma_tokens"]} == {"h16", "h32"}
    assert sum("unchecked" in n for n in mine["wgmma_tokens"]) == 4  # pages of 1 and 64 at 16 and 32 heads
    # each check calls its own path's kernel, which (on the CPU) refuses before any launch, under its own name
    monkeypatch.undo()
    by_name = dict(built)
    refusal = re.escape(sanitize.path_refusal("wgmma", CPU))
    for path, call in (("wgmma", "mla_decode_fp8_wgmma"), ("wgmma_tokens", "mla_decode_fp8_wgmma_tokens")):
        for name in (mine[path][0], mine[path][-1]):  # a case, an unchecked call
            with pytest.raises(ValueError, match=rf"^{call}: .*{refusal}"):
                by_name[name]()
    with pytest.raises(ValueError, match=r"wgmma_tokens.*splits.*got 3"):
        sanitize._fn("wgmma_tokens")(None, num_splits=3)


@pytest.mark.parametrize(
    "argv,words",
    [(["--device", "tpu"], "--device tpu: not a device these kernels run on")]
    + ([] if torch.cuda.is_available() else [([], "--device cuda: this machine has no CUDA GPU")]),
)
def test_sanitizer_programs_refuse_a_device_in_words(capsys, argv, words):
    """Issue 24, finding 8: --device tpu, or the default cuda on a CPU machine, is a usage error, not a traceback."""
    from kvwall.kernels.gather import sanitize as gather_sanitize

    for program in (sanitize, gather_sanitize):
        with pytest.raises(SystemExit) as info:
            program.main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and words in err and "--device cpu" in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------------
# Bad input: a clear error before any launch (a poisoned out stays untouched)
# ----------------------------------------------------------------------------------------------


def _bad_cases():
    inp = make_mla_inputs([3, 5], 2, seed=10, pool_slots=16)
    q_nope, q_pe, ckv, kpe, indptr, idx = (
        inp.q_nope,
        inp.q_pe,
        inp.ckv_cache,
        inp.kpe_cache,
        inp.kv_indptr,
        inp.kv_indices,
    )
    pool = inp.tok3_ckv.as_strided((16, 1, DC + DR), (DC + DR, DC + DR, 1))  # the whole [16, 1, 576] pool
    ok = dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, kv_indptr=indptr, kv_indices=idx, sm_scale=0.1)
    column_major = torch.empty_strided((ckv.shape[0], DC), (1, ckv.shape[0]), dtype=FP8)
    paged = pool.view(-1, 2, DC + DR)
    pool_bytes = pool.view(-1).view(BF16)[: 2 * 2 * DC].view(2, 2, DC)  # out over the pool's own bytes
    return [
        ("q fp32", dict(q_nope=q_nope.float()), TypeError, "q_nope has dtype"),
        ("q_pe fp16", dict(q_pe=q_pe.half()), TypeError, "q_pe has dtype"),
        ("bf16 cache", dict(ckv_cache=ckv.to(BF16)), TypeError, "must be torch.float8_e4m3fn"),
        ("float indices", dict(kv_indices=idx.float()), TypeError, "kv_indices has dtype"),
        ("2-D q", dict(q_nope=q_nope[0]), ValueError, "expected \\[batch, heads, dim\\]"),
        ("heads mismatch", dict(q_pe=q_pe[:, :1]), ValueError, "same batch and heads"),
        ("narrower latent 256 is fine", dict(ckv_cache=pool[:, 0, :256], q_nope=q_nope[..., :256]), None, None),
        ("latent mismatch", dict(ckv_cache=pool[:, 0, :256]), ValueError, "latent widths disagree"),
        ("not power of two", dict(ckv_cache=pool[:, 0, :48], q_nope=q_nope[..., :48]), ValueError, "power of two"),
        ("slots mismatch", dict(kpe_cache=kpe[:-1]), ValueError, "slots but kpe_cache has"),
        ("column-major cache", dict(ckv_cache=column_major), ValueError, "last stride 1"),
        ("paged without kv_len", dict(ckv_cache=paged[..., :DC], kpe_cache=paged[..., DC:]), ValueError, "pass kv_len"),
        ("kv_len with page size 1", dict(kv_len=torch.tensor([3, 5])), ValueError, "kv_len is for paged"),
        (
            "kv_len too long",
            dict(
                ckv_cache=paged[..., :DC], kpe_cache=paged[..., DC:], kv_len=torch.tensor([3, 11]), kv_indices=idx % 2
            ),
            ValueError,
            "kv_len\\[1\\] = 11",
        ),
        (
            "page out of range",
            dict(
                ckv_cache=paged[..., :DC],
                kpe_cache=paged[..., DC:],
                kv_len=torch.tensor([3, 5]),
                kv_indices=torch.full_like(idx, paged.shape[0]),
            ),
            IndexError,
            "pages",
        ),
        (
            "page sizes differ",
            dict(ckv_cache=paged[..., :DC], kv_len=torch.tensor([3, 5])),
            ValueError,
            "pages hold 2 tokens but kpe_cache pages hold 1",
        ),
        ("indptr length", dict(kv_indptr=indptr[:-1]), ValueError, "batch \\+ 1"),
        ("indptr decreasing", dict(kv_indptr=torch.tensor([0, 5, 3], dtype=torch.int32)), ValueError, "never decrease"),
        (
            "indptr past indices",
            dict(kv_indptr=torch.tensor([0, 3, 99], dtype=torch.int32)),
            ValueError,
            "only 8 entries",
        ),
        (
            "index out of range",
            dict(kv_indices=torch.tensor([0, 1, 2, 3, 4, 5, 6, 10**6], dtype=torch.int32)),
            IndexError,
            "outside the cache",
        ),
        (
            "negative index",
            dict(kv_indices=torch.tensor([0, -1, 2, 3, 4, 5, 6, 7], dtype=torch.int32)),
            IndexError,
            "holds -1",
        ),
        ("device mix", dict(kv_indptr=indptr.to("meta")), ValueError, "one device"),
        ("sm_scale nan", dict(sm_scale=float("nan")), TypeError, "sm_scale"),
        ("scale tensor shape", dict(ckv_scale=torch.ones(2)), ValueError, "ckv_scale must be"),
        ("scale string", dict(kpe_scale="1"), TypeError, "kpe_scale must be"),
        ("scale nan", dict(ckv_scale=float("nan")), ValueError, "ckv_scale=nan is not finite"),
        ("num_splits 0", dict(num_splits=0), ValueError, "num_splits"),
        ("out dtype", dict(out=torch.empty(2, 2, DC)), ValueError, "out must be"),
        ("out shape", dict(out=torch.empty(2, 3, DC, dtype=BF16)), ValueError, "out must be"),
        ("out aliases q", dict(out=q_nope), ValueError, "shares memory with q_nope"),
        ("out over the pool", dict(out=pool_bytes), ValueError, "shares memory with ckv_cache"),
        ("out expanded", dict(out=torch.zeros(1, 1, DC, dtype=BF16).expand(2, 2, DC)), ValueError, "overlaps itself"),
        (
            "out rows overlap",
            dict(out=torch.zeros(4 * DC, dtype=BF16).as_strided((2, 2, DC), (DC, DC // 2, 1))),
            ValueError,
            "overlaps itself",
        ),
    ], ok


@pytest.mark.parametrize("name", [c[0] for c in _bad_cases()[0]])
def test_bad_input_raises_before_launch(name):
    cases, ok = _bad_cases()
    _, change, exc, match = next(c for c in cases if c[0] == name)
    if exc is None:  # a consistent narrower latent (256) is fine
        mla_decode_fp8(**{**ok, **change})
        return
    poisoned = torch.full((2, 2, DC), float("nan"), dtype=BF16)
    args = {**ok, "out": poisoned, **change}
    named = {k: args.pop(k) for k in ("ckv_scale", "kpe_scale", "num_splits", "out", "kv_len") if k in args}
    sm = args.pop("sm_scale")
    with pytest.raises(exc, match=match) as info:
        mla_decode_fp8(*args.values(), sm, **named)
    assert str(info.value).startswith("mla_decode_fp8: ")
    assert torch.isnan(poisoned).all()


def test_tuned_entry_is_the_nearest_one(tmp_path):
    table = tmp_path / "tuned.json"

    def entry(splits):
        return {"config": {"block_h": 16, "block_n": 64}, "splits": splits}

    table.write_text(
        json.dumps({"GPU X": {"by": "test", "16": {"4096": entry(1), "131072": entry(2)}, "64": {"4096": entry(3)}}})
    )
    assert tuned_entry(3, 5000, "GPU X", path=table) == {"heads": 16, **entry(1)}  # heads round up
    assert tuned_entry(16, 60000, "GPU X", path=table)["splits"] == 2  # nearest context in log scale
    assert tuned_entry(200, None, "GPU X", path=table)["heads"] == 64  # more heads than tuned: the largest
    assert tuned_entry(16, 4096, "GPU Y", path=table) is None


def test_combine_shape_takes_whole_rows_when_there_are_many_to_merge():
    """The H200's measured crossover (132 SMs): 16 heads x 7 requests (112 rows) stay at 32 columns, every chunk in
    one step; 16 x 26 (416) and 128 x 19 take whole 512-wide rows, at most 16 chunks a step; a config's own fields
    win."""
    from kvwall.kernels.mla_decode.combine import combine_shape

    cfg = MLADecodeConfig(block_h=64, block_n=64)
    assert cfg.combine_block_d == 0
    assert combine_shape(cfg, heads=16, kv_lora_rank=512, combined=7, max_chunks=42, sms=132) == (32, 64, 4)
    assert combine_shape(cfg, heads=16, kv_lora_rank=512, combined=1, max_chunks=128, sms=132) == (32, 128, 4)
    assert combine_shape(cfg, heads=16, kv_lora_rank=512, combined=1, max_chunks=300, sms=132) == (32, 512, 8)
    assert combine_shape(cfg, heads=16, kv_lora_rank=512, combined=26, max_chunks=27, sms=132) == (512, 16, 8)
    assert combine_shape(cfg, heads=128, kv_lora_rank=512, combined=29, max_chunks=6, sms=132) == (512, 8, 4)
    assert combine_shape(cfg, heads=128, kv_lora_rank=512, combined=3, max_chunks=3, sms=132) == (512, 4, 4)
    assert combine_shape(cfg, heads=128, kv_lora_rank=512, combined=3, max_chunks=3, sms=1000) == (32, 4, 4)
    own = dataclasses.replace(cfg, combine_block_d=128, combine_block_s=8, combine_warps=2)
    assert combine_shape(own, heads=128, kv_lora_rank=512, combined=29, max_chunks=6, sms=132) == (128, 8, 2)
    assert (
        combine_shape(
            dataclasses.replace(cfg, combine_block_d=1024),
            heads=16,
            kv_lora_rank=512,
            combined=1,
            max_chunks=2,
            sms=132,
        )[0]
        == 512
    )


def test_every_tuned_entry_is_a_shape_the_kernel_has():
    """The shipped table's entries name only the launch options the kernel keeps (the retired ones -- FP8 scores,
    the bit-move conversion, tokens as M, a cache hint for the first tile read, a second tile read with its own
    hint -- are gone)."""
    table = json.loads(TUNED_CONFIG_FILE.read_text())
    kept = {f.name for f in dataclasses.fields(MLADecodeConfig)}
    assert kept == {
        "block_h",
        "block_n",
        "num_warps",
        "num_stages",
        "pairs",
        "combine_block_d",
        "combine_block_s",
        "combine_warps",
    }
    entries = [e for gpu in table.values() for h, by_ctx in gpu.items() if h.isdigit() for e in by_ctx.values()]
    assert entries and all(MLADecodeConfig(**e["config"]) for e in entries)
    assert {MLADecodeConfig(**e["config"]).pairs for e in entries} == {True, False}  # both token loops are
    assert all(isinstance(cfg, MLADecodeConfig) for shapes in FALLBACK_SHAPES.values() for cfg in shapes)


# ----------------------------------------------------------------------------------------------
# GPU: compiled, float16 dot operands, real sizes
# ----------------------------------------------------------------------------------------------

GPU_CASES = validation_cases(
    [16, 64, 128], [[4096], [32768], [0, 1, 777, 4096, 33, 20000, 130, 5]], [[1, 0, 4097, 30000, 64, 65]], 64
)


@on_gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=lambda c: c.name)
def test_case_table_on_gpu(c):
    row = check_case(mla_decode_fp8, c, "cuda", 495_000)
    assert row["ok"], row


@on_gpu
@pytest.mark.parametrize("c", SANITIZED_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(block_n=128, num_warps=8, num_stages=2, block_h=16),
        dict(block_n=32, num_stages=3),
        dict(pairs=True),
        dict(pairs=False),
    ],
    ids=["tuned", "bn128", "bn32", "pairs", "no_pairs"],
)
def test_launch_variants_on_gpu(c, variant):
    cfg = dataclasses.replace(default_config(c.heads, DC, torch.device("cuda"), max(c.lens)), **variant)
    row = check_case(mla_decode_fp8, c, "cuda", 2_000, config=cfg)
    assert row["ok"], row


@on_gpu
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_nan_makes_its_request_nan_on_gpu(num_splits):
    check_fp8_nan_makes_its_request_nan("cuda", num_splits)


@on_gpu
def test_nan_in_an_unread_slot_does_not_leak_on_gpu():
    check_nan_in_an_unread_slot_does_not_leak("cuda")


@on_gpu
@pytest.mark.parametrize("layout,num_splits", [("pool_view", 1), ("pool_view", 3), ("paged", 2)])
def test_unchecked_out_of_range_index_gives_nan_rows_on_gpu(layout, num_splits):
    check_unchecked_out_of_range("cuda", layout, num_splits)


@on_gpu
def test_every_fp8_code_on_gpu():
    check_every_fp8_code("cuda", 1e-4)


@on_gpu
@pytest.mark.parametrize("q_mul,sm_scale", [(3e4, 1e-6), (1e-5, 2e3)], ids=["huge_q", "tiny_q"])
def test_query_magnitudes_on_gpu(q_mul, sm_scale):
    inp = make_mla_inputs([4000, 90], 16, seed=23, device="cuda", pool_slots=50_000)
    inp = dataclasses.replace(
        inp, q_nope=(inp.q_nope.float() * q_mul).to(BF16), q_pe=(inp.q_pe.float() * q_mul).to(BF16)
    )
    out, _ = run(inp, sm_scale)
    assert torch.isfinite(out).all() and relative_error(out, reference64(inp, [0, 1], 1.0, 1.0, sm_scale)) <= 1e-2


@on_gpu
def test_cuda_graph_replay_with_changed_lengths():
    inp = make_mla_inputs([100, 3000], 16, seed=11, device="cuda", pool_slots=100_000)
    cap = 8192
    idx_buf = torch.zeros(cap, dtype=torch.int32, device="cuda")
    ptr_buf = inp.kv_indptr.clone()
    scale = torch.tensor([1.0], device="cuda")
    out = torch.empty(2, 16, DC, dtype=BF16, device="cuda")
    kw = dict(ckv_scale=scale, kpe_scale=scale, out=out, num_splits=16, check_range=False)

    def call():
        return mla_decode_fp8(inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, ptr_buf, idx_buf, 0.1, **kw)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    g = torch.Generator(device="cuda").manual_seed(3)
    for new_lens, s in (([100, 3000], 1.0), ([0, 8000], 1.5), ([4000, 4000], 0.75)):
        n = sum(new_lens)
        idx_buf[:n] = torch.randint(0, inp.ckv_cache.shape[0], (n,), device="cuda", generator=g, dtype=torch.int32)
        ptr_buf.copy_(torch.tensor([0, new_lens[0], n], dtype=torch.int32))
        scale.fill_(s)
        out.fill_(float("nan"))
        graph.replay()
        keep = nonempty_requests(new_lens)
        replayed = dataclasses.replace(inp, tok_slots=[idx_buf[: new_lens[0]].long(), idx_buf[new_lens[0] : n].long()])
        assert relative_error(out[keep], reference64(replayed, keep, s, s, 0.1)) <= 1e-2
        assert all((out[i] == 0).all() for i, n_new in enumerate(new_lens) if not n_new)


@on_gpu
def test_checked_call_refuses_graph_capture():
    inp = make_mla_inputs([10], 16, seed=0, device="cuda")

    def call(**kw):
        return mla_decode_fp8(
            inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, 0.1, num_splits=2, **kw
        )

    call(check_range=False)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="check_range=False"):
        with torch.cuda.graph(graph):
            call()


# ----------------------------------------------------------------------------------------------
# The plan: a balanced work list, reused across calls (layers), correct for requests that grew
# ----------------------------------------------------------------------------------------------

from kvwall.kernels.mla_decode.triton_path import plan_mla_decode_triton  # noqa: E402
from kvwall.kernels.mla_decode.work_list import TO_THE_END, build_work_list  # noqa: E402


@pytest.mark.parametrize(
    "lens,block_n,wanted",
    [
        ([1000], 64, 10),
        ([5, 0, 64, 65, 1, 129, 0, 200], 16, 7),
        ([0, 0], 64, 3),
        ([1] * 40, 64, 5),
        ([32_000, 1024, 3, 17_000, 0, 9_999], 64, 264),
        ([131_072], 64, 264),
        ([7], 32, 1000),
    ],
)
def test_work_list_covers_every_token_once_in_even_chunks(lens, block_n, wanted):
    wl = build_work_list(lens, block_n=block_n, items_wanted=wanted)
    covered = {b: [] for b in range(len(lens))}
    for b, lo, hi, row in wl.items:
        covered[b].append((lo, min(hi, lens[b])))
        assert lo % block_n == 0 and (hi == TO_THE_END or hi % block_n == 0)
        assert min(hi, lens[b]) - lo <= wl.chunk_tokens
    for b, spans in covered.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == lens[b]
        assert all(a[1] == c[0] for a, c in zip(spans, spans[1:]))  # contiguous, no overlap
        assert sum(1 for it in wl.items if it[0] == b and it[2] == TO_THE_END) == 1  # one last chunk
    rows = sorted(r for *_, r in wl.items if r >= 0)
    assert rows == list(range(wl.partial_rows))  # every partial row written exactly once
    for i, b in enumerate(wl.combine):
        mine = sorted(r for bb, _, _, r in wl.items if bb == b)
        assert mine == list(range(wl.part_indptr[i], wl.part_indptr[i + 1])) and len(mine) > 1
    sizes = wl.item_tokens()
    assert sizes == sorted(sizes, reverse=True)  # longest first


def test_work_list_balances_a_mixed_batch():
    lens = [32_000] + [1_000] * 31  # one long request, the rest short: a uniform split leaves the long one's
    wl = build_work_list(lens, block_n=64, items_wanted=264)  # programs with 32x the short ones' work
    assert wl.imbalance() < 1.3 and wl.chunk_tokens <= 256


def _plan_case(lens, heads=16, **kw):
    inp = make_mla_inputs(lens, heads, seed=21, pool_slots=CPU_POOL, **kw)
    keep = nonempty_requests(lens)
    return inp, keep


@pytest.mark.parametrize("lens,programs", [([700, 0, 5, 129], 24), ([1000], 40), ([3, 64, 65], 2)])
def test_explicit_plan_matches_float64_and_is_reused(lens, programs):
    inp, keep = _plan_case(lens)
    plan = plan_mla_decode_triton(inp.kv_indptr, heads=16, device="cpu", programs=programs)
    assert plan.items >= min(programs, sum(-(-n // 64) for n in lens)) - len(lens)
    want = reference64(inp, keep, 1.0, 1.0, SM_SCALE)
    for _ in range(2):  # two "layers" on one plan
        out = torch.full((len(lens), 16, DC), float("nan"), dtype=BF16)
        got, lse = run(inp, out=out, plan=plan, check_range=False)
        assert relative_error(got[keep], want) <= CPU_TOL
        assert all((got[i] == 0).all() and torch.isneginf(lse[i]).all() for i, n in enumerate(lens) if not n)


def test_plan_made_for_shorter_requests_stays_correct():
    lens = [300, 90]
    inp, keep = _plan_case(lens)
    old = torch.tensor([0, 100, 120], dtype=torch.int32)  # the plan of an earlier step: 100 and 20 tokens
    plan = plan_mla_decode_triton(old, heads=16, device="cpu")
    got, _ = run(inp, plan=plan, check_range=False)
    assert relative_error(got[keep], reference64(inp, keep, 1.0, 1.0, SM_SCALE)) <= CPU_TOL


def test_paged_plan_matches_float64():
    lens = [1, 0, 63, 64, 65, 200]
    inp, keep = _plan_case(lens, layout="paged", page_size=16)
    plan = plan_mla_decode_triton(inp.kv_indptr, inp.kv_len, heads=16, page_size=16, device="cpu")
    got, _ = run(inp, plan=plan)
    assert relative_error(got[keep], reference64(inp, keep, 1.0, 1.0, SM_SCALE)) <= CPU_TOL


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(heads=8), "made for"),
        (dict(page_size=16), "kv_len"),
        (dict(num_splits=2), "either plan or num_splits"),
    ],
)
def test_plan_mismatch_is_refused_before_launch(change, match):
    inp, _ = _plan_case([10, 20])
    heads = change.pop("heads", 16)
    if "page_size" in change:
        with pytest.raises(ValueError, match=match):
            plan_mla_decode_triton(inp.kv_indptr, heads=16, device="cpu", **change)
        return
    plan = plan_mla_decode_triton(inp.kv_indptr, heads=heads, device="cpu")
    with pytest.raises(ValueError, match=match):
        run(inp, plan=plan, **change)


def test_plan_refuses_a_bad_indptr():
    with pytest.raises(ValueError, match="never decrease"):
        plan_mla_decode_triton(torch.tensor([0, 5, 3], dtype=torch.int32), heads=16, device="cpu")


@pytest.mark.parametrize(
    "change,kind,words",
    [
        (dict(programs=0), ValueError, "programs must be a whole number >= 1, got 0"),
        (dict(device="meta"), ValueError, "device meta is not one the kernels run on"),
        (dict(heads=2.5), ValueError, "heads must be a whole number >= 1, got 2.5"),
        (dict(kv_lora_rank=-512), ValueError, "kv_lora_rank must be a power of two >= 64"),
        (dict(kv_indptr=torch.tensor([[0, 5, 9]])), ValueError, "kv_indptr must be a 1-D int32 or int64 tensor"),
        (dict(kv_indptr=[0, 5, 9]), TypeError, "kv_indptr must be a torch.Tensor, got list"),
        (dict(page_size=0), ValueError, "page_size must be a whole number >= 1"),
    ]
    + (
        []
        if torch.cuda.is_available()
        else [
            (dict(device="cuda"), RuntimeError, "device cuda: this machine has no CUDA GPU"),
            (dict(programs=8, device="cuda"), RuntimeError, "device cuda: .* pass device='cpu'"),
        ]
    ),
)
def test_plan_refuses_bad_arguments_in_words(change, kind, words):
    """Issue 24, finding 5: plan_mla_decode_triton's bad arguments are sentences naming the argument, not raw errors."""
    args = dict(kv_indptr=torch.tensor([0, 5, 9], dtype=torch.int32), heads=16, device="cpu")
    args.update(change)
    with pytest.raises(kind, match=f"^plan_mla_decode_triton: {words}"):
        plan_mla_decode_triton(args.pop("kv_indptr"), **args)


@on_gpu
def test_planned_call_replays_in_a_cuda_graph_as_requests_grow():
    lens = [100, 3000, 40_000, 7]
    inp = make_mla_inputs(lens, 16, seed=17, device="cuda", pool_slots=100_000)
    cap = 65_536
    idx_buf = torch.zeros(cap, dtype=torch.int32, device="cuda")
    idx_buf[: sum(lens)] = inp.kv_indices[: sum(lens)]
    ptr_buf = inp.kv_indptr.clone()
    plan = plan_mla_decode_triton(ptr_buf, heads=16)
    out = torch.empty(len(lens), 16, DC, dtype=BF16, device="cuda")

    def call():
        return mla_decode_fp8(
            inp.q_nope,
            inp.q_pe,
            inp.ckv_cache,
            inp.kpe_cache,
            ptr_buf,
            idx_buf,
            0.1,
            out=out,
            plan=plan,
            check_range=False,
        )

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    g = torch.Generator(device="cuda").manual_seed(5)
    for grow in (0, 1, 17):  # steps later: every request longer than planned
        new = [n + grow for n in lens]
        n = sum(new)
        idx_buf[:n] = torch.randint(0, inp.ckv_cache.shape[0], (n,), device="cuda", generator=g, dtype=torch.int32)
        ptr_buf.copy_(torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        starts = [0, *torch.tensor(new).cumsum(0).tolist()]
        replayed = dataclasses.replace(inp, tok_slots=[idx_buf[a:b].long() for a, b in zip(starts, starts[1:])])
        keep = list(range(len(lens)))
        assert relative_error(out, reference64(replayed, keep, 1.0, 1.0, 0.1)) <= 1e-2
