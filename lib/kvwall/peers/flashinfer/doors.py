"""FlashInfer's MLA decode paths with a native FP8 KV cache, and what each one demands.

Chapter 3 asks which of FlashInfer's MLA decode paths could read GLM-5's FP8 KV cache without the
whole-pool cast, on which GPU family. The answer must come from the library itself, never from
memory, so this module has three tools:

* :data:`CHECKS` names, for each path, the lines of the release's own source that decide it (a
  Python ``raise``, a ``static_assert``, a C++ ``FLASHINFER_CHECK``, a dtype dispatch, a kernel
  dispatch table), found by a pattern inside an anchor; :func:`cite` resolves them to
  ``file:line`` with the text, in whatever release is asked for.
* :func:`call_door` calls a path the way a serving stack would (GLM-5's 576-wide latent, bf16
  query, FP8 cache), on any device.
* :func:`replay` calls it on the CPU *as if* on another GPU family: the release's capability query
  answers SM90, SM100 or SM120, and the JIT module generators are replaced by stubs that stop the
  call at the moment the library asks for a kernel. Everything between (every Python check the
  release runs) is the release's own code. Replays run in a fresh subprocess with the release first
  on ``sys.path`` (:func:`replay_cases`), so any installed release can be asked.

The torch reference for checking outputs is :func:`kvwall.kernels.mla_decode_reference`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

__all__ = [
    "FAMILIES", "DOORS", "Door", "CheckSpec", "Citation", "CHECKS", "DoorCase", "KernelReached",
    "release_root", "cite", "cite_all", "make_inputs", "call_door", "replay", "replay_cases",
    "glm5_cases", "STATUSES", "door_matrix", "outcome_of",
]

#: GPU families of the matrix: name -> (compute capability, example GPUs).
FAMILIES: dict[str, tuple[tuple[int, int], str]] = {
    "SM90": ((9, 0), "H100 / H200"),
    "SM100": ((10, 0), "B200 / GB200"),
    "SM120": ((12, 0), "RTX PRO 6000 Blackwell / RTX 50xx"),
}
#: What a cell of the matrix can say.
STATUSES = ("runs", "accepted", "refused")


@dataclass(frozen=True)
class Door:
    key: str
    label: str
    api: str  # the public call
    page_sizes: tuple[int, ...]  # SGLang's page size 1, and the size the path itself requires
    note: str = ""


DOORS: tuple[Door, ...] = (
    Door("fa2", "fa2 (BatchMLAPagedAttentionWrapper)", "BatchMLAPagedAttentionWrapper(backend='fa2').plan/run",
         (1,), "what SGLang's flashinfer_mla backend calls"),
    Door("fa3", "fa3 (BatchMLAPagedAttentionWrapper)", "BatchMLAPagedAttentionWrapper(backend='fa3').plan/run", (1,)),
    Door("cutlass", "cutlass MLA", "BatchMLAPagedAttentionWrapper(backend='cutlass').run(kv_len=, page_table=)",
         (1, 128), "SGLang's cutlass_mla backend uses 128-token pages"),
    Door("trtllm-gen", "trtllm-gen MLA", "trtllm_batch_decode_with_kv_cache_mla(backend='trtllm-gen')", (1, 64),
         "SGLang's trtllm_mla backend uses 32- or 64-token pages"),
    Door("xqa", "XQA MLA", "xqa_batch_decode_with_kv_cache_mla", (1, 64)),
    Door("sm120-sparse", "SM120 sparse MLA (DSA, top-k 2048)",
         "trtllm_batch_decode_with_kv_cache_mla(backend='sparse', sparse_mla_top_k=2048)", (1, 64),
         "DeepSeek-sparse-attention decode: a packed 656-byte FP8 cache and the indexer's top-k slots"),
)
_DOOR = {d.key: d for d in DOORS}


# ------------------------------------------------------------------------------------------------
# Citations
# ------------------------------------------------------------------------------------------------


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
        w = len(str(self.excerpt[-1][0]))
        return "\n".join(f"{'>' if n == self.line else ' '} {n:>{w}} | {t}" for n, t in self.excerpt)


_CORE = "flashinfer/mla/_core.py"
_ALL = ("SM90", "SM100", "SM120")

#: The checks that decide the matrix, in the order the chapter shows them.
CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec("fa2", "FP8 KV only with the fa2/fa3 backends", _CORE, r"def plan\(", r"if self\._backend not in \(\"fa2\", \"fa3\"\)", _ALL),
    CheckSpec("fa2", "FP8 KV only on an SM90 device", _CORE, r"def plan\(", r"if major != 9:", ("SM100", "SM120")),
    CheckSpec("fa2", "FP8 KV only with a bf16 query", _CORE, r"def plan\(", r"if q_data_type != torch\.bfloat16:", _ALL),
    CheckSpec("fa2", "FP8 KV only for ckv 512 / kpe 0 or 64", _CORE, r"def plan\(", r"if head_dim_ckv != 512 or head_dim_kpe not in", _ALL),
    CheckSpec("fa3", "FP8 KV only on an SM90 device", _CORE, r"def plan\(", r"if major != 9:", ("SM100", "SM120")),
    CheckSpec("cutlass", "plan() refuses FP8 KV for anything but fa2/fa3", _CORE, r"def plan\(", r"FP8 kv_data_type for MLA is only supported with the fa2 or fa3", _ALL),
    CheckSpec("cutlass", "the kernel is built only for SM10x/SM11x", "flashinfer/jit/mla.py", r"def gen_mla_module\(", r"supported_major_versions=\[10, 11\]", ("SM90", "SM120")),
    CheckSpec("cutlass", "exactly 128 query heads", _CORE, r"def _check_cutlass_shape\(", r"if H != 128:", _ALL),
    CheckSpec("cutlass", "query/KV element type dispatched over FP16/BF16 only (FP8 is an output type)",
              "flashinfer/data/csrc/cutlass_mla.cu", r"auto in_dtype = q_nope_pe\.dtype\(\);", r"DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16\(in_dtype", _ALL),
    CheckSpec("trtllm-gen", "backend 'auto' sends anything but SM10x to XQA", _CORE, r"def trtllm_batch_decode_with_kv_cache_mla\(", r"elif cc\[0\] != 10:", ("SM90", "SM120")),
    CheckSpec("trtllm-gen", "page size 32 or 64 only", _CORE, r"def trtllm_batch_decode_with_kv_cache_mla\(", r"elif block_size != 32 and block_size != 64:", _ALL),
    CheckSpec("trtllm-gen", "no head counts between 64 and 128", _CORE, r"def trtllm_batch_decode_with_kv_cache_mla\(", r"if 64 < num_heads_q < 128:", _ALL),
    CheckSpec("trtllm-gen", "the runner accepts SM100 / SM103 / SM107 only", "flashinfer/data/include/flashinfer/trtllm/fmha/fmhaRunner.cuh",
              r"TllmGenFmhaRunner\(", r"FLASHINFER_CHECK\(mSM == kSM_100", ("SM90", "SM120"), decisive=True),
    CheckSpec("trtllm-gen", "bf16 query with an e4m3 KV cache is a decode mode the launcher knows",
              "flashinfer/data/csrc/trtllm_fmha_kernel_launcher.cu", r"bf16q_fp8kv_transform_mode", r"kv_data_type == Data_type::DATA_TYPE_E4M3", ("SM100",)),
    CheckSpec("xqa", "SM12x only", "flashinfer/mla/_core.py", r"def xqa_batch_decode_with_kv_cache_mla\(", r"if not is_sm12x_supported\(query\.device\):", ("SM90", "SM100")),
    CheckSpec("xqa", "FP8 KV only with an FP8 query", "flashinfer/mla/_core.py", r"def xqa_batch_decode_with_kv_cache_mla\(", r"fp8_ok = \(", _ALL),
    CheckSpec("xqa", "exactly 128 query heads", "flashinfer/xqa.py", r"def xqa_mla\(", r"if head_group_ratio != 128:", _ALL),
    CheckSpec("xqa", "the kernel generator asserts 128 heads", "flashinfer/jit/xqa.py", r"def gen_xqa_module_mla\(", r"assert head_group_ratio == 128", _ALL),
    CheckSpec("xqa", "page size 16, 32, 64 or 128", "flashinfer/jit/xqa.py", r"def gen_xqa_module_mla\(", r"if page_size not in \[16, 32, 64, 128\]:", _ALL),
    CheckSpec("sm120-sparse", "SM12x only", _CORE, r"def _trtllm_batch_decode_sparse_mla_sm120\(", r"if not is_sm12x_supported\(query\.device\):", ("SM90", "SM100")),
    CheckSpec("sm120-sparse", "needs sparse_mla_top_k > 0 (DSA)", _CORE, r"def _trtllm_batch_decode_sparse_mla_v32_sm120\(", r"if sparse_mla_top_k <= 0:", _ALL),
    CheckSpec("sm120-sparse", "packed uint8 cache, 656 bytes per token", _CORE, r"def _check_sm120_sparse_v32_kv_cache\(", r"if kv_cache\.size\(-1\) != 656:", _ALL),
    CheckSpec("sm120-sparse", "kv_lora_rank 512 / rope 64 (GLM-5's shape)", _CORE, r"def _trtllm_batch_decode_sparse_mla_v32_sm120\(", r"if kv_lora_rank != 512 or qk_rope_head_dim != 64", _ALL),
    CheckSpec("sm120-sparse", "decode kernels instantiated for 16 and 64 heads at top-k 2048",
              "flashinfer/mla/_sparse_mla_sm120.py", r"_DECODE_DSV3_2_DISPATCH = frozenset", r"\(16, 2048\),", ("SM120",)),
    CheckSpec("sm120-sparse", "decode page size 64", "flashinfer/mla/_sparse_mla_sm120.py", r"_DECODE_DSV3_2_DISPATCH = frozenset",
              r"_DECODE_DSV3_2_PAGE_BLOCK_SIZE = 64", ("SM120",)),
    CheckSpec("sm120-sparse", "GLM's arbitrary fp32 KV scales select the GLM model type", "flashinfer/mla/_sparse_mla_sm120.py",
              r"def _resolve_model_type\(", r"return _MODEL_TYPE_GLM_NSA", ("SM120",)),
)


def release_root(release: str | None = None) -> tuple[str, Path]:
    """``(version, folder holding the flashinfer package)``. ``None``: the FlashInfer importable here.
    A release other than the importable one is installed into the cache by
    :func:`kvwall.peers.flashinfer.releases.install_release` (network on first use)."""
    try:
        import flashinfer

        here = (flashinfer.__version__, Path(flashinfer.__file__).resolve().parents[1])
    except ImportError:
        here = None
    if release is None:
        if here is None:
            raise RuntimeError("FlashInfer is not importable here; name a release to install into the cache.")
        return here
    if here is not None and here[0] == release:
        return here
    from kvwall.peers.flashinfer.releases import install_release

    return release, install_release(release)


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
        raise LookupError(f"FlashInfer {version}: no line matching {spec.pattern!r} after {spec.anchor!r} in {spec.file}.")
    lo, hi = max(0, hit - context), min(len(lines), hit + context + 1)
    return Citation(spec.door, spec.claim, version, spec.file, hit + 1, lines[hit].strip(),
                    tuple((n + 1, lines[n]) for n in range(lo, hi)), spec.families, spec.pattern, spec.decisive)


def cite_all(release: str | None = None) -> list[dict[str, Any]]:
    """Every :data:`CHECKS` entry resolved in ``release``; a check the release lacks becomes a row
    with ``line: None`` and the reason (so a newer release that dropped a check is visible)."""
    out = []
    for spec in CHECKS:
        try:
            c = cite(spec, release)
            out.append({**asdict(c), "excerpt": [list(x) for x in c.excerpt], "families": list(c.families),
                        "where": c.where, "rendered": c.render()})
        except LookupError as exc:
            out.append({"door": spec.door, "claim": spec.claim, "release": release_root(release)[0], "file": spec.file,
                        "line": None, "text": "", "excerpt": [], "families": list(spec.families),
                        "pattern": spec.pattern, "decisive": spec.decisive, "where": "", "rendered": "",
                        "missing": str(exc)})
    return out


# ------------------------------------------------------------------------------------------------
# Calling a path
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DoorCase:
    """One call: a path, GLM-5's heads per GPU, a page size, the dtypes, a target family (replays)."""

    door: str
    heads: int
    page_size: int
    q_dtype: str = "bfloat16"
    kv_dtype: str = "float8_e4m3fn"
    family: str = "SM90"

    def __post_init__(self) -> None:
        if self.door not in _DOOR:
            raise ValueError(f"Unknown path {self.door!r}; one of {', '.join(_DOOR)}.")
        if self.family not in FAMILIES:
            raise ValueError(f"Unknown GPU family {self.family!r}; one of {', '.join(FAMILIES)}.")
        if self.heads < 1 or self.page_size < 1:
            raise ValueError(f"heads ({self.heads}) and page_size ({self.page_size}) must be positive.")


def glm5_cases(families: Iterable[str] = tuple(FAMILIES), heads: Sequence[int] = (16, 64)) -> list[DoorCase]:
    """Every path × family × GLM-5 head count × the path's page sizes, bf16 query, FP8 KV; XQA also
    with an FP8 query (the only FP8 pairing it accepts)."""
    cases = []
    for fam in families:
        for door in DOORS:
            for h in heads:
                for ps in door.page_sizes:
                    cases.append(DoorCase(door.key, h, ps, family=fam))
                    if door.key == "xqa":
                        cases.append(DoorCase(door.key, h, ps, q_dtype="float8_e4m3fn", family=fam))
    return cases


class KernelReached(Exception):
    """Raised by the stub that replaces a JIT module: the release's checks accepted the call."""


SPARSE_TOPK = 2048  # GLM-5's DSA index_topk
SPARSE_BYTES_PER_TOKEN = 656  # 512 FP8 + 4 fp32 scales + 64 bf16 rope values


def make_inputs(case: DoorCase, device, context_lens: Sequence[int] = (4096, 1000), seed: int = 0) -> dict[str, Any]:
    """GLM-5-shaped decode inputs for ``case`` on ``device``: a paged FP8 pool (pages in random
    order, every request's tokens on its own pages), a bf16 (or FP8) query, and the slot list of
    each request so :func:`kvwall.kernels.mla_decode_reference` can check an output."""
    import torch

    from kvwall.model.geometry import GLM5

    g = torch.Generator().manual_seed(seed)
    ps, rank, rope = case.page_size, GLM5.kv_lora_rank, GLM5.qk_rope_head_dim
    pages_per_req = [-(-n // ps) for n in context_lens]
    if case.door in ("cutlass", "trtllm-gen", "xqa"):  # block table width: a multiple of 128 / page size
        mult = max(1, 128 // ps)
        width = -(-max(pages_per_req) // mult) * mult
    else:
        width = max(pages_per_req)
    total_pages = sum(pages_per_req) + 1  # page 0 stays unused, as in SGLang
    order = (torch.randperm(total_pages - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(context_lens), width, dtype=torch.int32)
    slots, start = [], 0
    for b, n in enumerate(pages_per_req):
        pages = order[start:start + n]
        start += n
        table[b, :n] = torch.tensor(pages, dtype=torch.int32)
        slots.append([p * ps + o for p in pages for o in range(ps)][: context_lens[b]])
    kv_dtype = getattr(torch, case.kv_dtype)
    pool = (torch.randn(total_pages, ps, rank + rope, generator=g) * 0.5).to(kv_dtype)
    q = torch.randn(len(context_lens), case.heads, rank + rope, generator=g).to(getattr(torch, case.q_dtype))
    lens = torch.tensor(list(context_lens), dtype=torch.int32)
    inputs = {"pool": pool.to(device), "q": q.to(device), "table": table.to(device), "lens": lens.to(device),
              "slots": slots, "context_lens": list(context_lens), "sm_scale": GLM5.sm_scale}
    if case.door == "sm120-sparse":  # the DSA indexer's top-k slot list and the packed cache
        topk = torch.full((len(context_lens), 1, SPARSE_TOPK), -1, dtype=torch.int32)
        for b, s in enumerate(slots):
            k = min(SPARSE_TOPK, len(s))
            pick = torch.tensor(s)[torch.randperm(len(s), generator=g)[:k]]
            topk[b, 0, :k] = pick.to(torch.int32)
        inputs["topk_indices"] = topk.to(device)
        inputs["topk_lens"] = torch.tensor([min(SPARSE_TOPK, n) for n in context_lens], dtype=torch.int32).to(device)
        inputs["packed"] = torch.zeros(total_pages, ps, SPARSE_BYTES_PER_TOKEN, dtype=torch.uint8).to(device)
    return inputs


def call_door(case: DoorCase, inputs: dict[str, Any], workspace=None):
    """Call ``case.door`` as a serving stack would; returns its output ``[batch, heads, 512]``.
    Whatever the library raises propagates."""
    import torch

    import flashinfer
    from flashinfer import mla as fmla

    from kvwall.model.geometry import GLM5

    pool, q, table, lens = inputs["pool"], inputs["q"], inputs["table"], inputs["lens"]
    device = q.device
    rank, rope = GLM5.kv_lora_rank, GLM5.qk_rope_head_dim
    batch = q.shape[0]
    if workspace is None:
        workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
    q_nope, q_pe = q[..., :rank].contiguous(), q[..., rank:].contiguous()
    ckv, kpe = pool[..., :rank], pool[..., rank:]
    if case.door in ("fa2", "fa3"):
        w = _wrapper(fmla, workspace, case.door)
        ps = case.page_size
        pages = [table[b, : -(-int(lens[b]) // ps)] for b in range(batch)]
        kv_indptr = torch.tensor([0] + [sum(len(p) for p in pages[: b + 1]) for b in range(batch)], dtype=torch.int32)
        kv_indices = torch.cat(pages).to(torch.int32)
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32)
        w.plan(qo_indptr.to(device), kv_indptr.to(device), kv_indices, lens, case.heads, rank, rope, ps, False,
               inputs["sm_scale"], q.dtype, pool.dtype)
        scales = {"ckv_scale": 1.0, "kpe_scale": 1.0} if pool.dtype == torch.float8_e4m3fn else {}
        return w.run(q_nope, q_pe, ckv, kpe, **scales)
    if case.door == "cutlass":
        w = fmla.BatchMLAPagedAttentionWrapper(workspace, backend="cutlass")
        return w.run(q_nope, q_pe, ckv, kpe, kv_len=lens, page_table=table)
    max_len = int(max(inputs["context_lens"]))
    if case.door == "trtllm-gen":
        return fmla.trtllm_batch_decode_with_kv_cache_mla(
            q.unsqueeze(1), pool, workspace, GLM5.qk_nope_head_dim, rank, rope, table, lens, max_len,
            bmm1_scale=inputs["sm_scale"], bmm2_scale=1.0, backend="trtllm-gen").squeeze(1)
    if case.door == "xqa":
        return fmla.xqa_batch_decode_with_kv_cache_mla(
            q.unsqueeze(1), pool, workspace, GLM5.qk_nope_head_dim, rank, rope, table, lens, max_len,
            bmm1_scale=inputs["sm_scale"], bmm2_scale=1.0).squeeze(1)
    if case.door == "sm120-sparse":
        packed = inputs["packed"]
        return fmla.trtllm_batch_decode_with_kv_cache_mla(
            q.unsqueeze(1), packed, workspace, GLM5.qk_nope_head_dim, rank, rope, inputs["topk_indices"],
            inputs["topk_lens"], max_len, sparse_mla_top_k=SPARSE_TOPK, bmm1_scale=inputs["sm_scale"],
            bmm2_scale=1.0, backend="sparse", kv_scale_format="arbitrary_fp32").squeeze(1)
    raise ValueError(f"Unknown path {case.door!r}.")  # pragma: no cover - DoorCase validates


def _wrapper(fmla, workspace, backend: str):
    """``BatchMLAPagedAttentionWrapper(workspace, backend=...)``; on a CPU (replays) the pinned host
    buffer the constructor allocates cannot exist, so the same attributes are set by hand."""
    if workspace.device.type == "cuda":
        return fmla.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
    import torch

    w = object.__new__(fmla.BatchMLAPagedAttentionWrapper)
    w._float_workspace_buffer, w.device, w._backend = workspace, workspace.device, backend
    w._int_workspace_buffer = torch.empty(8 << 20, dtype=torch.uint8)
    w._pin_memory_int_workspace_buffer = torch.empty(8 << 20, dtype=torch.uint8)
    w._use_cuda_graph = False
    return w


_KVWALL_DIR = str(Path(__file__).resolve().parent)


def outcome_of(exc: BaseException, root: Path | None = None) -> dict[str, Any]:
    """Structured description of what the library raised: type, message (first 600 characters),
    and the innermost frame inside FlashInfer as ``flashinfer/...py:line``."""
    where = ""
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        m = re.search(r"(flashinfer/.*)$", fr.filename.replace(os.sep, "/"))
        if m and not fr.filename.startswith(_KVWALL_DIR):
            where = f"{m.group(1)}:{fr.lineno}"
            break
    msg = str(exc).strip()
    return {"exc_type": type(exc).__name__, "message": msg[:600], "where": where}


# ------------------------------------------------------------------------------------------------
# Replays: the release's own checks, as on another GPU family
# ------------------------------------------------------------------------------------------------

#: Generators of JIT modules, by the module that imports them; each is replaced by a stub in a replay.
_GENERATORS = {
    "flashinfer.mla._core": ("gen_batch_mla_module", "gen_mla_module", "gen_trtllm_gen_fmha_module"),
    "flashinfer.xqa": ("gen_xqa_module_mla",),
    "flashinfer.mla._sparse_mla_sm120": ("gen_sparse_mla_sm120_module",),
}
_CAPABILITY_USERS = ("flashinfer.utils", "flashinfer.mla._core", "flashinfer.xqa", "flashinfer.mla._sparse_mla_sm120")


class _KernelStub:
    def __init__(self, generator: str, args: tuple) -> None:
        self._name = generator
        self._args = args

    def build_and_load(self):
        return self

    def get_library_path(self):
        raise KernelReached(f"{self._name}().get_library_path")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*a, **k):
            raise KernelReached(f"{self._name}().{name}")

        return call


def _dtype_arg(a) -> str:
    s = str(a)
    return s.replace("torch.", "") if s.startswith("torch.") else (s if len(s) < 40 else s[:40])


def replay(case: DoorCase) -> dict[str, Any]:
    """Run ``case`` on the CPU through the importable FlashInfer, with its compute-capability query
    answering ``case.family`` and its JIT module generators stubbed. Outcome ``kernel_reached``:
    every check the release runs accepted the call (``kernel``: which module and function it asked
    for); ``refused``: it raised (type, message, where); ``error``: the replay itself could not
    drive this release (an API it does not know)."""
    import importlib

    import torch

    cap = FAMILIES[case.family][0]
    saved: list[tuple[Any, str, Any]] = []

    def patch(mod, name, value):
        if hasattr(mod, name):
            saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, value)

    def make_gen(name):
        def gen(*args, **kwargs):
            return _KernelStub(f"{name}({', '.join(_dtype_arg(a) for a in args)})", args)
        return gen

    mods = {}
    for modname in set(_CAPABILITY_USERS) | set(_GENERATORS):
        try:
            mods[modname] = importlib.import_module(modname)
        except ImportError:
            continue
    try:
        for modname, mod in mods.items():
            patch(mod, "get_compute_capability", lambda device=None: cap)
            patch(mod, "get_device_sm_count", lambda device=None: 148 if cap[0] == 10 else 132 if cap[0] == 9 else 188)
            patch(mod, "device_support_pdl", lambda device=None: cap[0] >= 9)
            for g in _GENERATORS.get(modname, ()):
                patch(mod, g, make_gen(g))
            for cached in ("get_batch_mla_module", "get_mla_module", "get_trtllm_gen_fmha_module",
                           "get_xqa_module_mla", "get_sparse_mla_sm120_module"):
                fn = getattr(mod, cached, None)
                if hasattr(fn, "cache_clear"):
                    fn.cache_clear()
        saved.append((torch.version, "cuda", torch.version.cuda))
        torch.version.cuda = "13.0"  # the toolkit a real SM120 install would have
        inputs = make_inputs(case, "cpu", context_lens=(300, 77))
        try:
            call_door(case, inputs, workspace=torch.zeros(16 << 20, dtype=torch.uint8))
        except KernelReached as reached:
            return {"outcome": "kernel_reached", "kernel": str(reached)}
        except (TypeError, AttributeError, ImportError) as exc:
            o = outcome_of(exc)
            # a TypeError/AttributeError raised by FlashInfer's own checks is a refusal; one raised
            # while calling it (wrong signature for this release) is a replay error
            kind = "refused" if o["where"] and "Expected" in o["message"] else "error"
            return {"outcome": kind, **o}
        except BaseException as exc:  # noqa: BLE001 - every refusal is a result
            return {"outcome": "refused", **outcome_of(exc)}
        return {"outcome": "returned", "note": "the call returned without asking for a kernel"}
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)


def _replay_main() -> None:  # pragma: no cover - runs in the subprocess
    args = json.loads(sys.argv[1])
    import flashinfer

    rows = []
    for c in args["cases"]:
        case = DoorCase(**c)
        try:
            r = replay(case)
        except BaseException as exc:  # noqa: BLE001
            r = {"outcome": "error", **outcome_of(exc)}
        rows.append({**asdict(case), **r})
    Path(args["out"]).write_text(json.dumps({"flashinfer": flashinfer.__version__, "rows": rows}))


def replay_cases(cases: Sequence[DoorCase], release: str | None = None, timeout_s: float = 600) -> dict[str, Any]:
    """:func:`replay` every case in a fresh Python with ``release`` first on ``sys.path`` (``None``:
    the FlashInfer importable here). Returns ``{"flashinfer": version, "rows": [...]}``."""
    version, root = release_root(release)
    with tempfile.TemporaryDirectory(prefix="kvwall-replay-") as tmp:
        out = Path(tmp) / "replay.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root)] + [p for p in sys.path if p and "site-packages" not in p]),
                   CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore", FLASHINFER_WORKSPACE_BASE=tmp,
                   FLASHINFER_LOGLEVEL="0")
        payload = {"cases": [asdict(c) for c in cases], "out": str(out)}
        proc = subprocess.run([sys.executable, "-c", "from kvwall.peers.flashinfer.doors import _replay_main; _replay_main()",
                               json.dumps(payload)], capture_output=True, text=True, env=env, timeout=timeout_s,
                              cwd=tmp)
        if not out.exists():
            raise RuntimeError(f"Replaying FlashInfer {version}'s checks failed (exit {proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
        data = json.loads(out.read_text())
    if data["flashinfer"] != version:
        raise RuntimeError(f"Asked to replay FlashInfer {version} but the subprocess imported {data['flashinfer']} "
                           f"(from {root}); is another copy first on sys.path?")
    return data


# ------------------------------------------------------------------------------------------------
# The matrix
# ------------------------------------------------------------------------------------------------


def door_matrix(citations: Sequence[dict], replays: Sequence[dict], gpu_calls: Sequence[dict] = ()) -> list[dict[str, Any]]:
    """One cell per (path, family): can GLM-5's decode (16 or 64 heads, 512 + 64 latent, bf16 query,
    FP8 KV) run there? Evidence, strongest first:

    1. a real call on a GPU of that family (``gpu_calls``: rows of ``doors_sm90``): ``runs`` if some
       call's output matched the reference, else ``refused`` with the library's words;
    2. a *decisive* citation (a check after the Python layer, such as trtllm-gen's C++ runner) that
       refuses this family: ``refused``;
    3. the replay of the release's checks: ``accepted`` if some bf16-query call reached the kernel
       (``conditions`` says which heads / page sizes), else ``refused`` with the first refusal.

    Every cell carries ``evidence`` (a list of ``{"kind", "where", "text"}``) and the citations of
    the checks that speak for it."""
    cells = []
    for door in DOORS:
        for fam in FAMILIES:
            cites = [c for c in citations if c["door"] == door.key and fam in c["families"] and c.get("line")]
            gpu = [r for r in gpu_calls if r["door"] == door.key and r.get("family") == fam and r.get("outcome") != "skipped"]
            rep = [r for r in replays if r["door"] == door.key and r["family"] == fam]
            rep_q = [r for r in rep if r["q_dtype"] == "bfloat16"]
            decisive = [c for c in cites if c.get("decisive")]
            evidence: list[dict[str, str]] = []
            conditions = ""
            if gpu:
                ran = [r for r in gpu if r["outcome"] == "runs"]
                if ran:
                    status = "runs"
                    for r in ran:
                        evidence.append({"kind": "gpu", "where": f"{r['heads']} heads, page {r['page_size']}",
                                         "text": f"ran on the GPU; relative error {r['rel_err_vs_float64']:.2e} against float64"
                                                 + (f"; {r['ms']:.3f} ms" if r.get("ms") is not None else "")})
                    conditions = ", ".join(sorted({f"{r['heads']} heads / page {r['page_size']}" for r in ran}))
                else:
                    status = "refused"
                    for r in gpu:
                        evidence.append({"kind": "gpu", "where": r.get("where", ""),
                                         "text": f"{r['heads']} heads, page {r['page_size']}, Q {r['q_dtype']}: "
                                                 f"{r.get('exc_type', r['outcome'])}: {r.get('message', '')}"})
            elif decisive:
                status = "refused"
                for c in decisive:
                    evidence.append({"kind": "source", "where": c["where"], "text": f"{c['claim']}: {c['text']}"})
                reached = [r for r in rep_q if r["outcome"] == "kernel_reached"]
                if reached:
                    evidence.append({"kind": "replay", "where": reached[0]["kernel"],
                                     "text": "the Python checks pass (replayed); the refusal comes after them, in C++"})
            else:
                reached = [r for r in rep_q if r["outcome"] == "kernel_reached"]
                if reached:
                    status = "accepted"
                    conditions = ", ".join(sorted({f"{r['heads']} heads / page {r['page_size']}" for r in reached}))
                    evidence.append({"kind": "replay", "where": reached[0]["kernel"],
                                     "text": f"the release's checks accept it ({conditions}); the kernel was not run here"})
                    for r in rep_q:
                        if r["outcome"] == "refused":
                            evidence.append({"kind": "replay", "where": r.get("where", ""),
                                             "text": f"{r['heads']} heads, page {r['page_size']}: {r.get('exc_type')}: {r.get('message', '')}"})
                else:
                    status = "refused"
                    seen = set()
                    for r in rep:
                        key = (r.get("where"), r.get("message"))
                        if key in seen:
                            continue
                        seen.add(key)
                        evidence.append({"kind": "replay", "where": r.get("where", ""),
                                         "text": f"{r['heads']} heads, page {r['page_size']}, Q {r['q_dtype']}: "
                                                 f"{r.get('exc_type', r['outcome'])}: {r.get('message', '')}"})
            cells.append({"door": door.key, "label": door.label, "family": fam, "status": status,
                          "conditions": conditions, "evidence": evidence,
                          "citations": [{"where": c["where"], "claim": c["claim"], "text": c["text"]} for c in cites]})
    return cells


if __name__ == "__main__":  # pragma: no cover
    _replay_main()
