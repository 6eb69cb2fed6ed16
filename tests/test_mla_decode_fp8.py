"""The fused FP8 MLA decode kernel against the float64 torch reference.

On CPU the kernels run in Triton's interpreter (built by the module itself, no TRITON_INTERPRET needed) with
float32 dot operands; on a GPU (the ``gpu``-marked tests, skipped elsewhere) they are compiled with float16 dot
operands. The reference runs on the *dequantized* cache (``ckv * ckv_scale``, ``kpe * kpe_scale``) in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvwall.kernels import mla_decode_fp8, mla_decode_reference

DC, DR = 512, 64
FP8 = torch.float8_e4m3fn


def make_inputs(lens, heads, *, slots=None, seed=0, device="cpu", pool_layout=True, index_dtype=torch.int32,
                spare=0):
    """A seeded batch: BF16 queries, an FP8 pool with random (repeating, unsorted) slots per request.

    ``pool_layout``: ckv/kpe are strided views of one SGLang ``[slots, 1, 576]`` pool; else two contiguous caches.
    ``spare``: extra entries past ``kv_indptr[-1]`` in ``kv_indices`` (a fixed-capacity buffer), holding garbage.
    """
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    total = sum(lens)
    slots = slots or max(8, 2 * total)
    pool = (torch.randn(slots, 1, DC + DR, generator=g, device=dev) * 0.6).to(FP8)
    if pool_layout:
        ckv, kpe = pool[:, 0, :DC], pool[:, 0, DC:]
    else:
        ckv, kpe = pool[:, 0, :DC].contiguous(), pool[:, 0, DC:].contiguous()
    b = len(lens)
    q_nope = (torch.randn(b, heads, DC, generator=g, device=dev) * 0.5).to(torch.bfloat16)
    q_pe = (torch.randn(b, heads, DR, generator=g, device=dev) * 0.5).to(torch.bfloat16)
    indptr = torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=index_dtype,
                          device=dev)
    idx = torch.randint(0, slots, (total,), generator=g, dtype=torch.int64, device=dev)
    if spare:
        idx = torch.cat([idx, torch.full((spare,), -12345, dtype=torch.int64, device=dev)])
    return q_nope, q_pe, ckv, kpe, indptr, idx.to(index_dtype), pool


def reference(q_nope, q_pe, ckv, kpe, indptr, idx, sm_scale, ckv_scale=1.0, kpe_scale=1.0):
    """float64 reference on the dequantized cache; empty requests -> zeros and lse -inf."""
    b, h, _ = q_nope.shape
    out = torch.zeros(b, h, DC, dtype=torch.float64, device=q_nope.device)
    lse = torch.full((b, h), -math.inf, dtype=torch.float64, device=q_nope.device)
    ptr = indptr.tolist()
    keep = [i for i in range(b) if ptr[i + 1] > ptr[i]]
    if not keep:
        return out, lse
    sub_ptr = torch.tensor([0] + torch.tensor([ptr[i + 1] - ptr[i] for i in keep]).cumsum(0).tolist(),
                           device=indptr.device)
    sub_idx = torch.cat([idx[ptr[i]:ptr[i + 1]] for i in keep])
    o, l = mla_decode_reference(q_nope[keep], q_pe[keep], ckv.double() * float(ckv_scale), kpe.double() * float(kpe_scale),
                                sub_ptr, sub_idx, sm_scale, compute_dtype=torch.float64, return_lse=True)
    out[keep], lse[keep] = o, l
    return out, lse


def rel_err(got, want):
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-300))


def check(lens, heads, *, num_splits=None, ckv_scale=1.0, kpe_scale=1.0, tol=1e-2, seed=0, device="cpu", config=None,
          **kw):
    q_nope, q_pe, ckv, kpe, indptr, idx, _ = make_inputs(lens, heads, seed=seed, device=device, **kw)
    sm_scale = 1.0 / math.sqrt(192 + 64)
    out, lse = mla_decode_fp8(q_nope, q_pe, ckv, kpe, indptr, idx, sm_scale, ckv_scale=ckv_scale, config=config,
                              kpe_scale=kpe_scale, return_lse=True, num_splits=num_splits)
    want, want_lse = reference(q_nope, q_pe, ckv, kpe, indptr, idx, sm_scale,
                               float(ckv_scale) if not isinstance(ckv_scale, torch.Tensor) else ckv_scale.item(),
                               float(kpe_scale) if not isinstance(kpe_scale, torch.Tensor) else kpe_scale.item())
    assert out.dtype == torch.bfloat16 and out.shape == (len(lens), heads, DC)
    assert lse.dtype == torch.float32 and lse.shape == (len(lens), heads)
    assert torch.isfinite(out).all()
    empty = torch.tensor([a == b for a, b in zip(indptr.tolist(), indptr.tolist()[1:])], device=out.device)
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    if (~empty).any():
        err = rel_err(out[~empty], want[~empty])
        assert err <= tol, err
        assert torch.allclose(lse[~empty].double(), want_lse[~empty], atol=1e-3, rtol=1e-4)
    return out, want


# ----------------------------------------------------------------------------------------------
# CPU: Triton's interpreter, float32 dot operands
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads", [1, 3, 16])
@pytest.mark.parametrize("lens", [[1], [7], [33], [130], [0, 7, 130, 1, 33]], ids=lambda l: "x".join(map(str, l)))
def test_matches_float64_reference(heads, lens):
    out, want = check(lens, heads, ckv_scale=1.25, kpe_scale=0.75, seed=len(lens) * 10 + heads)
    # float32 dots in the interpreter: what remains is the BF16 rounding of the output (half an ulp), plus float32
    # accumulation error, visible only on outputs that cancel to near zero.
    bound = want.abs() * 2.0**-8 + 1e-6 * want.abs().max()
    assert ((out.double() - want).abs() <= bound).all()


def test_long_context_and_wide_batch():
    check([1000], 16, ckv_scale=0.8, kpe_scale=1.1, seed=12)  # many tiles per split
    check([5, 0, 64, 65, 1, 129, 0, 200], 16, seed=13)  # tile-boundary lengths, batch 8


def test_sharp_softmax_stays_finite():
    # Logits in the thousands: the online softmax must subtract its running maximum (no overflow, no NaN).
    q_nope, q_pe, ckv, kpe, indptr, idx, _ = make_inputs([50, 90], 16, seed=14)
    out, lse = mla_decode_fp8(q_nope * 40, q_pe * 40, ckv, kpe, indptr, idx, 1.0, return_lse=True, num_splits=3)
    want, want_lse = reference(q_nope * 40, q_pe * 40, ckv, kpe, indptr, idx, 1.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_err(out, want) <= 1e-2
    assert torch.allclose(lse.double(), want_lse, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 40])
def test_split_counts_agree(num_splits):
    # 40 splits of a 33-token request: most splits are empty and carry no weight in the combine.
    check([33, 0, 70], 16, num_splits=num_splits, ckv_scale=0.5, kpe_scale=2.0, seed=3)


def test_contiguous_caches_int64_indices_and_spare_capacity():
    check([5, 66], 3, pool_layout=False, index_dtype=torch.int64, spare=9, seed=4)


def test_scales_as_tensors():
    check([17, 40], 16, ckv_scale=torch.tensor([1.5]), kpe_scale=torch.tensor([0.25]), seed=5)
    check([17], 2, ckv_scale=torch.tensor([1.5]), kpe_scale=0.25, seed=6)  # mixed: number + tensor


def test_three_d_page_size_one_views():
    q_nope, q_pe, ckv, kpe, indptr, idx, pool = make_inputs([9, 20], 4, seed=7)
    a = mla_decode_fp8(q_nope, q_pe, pool[:, :, :DC], pool[:, :, DC:], indptr, idx, 0.1, num_splits=2)
    b = mla_decode_fp8(q_nope, q_pe, ckv, kpe, indptr, idx, 0.1, num_splits=2)
    assert torch.equal(a, b)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_zero_length_requests_and_poisoned_out(num_splits):
    q_nope, q_pe, ckv, kpe, indptr, idx, _ = make_inputs([0, 12, 0], 3, seed=8)
    base = torch.full((3, 3, 2 * DC), float("nan"), dtype=torch.bfloat16)
    out = base[:, :, :DC]  # strided out: row stride 2 * DC
    got, lse = mla_decode_fp8(q_nope, q_pe, ckv, kpe, indptr, idx, 0.1, out=out, return_lse=True,
                              num_splits=num_splits)
    assert got is out and torch.isfinite(out).all()
    assert torch.isnan(base[:, :, DC:]).all()  # nothing written outside out
    assert (out[0] == 0).all() and (out[2] == 0).all() and torch.isneginf(lse[[0, 2]]).all()
    want, want_lse = reference(q_nope, q_pe, ckv, kpe, indptr, idx, 0.1)
    assert rel_err(out[1], want[1]) <= 1e-2
    assert torch.allclose(lse[1].double(), want_lse[1], atol=1e-4)


def test_all_requests_empty():
    q_nope, q_pe, ckv, kpe, _, _, _ = make_inputs([4], 2, seed=9)
    q_nope, q_pe = q_nope.expand(2, -1, -1), q_pe.expand(2, -1, -1)
    indptr = torch.zeros(3, dtype=torch.int32)
    out = torch.full((2, 2, DC), float("nan"), dtype=torch.bfloat16)
    got, lse = mla_decode_fp8(q_nope, q_pe, ckv, kpe, indptr, torch.empty(0, dtype=torch.int32), 0.1, out=out,
                              return_lse=True)
    assert (got == 0).all() and torch.isneginf(lse).all()


def make_paged(lens, heads, page_size, *, seed=0, device="cpu"):
    """A paged pool ``[pages, page_size, 576]`` with random pages per request, and the same request as token
    slots of the flattened pool (page * page_size + offset)."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    n_pages = [-(-n // page_size) for n in lens]
    pages_total = max(4, 2 * sum(n_pages))
    pool = (torch.randn(pages_total, page_size, DC + DR, generator=g, device=dev) * 0.6).to(FP8)
    q_nope = (torch.randn(len(lens), heads, DC, generator=g, device=dev) * 0.5).to(torch.bfloat16)
    q_pe = (torch.randn(len(lens), heads, DR, generator=g, device=dev) * 0.5).to(torch.bfloat16)
    pages = torch.randperm(pages_total, generator=g, device=dev)[: sum(n_pages)].to(torch.int32)
    page_ptr = torch.tensor([0] + torch.tensor(n_pages).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    slots = torch.cat([
        (pages[page_ptr[i]:page_ptr[i + 1]].long()[:, None] * page_size
         + torch.arange(page_size, device=dev)).flatten()[:n] for i, n in enumerate(lens)]).to(torch.int32)
    tok_ptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    kv_len = torch.tensor(lens, dtype=torch.int32, device=dev)
    return q_nope, q_pe, pool, pages, page_ptr, kv_len, slots, tok_ptr


@pytest.mark.parametrize("page_size", [2, 16, 64])
def test_paged_cache_matches_token_slots(page_size):
    lens = [1, 0, 63, 64, 65, 200]
    q_nope, q_pe, pool, pages, page_ptr, kv_len, slots, tok_ptr = make_paged(lens, 3, page_size, seed=page_size)
    got = mla_decode_fp8(q_nope, q_pe, pool[..., :DC], pool[..., DC:], page_ptr, pages, 0.07, kv_len=kv_len,
                         num_splits=3, ckv_scale=1.5)
    flat = pool.view(-1, DC + DR)
    want = mla_decode_fp8(q_nope, q_pe, flat[:, :DC], flat[:, DC:], tok_ptr, slots, 0.07, num_splits=3, ckv_scale=1.5)
    assert torch.equal(got, want)  # the same tokens in the same order and splits: the same bits
    ref, _ = reference(q_nope, q_pe, flat[:, :DC], flat[:, DC:], tok_ptr, slots, 0.07, 1.5)
    assert rel_err(got[[i for i, n in enumerate(lens) if n]], ref[[i for i, n in enumerate(lens) if n]]) <= 1e-2


@pytest.mark.parametrize("q_mul,sm_scale", [(3e4, 1e-6), (1e-5, 2e3), (1.0, 0.05)], ids=["huge_q", "tiny_q", "unit"])
def test_query_magnitudes_beyond_float16(q_mul, sm_scale):
    # q is carried to the float16 dots with a per-head power-of-two scale: |q| = 3e4 * N(0, 1) would overflow
    # float16 (max 65504) and 1e-5 * N(0, 1) would fall into its subnormals without it.
    q_nope, q_pe, ckv, kpe, indptr, idx, _ = make_inputs([40, 9], 4, seed=21)
    q_nope, q_pe = (q_nope.float() * q_mul).to(torch.bfloat16), (q_pe.float() * q_mul).to(torch.bfloat16)
    out, lse = mla_decode_fp8(q_nope, q_pe, ckv, kpe, indptr, idx, sm_scale, return_lse=True, num_splits=2)
    want, want_lse = reference(q_nope, q_pe, ckv, kpe, indptr, idx, sm_scale)
    assert torch.isfinite(out).all()
    assert rel_err(out, want) <= 4e-3
    assert torch.allclose(lse.double(), want_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("lens", [[130, 7, 0, 64], [1000]], ids=["mixed", "long"])
def test_fp8_scores_four_term_query_split(lens):
    # The FP8 tensor-core score path: q split into four e4m3 terms (16 significant bits) -- as exact as float16.
    import dataclasses

    from kvwall.kernels.mla_decode.kernel import default_config

    cfg = dataclasses.replace(default_config(16, DC, torch.device("cpu")), s_fp8=True)
    out, want = check(lens, 16, ckv_scale=1.3, kpe_scale=0.7, num_splits=2, seed=33, config=cfg)
    plain, _ = check(lens, 16, ckv_scale=1.3, kpe_scale=0.7, num_splits=2, seed=33)
    assert rel_err(out, want) <= rel_err(plain, want) * 1.001 + 1e-6


def every_fp8_code_case(device="cpu"):
    """One single-token request per finite FP8 code row: with one token the softmax weight is exactly 1, so
    out = the row's value (times ckv_scale) -- every code at every column, through the kernel's conversion."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8, device=device)
    rows = torch.stack([codes.roll(r)[: DC + DR] if codes.numel() >= DC + DR else
                        codes.roll(r).repeat(3)[: DC + DR] for r in range(codes.numel())])
    pool = rows.view(FP8).view(-1, 1, DC + DR)
    b = pool.shape[0]
    g = torch.Generator(device=device).manual_seed(22)
    q_nope = torch.randn(b, 2, DC, generator=g, device=device).to(torch.bfloat16)
    q_pe = torch.randn(b, 2, DR, generator=g, device=device).to(torch.bfloat16)
    indptr = torch.arange(b + 1, dtype=torch.int32, device=device)
    idx = torch.arange(b, dtype=torch.int32, device=device).flip(0)
    return q_nope, q_pe, pool, indptr, idx


def test_every_fp8_code_dequantizes_exactly():
    q_nope, q_pe, pool, indptr, idx = every_fp8_code_case()
    out, lse = mla_decode_fp8(q_nope, q_pe, pool[:, :, :DC], pool[:, :, DC:], indptr, idx, 0.1, ckv_scale=0.5,
                              return_lse=True)
    want = (pool[idx.long(), 0, :DC].float() * 0.5).to(torch.bfloat16)
    assert torch.equal(out, want[:, None, :].expand_as(out))
    ref, ref_lse = reference(q_nope, q_pe, pool[:, 0, :DC], pool[:, 0, DC:], indptr, idx, 0.1, 0.5)
    assert torch.allclose(lse.double(), ref_lse, rtol=1e-5, atol=1e-4)  # the logit path, every code


# ----------------------------------------------------------------------------------------------
# Bad input: a clear error before any launch (a poisoned out stays untouched)
# ----------------------------------------------------------------------------------------------

def _bad_cases():
    q_nope, q_pe, ckv, kpe, indptr, idx, pool = make_inputs([3, 5], 2, seed=10)
    ok = dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, kv_indptr=indptr, kv_indices=idx, sm_scale=0.1)
    column_major = torch.empty_strided((ckv.shape[0], DC), (1, ckv.shape[0]), dtype=FP8)
    paged = pool.view(-1, 2, DC + DR) if pool.shape[0] % 2 == 0 else pool[:-1].view(-1, 2, DC + DR)
    return [
        ("q fp32", dict(q_nope=q_nope.float()), TypeError, "q_nope has dtype"),
        ("q_pe fp16", dict(q_pe=q_pe.half()), TypeError, "q_pe has dtype"),
        ("bf16 cache", dict(ckv_cache=ckv.to(torch.bfloat16)), TypeError, "must be torch.float8_e4m3fn"),
        ("float indices", dict(kv_indices=idx.float()), TypeError, "kv_indices has dtype"),
        ("2-D q", dict(q_nope=q_nope[0]), ValueError, "expected \\[batch, heads, dim\\]"),
        ("heads mismatch", dict(q_pe=q_pe[:, :1]), ValueError, "same batch and heads"),
        ("narrower latent 256 is fine", dict(ckv_cache=pool[:, 0, :256], q_nope=q_nope[..., :256]), None, None),
        ("latent mismatch", dict(ckv_cache=pool[:, 0, :256]), ValueError, "latent widths disagree"),
        ("not power of two", dict(ckv_cache=pool[:, 0, :48], q_nope=q_nope[..., :48]), ValueError, "power of two"),
        ("slots mismatch", dict(kpe_cache=kpe[:-1]), ValueError, "slots but kpe_cache has"),
        ("column-major cache", dict(ckv_cache=column_major), ValueError, "last stride 1"),
        ("paged without kv_len", dict(ckv_cache=paged[..., :DC], kpe_cache=paged[..., DC:]), ValueError,
         "pass kv_len"),
        ("kv_len with page size 1", dict(kv_len=torch.tensor([3, 5])), ValueError, "kv_len is for paged"),
        ("kv_len too long", dict(ckv_cache=paged[..., :DC], kpe_cache=paged[..., DC:], kv_len=torch.tensor([3, 11]),
                                 kv_indices=idx % 2), ValueError, "kv_len\\[1\\] = 11"),
        ("page out of range", dict(ckv_cache=paged[..., :DC], kpe_cache=paged[..., DC:], kv_len=torch.tensor([3, 5]),
                                   kv_indices=torch.full_like(idx, paged.shape[0])), IndexError, "pages"),
        ("page sizes differ", dict(ckv_cache=paged[..., :DC], kv_len=torch.tensor([3, 5])), ValueError,
         "pages hold 2 tokens but kpe_cache pages hold 1"),
        ("indptr length", dict(kv_indptr=indptr[:-1]), ValueError, "batch \\+ 1"),
        ("indptr decreasing", dict(kv_indptr=torch.tensor([0, 5, 3], dtype=torch.int32)), ValueError, "never decrease"),
        ("indptr past indices", dict(kv_indptr=torch.tensor([0, 3, 99], dtype=torch.int32)), ValueError, "only 8 entries"),
        ("index out of range", dict(kv_indices=torch.tensor([0, 1, 2, 3, 4, 5, 6, 10**6], dtype=torch.int32)),
         IndexError, "outside the cache"),
        ("negative index", dict(kv_indices=torch.tensor([0, -1, 2, 3, 4, 5, 6, 7], dtype=torch.int32)),
         IndexError, "holds -1"),
        ("device mix", dict(kv_indptr=indptr.to("meta")), ValueError, "one device"),
        ("sm_scale nan", dict(sm_scale=float("nan")), TypeError, "sm_scale"),
        ("scale tensor shape", dict(ckv_scale=torch.ones(2)), ValueError, "ckv_scale must be"),
        ("scale string", dict(kpe_scale="1"), TypeError, "kpe_scale must be"),
        ("num_splits 0", dict(num_splits=0), ValueError, "num_splits"),
        ("out dtype", dict(out=torch.empty(2, 2, DC)), ValueError, "out must be"),
        ("out shape", dict(out=torch.empty(2, 3, DC, dtype=torch.bfloat16)), ValueError, "out must be"),
        ("out aliases q", dict(out=q_nope), ValueError, "shares memory with q_nope"),
    ], ok


@pytest.mark.parametrize("name", [c[0] for c in _bad_cases()[0]])
def test_bad_input_raises_before_launch(name):
    cases, ok = _bad_cases()
    _, change, exc, match = next(c for c in cases if c[0] == name)
    if exc is None:  # a consistent narrower latent (256) is fine
        mla_decode_fp8(**{**ok, **change})
        return
    poisoned = torch.full((2, 2, DC), float("nan"), dtype=torch.bfloat16)
    args = {**ok, "out": poisoned, **change}
    scale_kw = {k: args.pop(k) for k in ("ckv_scale", "kpe_scale", "num_splits", "out", "kv_len") if k in args}
    sm = args.pop("sm_scale")
    with pytest.raises(exc, match=match):
        mla_decode_fp8(*args.values(), sm, **scale_kw)
    assert torch.isnan(poisoned).all()


# ----------------------------------------------------------------------------------------------
# GPU: compiled, float16 dot operands, real sizes
# ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (compiled Triton kernel, BF16 dots)")
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("lens", [[4096], [32768], [0, 1, 777, 4096, 33, 20000, 130, 5]],
                         ids=["4K", "32K", "mixed"])
@pytest.mark.parametrize("pool_layout", [True, False], ids=["pool_view", "contiguous"])
@pytest.mark.parametrize("num_splits", [None, 1, 7], ids=["auto", "s1", "s7"])
def test_real_sizes_on_gpu(heads, lens, pool_layout, num_splits):
    check(lens, heads, num_splits=num_splits, ckv_scale=1.25, kpe_scale=0.5, device="cuda", pool_layout=pool_layout,
          slots=495_000, seed=heads + len(lens))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("variant", [dict(), dict(s_fp8=True), dict(convert="bits"), dict(block_n=128, num_warps=8),
                                     dict(cache_v=""), dict(block_n=32, num_stages=3)],
                         ids=["tuned", "s8", "bits", "bn128", "one_load", "bn32"])
def test_launch_variants_on_gpu(heads, variant):
    import dataclasses

    from kvwall.kernels.mla_decode.kernel import default_config

    cfg = dataclasses.replace(default_config(heads, DC, torch.device("cuda"), 4096), **variant)
    q_nope, q_pe, ckv, kpe, indptr, idx, _ = make_inputs([0, 1, 777, 4096, 33, 130], heads, seed=31, device="cuda",
                                                         slots=200_000)
    sm_scale = 1.0 / math.sqrt(192 + 64)
    out, lse = mla_decode_fp8(q_nope, q_pe, ckv, kpe, indptr, idx, sm_scale, ckv_scale=1.25, kpe_scale=0.5,
                              return_lse=True, config=cfg)
    want, want_lse = reference(q_nope, q_pe, ckv, kpe, indptr, idx, sm_scale, 1.25, 0.5)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert rel_err(out[1:], want[1:]) <= 1e-2
    assert torch.allclose(lse[1:].double(), want_lse[1:], atol=2e-3, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_nan_in_slot_zero_does_not_leak_on_gpu():
    # Rows past a split's end repeat its last token; an FP8 NaN in a slot no request owns (slot 0) must not reach
    # the output through p = 0 x NaN. (GPU only: the interpreter's bit-move conversion maps NaN to a finite value.)
    q_nope, q_pe, ckv, kpe, indptr, idx, pool = make_inputs([77, 1000], 16, seed=32, device="cuda", slots=5000)
    idx = idx.clamp_min(1)
    pool.view(torch.uint8)[0] = 0x7F  # e4m3 NaN in every byte of slot 0
    out = mla_decode_fp8(q_nope, q_pe, ckv, kpe, indptr, idx, 0.1, num_splits=3)
    want, _ = reference(q_nope, q_pe, ckv, kpe, indptr, idx, 0.1)
    assert torch.isfinite(out).all() and rel_err(out, want) <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_every_fp8_code_on_gpu():
    q_nope, q_pe, pool, indptr, idx = every_fp8_code_case("cuda")
    out, lse = mla_decode_fp8(q_nope, q_pe, pool[:, :, :DC], pool[:, :, DC:], indptr, idx, 0.1, ckv_scale=0.5,
                              return_lse=True)
    want = (pool[idx.long(), 0, :DC].float() * 0.5).to(torch.bfloat16)
    assert torch.equal(out, want[:, None, :].expand_as(out))
    ref, ref_lse = reference(q_nope, q_pe, pool[:, 0, :DC], pool[:, 0, DC:], indptr, idx, 0.1, 0.5)
    assert torch.allclose(lse.double(), ref_lse, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_on_gpu(page_size):
    lens = [1, 0, 4097, 30000, 64, 65]
    q_nope, q_pe, pool, pages, page_ptr, kv_len, slots, tok_ptr = make_paged(lens, 16, page_size, seed=page_size,
                                                                            device="cuda")
    got = mla_decode_fp8(q_nope, q_pe, pool[..., :DC], pool[..., DC:], page_ptr, pages, 0.07, kv_len=kv_len)
    flat = pool.view(-1, DC + DR)
    ref, _ = reference(q_nope, q_pe, flat[:, :DC], flat[:, DC:], tok_ptr, slots, 0.07)
    keep = [i for i, n in enumerate(lens) if n]
    assert rel_err(got[keep], ref[keep]) <= 1e-2 and (got[1] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("q_mul,sm_scale", [(3e4, 1e-6), (1e-5, 2e3)], ids=["huge_q", "tiny_q"])
def test_query_magnitudes_on_gpu(q_mul, sm_scale):
    q_nope, q_pe, ckv, kpe, indptr, idx, _ = make_inputs([4000, 90], 16, seed=23, device="cuda", slots=50_000)
    q_nope, q_pe = (q_nope.float() * q_mul).to(torch.bfloat16), (q_pe.float() * q_mul).to(torch.bfloat16)
    out = mla_decode_fp8(q_nope, q_pe, ckv, kpe, indptr, idx, sm_scale)
    want, _ = reference(q_nope, q_pe, ckv, kpe, indptr, idx, sm_scale)
    assert torch.isfinite(out).all() and rel_err(out, want) <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA graphs)")
def test_cuda_graph_replay_with_changed_lengths():
    lens = [100, 3000]
    q_nope, q_pe, ckv, kpe, indptr, idx, _ = make_inputs(lens, 16, slots=100_000, seed=11, device="cuda")
    cap = 8192
    idx_buf = torch.zeros(cap, dtype=torch.int32, device="cuda")
    idx_buf[: idx.numel()] = idx
    ptr_buf = indptr.clone()
    scale = torch.tensor([1.0], device="cuda")
    out = torch.empty(2, 16, DC, dtype=torch.bfloat16, device="cuda")
    kw = dict(ckv_scale=scale, kpe_scale=scale, out=out, num_splits=16, check_range=False)
    mla_decode_fp8(q_nope, q_pe, ckv, kpe, ptr_buf, idx_buf, 0.1, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_fp8(q_nope, q_pe, ckv, kpe, ptr_buf, idx_buf, 0.1, **kw)
    for new_lens, s in (([100, 3000], 1.0), ([0, 8000], 1.5), ([4000, 4000], 0.75)):
        g = torch.Generator(device="cuda").manual_seed(len(new_lens) + int(s * 4))
        n = sum(new_lens)
        idx_buf[:n] = torch.randint(0, ckv.shape[0], (n,), device="cuda", generator=g, dtype=torch.int32)
        ptr_buf.copy_(torch.tensor([0, new_lens[0], n], dtype=torch.int32))
        scale.fill_(s)
        out.fill_(float("nan"))
        graph.replay()
        want, _ = reference(q_nope, q_pe, ckv, kpe, ptr_buf, idx_buf, 0.1, s, s)
        keep = [i for i, l in enumerate(new_lens) if l]
        assert rel_err(out[keep], want[keep]) <= 1e-2
        assert all((out[i] == 0).all() for i, l in enumerate(new_lens) if not l)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_checked_call_refuses_graph_capture():
    q_nope, q_pe, ckv, kpe, indptr, idx, _ = make_inputs([10], 16, device="cuda")
    mla_decode_fp8(q_nope, q_pe, ckv, kpe, indptr, idx, 0.1, num_splits=2, check_range=False)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="check_range=False"):
        with torch.cuda.graph(graph):
            mla_decode_fp8(q_nope, q_pe, ckv, kpe, indptr, idx, 0.1, num_splits=2)
