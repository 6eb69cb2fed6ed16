"""GLM-5's DSA decode as SGLang runs it (:mod:`kvwall.peers.dsa`): the scaled pool row, the indexer stand-in, the
top-k's slots, the head padding, and ``dsa_decode`` at small scale (CPU: Triton's interpreter, FlashMLA's rows refused
with their reason)."""

from __future__ import annotations

import re

import pytest
import torch

from kvwall.peers.dsa import (
    INDEX_HEAD_DIM,
    INDEX_ROW_BYTES,
    TILE,
    V32_ROW_BYTES,
    dequantize_v32,
    index_logits,
    index_logits_reference,
    padded_heads,
    quantize_index_keys,
    quantize_v32,
    select_topk,
)
from kvwall.peers.flashmla import PAGE_SIZE

FP8 = torch.float8_e4m3fn


def _keys(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, 576, generator=g) * torch.exp(torch.randn(n, 1, generator=g))  # rows of different sizes
    k[0, :128] *= 1000.0  # one tile far larger than the others: its own scale
    return k.to(torch.bfloat16)


def test_v32_row_is_656_bytes_in_sglangs_order():
    k = _keys(37, 0)
    rows = quantize_v32(k)
    assert rows.shape == (37, V32_ROW_BYTES) and V32_ROW_BYTES == 656 and rows.dtype == torch.uint8
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    want = k[:, :512].float().view(37, 4, TILE).abs().amax(-1) / 448.0
    assert torch.equal(scales, want)  # bytes 512..527: one float32 per tile of 128, max|x| / 448
    assert torch.equal(rows[:, 528:].contiguous().view(torch.bfloat16), k[:, 512:])  # the rotary part, BF16, exact
    q = rows[:, :512].contiguous().view(FP8).float().view(37, 4, TILE)
    assert q.abs().amax(-1).max() <= 448.0 and (q.abs().amax(-1) == 448.0).all()  # each tile's max hits 448


def test_v32_round_trip_is_within_e4m3_rounding():
    k = _keys(64, 1)
    back = dequantize_v32(quantize_v32(k))
    x = k.float()
    err = (back[:, :512] - x[:, :512]).abs()
    scale = x[:, :512].view(64, 4, TILE).abs().amax(-1, keepdim=True).expand(64, 4, TILE).reshape(64, 512)
    # e4m3: 3 mantissa bits (relative half-ulp 2^-4) above its normal range, absolute steps of 2^-9 * scale / 448 below
    assert (err <= x[:, :512].abs() * 2.0**-4 + scale / 448.0 * 2.0**-9 + 1e-30).all()
    assert torch.equal(back[:, 512:], x[:, 512:])


def test_v32_refuses_wrong_shapes():
    with pytest.raises(ValueError, match=r"\[N, 576\].*\(4, 512\)"):  # the shape it takes, the shape given
        quantize_v32(torch.zeros(4, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="656"):
        dequantize_v32(torch.zeros(4, 576, dtype=torch.uint8))


@pytest.mark.parametrize("heads,padded", [(16, 64), (32, 64), (64, 64), (65, 128), (128, 128)])
def test_heads_are_padded_as_sglang_pads_them(heads, padded):
    assert padded_heads(heads) == padded


def _indexer_case(lens, heads=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages_needed = sum(-(-n // PAGE_SIZE) for n in lens)
    pool_pages = pages_needed + 3
    cache = quantize_index_keys(
        torch.randn(pool_pages * PAGE_SIZE, INDEX_HEAD_DIM, generator=g)
        * torch.exp(torch.randn(pool_pages * PAGE_SIZE, 1, generator=g))
    )
    perm = torch.randperm(pool_pages, generator=g)
    width = max(-(-n // PAGE_SIZE) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(lens):
        p = -(-n // PAGE_SIZE)
        table[i, :p] = perm[start : start + p].to(torch.int32)
        start += p
    q = torch.randn(len(lens), heads, INDEX_HEAD_DIM, generator=g).to(FP8)
    w = torch.randn(len(lens), heads, generator=g)
    return q, w, cache, table, torch.tensor(lens, dtype=torch.int32)


def test_index_cache_page_holds_values_then_scales():
    keys = torch.randn(2 * PAGE_SIZE, INDEX_HEAD_DIM)
    cache = quantize_index_keys(keys)
    assert cache.shape == (2, PAGE_SIZE * INDEX_ROW_BYTES) and INDEX_ROW_BYTES == 132
    scales = cache[1, PAGE_SIZE * INDEX_HEAD_DIM :].contiguous().view(torch.float32)
    assert torch.allclose(scales, keys[PAGE_SIZE:].abs().amax(-1) / 448.0)


def test_index_logits_match_float64_on_odd_lengths():
    q, w, cache, table, lens = _indexer_case([1, 63, 65, 200])
    out = torch.full((4, table.shape[1] * PAGE_SIZE), float("nan"))  # poisoned: every entry must be written
    index_logits(q, w, cache, table, lens, out)
    want = index_logits_reference(q, w, cache, table, lens)
    for b, n in enumerate(lens.tolist()):
        torch.testing.assert_close(out[b, :n].double(), want[b], rtol=1e-5, atol=1e-5)
        assert torch.isneginf(out[b, n:]).all()


def test_index_logits_refuse_bad_queries():
    q, w, cache, table, lens = _indexer_case([70])
    out = torch.empty(1, table.shape[1] * PAGE_SIZE)
    with pytest.raises(ValueError, match=rf"^index_logits takes q .*\(1, 24, {INDEX_HEAD_DIM}\)"):  # 24 heads
        index_logits(q[:, :24], w[:, :24], cache, table, lens, out)
    wanted = re.escape(str(tuple(out.shape)))
    with pytest.raises(ValueError, match=rf"^out .*{wanted}.*\(1, 10\)"):  # the shape it needs, the shape given
        index_logits(q, w, cache, table, lens, out[:, :10])


def test_topk_gives_the_best_slots_and_minus_one_past_a_short_request():
    q, w, cache, table, lens = _indexer_case([100, 30], heads=16)
    out = torch.empty(2, table.shape[1] * PAGE_SIZE)
    index_logits(q, w, cache, table, lens, out)
    sel = select_topk(out, table, lens, topk=50)
    assert sel.shape == (2, 1, 50) and sel.dtype == torch.int32
    want = index_logits_reference(q, w, cache, table, lens)
    slots0 = (table[0, :2].long()[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(-1)[:100]
    assert set(sel[0, 0].tolist()) == set(slots0[torch.topk(want[0], 50).indices].tolist())
    row1 = sel[1, 0].tolist()
    assert sum(s == -1 for s in row1) == 20  # 30 tokens: 30 slots, then -1
    slots1 = (table[1, :1].long()[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(-1)[:30]
    assert {s for s in row1 if s >= 0} == set(slots1.tolist())
    buf = torch.zeros(2, 1, 50, dtype=torch.int32)
    assert select_topk(out, table, lens, topk=50, out=buf) is buf and torch.equal(buf, sel)


def test_dsa_decode_runs_at_small_scale_on_a_cpu():
    from kvwall.experiments import run_experiment

    result = run_experiment("dsa_decode", torch.device("cpu"), "small", batches=[2])
    parts = {r["part"]: r for r in result.rows if r["section"] == "dsa"}
    assert set(parts) == {"indexer_logits", "topk", "sparse_decode", "layer"}
    assert parts["indexer_logits"]["us"] and parts["indexer_logits"]["logits_rel_err_f64"] < 1e-5
    assert parts["topk"]["topk_recall"] == 1.0
    assert parts["sparse_decode"]["us"] is None and "flash_mla" in parts["sparse_decode"]["error"]
    dense = [r for r in result.rows if r["section"] == "bench"]
    assert dense and dense[0]["rel_err_f64"] < 3e-3
