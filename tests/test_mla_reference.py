"""The torch MLA decode reference against an independent float64 computation, and its input checks; the seeded
inputs of the fused kernel and the float64 reference on their dequantized cache."""

import math

import pytest
import torch

from kvwall.model.geometry import GLM5
from kvwall.kernels import mla_decode_reference, split_latent_cache
from kvwall.kernels.mla_decode.reference import MLA_LAYOUTS, make_mla_inputs, nonempty_requests, reference64
from kvwall.model.pool import make_decode_batch


def naive_float64(q_nope, q_pe, cache, kv_indptr, kv_indices, rank, sm_scale):
    """Token by token, head by head, in float64: deliberately nothing like the reference's code."""
    b_, h_, dc = q_nope.shape
    out = torch.zeros(b_, h_, dc, dtype=torch.float64)
    c64 = cache.to(torch.float64)
    for b in range(b_):
        slots = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].tolist()
        for h in range(h_):
            logits = [
                float((q_nope[b, h].double() @ c64[s, 0, :rank]) + (q_pe[b, h].double() @ c64[s, 0, rank:])) * sm_scale
                for s in slots
            ]
            m = max(logits)
            w = [math.exp(x - m) for x in logits]
            z = sum(w)
            for wi, s in zip(w, slots):
                out[b, h] += (wi / z) * c64[s, 0, :rank]
    return out


@pytest.mark.parametrize("lens,heads,rank,rope", [([1], 1, 8, 4), ([5, 17, 33], 3, 24, 8), ([29, 2], 5, 40, 12)])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float32])
def test_reference_matches_naive_float64(lens, heads, rank, rope, cache_dtype):
    gen = torch.Generator().manual_seed(sum(lens) * heads + rank)
    slots = sum(lens) + 40
    cache = torch.randn(slots, 1, rank + rope, generator=gen).to(cache_dtype)
    q_nope = torch.randn(len(lens), heads, rank, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(len(lens), heads, rope, generator=gen, dtype=torch.float64)
    batch = make_decode_batch(lens, slots, seed=len(lens), max_run=3)
    ckv, kpe = split_latent_cache(cache, rank)
    scale = 0.3
    got = mla_decode_reference(
        q_nope, q_pe, ckv, kpe, batch.kv_indptr, batch.kv_indices, scale, compute_dtype=torch.float64
    )
    want = naive_float64(q_nope, q_pe, cache, batch.kv_indptr, batch.kv_indices, rank, scale)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    # float32 compute: the relative error lands far under 1e-3 (METHOD.md's yardstick)
    got32 = mla_decode_reference(q_nope.float(), q_pe.float(), ckv, kpe, batch.kv_indptr, batch.kv_indices, scale)
    assert float((got32.double() - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_reference64_reads_each_requests_tokens_dequantized(layout):
    # The generator's token view of every layout (paged included) against the naive loop over the kernel's own
    # inputs: the slots it names are the ones the kernel is given, scaled in float64.
    lens = [3, 0, 21, 16]
    inp = make_mla_inputs(lens, 2, seed=3, layout=layout, page_size=8, pool_slots=64)
    keep = nonempty_requests(lens)
    got = reference64(inp, keep, 0.5, 2.0, 0.3)
    if layout == "paged":
        pages = inp.kv_indices.long().tolist()
        ptr = inp.kv_indptr.tolist()
        slots = [[pages[ptr[b] + t // 8] * 8 + t % 8 for t in range(n)] for b, n in enumerate(lens)]
    else:
        ptr = inp.kv_indptr.tolist()
        slots = [inp.kv_indices[ptr[b] : ptr[b + 1]].long().tolist() for b in range(len(lens))]
    cache = torch.cat([inp.tok_ckv.double() * 0.5, inp.tok_kpe.double() * 2.0], dim=-1).unsqueeze(1)
    flat = [s for b in keep for s in slots[b]]
    ptr_keep = torch.tensor([0] + torch.tensor([lens[b] for b in keep]).cumsum(0).tolist())
    want = naive_float64(inp.q_nope[keep], inp.q_pe[keep], cache, ptr_keep, torch.tensor(flat), 512, 0.3)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_lse_is_natural_log_sum_exp():
    cache = torch.randn(10, 1, 12, dtype=torch.float64)
    q = torch.randn(1, 2, 8, dtype=torch.float64), torch.randn(1, 2, 4, dtype=torch.float64)
    idx = torch.tensor([3, 1, 7], dtype=torch.int32)
    _, lse = mla_decode_reference(
        *q,
        *split_latent_cache(cache, 8),
        torch.tensor([0, 3], dtype=torch.int32),
        idx,
        0.5,
        compute_dtype=torch.float64,
        return_lse=True,
    )
    logits = (q[0][0] @ cache[idx.long(), 0, :8].T + q[1][0] @ cache[idx.long(), 0, 8:].T) * 0.5
    assert torch.allclose(lse[0], torch.logsumexp(logits, -1))


def _inputs():
    cache = torch.randn(20, 1, 12)
    ckv, kpe = split_latent_cache(cache, 8)
    return (
        torch.randn(2, 3, 8),
        torch.randn(2, 3, 4),
        ckv,
        kpe,
        torch.tensor([0, 2, 5], dtype=torch.int32),
        torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32),
    )


@pytest.mark.parametrize(
    "mutate,exc,words",
    [
        (lambda a: a.__setitem__(5, torch.tensor([1, 2, 3, 4, 20], dtype=torch.int32)), IndexError, "out of range"),
        (lambda a: a.__setitem__(5, torch.tensor([1, 2, -1, 4, 5], dtype=torch.int32)), IndexError, "out of range"),
        (lambda a: a.__setitem__(4, torch.tensor([0, 2], dtype=torch.int32)), ValueError, "batch \\+ 1"),
        (lambda a: a.__setitem__(4, torch.tensor([0, 2, 2], dtype=torch.int32)), ValueError, "empty request"),
        (lambda a: a.__setitem__(5, a[5].float()), TypeError, "int32 or int64"),
        (lambda a: a.__setitem__(1, torch.randn(2, 3, 5)), ValueError, "widths disagree"),
        (lambda a: a.__setitem__(0, torch.randn(3, 8)), ValueError, r"\[batch, heads, dim\]"),
        (lambda a: a.__setitem__(4, torch.tensor([0, 6, 5], dtype=torch.int32)), ValueError, "never decrease"),
    ],
)
def test_bad_input_gets_a_clear_error(mutate, exc, words):
    args = list(_inputs())
    mutate(args)
    with pytest.raises(exc, match=words):
        mla_decode_reference(*args, 0.1)


def test_split_rejects_a_flat_cache():
    with pytest.raises(ValueError, match="kv_lora_rank"):
        split_latent_cache(torch.zeros(4, 512), GLM5.kv_lora_rank)


@pytest.mark.gpu
def test_flashinfer_bf16_matches_reference_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU: FlashInfer's MLA kernels do not run on a CPU")
    from kvwall.model.attention import FlashInferMLADecode
    from kvwall.model.pool import random_kv

    geom = GLM5
    for lens in ([1], [37, 1000, 4099]):
        gen = torch.Generator().manual_seed(len(lens))
        cache = random_kv((6000, 1, geom.kv_dim), generator=gen, device="cuda", dtype=torch.bfloat16)
        batch = make_decode_batch(lens, 6000, seed=1, device="cuda")
        q_nope = random_kv((len(lens), 16, 512), generator=gen, device="cuda", dtype=torch.bfloat16)
        q_pe = random_kv((len(lens), 16, 64), generator=gen, device="cuda", dtype=torch.bfloat16)
        ckv, kpe = split_latent_cache(cache, 512)
        got = FlashInferMLADecode.for_batch(geom, batch)(q_nope, q_pe, ckv, kpe).double()
        want = mla_decode_reference(
            q_nope, q_pe, ckv, kpe, batch.kv_indptr, batch.kv_indices, geom.sm_scale, compute_dtype=torch.float64
        )
        assert float((got - want).norm() / want.norm()) < 1e-2
