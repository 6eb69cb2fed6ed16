"""The wgmma paths' host side on a CPU, against a float64 emulation of their CUDA kernels' launch contract.

Everything the tokens-on-M wgmma path (and the heads-on-M wgmma path) does on the host before and after its launch
-- the refusals, the plan, the ``Params`` it fills, the launch arguments (heads per CTA, head blocks, items), the
partial rows and the Triton combine -- otherwise runs only on an H100 / H200. Here the launch is caught: a fake
library reads the ``Params`` the host built (and the tensors it built them from), checks them against what the
kernels assume, and computes what ``mla_decode_wgmma_tokens.cu`` / ``mla_decode_wgmma.cu`` write -- each plan item's
output (a request of one chunk) or float32 partial and its base-2 LSE, NaN for a chunk that read an out-of-range
index, zeros and -inf for an empty one -- in float64. The checks then run what the device session runs: the case
table (heads 20 -> one 32-head block with 12 heads masked; 100 -> four blocks), the sanitizer program's checks of both
wgmma paths, ``fused_decode_paths``' rows and the dispatcher's table written from them, the SGLang graph plan. With
nvcc, the real library is built and bound (``_bind``: ``Params`` size, each instantiation's shape) as
``load_mla_decode_wgmma_tokens`` does on the GPU. The combine runs in Triton's interpreter (skipped where this
Triton's cannot: GPU machines run the real kernels instead).
"""

from __future__ import annotations

import ctypes
import json
import math
import shutil
import types

import pytest
import torch
from conftest import _interpreter_gap

from kvwall.kernels.mla_decode import dispatch, hopper, sanitize
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode import wgmma_tokens as tokens_path
from kvwall.kernels.mla_decode.cases import WGMMA_SANITIZED_CASES, DecodeCase, check_case

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(bool(_interpreter_gap()), reason=_interpreter_gap() or "runs")


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(x, hi))


class EmulatedKernels:
    """The fake library: ``kvwall_mla_wgmma_tokens_split`` / ``kvwall_mla_wgmma_split`` emulated (``launches``: the
    arguments of each)."""

    def __init__(self) -> None:
        self.launches: list[dict] = []
        self.pending: dict | None = None

    def kvwall_mla_wgmma_tokens_split(self, params, hn, head_blocks, items, stream):
        assert hn in tokens_path.HEADS_PER_CTA, hn
        return self._run(params._obj, "wgmma_tokens", hn, head_blocks, items)

    def kvwall_mla_wgmma_split(self, params, head_blocks, items, stream):
        return self._run(params._obj, "wgmma", wgmma_path.HEADS_PER_CTA, head_blocks, items)

    @staticmethod
    def kvwall_mla_error_string(code):
        return b"emulated error"

    def _run(self, p: hopper.Params, path: str, hn: int, head_blocks: int, items: int) -> int:
        s, self.pending = self.pending, None
        assert s is not None, "a launch without the Params the host built"
        self.launches.append(dict(path=path, hn=hn, head_blocks=head_blocks, items=items, heads=p.H))
        plan, q_nope, q_pe, out, lse = s["plan"], s["q_nope"], s["q_pe"], s["out"], s["lse"]
        ckv, kpe = s["inputs"].ckv, s["inputs"].kpe
        # what the kernel assumes of the host's arguments
        assert p.H == q_nope.shape[1] == plan.heads and head_blocks == -(-p.H // hn)
        assert items == plan.items and p.work == plan.work.data_ptr()
        assert (p.part_o, p.part_lse) == (plan.part_o.data_ptr(), plan.part_lse.data_ptr())
        assert plan.part_o.is_contiguous() and plan.part_o.shape[1:] == (p.H, ckv.shape[1])
        assert (p.out, p.qn, p.qp) == (out.data_ptr(), q_nope.data_ptr(), q_pe.data_ptr())
        assert (p.stride_o_b, p.stride_o_h) == out.stride()[:2] and out.stride(-1) == 1
        assert (p.stride_qn_b, p.stride_qn_h, p.stride_qp_b, p.stride_qp_h) == q_nope.stride()[:2] + q_pe.stride()[:2]
        assert (p.ckv, p.kpe, p.stride_ckv, p.stride_kpe) == (
            ckv.data_ptr(),
            kpe.data_ptr(),
            ckv.stride(0),
            kpe.stride(0),
        )
        assert p.num_units == ckv.shape[0] // p.page and bool(p.write_lse) == (lse is not None)
        idx, ptr, kvlen = s["kv_indices"], s["kv_indptr"], s["kv_len"]
        assert (p.indices == idx.data_ptr() or not idx.numel()) and p.indptr == ptr.data_ptr()
        assert (p.indices64, p.indptr64) == (idx.dtype == torch.int64, ptr.dtype == torch.int64)
        assert kvlen is None or (p.kvlen, p.kvlen64) == (kvlen.data_ptr(), kvlen.dtype == torch.int64)
        for t in (q_nope, q_pe) if p.q_vec else ():  # 16-byte query loads only where rows are 16-byte aligned
            assert t.data_ptr() % 16 == 0 and all(st * 2 % 16 == 0 for st in t.stride()[:-1])
        (c_t, _), (k_t, _) = s["inputs"].scales
        cs, ks = (float(c_t), float(k_t)) if p.scale_from_ptr else (p.ckv_scale_val, p.kpe_scale_val)
        work, ptr, idx = plan.work.tolist(), ptr.tolist(), idx.tolist()
        kvlen = kvlen.tolist() if kvlen is not None else None
        assert p.q_len * p.heads_per_token == p.H and p.q_len == plan.q_len
        qn, qp = q_nope.double(), q_pe.double()
        for b, item_lo, item_hi, prow in work[:items]:  # item_bounds() of mla_decode_common.cuh
            start = _clamp(ptr[b], 0, p.num_indices)
            stop = _clamp(ptr[b + 1], start, p.num_indices)
            length = stop - start if p.page == 1 else _clamp(kvlen[b], 0, (stop - start) * p.page)
            lo = _clamp(item_lo, 0, length)
            hi = _clamp(item_hi, lo, length)
            units = [idx[start + t // p.page] for t in range(lo, hi)]
            bad = any(u < 0 or u >= p.num_units for u in units)
            slots = torch.tensor(
                [(u if 0 <= u < p.num_units else 0) * p.page + t % p.page for u, t in zip(units, range(lo, hi))],
                dtype=torch.long,
            )
            o = torch.zeros(p.H, ckv.shape[1], dtype=torch.float64)
            lse2 = torch.full((p.H,), -math.inf, dtype=torch.float64)
            if slots.numel():
                k, r = ckv[slots].double(), kpe[slots].double()
                scores = (qn[b] @ k.T * cs + qp[b] @ r.T * ks) * p.qk_scale  # base 2
                # row h (token j = h // heads_per_token) sees positions < length - (q_len - 1 - j)
                limit = length - (p.q_len - 1 - torch.arange(p.H) // p.heads_per_token)
                scores[torch.arange(lo, hi)[None, :] >= limit[:, None]] = -math.inf
                seen = scores.max(-1).values > -math.inf  # a row with no token: zeros and -inf
                m = scores[seen].max(-1).values
                w = torch.exp2(scores[seen] - m[:, None])
                o[seen], lse2[seen] = (w @ k) * cs / w.sum(-1)[:, None], m + torch.log2(w.sum(-1))
            if bad:
                o, lse2 = torch.full_like(o, math.nan), torch.full_like(lse2, math.nan)
            if prow < 0:
                out[b] = o.to(out.dtype)
                if lse is not None:
                    lse[b] = (lse2 * math.log(2)).float()
            else:
                plan.part_o[prow], plan.part_lse[prow] = o.float(), lse2.float()
        return 0


@pytest.fixture
def kernels(monkeypatch) -> EmulatedKernels:
    """Both wgmma paths' host code on CPU tensors, their launches emulated (as on an H100 / H200 otherwise): the
    fake library stands for both kinds', and each :func:`~kvwall.kernels.mla_decode.hopper.launch_planned` call
    hands it the tensors the ``Params`` were filled from."""
    lib = EmulatedKernels()
    for module in (hopper, wgmma_path):  # the checks' and the dispatcher's / sanitizer's
        monkeypatch.setattr(module, "wgmma_refusal", lambda device: None)
    monkeypatch.setattr(hopper, "load_library", lambda kind, trace=False: lib)
    launch = hopper.launch_planned

    def launch_planned(kind, plan, q_nope, q_pe, ckv_rows, kpe_rows, kv_indptr, kv_indices, kv_len, scales, *rest):
        out, lse = rest[-3], rest[-2]
        lib.pending = dict(
            inputs=types.SimpleNamespace(ckv=ckv_rows, kpe=kpe_rows, scales=scales),
            plan=plan,
            q_nope=q_nope,
            q_pe=q_pe,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            kv_len=kv_len,
            out=out,
            lse=lse,
        )
        return launch(kind, plan, q_nope, q_pe, ckv_rows, kpe_rows, kv_indptr, kv_indices, kv_len, scales, *rest)

    monkeypatch.setattr(hopper, "launch_planned", launch_planned)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    return lib


def _no_splits(call):
    def run(*args, num_splits=None, **kwargs):
        assert num_splits is None
        return call(*args, **kwargs)

    return run


@pytest.mark.parametrize("layout", ["pool_view", "pool_view_3d", "paged"])
@pytest.mark.parametrize("heads", [1, 3, 16, 20, 32, 64, 100])
def test_the_tokens_path_host_side_on_the_case_table(kernels, heads, layout):
    """Every head count launches 16 heads a CTA up to 16 and 32 above, in ceil(heads / hn) blocks (20: one block,
    12 heads masked), and the result -- direct rows, partials and the combine -- is float64's."""
    page = 64 if layout == "paged" else 1
    case = DecodeCase(f"h{heads} {layout}", heads, (0, 1, 65, 300, 7), layout, 0.37, 0.74, "int64", None, 3, page)
    row = check_case(_no_splits(tokens_path.mla_decode_fp8_wgmma_tokens), case, CPU, 2000)
    assert row["ok"], row
    (launch,) = kernels.launches
    hn = 16 if heads <= 16 else 32
    assert launch == dict(path="wgmma_tokens", hn=hn, head_blocks=-(-heads // hn), items=launch["items"], heads=heads)


def test_the_heads_on_m_path_host_side(kernels):
    case = DecodeCase("h128 paged", 128, (1, 0, 63, 64, 65, 200), "paged", 1.5, 0.75, "int32", None, 12, 64)
    assert check_case(_no_splits(wgmma_path.mla_decode_fp8_wgmma), case, CPU, 2000)["ok"]
    assert [(x["path"], x["hn"], x["head_blocks"]) for x in kernels.launches] == [("wgmma", 64, 2)]


@pytest.mark.parametrize(
    "path,heads,q_len", [("wgmma_tokens", 16, 2), ("wgmma_tokens", 3, 4), ("wgmma", 16, 4), ("wgmma", 20, 3)]
)
def test_a_multi_token_query_sees_its_causal_prefix(kernels, path, heads, q_len):
    """The fold: ``[batch, q_len * heads, D]`` rows, a plan for them; token j of request b equals a decode of its own
    over the first length - (q_len - 1 - j) tokens (float64), a token that sees nothing gives zeros -- across one
    chunk or several (the plan cuts the long request; the combine merges its chunks, a chunk a row cannot see
    weighed 0). 16 heads x 4 tokens fill one 64-row CTA of the heads-on-M kernel."""
    from kvwall.kernels.mla_decode.reference import mla_decode_reference

    call, plan_fn = {
        "wgmma": (wgmma_path.mla_decode_fp8_wgmma, wgmma_path.plan_mla_decode_wgmma),
        "wgmma_tokens": (tokens_path.mla_decode_fp8_wgmma_tokens, tokens_path.plan_mla_decode_wgmma_tokens),
    }[path]
    gen = torch.Generator().manual_seed(q_len)
    pool = (torch.randn(3000, 576, generator=gen) * 0.7).to(torch.float8_e4m3fn)
    lens = [q_len - 2, 9, 700, q_len]  # the first: its first token(s) see nothing
    ptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    idx = torch.randint(0, 3000, (sum(lens),), generator=gen, dtype=torch.int32)
    q = (torch.randn(len(lens), q_len * heads, 576, generator=gen) * 0.5).to(torch.bfloat16)
    plan = plan_fn(ptr, heads=heads, q_len=q_len, programs=6)
    assert plan.heads == q_len * heads and plan.q_len == q_len and plan.work_list.combine  # a request is cut
    got, lse = call(
        q[..., :512], q[..., 512:], pool[:, :512], pool[:, 512:], ptr, idx, 0.1, plan=plan, q_len=q_len, return_lse=True
    )
    assert kernels.launches[-1]["heads"] == q_len * heads
    for b, n in enumerate(lens):
        for j in range(q_len):
            rows, seen = slice(j * heads, (j + 1) * heads), n - (q_len - 1 - j)
            if seen <= 0:
                assert (got[b, rows] == 0).all() and (lse[b, rows] == -math.inf).all(), (b, j)
                continue
            want = mla_decode_reference(
                q[b : b + 1, rows, :512],
                q[b : b + 1, rows, 512:],
                pool[:, :512],
                pool[:, 512:],
                torch.tensor([0, seen]),
                idx[ptr[b] : ptr[b] + seen].long(),
                0.1,
                compute_dtype=torch.float64,
            )
            err = float((got[b : b + 1, rows].double() - want).norm() / want.norm())
            assert err < 1e-2, (b, j, err)


def test_a_plan_for_another_q_len_is_refused(kernels):
    ptr = torch.tensor([0, 5], dtype=torch.int32)
    q = torch.zeros(1, 32, 576, dtype=torch.bfloat16)
    pool = torch.zeros(8, 576).to(torch.float8_e4m3fn)
    plan = tokens_path.plan_mla_decode_wgmma_tokens(ptr, heads=16, q_len=2)
    # the plan's q_len (2), then the call's (1)
    with pytest.raises(ValueError, match=r"^mla_decode_fp8_wgmma_tokens: .*q_len\).*\b2\);.*\b1\)"):
        tokens_path.mla_decode_fp8_wgmma_tokens(
            q[..., :512],
            q[..., 512:],
            pool[:, :512],
            pool[:, 512:],
            ptr,
            torch.arange(5, dtype=torch.int32),
            0.1,
            plan=plan,
            q_len=1,
        )
    with pytest.raises(ValueError, match=r"\bq_len\b.*\b9\b.*\b8\b"):  # the argument, its value, the most
        wgmma_path.plan_mla_decode_wgmma(ptr, heads=16, q_len=9)


def test_the_sanitizer_program_checks_both_wgmma_paths(kernels, capsys):
    """What memcheck runs on the H200 (``--paths wgmma wgmma_tokens``): every case right, NaN rows where the
    unchecked calls put out-of-range indices."""
    argv = ["--device", "cpu", "--paths", "wgmma", "wgmma_tokens"]
    assert sanitize.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    device, paths, names = sanitize.parse_args(argv)
    want = [name for name, _ in sanitize.checks(device, names, paths)]  # each case, then the unchecked calls
    assert {c.name for cases in WGMMA_SANITIZED_CASES.values() for c in cases} <= set(want)
    assert any(n.startswith("wgmma_tokens h32") and "unchecked" in n for n in want)
    assert [line.rsplit(None, 1) for line in lines[:-1]] == [[n, "ok"] for n in want]  # each check, ok
    assert lines[-1].endswith("none")  # no wrong result
    assert {x["hn"] for x in kernels.launches} == {16, 32, 64}


def test_fused_decode_paths_rows_make_the_table_ours_reads(kernels, monkeypatch, tmp_path):
    """fused_decode_paths' rows for the three paths forced (page 1 and 64, each against float64) and ours, in the
    schemas a recording validates, and the table written from them choosing what they timed."""
    from kvwall.experiments.fused_decode import bench, strategies
    from kvwall.experiments.fused_decode import kernel_paths as paths
    from kvwall.results import Result, collect_provenance, validate_rows

    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn(4096, 1, 576, generator=gen) * 0.7).to(torch.float8_e4m3fn)
    clock = {"triton": 30.0, "wgmma": 20.0, "wgmma_tokens": 10.0}
    rows = []
    for heads in (20, 64):
        pt = strategies.make_point(heads, 300, 4, pool_slots=4096, max_total=2_000_000, gen=gen, seed=0, device=CPU)
        timed = [(p, page) for page in (1, 64) for p in strategies.FORCED_PATHS]
        got = bench.bench_point_rows(
            pt,
            pool,
            CPU,
            timed + ["ours"],
            lambda: None,
            copy_gbps=4000.0,
            bf16_tflops=800.0,
            reps=1,
            rounds=1,
            host_calls=0,
            ctx=strategies.BuildContext(),
            sglang_split_sweep=[],
            timer=lambda *args: (1.0, "fake clock", None),
        )
        for r in got:
            assert "error" not in r and r["rel_err_f64"] < 3e-3, r
            if r["strategy"] in clock:  # the tokens-on-M path slower at 64 heads (two blocks re-read the tiles)
                assert r["kernel_path"] == r["strategy"]
                r["us"] = clock[r["strategy"]] * (4 if heads > 32 and r["strategy"] == "wgmma_tokens" else 1)
        assert got[-1]["kernel_path"] == ("wgmma_tokens" if heads <= 32 else "wgmma")  # no table for "cpu"
        rows += got
    validate_rows("fused_decode_bench", rows)
    build = {
        "section": "build",
        "gpu": "NVIDIA H200",
        "capability": [9, 0],
        "sms": 132,
        "nvcc": "12.8",
        "copy_gbps": 4200.0,
        "copy_ms": 0.5,
        "bf16_tflops": 700.0,
        "wgmma": {"runs": True, "why": None},
        "wgmma_tokens": {"runs": True, "why": None},
        "seconds_total": 70.0,
    }
    recorded = [build] + [r for r in rows if r["strategy"] in clock]
    validate_rows("fused_decode_paths", recorded)
    target = tmp_path / "kernel_paths.json"
    paths.write_path_table(Result("fused_decode_paths", {}, recorded, collect_provenance(CPU, paths.__name__)), target)
    table = json.loads(target.read_text())
    assert [p[:4] for p in table["NVIDIA H200"]["points"]] == [[20, 300, 4, "wgmma_tokens"], [64, 300, 4, "wgmma"]]
    for heads, want in ((16, "wgmma_tokens"), (32, "wgmma_tokens"), (100, "wgmma")):
        assert (
            dispatch.decide_path(heads, 4, 300, gpu="NVIDIA H200", capability=(9, 0), refusal=None, table=table)[0]
            == want
        )


def test_a_graph_plan_of_the_tokens_path_refills_and_runs(kernels):
    """A CUDA-graph plan (ours' front door, ``graph_max_len``) chosen by the dispatcher (few heads: the tokens-on-M
    path), refilled in place for new lengths, runs ours with the spare row taking the empty items."""
    from kvwall.kernels import mla_decode, plan_mla_decode
    from kvwall.kernels.mla_decode.reference import mla_decode_reference

    gen = torch.Generator().manual_seed(3)
    pool = (torch.randn(3000, 1, 576, generator=gen) * 0.7).to(torch.float8_e4m3fn)
    q = (torch.randn(4, 3, 576, generator=gen) * 0.5).to(torch.bfloat16)
    ptr_buf = torch.zeros(5, dtype=torch.int32)
    idx_buf = torch.zeros(800, dtype=torch.int32)
    plan = plan_mla_decode(ptr_buf, idx_buf, heads=3, sm_scale=0.1, graph_max_len=200, lengths=[200] * 4)
    assert plan.path == "wgmma_tokens" and isinstance(plan.work, tokens_path.WgmmaTokensPlan)
    for lens in ([5, 130, 1, 17], [200, 0, 1, 150]):
        plan.refill(lens)
        ptr_buf.copy_(torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32))
        idx_buf[: sum(lens)] = torch.randint(0, 3000, (sum(lens),), generator=gen, dtype=torch.int32)
        got = mla_decode(q[..., :512], q[..., 512:], pool[:, :, :512], pool[:, :, 512:], plan)
        assert kernels.launches[-1]["items"] == plan.graph_capacity
        for b, n in enumerate(lens):
            if not n:
                assert (got[b] == 0).all()
                continue
            want = mla_decode_reference(
                q[b : b + 1, :, :512],
                q[b : b + 1, :, 512:],
                pool[:, 0, :512],
                pool[:, 0, 512:],
                torch.tensor([0, n]),
                idx_buf[int(ptr_buf[b]) : int(ptr_buf[b + 1])].long(),
                0.1,
                compute_dtype=torch.float64,
            )
            assert float((got[b : b + 1].double() - want).norm() / want.norm()) < 1e-2, (lens, b)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_the_real_library_builds_and_binds_as_on_the_gpu(monkeypatch, tmp_path):
    """load_mla_decode_wgmma_tokens' build and ``_bind`` (Params size, each instantiation's shape against the host's)
    -- what the first GPU call runs -- on the library nvcc builds here; a head count per CTA it was not built for is
    refused by the library before any CUDA call, and its error string reads back."""
    monkeypatch.setenv("KVWALL_BUILD_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lib = hopper.load_library.__wrapped__("wgmma_tokens")  # not cached: this one is built in tmp_path
    assert [p.name for p in tmp_path.glob("*.so")] == [f"kvwall_mla_wgmma_tokens_{tokens_path.source_hash()}.so"]
    for hn in tokens_path.HEADS_PER_CTA:
        assert tokens_path.kernel_shape(lib, hn) == tokens_path.host_shape(hn)
    code = lib.kvwall_mla_wgmma_tokens_split(ctypes.byref(hopper.Params()), 64, 1, 1, None)
    assert code != 0 and lib.kvwall_mla_error_string(code).decode() == "invalid argument"
    assert lib.kvwall_mla_wgmma_tokens_split(ctypes.byref(hopper.Params()), 16, 1, 0, None) == 0  # no items
