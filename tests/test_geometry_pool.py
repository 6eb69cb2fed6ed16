import re

import pytest
import torch

from kvwall.model.geometry import GLM5, MLAGeometry
from kvwall.model.roofline import attention_read_bytes, full_pool_cast_bytes
from kvwall.model.pool import TokenPool, make_decode_batch


def test_glm5_shape():
    assert GLM5.kv_dim == GLM5.kv_lora_rank + GLM5.qk_rope_head_dim == 576
    assert GLM5.heads_per_gpu == GLM5.num_heads // 4 == 16
    assert GLM5.with_tensor_parallel(8).heads_per_gpu == 8
    assert GLM5.sm_scale == pytest.approx((192 + 64) ** -0.5)


def test_tensor_parallel_must_divide_heads():
    with pytest.raises(ValueError, match=rf"tensor_parallel=3\b.*num_heads={GLM5.num_heads}\b"):
        GLM5.with_tensor_parallel(3)


def test_cast_bytes_are_one_read_two_written():
    b = full_pool_cast_bytes(GLM5, 1000)
    assert b == {"read": 1000 * 576, "written": 2000 * 576, "total": 3000 * 576}
    assert attention_read_bytes(GLM5, 10) == 10 * 576 * 2
    # The original's "about 857 MB" for 495K tokens: our arithmetic lands within half a percent.
    assert abs(full_pool_cast_bytes(GLM5, 495_000)["total"] / 857e6 - 1) < 5e-3


@pytest.mark.parametrize("lens", [[1], [7, 300, 33], [1000, 1]])
def test_decode_batch_page_tables(lens):
    slots = 2000
    batch = make_decode_batch(lens, slots, seed=3)
    idx = batch.kv_indices.long()
    assert batch.kv_indptr.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
    assert idx.min() >= 1 and idx.max() < slots, "slot 0 is reserved and indices stay in the pool"
    assert idx.unique().numel() == idx.numel(), "no slot is handed out twice"
    assert batch.new_token_slots.tolist() == [int(idx[e - 1]) for e in batch.kv_indptr[1:].tolist()]
    # Scattered, not one contiguous block (the pool after churn):
    if len(idx) > 200:
        assert (idx[1:] - idx[:-1] != 1).any()


def test_decode_batch_rejects_what_does_not_fit():
    with pytest.raises(ValueError, match="usable ones"):
        make_decode_batch([100], 100)
    with pytest.raises(ValueError, match=re.escape("context_lens=[0]")):  # the lengths given
        make_decode_batch([0], 100)


def test_pool_layout_and_write_round_trip():
    geom = MLAGeometry("tiny", 2, 0, 4, 32, 8, 16, 16, tensor_parallel=2)
    pool = TokenPool.random(geom, 50, 2, seed=1)
    assert pool.key_buffer(1).shape == (50, 1, 40) and pool.dtype == torch.float8_e4m3fn
    assert not torch.equal(pool.key_buffer(0).view(torch.uint8), pool.key_buffer(1).view(torch.uint8))
    kv = torch.randn(3, 1, 40, dtype=torch.bfloat16)
    slots = torch.tensor([5, 17, 49])
    pool.write_new_tokens(1, slots, kv)
    assert torch.equal(pool.key_buffer(1)[slots].to(torch.float32), kv.to(torch.float8_e4m3fn).to(torch.float32))
    with pytest.raises(ValueError, match=r"^num_slots=1\b"):
        TokenPool.random(geom, 1, 1)
