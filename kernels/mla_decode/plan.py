"""The plan every path of the fused FP8 MLA decode runs: a batch's work list on the device
(:mod:`.work_list`), the launch shape it was cut for and the float32 partial buffers, made once per decode step and
reused by every layer. The Triton path makes it (:func:`~kvwall.kernels.mla_decode.triton_path.plan_mla_decode_triton`);
the wgmma paths extend it (:mod:`.wgmma`, :mod:`.wgmma_tokens`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from kvwall.kernels.mla_decode.work_list import WorkList

if TYPE_CHECKING:
    from kvwall.kernels.mla_decode.launch_shape import MLADecodeConfig

__all__ = ["MLADecodePlan", "device_ints"]


@dataclass(frozen=True)
class MLADecodePlan:
    """A batch's work list on the device (:mod:`.work_list`), the launch shape it was cut for,
    and the float32 partial buffers of the requests with more than one chunk. Made once per decode step by
    :func:`plan_mla_decode_triton`; every layer's :func:`mla_decode_fp8` call with ``plan=`` reuses it, and such a call
    never synchronizes (CUDA-graph capturable)."""

    batch: int
    heads: int
    kv_lora_rank: int
    page_size: int
    device: torch.device
    config: MLADecodeConfig
    work_list: WorkList
    work: torch.Tensor  # int32 [items, 4]
    combine_requests: torch.Tensor  # int32 [requests with > 1 chunk] (at least one entry)
    part_indptr: torch.Tensor  # int32 [that + 1]
    part_o: torch.Tensor  # float32 [partial rows, heads, kv_lora_rank]
    part_lse: torch.Tensor  # float32 [partial rows, heads]

    @property
    def items(self) -> int:
        return len(self.work_list.items)


def device_ints(values: Sequence, device: torch.device) -> torch.Tensor:
    """``values`` as an int32 tensor on ``device``, copied from pinned host memory without waiting (a copy from
    pageable memory would wait for the work already queued on the stream: a plan made while the previous step runs
    must not stall the host). The caching host allocator keeps the pinned block until the copy is done."""
    t = torch.tensor(values, dtype=torch.int32)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
