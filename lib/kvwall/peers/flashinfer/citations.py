"""The lines of a FlashInfer release's own source that decide each MLA door, found and quoted.

:data:`CHECKS` names, for each path, the lines that decide it (a Python ``raise``, a
``static_assert``, a C++ ``FLASHINFER_CHECK``, a dtype dispatch, a kernel dispatch table), each by
a pattern inside an anchor (the function it is in), so the line numbers are the release's own;
:func:`cite` resolves one to ``file:line`` with the text, in whatever release is asked for
(:func:`kvwall.peers.flashinfer.releases.release_root`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from kvwall.peers.flashinfer.releases import release_root

__all__ = ["CheckSpec", "Citation", "CHECKS", "cite", "cite_all"]


@dataclass(frozen=True)
class CheckSpec:
    """A line of a release's source that decides something about a path.

    ``file``: relative to the folder that holds the ``flashinfer`` package (``flashinfer/mla/_core.py``,
    ``flashinfer/data/include/...``). ``anchor``: a regex for a line above it (the function it is
    in); ``pattern``: a regex the cited line itself must match. ``families``: the matrix cells it
    speaks for."""

    door: str
    claim: str
    file: str
    anchor: str
    pattern: str
    families: tuple[str, ...]
    decisive: bool = False  # refuses on ``families`` at a point a replay cannot reach (C++, after the Python checks)


@dataclass(frozen=True)
class Citation:
    """A :class:`CheckSpec` resolved in one release: the line, its text and a few lines around it."""

    door: str
    claim: str
    release: str
    file: str
    line: int
    text: str  # the cited line, stripped
    excerpt: tuple[tuple[int, str], ...]  # a few lines around it
    families: tuple[str, ...]
    pattern: str
    decisive: bool = False

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def render(self) -> str:
        """The excerpt with line numbers, the cited line marked ``>``."""
        w = len(str(self.excerpt[-1][0]))
        return "\n".join(f"{'>' if n == self.line else ' '} {n:>{w}} | {t}" for n, t in self.excerpt)


_CORE = "flashinfer/mla/_core.py"
_ALL = ("SM90", "SM100", "SM120")

#: The checks that decide the matrix, in the order the chapter shows them.
CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec(
        "fa2",
        "FP8 KV only with the fa2/fa3 backends",
        _CORE,
        r"def plan\(",
        r"if self\._backend not in \(\"fa2\", \"fa3\"\)",
        _ALL,
    ),
    CheckSpec("fa2", "FP8 KV only on an SM90 device", _CORE, r"def plan\(", r"if major != 9:", ("SM100", "SM120")),
    CheckSpec(
        "fa2", "FP8 KV only with a bf16 query", _CORE, r"def plan\(", r"if q_data_type != torch\.bfloat16:", _ALL
    ),
    CheckSpec(
        "fa2",
        "FP8 KV only for ckv 512 / kpe 0 or 64",
        _CORE,
        r"def plan\(",
        r"if head_dim_ckv != 512 or head_dim_kpe not in",
        _ALL,
    ),
    CheckSpec("fa3", "FP8 KV only on an SM90 device", _CORE, r"def plan\(", r"if major != 9:", ("SM100", "SM120")),
    CheckSpec(
        "cutlass",
        "plan() refuses FP8 KV for anything but fa2/fa3",
        _CORE,
        r"def plan\(",
        r"FP8 kv_data_type for MLA is only supported with the fa2 or fa3",
        _ALL,
    ),
    CheckSpec(
        "cutlass",
        "the kernel is built only for SM10x/SM11x",
        "flashinfer/jit/mla.py",
        r"def gen_mla_module\(",
        r"supported_major_versions=\[10, 11\]",
        ("SM90", "SM120"),
    ),
    CheckSpec("cutlass", "exactly 128 query heads", _CORE, r"def _check_cutlass_shape\(", r"if H != 128:", _ALL),
    CheckSpec(
        "cutlass",
        "query/KV element type dispatched over FP16/BF16 only (FP8 is an output type)",
        "flashinfer/data/csrc/cutlass_mla.cu",
        r"auto in_dtype = q_nope_pe\.dtype\(\);",
        r"DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16\(in_dtype",
        _ALL,
    ),
    CheckSpec(
        "trtllm-gen",
        "backend 'auto' sends anything but SM10x to XQA",
        _CORE,
        r"def trtllm_batch_decode_with_kv_cache_mla\(",
        r"elif cc\[0\] != 10:",
        ("SM90", "SM120"),
    ),
    CheckSpec(
        "trtllm-gen",
        "page size 32 or 64 only",
        _CORE,
        r"def trtllm_batch_decode_with_kv_cache_mla\(",
        r"elif block_size != 32 and block_size != 64:",
        _ALL,
    ),
    CheckSpec(
        "trtllm-gen",
        "no head counts between 64 and 128",
        _CORE,
        r"def trtllm_batch_decode_with_kv_cache_mla\(",
        r"if 64 < num_heads_q < 128:",
        _ALL,
    ),
    CheckSpec(
        "trtllm-gen",
        "the runner accepts SM100 / SM103 / SM107 only",
        "flashinfer/data/include/flashinfer/trtllm/fmha/fmhaRunner.cuh",
        r"TllmGenFmhaRunner\(",
        r"FLASHINFER_CHECK\(mSM == kSM_100",
        ("SM90", "SM120"),
        decisive=True,
    ),
    CheckSpec(
        "trtllm-gen",
        "bf16 query with an e4m3 KV cache is a decode mode the launcher knows",
        "flashinfer/data/csrc/trtllm_fmha_kernel_launcher.cu",
        r"bf16q_fp8kv_transform_mode",
        r"kv_data_type == Data_type::DATA_TYPE_E4M3",
        ("SM100",),
    ),
    CheckSpec(
        "xqa",
        "SM12x only",
        "flashinfer/mla/_core.py",
        r"def xqa_batch_decode_with_kv_cache_mla\(",
        r"if not is_sm12x_supported\(query\.device\):",
        ("SM90", "SM100"),
    ),
    CheckSpec(
        "xqa",
        "FP8 KV only with an FP8 query",
        "flashinfer/mla/_core.py",
        r"def xqa_batch_decode_with_kv_cache_mla\(",
        r"fp8_ok = \(",
        _ALL,
    ),
    CheckSpec(
        "xqa", "exactly 128 query heads", "flashinfer/xqa.py", r"def xqa_mla\(", r"if head_group_ratio != 128:", _ALL
    ),
    CheckSpec(
        "xqa",
        "the kernel generator asserts 128 heads",
        "flashinfer/jit/xqa.py",
        r"def gen_xqa_module_mla\(",
        r"assert head_group_ratio == 128",
        _ALL,
    ),
    CheckSpec(
        "xqa",
        "page size 16, 32, 64 or 128",
        "flashinfer/jit/xqa.py",
        r"def gen_xqa_module_mla\(",
        r"if page_size not in \[16, 32, 64, 128\]:",
        _ALL,
    ),
    CheckSpec(
        "sm120-sparse",
        "SM12x only",
        _CORE,
        r"def _trtllm_batch_decode_sparse_mla_sm120\(",
        r"if not is_sm12x_supported\(query\.device\):",
        ("SM90", "SM100"),
    ),
    CheckSpec(
        "sm120-sparse",
        "needs sparse_mla_top_k > 0 (DSA)",
        _CORE,
        r"def _trtllm_batch_decode_sparse_mla_v32_sm120\(",
        r"if sparse_mla_top_k <= 0:",
        _ALL,
    ),
    CheckSpec(
        "sm120-sparse",
        "packed uint8 cache, 656 bytes per token",
        _CORE,
        r"def _check_sm120_sparse_v32_kv_cache\(",
        r"if kv_cache\.size\(-1\) != 656:",
        _ALL,
    ),
    CheckSpec(
        "sm120-sparse",
        "kv_lora_rank 512 / rope 64 (GLM-5's shape)",
        _CORE,
        r"def _trtllm_batch_decode_sparse_mla_v32_sm120\(",
        r"if kv_lora_rank != 512 or qk_rope_head_dim != 64",
        _ALL,
    ),
    CheckSpec(
        "sm120-sparse",
        "decode kernels instantiated for 16 and 64 heads at top-k 2048",
        "flashinfer/mla/_sparse_mla_sm120.py",
        r"_DECODE_DSV3_2_DISPATCH = frozenset",
        r"\(16, 2048\),",
        ("SM120",),
    ),
    CheckSpec(
        "sm120-sparse",
        "decode page size 64",
        "flashinfer/mla/_sparse_mla_sm120.py",
        r"_DECODE_DSV3_2_DISPATCH = frozenset",
        r"_DECODE_DSV3_2_PAGE_BLOCK_SIZE = 64",
        ("SM120",),
    ),
    CheckSpec(
        "sm120-sparse",
        "GLM's arbitrary fp32 KV scales select the GLM model type",
        "flashinfer/mla/_sparse_mla_sm120.py",
        r"def _resolve_model_type\(",
        r"return _MODEL_TYPE_GLM_NSA",
        ("SM120",),
    ),
)


def cite(spec: CheckSpec, release: str | None = None, context: int = 3) -> Citation:
    """Resolve ``spec`` in ``release``: the first line matching ``pattern`` at or after the first line
    matching ``anchor``. Raises ``LookupError`` naming the file when the release has no such line."""
    version, root = release_root(release)
    path = root / spec.file
    if not path.is_file():
        raise LookupError(f"FlashInfer {version} has no {spec.file} (looked in {root}).")
    lines = path.read_text(errors="replace").splitlines()
    anchor = next((i for i, t in enumerate(lines) if re.search(spec.anchor, t)), None)
    if anchor is None:
        raise LookupError(f"FlashInfer {version}: no line matching {spec.anchor!r} in {spec.file}.")
    hit = next((i for i in range(anchor, len(lines)) if re.search(spec.pattern, lines[i])), None)
    if hit is None:
        raise LookupError(
            f"FlashInfer {version}: no line matching {spec.pattern!r} after {spec.anchor!r} in {spec.file}."
        )
    lo, hi = max(0, hit - context), min(len(lines), hit + context + 1)
    return Citation(
        spec.door,
        spec.claim,
        version,
        spec.file,
        hit + 1,
        lines[hit].strip(),
        tuple((n + 1, lines[n]) for n in range(lo, hi)),
        spec.families,
        spec.pattern,
        spec.decisive,
    )


def cite_all(release: str | None = None) -> list[dict[str, Any]]:
    """Every :data:`CHECKS` entry resolved in ``release``; a check the release lacks becomes a row
    with ``line: None`` and the reason (so a newer release that dropped a check is visible)."""
    out = []
    for spec in CHECKS:
        try:
            c = cite(spec, release)
            out.append(
                {
                    **asdict(c),
                    "excerpt": [list(x) for x in c.excerpt],
                    "families": list(c.families),
                    "where": c.where,
                    "rendered": c.render(),
                }
            )
        except LookupError as exc:
            out.append(
                {
                    "door": spec.door,
                    "claim": spec.claim,
                    "release": release_root(release)[0],
                    "file": spec.file,
                    "line": None,
                    "text": "",
                    "excerpt": [],
                    "families": list(spec.families),
                    "pattern": spec.pattern,
                    "decisive": spec.decisive,
                    "where": "",
                    "rendered": "",
                    "missing": str(exc),
                }
            )
    return out
