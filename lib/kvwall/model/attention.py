"""MLA decode attention back-ends the decode step can use.

- :class:`FlashInferMLADecode`: FlashInfer's ``BatchMLAPagedAttentionWrapper``, what SGLang's
  ``flashinfer_mla`` backend calls (GPU only; planned once per batch, run per layer).
- :class:`ReferenceMLADecode`: the torch reference from ``kvwall.kernels`` (any device).

Both take ``(q_nope, q_pe, ckv, kpe)`` with the cache views of an SGLang-layout buffer.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvwall.kernels import mla_decode_reference

from kvwall.model.geometry import MLAGeometry
from kvwall.model.pool import DecodeBatch

__all__ = ["MLADecode", "FlashInferMLADecode", "ReferenceMLADecode", "make_mla_decode"]

ATTENTION_BACKENDS = ("auto", "flashinfer", "reference")


class MLADecode(Protocol):
    name: str

    def __call__(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor,
                 kpe: torch.Tensor) -> torch.Tensor: ...


class ReferenceMLADecode:
    """Torch reference attention in float32, returned in the query's dtype."""

    name = "torch reference (float32)"

    def __init__(self, geometry: MLAGeometry, batch: DecodeBatch) -> None:
        self.geometry = geometry
        self.batch = batch

    def __call__(self, q_nope, q_pe, ckv, kpe):
        out = mla_decode_reference(q_nope, q_pe, ckv, kpe, self.batch.kv_indptr,
                                   self.batch.kv_indices, self.geometry.sm_scale)
        return out.to(q_nope.dtype)


class FlashInferMLADecode:
    """FlashInfer's paged MLA decode, planned for one batch (page size 1, as SGLang uses it)."""

    def __init__(self, geometry: MLAGeometry, batch: DecodeBatch, *,
                 q_dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype = torch.bfloat16,
                 backend: str = "fa2", workspace_bytes: int = 128 << 20) -> None:
        device = batch.kv_indices.device
        if device.type != "cuda":
            raise RuntimeError(
                "FlashInfer's MLA kernels need an NVIDIA GPU; the batch is on "
                f"{device}. Use ReferenceMLADecode (or mode='cpu') on this machine."
            )
        import flashinfer

        self.name = f"FlashInfer {flashinfer.__version__} BatchMLAPagedAttentionWrapper ({backend})"
        self.flashinfer_version = flashinfer.__version__
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
        qo_indptr = torch.arange(batch.batch_size + 1, dtype=torch.int32, device=device)
        self.wrapper.plan(
            qo_indptr, batch.kv_indptr, batch.kv_indices, batch.context_lens,
            geometry.heads_per_gpu, geometry.kv_lora_rank, geometry.qk_rope_head_dim,
            1, False, geometry.sm_scale, q_dtype, kv_dtype,
        )

    def __call__(self, q_nope, q_pe, ckv, kpe):
        return self.wrapper.run(q_nope, q_pe, ckv, kpe)


def make_mla_decode(kind: str, geometry: MLAGeometry, batch: DecodeBatch) -> MLADecode:
    """``kind``: "flashinfer", "reference", or "auto" (FlashInfer on CUDA, the reference elsewhere)."""
    if kind not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {kind!r} is not one of {ATTENTION_BACKENDS}.")
    if kind == "auto":
        kind = "flashinfer" if batch.kv_indices.device.type == "cuda" else "reference"
    if kind == "flashinfer":
        return FlashInferMLADecode(geometry, batch)
    return ReferenceMLADecode(geometry, batch)
