"""The fewest stand-ins for SGLang's own modules that SGLang 0.5.23's ``flashinfer_mla_backend.py`` imports, so the
patched (or unpatched) file can be executed here, where sglang cannot be installed whole.

Why stand-ins: with ``pip install --no-deps sglang==0.5.23`` the real module fails at ``import sglang`` (its
``__init__`` imports ``sglang/srt/utils/common.py``, which needs ``orjson``, then ~25 more PyPI packages); with those
added, ``sglang/srt/configs/nano_nemotron_vl.py`` imports ``sglang/srt/multimodal/internvl_utils.py``, which imports
``torchvision``, whose compiled operators need the torch it was built for (torchvision 0.29 needs torch >= 2.14;
sglang 0.5.23 pins torch 2.14.1; the GPU machine has torch 2.11 and no network). :data:`BLOCKER` says it in one
sentence. The check inside SGLang's real modules (:mod:`.real`, :mod:`.realcheck`) gets past that on the GPU machine
by carrying the wheels the chain needs (torchvision 0.26 is that machine's own).

Each stand-in below carries only what the backend's decode path reads (names from the file's import block); the
functions the decode path never reaches raise, naming themselves, so a patch that starts calling one is noticed.
:func:`stub_modules` builds them; :func:`kvwall.peers.sglang_patch.load_patched_backend` installs them in
``sys.modules`` only while the backend's source executes.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch

__all__ = ["BLOCKER", "ForwardMode", "StubSettings", "stub_modules", "device_torch"]

#: What stops importing the real module (measured with sglang 0.5.23 from PyPI, Python 3.11, torch 2.13.0+cpu).
BLOCKER = (
    "With `pip install --no-deps sglang==0.5.23`, importing sglang.srt.layers.attention.flashinfer_mla_backend stops "
    "at `import orjson` (sglang/srt/utils/common.py:85, reached from sglang/__init__.py); after adding the ~25 "
    "ordinary PyPI packages it asks for next (orjson, pybase64, pillow, starlette, msgspec, aiohttp and its deps, "
    "transformers 5.19.0, tokenizers, sentencepiece, huggingface_hub, httpx2, httpcore2, truststore, safetensors, "
    "regex, compressed-tensors, gguf, loguru, openai, sniffio, partial_json_parser), the one blocker is torchvision: "
    "sglang/srt/configs/nano_nemotron_vl.py:22 imports sglang/srt/multimodal/internvl_utils.py, whose line 5 "
    "imports torchvision, and PyPI's torchvision 0.29.1 (torch >= 2.14, as sglang 0.5.23 pins torch==2.14.1) fails "
    "on torch 2.13 with `RuntimeError: operator torchvision::nms does not exist`; with torchvision replaced by a "
    "stub the module imports on CPU (sgl_kernel is not needed to import it). The `checks` rows execute the backend's "
    "source with stand-ins for its sglang imports, wherever it runs; the `real_*` rows import SGLang's own modules "
    "from the wheel's files where the run carries the packages its import chain needs (the GPU run does)."
)


class ForwardMode:
    """The three questions the backend's decode path asks of SGLang's ``ForwardMode`` (decode only here)."""

    def __init__(self, decode: bool = True) -> None:
        self.decode = decode

    def is_decode_or_idle(self) -> bool:
        return self.decode

    def is_decode(self) -> bool:
        return self.decode

    def is_target_verify(self) -> bool:
        return False

    def is_draft_extend_v2(self) -> bool:
        return False


class _Env:
    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        return self.value


class _AttentionBackend:
    """SGLang's ``AttentionBackend`` base: the decode path uses nothing of it."""

    def __init__(self) -> None:
        pass


class _KVWriteLoc:
    @classmethod
    def for_batch(cls, forward_batch: Any) -> Any:
        return forward_batch.out_cache_loc


@dataclass
class StubSettings:
    """What the stand-ins answer: a plain decode set-up (no DCP, no disaggregation, attention TP 1, not SM100)."""

    flashinfer_available: bool = True
    workspace_bytes: int = 128 << 20
    buffers: dict[str, Any] = field(default_factory=dict)


def _unreached(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name} is a kvwall stand-in: the decode path under test should not call it.")

    return call


def _module(name: str, **names: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(names)
    mod.__path__ = []  # a package, so that submodules import under it
    return mod


def stub_modules(settings: StubSettings) -> dict[str, types.ModuleType]:
    """``{module name: stand-in}`` for every ``sglang`` module the backend file imports, and their parents."""

    def get_buffer(name: str, factory: Callable[[], Any]) -> Any:
        if name not in settings.buffers:
            settings.buffers[name] = factory()
        return settings.buffers[name]

    parallel = SimpleNamespace(attn_tp_size=1, attn_dcp_size=1, dcp_enabled=False)
    leaves = {
        "sglang.srt.runtime_context": dict(
            get_buffer=get_buffer,
            get_parallel=lambda: parallel,
            get_disagg=lambda: SimpleNamespace(disaggregation_mode="null"),
            get_exec=lambda: SimpleNamespace(kernel=SimpleNamespace(flashinfer_mla_disable_ragged=True)),
            get_platform=lambda: SimpleNamespace(is_sm100=False),
            get_schedule=lambda: SimpleNamespace(disable_chunked_prefix_cache=True, page_size=1),
        ),
        "sglang.kernels.ops.attention.utils": dict(assert_buffer_fits=_unreached("assert_buffer_fits")),
        "sglang.srt.environ": dict(
            envs=SimpleNamespace(
                SGLANG_ENABLE_TORCH_COMPILE=_Env(False), SGLANG_FLASHINFER_WORKSPACE_SIZE=_Env(settings.workspace_bytes)
            )
        ),
        "sglang.srt.layers.attention.base_attn_backend": dict(AttentionBackend=_AttentionBackend),
        "sglang.srt.layers.dcp": dict(
            DecodeContextParallelMetadata=object,
            update_local_kv_lens_for_dcp=_unreached("update_local_kv_lens_for_dcp"),
        ),
        "sglang.srt.layers.dcp.planner": dict(plan_dcp_decode_metadata=_unreached("plan_dcp_decode_metadata")),
        "sglang.srt.mem_cache.memory_pool": dict(KVWriteLoc=_KVWriteLoc),
        "sglang.srt.model_executor.forward_batch_info": dict(ForwardBatch=object, ForwardMode=ForwardMode),
        "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph": dict(
            is_in_breakable_cuda_graph=lambda: False
        ),
        "sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph": dict(
            is_in_tc_piecewise_cuda_graph=lambda: False
        ),
        "sglang.srt.speculative.spec_info": dict(
            SpecInput=object, SpecInputType=SimpleNamespace(DFLASH_VERIFY="dflash")
        ),
        "sglang.srt.speculative.spec_utils": dict(
            draft_kv_indices_buffer_width=_unreached("draft_kv_indices_buffer_width"),
            draft_kv_indices_used_len=_unreached("draft_kv_indices_used_len"),
            generate_draft_decode_kv_indices=_unreached("generate_draft_decode_kv_indices"),
        ),
        "sglang.srt.utils": dict(
            get_cuda_graph_max_batch_size=lambda size: size,
            is_flashinfer_available=lambda: settings.flashinfer_available,
            next_power_of_2=lambda n: 1 << (n - 1).bit_length() if n > 0 else 1,
        ),
    }
    mods: dict[str, types.ModuleType] = {}
    for name, names in leaves.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            mods.setdefault(".".join(parts[:i]), _module(".".join(parts[:i])))
        mods[name] = _module(name, **names)
    return mods


def device_torch(device: torch.device) -> types.ModuleType:
    """``torch`` for the backend's globals, with ``device="cuda"`` (hard-coded in a few of its allocations, e.g.
    the decode ``kv_indices``) sent to ``device``; everything else is torch itself. Only used off the GPU."""
    shim = types.ModuleType("torch")

    def moved(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: Any, **kwargs: Any) -> torch.Tensor:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = device
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        return call

    shim.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[attr-defined]
    for name in ("empty", "zeros", "ones", "arange", "full"):
        setattr(shim, name, moved(getattr(torch, name)))
    return shim
