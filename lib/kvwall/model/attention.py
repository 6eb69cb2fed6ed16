"""MLA decode attention back-ends: the one FlashInfer wrapper of the book, and the torch reference.

- :class:`FlashInferMLADecode`: FlashInfer's ``BatchMLAPagedAttentionWrapper``, what SGLang's ``flashinfer_mla``
  backend calls: planned once per batch (page size 1), run per layer. ``backend`` is FlashInfer's: ``"fa2"``,
  ``"fa3"`` (Hopper) or ``"auto"`` (FlashInfer's choice: fa3 on SM90). BF16 or FP8 KV; an FP8 run takes
  ``ckv_scale``/``kpe_scale``. GPU only.
- :class:`ReferenceMLADecode`: the torch reference from ``kvwall.kernels`` (any device).
- :func:`prebuild_flashinfer_mla`: JIT-builds FlashInfer's MLA modules in one parallel ninja run before anything
  is timed.

Both back-ends take ``(q_nope, q_pe, ckv, kpe)`` with the cache views of an SGLang-layout buffer.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from kvwall.kernels.mla_decode.reference import mla_decode_reference
from kvwall.measure.failures import error_text
from kvwall.model.geometry import GLM5, MLAGeometry
from kvwall.model.pool import DecodeBatch

__all__ = [
    "MLADecode",
    "FlashInferMLADecode",
    "ReferenceMLADecode",
    "make_mla_decode",
    "flashinfer_version",
    "prebuild_flashinfer_mla",
    "FLASHINFER_BACKENDS",
]

ATTENTION_BACKENDS = ("auto", "flashinfer", "reference")
#: FlashInfer's MLA back-ends this wrapper drives ("auto": FlashInfer picks, fa3 on SM90).
FLASHINFER_BACKENDS = ("fa2", "fa3", "auto")
WORKSPACE_BYTES = 128 << 20


class MLADecode(Protocol):
    name: str

    def __call__(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor
    ) -> torch.Tensor: ...


def flashinfer_version() -> str | None:
    """The installed FlashInfer's version (None when it is absent or fails to import)."""
    try:
        import flashinfer  # pylint: disable=import-outside-toplevel  # optional: GPU machines only
    except Exception:  # noqa: BLE001 - absent or broken: recorded as such
        return None
    return str(flashinfer.__version__)


class ReferenceMLADecode:
    """Torch reference attention in float32, returned in the query's dtype."""

    name = "torch reference (float32)"

    def __init__(self, geometry: MLAGeometry, batch: DecodeBatch) -> None:
        self.geometry = geometry
        self.batch = batch

    def __call__(self, q_nope, q_pe, ckv, kpe):
        out = mla_decode_reference(
            q_nope, q_pe, ckv, kpe, self.batch.kv_indptr, self.batch.kv_indices, self.geometry.sm_scale
        )
        return out.to(q_nope.dtype)


class FlashInferMLADecode:
    """FlashInfer's paged MLA decode, planned for one page-size-1 batch.

    ``kv_indptr``/``kv_indices``/``kv_lens`` describe the batch (CSR, as SGLang's ``flashinfer_mla`` passes them;
    converted to int32); ``plan()`` runs here, host work timed into :attr:`plan_ms`. Call it (or :meth:`run`) once
    per layer with that layer's cache views ``[slots, 1, kv_lora_rank]`` and ``[slots, 1, qk_rope_head_dim]``."""

    def __init__(
        self,
        heads: int,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_lens: torch.Tensor,
        sm_scale: float,
        *,
        kv_dtype: torch.dtype = torch.bfloat16,
        q_dtype: torch.dtype = torch.bfloat16,
        backend: str = "fa2",
        geometry: MLAGeometry = GLM5,
        workspace_bytes: int = WORKSPACE_BYTES,
    ) -> None:
        device = kv_indices.device
        if device.type != "cuda":
            raise RuntimeError(
                "FlashInfer's MLA kernels need an NVIDIA GPU; the batch is on "
                f"{device}. Use ReferenceMLADecode (or mode='cpu') on this machine."
            )
        if backend not in FLASHINFER_BACKENDS:
            raise ValueError(f"FlashInfer MLA backend {backend!r} is not one of {FLASHINFER_BACKENDS}.")
        import flashinfer  # pylint: disable=import-outside-toplevel  # optional: GPU machines only

        self.flashinfer_version = str(flashinfer.__version__)
        self.kv_dtype = kv_dtype
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
        #: The back-end FlashInfer runs ("auto" resolved).
        self.backend = str(getattr(self.wrapper, "_backend", backend))
        qo_indptr = torch.arange(kv_lens.numel() + 1, dtype=torch.int32, device=device)
        t0 = time.perf_counter()
        self.wrapper.plan(
            qo_indptr,
            kv_indptr.to(torch.int32),
            kv_indices.to(torch.int32),
            kv_lens.to(torch.int32),
            heads,
            geometry.kv_lora_rank,
            geometry.qk_rope_head_dim,
            1,
            False,
            sm_scale,
            q_dtype,
            kv_dtype,
        )
        self.plan_ms = (time.perf_counter() - t0) * 1e3
        kv = "FP8" if kv_dtype == torch.float8_e4m3fn else "BF16"
        self.name = f"FlashInfer {self.flashinfer_version} BatchMLAPagedAttentionWrapper ({self.backend})"
        self.label = f"{self.name}, {kv} KV"

    @classmethod
    def for_batch(cls, geometry: MLAGeometry, batch: DecodeBatch, **kw: Any) -> "FlashInferMLADecode":
        """Planned for a :class:`DecodeBatch` with the geometry's heads per GPU and softmax scale."""
        return cls(
            geometry.heads_per_gpu,
            batch.kv_indptr,
            batch.kv_indices,
            batch.context_lens,
            geometry.sm_scale,
            geometry=geometry,
            **kw,
        )

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        fp8_scales: tuple[float, float] | None = None,
    ) -> torch.Tensor:
        """Attention for the planned batch; ``fp8_scales`` = (ckv_scale, kpe_scale), FP8 KV only (FlashInfer
        rejects scales on a BF16 run)."""
        kw = {} if fp8_scales is None else {"ckv_scale": float(fp8_scales[0]), "kpe_scale": float(fp8_scales[1])}
        return self.wrapper.run(q_nope, q_pe, ckv, kpe, out=out, **kw)

    def __call__(self, q_nope, q_pe, ckv, kpe):
        return self.run(q_nope, q_pe, ckv, kpe)


def make_mla_decode(kind: str, geometry: MLAGeometry, batch: DecodeBatch) -> MLADecode:
    """``kind``: "flashinfer" (fa2, as chapters 1 and 4 record it), "reference", or "auto" (FlashInfer on CUDA,
    the reference elsewhere)."""
    if kind not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {kind!r} is not one of {ATTENTION_BACKENDS}.")
    if kind == "auto":
        kind = "flashinfer" if batch.kv_indices.device.type == "cuda" else "reference"
    if kind == "flashinfer":
        return FlashInferMLADecode.for_batch(geometry, batch)
    return ReferenceMLADecode(geometry, batch)


def prebuild_flashinfer_mla(device: torch.device, geometry: MLAGeometry = GLM5) -> dict[str, Any]:
    """JIT-build FlashInfer's four MLA modules (fa2/fa3 x BF16/FP8 KV, BF16 Q/O, int32 indices) in one ninja run,
    in parallel, before anything is timed; plan() then loads them. A failure here only means plan() builds them
    one at a time (the error is returned)."""
    info: dict[str, Any] = {"flashinfer": flashinfer_version()}
    if device.type != "cuda":
        return {**info, "skipped": "no GPU"}
    t0 = time.perf_counter()
    try:
        # pylint: disable-next=import-outside-toplevel  # optional: GPU machines only
        from flashinfer.jit import gen_batch_mla_module
        from flashinfer.jit.core import build_jit_specs  # pylint: disable=import-outside-toplevel

        bf16 = torch.bfloat16
        specs = [
            gen_batch_mla_module(
                backend, bf16, kv, bf16, torch.int32, geometry.kv_lora_rank, geometry.qk_rope_head_dim, False
            )
            for backend in ("fa2", "fa3")
            for kv in (bf16, torch.float8_e4m3fn)
        ]
        build_jit_specs(specs, verbose=False)
        info["modules"] = len(specs)
    except Exception as exc:  # noqa: BLE001 - plan() builds whatever is missing, one at a time
        info["error"] = error_text(exc)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    return info
