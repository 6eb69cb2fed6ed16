"""Rows of an odd stride or byte offset (a 577-byte row one byte past alignment) on the Triton path through the front
door: the GPU tier found on the H200 (2026-12-03) that the front door launched a 16-bit-pairs launch shape on them
("misaligned address"); the Triton path's launch now drops the pairs for such rows, whoever calls it."""

from __future__ import annotations

import pytest
import torch

from kvwall.kernels.mla_decode import triton_path
from kvwall.kernels.mla_decode.cases import SM_SCALE
from kvwall.kernels.mla_decode.dispatch import mla_decode, plan_mla_decode
from kvwall.kernels.mla_decode.launch_shape import MLADecodeConfig
from kvwall.kernels.mla_decode.reference import make_mla_inputs

DC, DR = 512, 64
FP8 = torch.float8_e4m3fn


def test_the_front_door_reads_odd_rows_without_16_bit_pairs(monkeypatch):
    """Rows one byte off alignment with a 577-byte stride, planned for the Triton path with a 16-bit-pairs launch
    shape: what the front door launches must not read them as 16-bit pairs (mla_decode_fp8 does not)."""
    inp = make_mla_inputs([30, 50, 9], 16, seed=3, layout="pool_view", pool_slots=4096, device=torch.device("cpu"))
    slots = inp.ckv_cache.shape[0]
    raw = torch.randint(0, 0x70, (slots * 577 + 16,), dtype=torch.uint8)
    odd = raw[1 : 1 + slots * 577].view(-1, 577).view(FP8)
    ckv, kpe = odd[:, :DC], odd[:, DC : DC + DR]
    plan = plan_mla_decode(
        inp.kv_indptr,
        inp.kv_indices,
        heads=16,
        sm_scale=SM_SCALE,
        path="triton",
        config=MLADecodeConfig(16, 64, 4, 3, pairs=True),
        ckv_cache=ckv,
        kpe_cache=kpe,
    )
    assert plan.work.config.pairs  # the plan asks for pairs; the launch must not use them on these rows
    launched = []

    def spy(cfg, **kw):
        launched.append(cfg)
        raise _Launched

    monkeypatch.setattr(triton_path, "split_constexprs", spy)
    with pytest.raises(_Launched):
        mla_decode(inp.q_nope, inp.q_pe, ckv, kpe, plan)
    assert len(launched) == 1 and launched[0].block_h == 16 and not launched[0].pairs


class _Launched(Exception):
    """Raised by the spy in place of the launch."""


@pytest.mark.parametrize(
    ("stride", "offset", "keeps_pairs"), [(576, 0, True), (576, 2, True), (577, 0, False), (576, 1, False)]
)
def test_pairs_are_dropped_only_for_rows_they_cannot_read(stride, offset, keeps_pairs):
    """The rule the launch applies: 16-bit pairs stay for rows of an even stride and offset (SGLang's pool), and go
    for an odd stride or an odd byte offset."""
    raw = torch.zeros(8 * stride + 16, dtype=torch.uint8)
    rows = raw[offset : offset + 8 * stride].view(-1, stride).view(FP8)
    cfg = MLADecodeConfig(16, 64, 4, 3, pairs=True)
    assert triton_path.config_for_rows(cfg, rows[:, :DC], rows[:, DC : DC + DR]).pairs is keeps_pairs
