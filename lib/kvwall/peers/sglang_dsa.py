"""What SGLang 0.5.23 does with a DSA model (GLM-5, DeepSeek-V3.2) and an FP8 KV cache, as data with citations.

Every fact names the file inside the 0.5.23 wheel and a regex that must match a line there (:func:`check_citations`
reports the ones that do not). :func:`reproduce_forced_dense` runs SGLang's own memory-pool classes on CPU (Triton
kernels under ``TRITON_INTERPRET=1``) to show what a forced dense backend reads from the DSA pool.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Citation",
    "Fact",
    "DSADefault",
    "FACTS",
    "DSA_DEFAULTS",
    "REJECTED_BACKENDS",
    "ACCEPTED_DENSE_BACKENDS",
    "flashmla_kv_heads",
    "dsa_kv_row_bytes",
    "indexer_row_bytes",
    "check_citations",
    "cite_lines",
    "ForcedDenseResult",
    "reproduce_forced_dense",
]


@dataclass(frozen=True)
class Citation:
    path: str  # inside the wheel
    anchor: str  # a regex that must match one line of that file

    def line(self, root: Path | str) -> int | None:
        """The first line of ``root/path`` the anchor matches (1-based), or None."""
        p = Path(root) / self.path
        if not p.exists():
            return None
        rx = re.compile(self.anchor)
        for i, text in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if rx.search(text):
                return i
        return None


def _c(path: str, literal: str) -> Citation:
    return Citation(path, re.escape(literal))


@dataclass(frozen=True)
class Fact:
    key: str
    value: Any
    cites: tuple[Citation, ...]


@dataclass(frozen=True)
class DSADefault:
    """What ``_dsa_split_backend_resolution`` picks when neither DSA backend flag is given (CUDA, no sinks)."""

    sm: str  # "SM90", "SM100", "SM120"
    kv_cache_dtype: str  # after resolution: "fp8_e4m3" or "bfloat16"
    model: str  # "GLM-5" (GlmMoeDsaForCausalLM) or "DeepSeek-V3.2"
    prefill: str
    decode: str
    pool_row_bytes: int  # per token per layer, from calculate_mla_kv_cache_dim with these backends


A = "sglang/srt/layers/attention/"
OV = "sglang/srt/arg_groups/overrides.py"
MP = "sglang/srt/mem_cache/memory_pool.py"
KC = "sglang/srt/mem_cache/kv_cache_configurator.py"
DSA = A + "dsa_backend.py"
FI = A + "flashinfer_mla_backend.py"
REG = A + "attention_registry.py"

#: Accepted by ``--attention-backend`` in 0.5.23 and asked about here; the full list is in :mod:`.sglang_flags`.
ACCEPTED_DENSE_BACKENDS = ("flashinfer", "flashmla", "triton", "fa3", "trtllm_mla", "dsa", "nsa")
#: Spellings a reader may know that 0.5.23's ``--attention-backend`` rejects (argparse ``invalid choice``).
REJECTED_BACKENDS = ("flashinfer_mla", "cutlass_mla")

_GLM_SM12_FP8 = _c(OV, '        backend = "flashinfer_sparse_mla"')
DSA_DEFAULTS: tuple[DSADefault, ...] = (
    DSADefault("SM90", "fp8_e4m3", "GLM-5 / DeepSeek-V3.2", "flashmla_kv", "flashmla_kv", 656),
    DSADefault("SM90", "bfloat16", "GLM-5 / DeepSeek-V3.2", "flashmla_sparse", "fa3", 576 * 2),
    DSADefault("SM100", "fp8_e4m3", "GLM-5 / DeepSeek-V3.2", "trtllm", "trtllm", 576),
    DSADefault("SM100", "bfloat16", "GLM-5 / DeepSeek-V3.2", "flashmla_sparse", "trtllm", 576 * 2),
    DSADefault("SM120", "fp8_e4m3", "GLM-5", "flashinfer_sparse_mla", "flashinfer_sparse_mla", 656),
    DSADefault("SM120", "fp8_e4m3", "DeepSeek-V3.2", "trtllm", "trtllm", 576),
    DSADefault("SM120", "bfloat16", "GLM-5 / DeepSeek-V3.2", "flashmla_sparse", "trtllm", 576 * 2),
)


def flashmla_kv_heads(num_q_heads: int) -> int:
    """Query heads the ``flashmla_kv`` decode runs for ``num_q_heads`` heads per GPU (the rest are zero padding)."""
    return 64 if num_q_heads <= 64 else 128 if num_q_heads <= 128 else num_q_heads


def dsa_kv_row_bytes(
    kv_lora_rank: int = 512, qk_rope_head_dim: int = 64, *, fp8: bool = True, raw_layout: bool = False
) -> int:
    """Bytes per token per layer of the DSA pool: scaled FP8 rows (e4m3 latent + one float32 scale per 128 values +
    BF16 rope) unless a raw-layout backend (``trtllm``, both ``tilelang``) is chosen; BF16 rows otherwise."""
    if not fp8:
        return 2 * (kv_lora_rank + qk_rope_head_dim)
    if raw_layout:
        return kv_lora_rank + qk_rope_head_dim
    return kv_lora_rank + kv_lora_rank // 128 * 4 + qk_rope_head_dim * 2


def indexer_row_bytes(index_head_dim: int = 128, index_kpool: int = 1) -> int:
    """Bytes per token per layer of the DSA indexer's own key cache (e4m3 key + one float32 scale per 128)."""
    return -(-(index_head_dim + index_head_dim // 128 * 4) // index_kpool)


FACTS: tuple[Fact, ...] = (
    Fact(
        "attention_backend_choices",
        "ATTENTION_BACKEND_CHOICES: triton, torch_native, flex_attention, dsa, nsa, qsa, "
        "dsv4, compressed, fa3, fa4, flashinfer, llada2_cfg_flashinfer, flashmla, trtllm_mla, cutedsl_mla, "
        "tokenspeed_mla, trtllm_mha, hpc_ops, minicpm_flashattn, minicpm_flashinfer, aiter, wave, intel_amx, ascend, "
        "intel_xpu; no flashinfer_mla, no cutlass_mla",
        (
            _c("sglang/srt/arg_groups/choices.py", "ATTENTION_BACKEND_CHOICES = ["),
            _c("sglang/srt/arg_groups/choices.py", '"nsa",  # Deprecated alias for "dsa"'),
            _c("sglang/srt/arg_groups/fields/exec_.py", "choices=ATTENTION_BACKEND_CHOICES,"),
        ),
    ),
    Fact(
        "flashinfer_is_flashinfer_mla_for_mla_models",
        "--attention-backend flashinfer builds FlashInferMLAAttnBackend when the model uses MLA",
        (_c(REG, '@register_attention_backend("flashinfer")'), _c(REG, "return FlashInferMLAAttnBackend(runner)")),
    ),
    Fact(
        "dsa_backend_flags",
        "--dsa-prefill-backend {flashmla_sparse, flashmla_sparse_q8, flashmla_kv, flashmla_auto, "
        "flashinfer_sparse_mla, triton_sparse_mla, fa3, tilelang, triton, aiter, trtllm, intel_xpu}; "
        "--dsa-decode-backend {same without triton_sparse_mla}; no --nsa-* flags",
        (
            _c("sglang/srt/arg_groups/fields/exec_.py", "dsa_prefill_backend: A["),
            _c("sglang/srt/arg_groups/fields/exec_.py", "dsa_decode_backend: A["),
        ),
    ),
    Fact(
        "kv_cache_dtype_choices",
        "auto, fp8_e5m2, fp8_e4m3, mxfp8, bf16, bfloat16, nvfp4, fp4_mx_block16 (no 'fp8')",
        (
            _c("sglang/srt/arg_groups/fields/model.py", "kv_cache_dtype: A["),
            _c("sglang/srt/arg_groups/fields/model.py", '"fp4_mx_block16",'),
        ),
    ),
    Fact(
        "speculative_algorithm",
        "any string at parse time; resolution upper-cases it and accepts DFLASH, UNO, DSPARK, "
        "EAGLE, EAGLE3, FROZEN_KV_MTP, STANDALONE, NGRAM, NONE, or NEXTN (becomes EAGLE); MTP is rejected",
        (
            _c("sglang/srt/arg_groups/fields/spec.py", "speculative_algorithm: A["),
            _c(
                "sglang/srt/speculative/spec_info.py", 'raise ValueError(f"Unknown speculative algorithm name: {name}")'
            ),
            _c("sglang/srt/speculative/spec_registry.py", '_RESERVED_ALIASES = frozenset({"NEXTN"})'),
            _c(
                "sglang/srt/arg_groups/speculative_hook.py",
                'if speculative_algorithm == "NEXTN" or speculative_algorithm == "EAGLE":',
            ),
        ),
    ),
    Fact(
        "dsa_model_detection",
        "architecture in a list (DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM, ...) and config.index_topk set",
        (
            _c("sglang/srt/configs/model_config.py", "def is_deepseek_dsa(config) -> bool:"),
            _c("sglang/srt/configs/model_config.py", '"GlmMoeDsaForCausalLM",'),
            _c("sglang/srt/configs/model_config.py", 'and _hf_attr(config, "index_topk") is not None'),
        ),
    ),
    Fact(
        "dsa_backend_only_when_unforced",
        "attention_backend = 'dsa' only when --attention-backend, "
        "--prefill-attention-backend and --decode-attention-backend are all unset",
        (
            _c("sglang/srt/arg_groups/model_overrides/deepseek_v2.py", "if is_attention_backend_not_set(cfg):"),
            _c("sglang/srt/arg_groups/model_overrides/deepseek_v2.py", 'overrides["attention_backend"] = "dsa"'),
            _c("sglang/srt/arg_groups/model_override_base.py", "def is_attention_backend_not_set(cfg: Any):"),
        ),
    ),
    Fact(
        "dsa_page_size",
        "page size 64 x index_kpool for DSA on CUDA; the DSA pool asserts 64-token physical pages; "
        "flashmla_kv asserts page size 64",
        (
            _c("sglang/srt/arg_groups/model_overrides/deepseek_v2.py", "page_size = 64 * index_kpool"),
            _c(MP, "assert physical_page_size == 64, ("),
            _c(DSA, 'assert self.physical_page_size == 64, "only page size 64 is supported"'),
        ),
    ),
    Fact(
        "unset_kv_dtype",
        "auto -> fp8_e4m3 on SM>=10 (no attention sinks), else bfloat16: on SM90 FP8 must be asked "
        "for; a DSA model takes only bfloat16 or fp8_e4m3",
        (
            _c(OV, '"fp8_e4m3" if major >= 10 and not has_attention_sinks else "bfloat16"'),
            _c(OV, '], "DeepSeek DSA only supports bf16/bfloat16 or fp8_e4m3 kv_cache_dtype"'),
        ),
    ),
    Fact(
        "dsa_split_defaults",
        [asdict(d) for d in DSA_DEFAULTS],
        (
            _c(OV, "def _dsa_split_backend_resolution(view: Any) -> dict:"),
            _c(OV, 'model_arch == "GlmMoeDsaForCausalLM"'),
            _GLM_SM12_FP8,
            _c(OV, 'default = "trtllm" if major >= 10 else "flashmla_kv"'),
            _c(OV, 'declared["dsa_prefill_backend"] = "flashmla_sparse"'),
            _c(OV, 'declared["dsa_decode_backend"] = "trtllm" if major >= 10 else "fa3"'),
        ),
    ),
    Fact(
        "dsa_resolution_ignores_forced_backend",
        "the DSA kv-dtype default and split-backend resolution run for every "
        "DSA model on CUDA, whatever --attention-backend says (so a forced dense backend still gets "
        "dsa_decode_backend=flashmla_kv on SM90 FP8, which sets the pool layout)",
        (
            _c(
                "sglang/srt/arg_groups/model_hook.py", "run_post_process_pass(server_args, _dsa_kv_cache_dtype_default)"
            ),
            _c(
                "sglang/srt/arg_groups/model_hook.py",
                "run_post_process_pass(server_args, _dsa_split_backend_resolution)",
            ),
        ),
    ),
    Fact(
        "flashmla_kv_head_padding",
        "num_q_heads = num_attention_heads // attn_tp_size, padded with zero heads to 64 "
        "(<=64) or 128 (<=128): GLM-5's 64 heads at TP4 -> 16 per GPU -> 64",
        (
            _c(DSA, "model_runner.model_config.num_attention_heads // get_parallel().attn_tp_size"),
            _c(DSA, "self.flashmla_kv_num_q_heads = 64"),
            _c(DSA, "self.flashmla_kv_num_q_heads = 128"),
            _c(DSA, "target_q_heads = self.flashmla_kv_num_q_heads"),
            _c(DSA, "# Pad q heads to match FlashMLA decode supported head-count variants."),
        ),
    ),
    Fact(
        "dsa_pool_class",
        "DSATokenToKVPool (subclass of MLATokenToKVPool) for every MLA DSA model, whatever the attention backend",
        (
            _c(MP, "class DSATokenToKVPool(MLATokenToKVPool):"),
            _c(KC, "elif self.use_mla_backend and is_dsa_model and not self.mambaish_config:"),
            _c(KC, "token_to_kv_pool = self._build_dsa_kv_pool("),
        ),
    ),
    Fact(
        "dsa_fp8_row",
        f"{dsa_kv_row_bytes()} bytes = 512 e4m3 + 4 float32 scales (one per 128) + 64 bf16 rope; "
        f"raw {dsa_kv_row_bytes(raw_layout=True)} bytes when trtllm is the DSA prefill or decode backend (or both "
        "are tilelang)",
        (
            _c(KC, "def calculate_mla_kv_cache_dim("),
            _c(KC, "if uses_trtllm_kv_layout:"),
            _c(KC, "+ kv_lora_rank // quant_block_size * 4"),
            _c(KC, "+ qk_rope_head_dim * rope_storage_dtype.itemsize"),
            _c(MP, "quant_block_size = 128"),
            _c(MP, "rope_storage_dtype = torch.bfloat16  # rope is always stored in bf16"),
            _c(MP, "and override_kv_cache_dim is not None"),
        ),
    ),
    Fact(
        "indexer_row",
        f"{indexer_row_bytes()} bytes per token per layer (128 e4m3 + one float32 scale), uint8, "
        "page_size // index_kpool rows per page",
        (
            _c(
                "sglang/srt/mem_cache/index_key_cache.py",
                "* (pool.index_head_dim + pool.index_head_dim // pool.quant_block_size * 4),",
            ),
            _c(MP, "assert index_head_dim == 128"),
            _c(MP, "index_k_with_scale_buffer_dtype = torch.uint8"),
        ),
    ),
    Fact(
        "forced_dense_allowed",
        "no guard: the flashinfer/flashmla/triton/fa3 creators never look at DSA (fa3 asserts SM90 for MLA models)",
        (
            _c(REG, "def create_flashinfer_backend(runner):"),
            _c(REG, "def create_flashmla_backend(runner):"),
            _c(REG, "def create_triton_backend(runner):"),
            _c(REG, "assert (major == 8 and not runner.use_mla_backend) or major == 9, ("),
        ),
    ),
    Fact(
        "indexer_skipped_on_dense",
        "the indexer asks the backend for indexer metadata; every non-DSA backend "
        "returns None, so the indexer returns None and attention runs over every token",
        (
            _c(
                "sglang/srt/layers/attention/dsa/dsa_indexer.py",
                "metadata = get_attn_backend().get_indexer_metadata(layer_id, forward_batch)",
            ),
            _c(A + "base_attn_backend.py", '"""Get the indexer metadata. None means don\'t support indexer."""'),
        ),
    ),
    Fact(
        "absorbed_backends_write_mla",
        "flashinfer and fa3 (absorbed MLA) write K through set_mla_kv_buffer, which on "
        "the DSA FP8 pool quantizes to the scaled 656-byte row",
        (
            _c("sglang/srt/models/deepseek_common/utils.py", "FORWARD_ABSORB_CORE_ATTENTION_BACKENDS = ["),
            _c(FI, "self.token_to_kv_pool.set_mla_kv_buffer("),
            _c(MP, "elif self.dsa_kv_cache_store_fp8:"),
            _c(MP, "cache_k_nope_fp8, cache_k_rope_fp8 = quantize_k_cache_separate("),
        ),
    ),
    Fact(
        "key_buffer_on_dsa_pool",
        "get_key_buffer returns the uint8 store viewed as float8_e4m3fn: [tokens+page, 1, 656]",
        (
            _c(MP, "return self.kv_buffer[layer_id - self.start_layer].view(self.dtype)"),
            _c(MP, "self.store_dtype = torch.uint8"),
        ),
    ),
    Fact(
        "flashinfer_dense_read",
        "forward_decode casts that whole buffer to the query dtype and hands FlashInfer "
        "columns [:512] as the latent and [512:] (144 columns: 16 scale bytes + 128 rope bytes, each decoded as e4m3) "
        "as the rope cache, planned with head_dim_kpe = 64",
        (
            _c(FI, "k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)"),
            _c(FI, "k_buffer[:, :, : layer.v_head_dim],"),
            _c(FI, "k_buffer[:, :, layer.v_head_dim :],"),
        ),
    ),
    Fact(
        "fa3_dense_read",
        "fa3's absorbed MLA reads the same way: .to(q.dtype), [:512] and [512:]",
        (
            _c(
                A + "flashattention_backend.py",
                "kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)",
            ),
            _c(A + "flashattention_backend.py", "k_rope = kv_cache[:, :, layer.v_head_dim :]"),
        ),
    ),
    Fact(
        "flashmla_triton_write_raises",
        "flashmla and triton are not absorbed backends: the model concatenates K and "
        "they call set_kv_buffer, which asserts the pool is not the DSA FP8 layout (AssertionError)",
        (
            _c(
                "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mla.py",
                "k = torch.cat([k_nope, k_pe], dim=-1)",
            ),
            _c(A + "flashmla_backend.py", "self.token_to_kv_pool.set_kv_buffer("),
            _c(MP, "assert not self.dsa_kv_cache_store_fp8"),
        ),
    ),
    Fact(
        "dense_prefill_is_dsa_aware",
        "the MHA prefill path dequantizes the DSA FP8 rows itself (only decode through "
        "the dense backend misreads them)",
        (
            _c(
                "sglang/srt/models/deepseek_common/attention_forward_methods/forward_mha.py",
                "kv_a, k_pe = self._get_mla_kv_buffer_from_fp8_for_dsa(forward_batch)",
            ),
        ),
    ),
)


def check_citations(root: Path | str) -> list[str]:
    """Every citation of :data:`FACTS` whose anchor matches no line of its file under ``root``:
    ``fact: path: anchor``."""
    out = []
    for fact in FACTS:
        for c in fact.cites:
            if c.line(root) is None:
                out.append(f"{fact.key}: {c.path}: no line matches {c.anchor!r}")
    return out


def cite_lines(root: Path | str) -> dict[str, list[str]]:
    """``{fact key: ["path:line", ...]}`` for every citation (``path:?`` where it matches nothing)."""
    return {f.key: [f"{c.path}:{c.line(root) or '?'}" for c in f.cites] for f in FACTS}


@dataclass(frozen=True)
class ForcedDenseResult:
    """SGLang 0.5.23's own pools on CPU: the same K written through each pool's ``set_mla_kv_buffer``, then read the
    way ``flashinfer_mla_backend.forward_decode`` reads (``get_key_buffer(...).to(bf16)``, columns ``[:512]`` and the
    first 64 of ``[512:]``). Errors are relative Frobenius norms against the K that was written."""

    torch_version: str
    tokens: int
    heads: int
    dsa_pool_class: str
    dsa_row_bytes: int  # kv_cache_dim SGLang's calculate_mla_kv_cache_dim gives (dsa_decode_backend=flashmla_kv)
    dsa_row_bytes_trtllm: int  # the same with dsa_decode_backend=trtllm
    key_buffer_dtype: str
    key_buffer_last_dim: int
    dense_latent_rel_err: float  # columns [:512] as read, vs the true latent
    dense_rope_nan_tokens: float  # share of tokens whose 64 read rope values hold a NaN (bytes 0x7F/0xFF as e4m3)
    dense_rope_rel_err_finite: float  # over the finite read rope values
    dense_output_rel_err: float  # MLA decode output from what the dense path reads (NaN when any score is NaN)
    dense_output_rel_err_nan_zeroed: float  # the same with NaN read values set to 0
    dsa_dequant_rel_err: float  # the DSA rows decoded the DSA way (scales applied, BF16 rope): the pool is right
    mla_pool_row_bytes: int  # control: plain MLATokenToKVPool, FP8
    mla_pool_rel_err: float
    mla_pool_output_rel_err: float
    set_kv_buffer_error: str  # what the flashmla/triton write path hits on the DSA pool
    sglang_files_checked: int  # SGLang files loaded and matched against the wheel's RECORD
    standins: dict[str, str]


def reproduce_forced_dense(
    tokens: int = 64, heads: int = 16, seed: int = 0, source: Path | str | None = None, timeout_s: int = 600
) -> ForcedDenseResult:
    """Run :func:`_forced_dense_child` in a fresh interpreter (SGLang's modules and the stand-ins for packages this
    machine lacks stay out of the caller's process). ``source`` defaults to :func:`.sglang_source.sglang_source`;
    the import needs :func:`.sglang_source.sglang_import_deps` too."""
    from kvwall.peers.sglang_source import sglang_import_deps, sglang_source  # pylint: disable=import-outside-toplevel

    root = Path(source) if source is not None else sglang_source()
    deps = sglang_import_deps()
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        KVWALL_SGLANG_ROOT=str(root),
        KVWALL_SGLANG_DEPS=str(deps),
        KVWALL_FORCED_DENSE=json.dumps({"tokens": tokens, "heads": heads, "seed": seed}),
    )
    p = subprocess.run(
        [sys.executable, "-c", "from kvwall.peers.sglang_dsa import _forced_dense_child as f; f()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
    if p.returncode or line is None:
        raise RuntimeError(
            f"the forced-dense reproduction failed (exit {p.returncode}): {(p.stdout + p.stderr).strip()[-2000:]}"
        )
    return ForcedDenseResult(**json.loads(line))


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def _mla_decode(q_nope, q_pe, ckv, kpe, scale: float):
    """Reference MLA decode for one request: q [heads, 512|64], cache [tokens, 512|64] -> [heads, 512] (fp32)."""
    import torch  # pylint: disable=import-outside-toplevel

    s = (q_nope @ ckv.T + q_pe @ kpe.T) * scale
    return torch.softmax(s, dim=-1) @ ckv


def _forced_dense_child() -> None:  # pragma: no cover - runs in the subprocess reproduce_forced_dense starts
    import warnings  # pylint: disable=import-outside-toplevel
    from types import SimpleNamespace  # pylint: disable=import-outside-toplevel

    warnings.simplefilter("ignore")
    root, deps = os.environ["KVWALL_SGLANG_ROOT"], os.environ["KVWALL_SGLANG_DEPS"]
    args = json.loads(os.environ["KVWALL_FORCED_DENSE"])
    sys.path.append(deps)
    import torch  # pylint: disable=import-outside-toplevel

    from kvwall.peers.sglang_patch.real import import_sglang  # pylint: disable=import-outside-toplevel

    sa = {
        "attention_backend": "flashinfer",
        "kv_cache_dtype": "fp8_e4m3",
        "dsa_decode_backend": "flashmla_kv",
        "dsa_prefill_backend": "flashmla_kv",
        "page_size": 64,
    }
    imp = import_sglang(root, server_args=sa)
    mods = imp["modules"]
    mp, rc, sargs = mods["memory_pool"], mods["runtime_context"], mods["server_args"]
    import importlib  # pylint: disable=import-outside-toplevel

    kcc = importlib.import_module("sglang.srt.mem_cache.kv_cache_configurator")
    glm5 = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["GlmMoeDsaForCausalLM"], index_topk=2048),
        kv_lora_rank=512,
        qk_rope_head_dim=64,
    )
    fp8 = torch.float8_e4m3fn
    dim = kcc.calculate_mla_kv_cache_dim(model_config=glm5, kv_cache_dtype=fp8)
    rc.reset_context()
    rc.publish(
        sargs.ServerArgs(model_path="dummy", **dict(sa, dsa_decode_backend="trtllm", dsa_prefill_backend="trtllm")),
        role="test",
        ranks=rc.SpawnRanks(world_rank=0),
    )
    dim_trtllm = kcc.calculate_mla_kv_cache_dim(model_config=glm5, kv_cache_dtype=fp8)
    rc.reset_context()
    rc.publish(sargs.ServerArgs(model_path="dummy", **sa), role="test", ranks=rc.SpawnRanks(world_rank=0))

    n, h = int(args["tokens"]), int(args["heads"])
    gen = torch.Generator().manual_seed(int(args["seed"]))
    common = dict(
        size=max(128, n),
        page_size=64,
        kv_lora_rank=512,
        dtype=fp8,
        qk_rope_head_dim=64,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    dsa = mp.DSATokenToKVPool(index_head_dim=128, kv_cache_dim=dim, **common)
    mla = mp.MLATokenToKVPool(**common)
    k_nope = torch.randn(n, 1, 512, generator=gen).to(torch.bfloat16)
    k_rope = torch.randn(n, 1, 64, generator=gen).to(torch.bfloat16)
    q_nope = torch.randn(h, 512, generator=gen)
    q_pe = torch.randn(h, 64, generator=gen)
    loc = torch.arange(64, 64 + n)
    layer = SimpleNamespace(layer_id=0)
    dsa.set_mla_kv_buffer(layer, loc, k_nope, k_rope)
    mla.set_mla_kv_buffer(layer, loc, k_nope, k_rope)
    scale = (128 + 64) ** -0.5
    true_nope, true_rope = k_nope[:, 0].float(), k_rope[:, 0].float()
    ref = _mla_decode(q_nope, q_pe, true_nope, true_rope, scale)

    kb = dsa.get_key_buffer(0)
    rows = kb.to(torch.bfloat16)[loc][:, 0].float()  # what forward_decode's .to(q.dtype) yields for these tokens
    ckv, kpe = rows[:, :512], rows[:, 512:][:, :64]
    finite = torch.isfinite(kpe)
    out = _mla_decode(q_nope, q_pe, ckv, kpe, scale)
    out0 = _mla_decode(q_nope, q_pe, torch.nan_to_num(ckv, nan=0.0), torch.nan_to_num(kpe, nan=0.0), scale)
    raw = dsa.kv_buffer[0][loc][:, 0]  # uint8 rows as stored
    deq_nope = (
        raw[:, :512].view(fp8).float().view(n, 4, 128) * raw[:, 512:528].contiguous().view(torch.float32).view(n, 4, 1)
    ).view(n, 512)
    deq_rope = raw[:, 528:656].contiguous().view(torch.bfloat16).float()
    mrows = mla.get_key_buffer(0).to(torch.bfloat16)[loc][:, 0].float()
    try:
        dsa.set_kv_buffer(layer, loc, torch.cat([k_nope, k_rope], -1), k_nope)
        err = "no error"
    except AssertionError as e:  # the flashmla / triton write path
        err = f"AssertionError at memory_pool.py: {e!r}"
    result = ForcedDenseResult(
        torch_version=torch.__version__,
        tokens=n,
        heads=h,
        dsa_pool_class=type(dsa).__name__,
        dsa_row_bytes=dim,
        dsa_row_bytes_trtllm=dim_trtllm,
        key_buffer_dtype=str(kb.dtype),
        key_buffer_last_dim=int(kb.shape[-1]),
        dense_latent_rel_err=_rel(ckv, true_nope),
        dense_rope_nan_tokens=float((~finite).any(dim=1).float().mean()),
        dense_rope_rel_err_finite=_rel(kpe[finite], true_rope[finite]),
        dense_output_rel_err=_rel(out, ref),
        dense_output_rel_err_nan_zeroed=_rel(out0, ref),
        dsa_dequant_rel_err=_rel(torch.cat([deq_nope, deq_rope], 1), torch.cat([true_nope, true_rope], 1)),
        mla_pool_row_bytes=int(mla.kv_buffer[0].shape[-1] * mla.kv_buffer[0].element_size()),
        mla_pool_rel_err=_rel(mrows, torch.cat([true_nope, true_rope], 1)),
        mla_pool_output_rel_err=_rel(_mla_decode(q_nope, q_pe, mrows[:, :512], mrows[:, 512:], scale), ref),
        set_kv_buffer_error=err,
        sglang_files_checked=int(imp["files_checked_against_record"]),
        standins=dict(imp["finder"].standins),
    )
    if imp["files_mismatched"]:
        raise RuntimeError(f"SGLang files differ from the wheel's RECORD: {imp['files_mismatched'][:5]}")
    print(json.dumps(asdict(result)))
