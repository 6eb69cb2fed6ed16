"""Our fused kernel compiled for GPUs we do not have: Triton's offline compile (no GPU needed, Triton's bundled ptxas)
of every launch shape of the Triton path we ship or try, for sm_90, sm_100 and sm_120, held against each
architecture's limits; and nvcc's compile of the two wgmma paths for their only target, sm_90a.

Run with ``python -m kvwall.tuning.arch_check`` (a table of every row); chapter 6 calls :func:`check_architectures`.

The compiler is the GPU machines' Triton (``requirements-triton-gpu.txt``, 3.6.0 on the H200 we tune and record on;
it bundles ptxas 12.8 and ptxas-blackwell), not this environment's own (3.9.0 without a GPU, for its interpreter):
registers and spills differ between Triton versions. ``make setup`` installs it apart, in
``<venv>/triton-gpu`` (:func:`pinned_triton_dir`; ``$KVWALL_PINNED_TRITON`` names another folder), and
:func:`check_architectures` compiles in a child Python whose ``PYTHONPATH`` puts it first
(``python -m kvwall.tuning.arch_check --here --json``). Each row says the ``triton`` it was compiled with. Without
the pinned Triton it compiles in this process where this environment's Triton *is* the pin (a GPU machine whose
torch came with it), and otherwise raises :class:`PinnedTritonMissing`, unless asked to use this environment's
(``current_triton=True``, ``--current-triton``).

The shapes, each a row per architecture with its ``role``:

- ``"fallback"``: the shape the launcher picks on a GPU of that architecture missing from the tuned table, for
  that head count (:func:`kvwall.kernels.mla_decode.launch_shape.fallback_config`, asked with the architecture's
  capability and per-block shared-memory limit). Shipped on every architecture.
- ``"tuned"``: every distinct (head count, shape) of ``tuned.json``. Shipped only on the architecture of the GPU
  it was tuned on (the launcher reads an entry for that GPU model only); compiled everywhere all the same.
- ``"candidate"``: every shape the tuner tries (:func:`kvwall.tuning.fused.candidates`) for 16, 64 and 128 heads.
  Not shipped; one that does not fit is a finding, not a failure.

Every compile goes through :func:`kvwall.kernels.mla_decode.launch_shape.compile_offline` with the launcher's own
compile-time parameters (:func:`~kvwall.kernels.mla_decode.launch_shape.split_constexprs`, the work-list launch, as
:func:`~kvwall.kernels.mla_decode.launch_shape.split_resources` compiles it), once per (shape, architecture), two at
a time. A shape fits an architecture when its shared memory is within the per-block limit, the kernel is not
trap-only (where Triton gives up on a layout it emits a kernel that only traps) and its tensor memory is within
the architecture's columns (512 on SM100, none elsewhere).

Tensor memory (SM100's tcgen05 MMAs) is read from the PTX: the column count of each ``tcgen05.alloc`` (Triton 3.6
and 3.9 emit one, with an immediate count, a power of two from 32). A trap-only kernel has no allocation left in its
PTX; there, and wherever an allocation's count is not an immediate, the count is Triton's own
``metadata.tmem_size`` (the columns it laid out: with Triton 3.6, 544 for a 64-head x 64-token tile, 528 for
64 x 32), or None where this Triton has no such field.

The wgmma paths are compiled by nvcc for sm_90a (:func:`wgmma_builds`, ``wgmma=True``): role ``"wgmma"``, one row;
``"wgmma_tokens"``, one row per instantiation (16 and 32 heads per CTA): :mod:`kvwall.tuning.arch_check_cuda`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

import triton

from kvwall.kernels.gather.cuda import nvcc_compile_check
from kvwall.kernels.gather.kernel import DEFAULT_CONFIGS, _kernel as _gather_kernel, chunk_width
from kvwall.kernels.mla_decode import launch_shape as mla
from kvwall.kernels.mla_decode.launch_shape import MLADecodeConfig
from kvwall.measure.failures import error_text
from kvwall.model.cost import GPUS
from kvwall.model.geometry import GLM5
from kvwall.results.locations import PROJECT_ROOT
from kvwall.tuning.arch_check_cuda import tokens_rows, wgmma_rows
from kvwall.tuning.fused import candidates

__all__ = [
    "ARCHS",
    "ArchLimits",
    "KernelBuild",
    "ROLES",
    "CANDIDATE_HEADS",
    "PINNED_TRITON_ENV",
    "PinnedTritonMissing",
    "PINNED_TRITON_REQUIREMENTS",
    "pinned_triton_requirement",
    "pinned_triton_dir",
    "pinned_triton_version",
    "fallback_config",
    "tuned_shapes",
    "tuned_arch",
    "tmem_columns",
    "compile_split",
    "compile_gather",
    "cuda_twin_builds",
    "wgmma_builds",
    "check_architectures",
    "check_every_shape",
    "format_rows",
    "main",
]


@dataclass(frozen=True)
class ArchLimits:
    """Per-block shared memory a kernel may use (the opt-in maximum), registers per SM, and tensor-memory columns
    per SM (SM100's tcgen05 accumulators; 0 where the architecture has none)."""

    cap: int
    name: str
    shared_per_block: int
    regs_per_sm: int = 65_536
    tmem_columns: int = 0


ARCHS = (
    ArchLimits(90, "sm_90: H100, H200", 232_448),
    ArchLimits(100, "sm_100: B200", 232_448, tmem_columns=512),
    ArchLimits(120, "sm_120: RTX PRO 6000, 5090", 101_376),
)
ROLES = ("fallback", "tuned", "candidate")
#: Head counts whose tuner candidates are compiled (the tuner's own: 16, 64 and 128 heads per GPU).
CANDIDATE_HEADS = (16, 64, 128)
FUSED = "fused split"


def fallback_config(heads: int, limits: ArchLimits | None = None) -> MLADecodeConfig:
    """The launch shape ``mla_decode_fp8`` picks for ``heads`` on a GPU of architecture ``limits`` missing from the
    tuned table: the launcher's own rule (:func:`kvwall.kernels.mla_decode.launch_shape.fallback_config`), which
    compiles its preferences for that architecture. Without ``limits``: its first preference, unfiltered."""
    if limits is None:
        return mla.fallback_shapes(heads)[0]
    return mla.fallback_config(heads, limits.cap, limits.shared_per_block)


def tuned_arch(gpu: str) -> int | None:
    """The compute capability of the GPU model a tuned.json entry is keyed by (as ``torch.cuda.get_device_name``
    says it, e.g. "NVIDIA H200" -> 90), from the cost model's GPU table; None for a model it does not list."""
    for spec in GPUS.values():
        if gpu in spec.name or spec.name in gpu:
            return int(spec.arch.removeprefix("sm_"))
    return None


def tuned_shapes(path: Path | None = None) -> list[tuple[int, MLADecodeConfig, frozenset[int]]]:
    """Every distinct (head count, launch shape) of the tuned table, with the capabilities of the GPUs that entry
    is tuned for (where it is shipped)."""
    table = json.loads((path or mla.TUNED_CONFIG_FILE).read_text())
    found: dict[tuple[int, MLADecodeConfig], set[int]] = {}
    for gpu, entry in table.items():
        cap = tuned_arch(gpu)
        for heads, by_context in entry.items():
            if not heads.isdigit():
                continue
            for tuned in by_context.values():
                fields = {k: v for k, v in tuned["config"].items() if not k.startswith("combine_")}
                caps = found.setdefault((int(heads), MLADecodeConfig(**fields)), set())
                caps.update({cap} if cap is not None else set())
    return [(h, cfg, frozenset(caps)) for (h, cfg), caps in found.items()]


@dataclass(frozen=True)
class KernelBuild:
    """One compile: the shape, the architecture, and what the compiler reports (or why it failed). ``spills``:
    local-memory bytes per thread (register spills; they slow a kernel, they do not stop it). ``tmem_columns``:
    tensor-memory columns allocated (SM100). ``fits``: it would launch (shared memory and tensor memory within
    the limits, not a trap-only kernel). ``role``: fallback, tuned or candidate (module docstring); ``shipped``:
    the launcher can run this shape on this architecture. ``triton``: the version that compiled it."""

    kernel: str
    heads: int
    shape: str
    arch: str
    cap: int
    shared_bytes: int | None
    shared_limit: int
    regs: int | None
    spills: int | None
    threads: int
    blocks_per_sm_by_regs: int | None
    fits: bool
    trap_only: bool = False
    error: str | None = None
    role: str = ""
    shipped: bool = False
    tmem_columns: int | None = None
    tmem_limit: int = 0
    config: dict[str, Any] | None = None
    triton: str | None = None


@dataclass(frozen=True)
class _Report:
    """What one offline compile says, before it is held against an architecture's limits."""

    shared: int | None
    regs: int | None
    spills: int | None
    tmem: int | None
    trap_only: bool
    error: str | None


_TMEM_ALLOC = re.compile(r"tcgen05\.alloc\.[\w:.]*\s+\[[^\]]*\]\s*,\s*([^;]+);")


def tmem_columns(compiled: Any) -> int | None:
    """Tensor-memory columns a compiled kernel allocates: the sum of its PTX ``tcgen05.alloc`` counts; Triton's
    ``metadata.tmem_size`` where the PTX has no allocation (a trap-only kernel) or a count is not an immediate;
    None where neither says (module docstring)."""
    counts = [c.strip() for c in _TMEM_ALLOC.findall(compiled.asm.get("ptx", ""))]
    if counts and all(c.isdigit() for c in counts):
        return sum(int(c) for c in counts)
    meta = getattr(compiled.metadata, "tmem_size", None)
    return int(meta) if meta is not None else None


def _report(compile_it) -> _Report:
    """Run one offline compile and read its report; never raises (a shape an architecture cannot compile is a
    finding)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the launcher's default, without Triton's warning
    try:
        compiled = compile_it()
    except Exception as exc:  # noqa: BLE001
        return _Report(None, None, None, None, False, error_text(exc, 300))
    regs, spills = mla.cubin_resources(compiled.asm)  # Triton's n_regs is filled only when a GPU loads it
    return _Report(
        int(compiled.metadata.shared), regs, spills, tmem_columns(compiled), mla.is_trap_only(compiled), None
    )


@functools.cache
def _split_report(cfg: MLADecodeConfig, cap: int) -> _Report:
    """The split kernel with ``cfg`` compiled for ``cap`` exactly as the launcher's resource check compiles it."""
    return _report(lambda: mla.compile_offline("split", mla.split_constexprs(cfg), cfg.num_warps, cfg.num_stages, cap))


def _build(
    kernel: str, rep: _Report, limits: ArchLimits, *, heads: int, shape: str, threads: int, **extra
) -> KernelBuild:
    """A compile's report held against ``limits``."""
    tmem_ok = rep.tmem is None or rep.tmem <= limits.tmem_columns
    fits = (
        rep.error is None
        and rep.shared is not None
        and rep.shared <= limits.shared_per_block
        and not rep.trap_only
        and tmem_ok
    )
    return KernelBuild(
        kernel=kernel,
        heads=heads,
        shape=shape,
        arch=limits.name,
        cap=limits.cap,
        shared_bytes=rep.shared,
        shared_limit=limits.shared_per_block,
        regs=rep.regs,
        spills=rep.spills,
        threads=threads,
        blocks_per_sm_by_regs=(limits.regs_per_sm // (rep.regs * threads)) if rep.regs else None,
        fits=fits,
        trap_only=rep.trap_only,
        error=rep.error,
        tmem_columns=rep.tmem,
        tmem_limit=limits.tmem_columns,
        triton=triton.__version__,
        **extra,
    )


def _shape_text(cfg: MLADecodeConfig) -> str:
    """``cfg`` in words: heads x tokens, warps, stages, then every other split-kernel field not at its default."""
    text = f"{cfg.block_h} heads × {cfg.block_n} tokens, {cfg.num_warps} warps, {cfg.num_stages} stages"
    default = MLADecodeConfig(cfg.block_h, cfg.block_n)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in ("num_warps", "num_stages") or f.name.startswith("combine_") or value == getattr(default, f.name):
            continue
        text += f", {f.name}" if value is True else f", {f.name} {value}"
    return text


def compile_split(
    config: MLADecodeConfig, limits: ArchLimits, heads: int, role: str = "fallback", shipped: bool | None = None
) -> KernelBuild:
    """The fused kernel's split launch with ``config``, compiled for ``limits.cap`` (once per shape and
    architecture) and held against its limits. ``shipped`` defaults to ``role == "fallback"``."""
    return _build(
        FUSED,
        _split_report(config, limits.cap),
        limits,
        heads=heads,
        shape=_shape_text(config),
        threads=32 * config.num_warps,
        role=role,
        shipped=(role == "fallback") if shipped is None else shipped,
        config=dataclasses.asdict(config),
    )


def _gather_compiled(const: dict[str, Any], num_warps: int, cap: int):
    """Chapter 4's gather_cast compiled offline (its module has no offline-compile helper of its own)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _gather_kernel("gather_cast", False)
    types = {
        "pool_ptr": "*fp8e4nv",
        "kv_indices_ptr": "*i32",
        "out_ptr": "*bf16",
        "indptr_end_ptr": "*i32",
        "scale_ptr": "*fp32",
        "scale_value": "fp32",
    }
    sig = {a: "constexpr" if a in const else types.get(a, "i32") for a in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(sig) if sig[a].startswith("*") or "stride" in a}
    return triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=const, attrs=aligned),
        target=GPUTarget("cuda", cap, 32),
        options=dict(num_warps=num_warps, num_stages=1),
    )


def compile_gather(limits: ArchLimits) -> KernelBuild:
    """Chapter 4's gather_cast (Triton) with its default large-launch configuration, for ``limits.cap``."""
    cfg, d = DEFAULT_CONFIGS["large"], GLM5.kv_dim
    const = dict(
        D=d,
        PAGE=1,
        CHUNK=chunk_width(d),
        BLOCK=cfg.block,
        HAS_INDPTR=True,
        SCALE_MODE=0,
        WIDE=False,
        POOL_WIDE=False,
        EVICT_LOADS=cfg.evict_loads,
        EVICT_STORES=cfg.evict_stores,
        LOAD_VEC=cfg.load_vec,
    )
    rep = _report(lambda: _gather_compiled(const, cfg.num_warps, limits.cap))
    return _build(
        "gather_cast (Triton)",
        rep,
        limits,
        heads=0,
        threads=32 * cfg.num_warps,
        shape=f"{cfg.block} × {chunk_width(d)}-value chunks, {cfg.num_warps} warps",
        shipped=True,
    )


def cuda_twin_builds() -> list[dict[str, Any]]:
    """Chapter 4's CUDA C++ twin compiled by nvcc for each architecture (registers per instantiation, spills)."""
    rows = []
    for limits in ARCHS:
        base = dict(
            kernel="gather_cast (CUDA C++)",
            heads=0,
            arch=limits.name,
            cap=limits.cap,
            shared_limit=limits.shared_per_block,
            threads=0,
            blocks_per_sm_by_regs=None,
            trap_only=False,
            role="",
            shipped=True,
            tmem_columns=0,
            tmem_limit=limits.tmem_columns,
            config=None,
            triton=None,
        )
        try:
            rep = nvcc_compile_check(f"sm_{limits.cap}")
            spilled = max((int(n) for n in re.findall(r"(\d+) bytes spill stores", rep.log)), default=0)
            rows.append(
                dict(
                    base,
                    shape="every vector width (most registers)",
                    shared_bytes=0,
                    regs=max(rep.registers.values()) if rep.registers else None,
                    spills=spilled,
                    fits=rep.ok,
                    error=None if rep.ok else rep.log[-300:],
                )
            )
        except FileNotFoundError as exc:
            rows.append(dict(base, shape="", shared_bytes=None, regs=None, spills=None, fits=False, error=str(exc)))
    return rows


def wgmma_builds() -> list[dict[str, Any]]:
    """The fused kernel's wgmma paths compiled by nvcc for sm_90a, their only target: the wgmma path's row, then the
    tokens-on-M path's, one per instantiation (:mod:`kvwall.tuning.arch_check_cuda`)."""
    return wgmma_rows(ARCHS[0].regs_per_sm) + tokens_rows(ARCHS[0].regs_per_sm)


def _compile_all(pairs: Iterable[tuple[MLADecodeConfig, int]]) -> None:
    """Compile each distinct (shape, capability) once, as many at a time as there are CPU cores (the compiler's
    passes and ptxas run outside the GIL), the largest tiles first; the launcher's own resource check of the
    fallback shapes then finds them in Triton's cache."""
    todo = sorted(dict.fromkeys(pairs), key=lambda p: -p[0].block_h * p[0].block_n)
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        list(pool.map(lambda p: _split_report(*p), todo))


def _fallback_rows(heads: Iterable[int]) -> list[KernelBuild]:
    heads = tuple(heads)
    _compile_all((cfg, a.cap) for h in heads for cfg in mla.fallback_shapes(h) for a in ARCHS)
    return [compile_split(fallback_config(h, a), a, h, "fallback") for h in heads for a in ARCHS]


def _check_here(heads: tuple[int, ...], cast_kernels: bool, every_shape: bool) -> list[dict[str, Any]]:
    """:func:`check_architectures`' rows, compiled in this process with the Triton it imports."""
    if every_shape:
        rows = _every_shape_rows(heads)
    else:
        rows = [dataclasses.asdict(b) for b in _fallback_rows(heads)]
    if cast_kernels:
        rows += [dataclasses.asdict(compile_gather(limits)) for limits in ARCHS]
        rows += cuda_twin_builds()
    return rows


def _every_shape_rows(heads: tuple[int, ...]) -> list[dict[str, Any]]:
    tuned = tuned_shapes()
    cands = [(h, cfg) for h in CANDIDATE_HEADS for cfg in candidates(h)]
    _compile_all(
        [(cfg, a.cap) for h in heads for cfg in mla.fallback_shapes(h) for a in ARCHS]
        + [(cfg, a.cap) for _, cfg, _ in tuned for a in ARCHS]
        + [(cfg, a.cap) for _, cfg in cands for a in ARCHS]
    )
    builds = _fallback_rows(heads)
    builds += [compile_split(cfg, a, h, "tuned", shipped=a.cap in caps) for h, cfg, caps in tuned for a in ARCHS]
    builds += [compile_split(cfg, a, h, "candidate") for h, cfg in cands for a in ARCHS]
    return [dataclasses.asdict(b) for b in builds]


#: The environment variable naming the folder the pinned Triton is installed in (:func:`pinned_triton_dir`).
PINNED_TRITON_ENV = "KVWALL_PINNED_TRITON"


class PinnedTritonMissing(RuntimeError):
    """The GPU machines' Triton is not installed where :func:`pinned_triton_dir` says."""


def pinned_triton_dir() -> Path:
    """The folder of the GPU machines' Triton (``requirements-triton-gpu.txt``), installed apart from this
    environment's own: ``$KVWALL_PINNED_TRITON`` if set, else ``<sys.prefix>/triton-gpu`` (where ``make setup``
    installs it)."""
    return Path(os.environ.get(PINNED_TRITON_ENV) or Path(sys.prefix) / "triton-gpu")


#: The file that pins the GPU machines' Triton (``triton==X.Y.Z``).
PINNED_TRITON_REQUIREMENTS = PROJECT_ROOT / "requirements-triton-gpu.txt"


def pinned_triton_requirement(path: Path = PINNED_TRITON_REQUIREMENTS) -> str | None:
    """The version ``requirements-triton-gpu.txt`` pins (``triton==3.6.0`` -> ``"3.6.0"``); None if it pins none."""
    found = re.search(r"^\s*triton\s*==\s*([\w.+-]+)", path.read_text() if path.is_file() else "", re.MULTILINE)
    return found.group(1) if found else None


def pinned_triton_version(folder: Path | None = None) -> str | None:
    """The version of the Triton installed in ``folder`` (default: :func:`pinned_triton_dir`); None where none is."""
    folder = folder or pinned_triton_dir()
    if not (folder / "triton" / "__init__.py").is_file():
        return None
    return next(
        (
            d.version
            for d in metadata.distributions(path=[str(folder)])
            if (d.metadata["Name"] or "").lower() == "triton"
        ),
        None,
    )


def _check_pinned(version: str, heads: tuple[int, ...], cast_kernels: bool, every_shape: bool) -> list[dict[str, Any]]:
    """:func:`check_architectures`' rows from a child Python whose ``PYTHONPATH`` puts the pinned Triton first
    (``python -m kvwall.tuning.arch_check --here --json``: the rows as JSON on its last line of output)."""
    folder = pinned_triton_dir()
    argv = [sys.executable, "-m", "kvwall.tuning.arch_check", "--here", "--json", "--heads", *map(str, heads)]
    argv += ([] if every_shape else ["--fallback-only"]) + ([] if cast_kernels else ["--no-cast-kernels"])
    argv += ["--no-wgmma"]  # nvcc's rows need no Triton: check_architectures adds them in this process
    path = os.pathsep.join([str(folder), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run(argv, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=3600)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"the offline compile with Triton {version} ({folder}) failed (exit {proc.returncode}):\n"
            + proc.stderr[-3000:]
        )
    rows = json.loads(lines[-1])
    other = {r["triton"] for r in rows if r["triton"] not in (None, version)}
    if other:
        raise RuntimeError(f"the child Python compiled with Triton {other}, not the pinned {version} in {folder}")
    return rows


def check_architectures(
    heads: tuple[int, ...] = (16, 32, 64, 128),
    *,
    cast_kernels: bool = False,
    every_shape: bool = False,
    current_triton: bool = False,
    wgmma: bool = False,
) -> list[dict[str, Any]]:
    """Every head count's fallback launch shape of the fused kernel -- the one the launcher picks on each
    architecture -- compiled for every architecture of :data:`ARCHS`; with ``every_shape``, the tuned and
    candidate shapes too (:func:`check_every_shape`); with ``cast_kernels``, chapter 4's Triton gather_cast and
    (where nvcc is) its CUDA twin; with ``wgmma``, the fused kernel's wgmma paths on sm_90a (:func:`wgmma_builds`).
    One dict per (kernel, shape, architecture), with the ``triton`` version it was compiled with (None for the CUDA
    C++ rows).

    The compiles run with the GPU machines' Triton (module docstring), in a child Python. Where it is not
    installed: in this process when this environment's Triton is the pinned version (or ``current_triton``
    asks for it whatever its version); else :class:`PinnedTritonMissing`."""
    heads = tuple(heads)
    version = pinned_triton_version()
    if version is not None:
        return _check_pinned(version, heads, cast_kernels, every_shape) + (wgmma_builds() if wgmma else [])
    pin = pinned_triton_requirement()
    if current_triton or triton.__version__ == pin:  # the running Triton is the pin itself (a GPU machine)
        return _check_here(heads, cast_kernels, every_shape) + (wgmma_builds() if wgmma else [])
    raise PinnedTritonMissing(
        f"no Triton in {pinned_triton_dir()}, and this environment's Triton is {triton.__version__}, not the GPU "
        f"machines' {pin} (requirements-triton-gpu.txt): the offline architecture check compiles with the pinned "
        f"one, which `make setup` installs there (or set {PINNED_TRITON_ENV} to a folder holding it; or ask for "
        f"this environment's Triton {triton.__version__}, whose registers and spills differ, with "
        "current_triton=True / --current-triton)"
    )


def check_every_shape(
    heads: tuple[int, ...] = (16, 32, 64, 128), *, current_triton: bool = False
) -> list[dict[str, Any]]:
    """Rows of every role (module docstring) on every architecture: the fallbacks for ``heads``, every tuned
    shape, every tuner candidate for :data:`CANDIDATE_HEADS`; each (shape, architecture) compiled once, with the
    GPU machines' Triton (:func:`check_architectures`)."""
    return check_architectures(heads, every_shape=True, current_triton=current_triton)


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:,}" if isinstance(x, int) else str(x)


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The rows as a plain-text table: role, architecture, heads, shape, shared / limit, registers, spills, tensor
    memory, fits (and why not)."""
    kw = max([24] + [len(r["kernel"]) + 1 for r in rows])
    head = (
        f"{'kernel':<{kw}}{'role':<14}{'arch':<8}{'heads':>5}  {'shape':<68}{'shared / limit B':>20}{'regs':>6}"
        f"{'spills':>8}{'tmem':>6}  fits"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        why = []
        if r["error"]:
            why.append(r["error"][:120])
        else:
            if r["shared_bytes"] is not None and r["shared_bytes"] > r["shared_limit"]:
                why.append("shared memory")
            if r["trap_only"]:
                why.append("trap-only kernel")
            if r.get("tmem_columns") and r["tmem_columns"] > r.get("tmem_limit", 0):
                why.append(f"tensor memory > {r.get('tmem_limit', 0)} columns")
        verdict = "yes" if r["fits"] else "NO" + (f" ({', '.join(why)})" if why else "")
        shipped = "  [shipped]" if r.get("shipped") and r.get("role") else ""
        lines.append(
            f"{r['kernel']:<{kw}}{r.get('role') or '-':<14}{r['arch'].split(':')[0]:<8}{r['heads'] or '':>5}  "
            f"{r['shape'][:67]:<68}{_num(r['shared_bytes']) + ' / ' + _num(r['shared_limit']):>20}"
            f"{_num(r['regs']):>6}{_num(r['spills']):>8}{_num(r.get('tmem_columns')):>6}  {verdict}{shipped}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 32, 64, 128], help="fallback head counts")
    parser.add_argument("--fallback-only", action="store_true", help="only the launcher's fallback shapes")
    parser.add_argument("--no-cast-kernels", action="store_true", help="leave out chapter 4's cast kernels")
    parser.add_argument("--no-wgmma", action="store_true", help="leave out the fused kernel's wgmma paths (nvcc)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (one line), not as a table")
    parser.add_argument(
        "--current-triton",
        action="store_true",
        help="where the GPU machines' Triton is not installed, compile with this environment's own",
    )
    parser.add_argument(
        "--here",
        action="store_true",
        help="compile in this process with the Triton it imports (what the pinned run's child does)",
    )
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    which = dict(cast_kernels=not args.no_cast_kernels, every_shape=not args.fallback_only)
    if args.here:
        rows = _check_here(tuple(args.heads), **which) + ([] if args.no_wgmma else wgmma_builds())
    else:
        rows = check_architectures(
            tuple(args.heads), current_triton=args.current_triton, wgmma=not args.no_wgmma, **which
        )
    if args.json:
        print(json.dumps(rows))
        return 0
    versions = ", ".join(sorted({r["triton"] for r in rows if r["triton"]}))
    print(f"triton {versions}; {len(rows)} rows in {time.perf_counter() - t0:.0f} s")
    print(format_rows(rows))
    for what, bad in (
        ("do not fit", [r for r in rows if r.get("shipped") and not r["fits"]]),
        ("spill registers", [r for r in rows if r.get("shipped") and r["spills"]]),
    ):
        print(
            f"\nshipped rows that {what}: {len(bad)}"
            + "".join(
                f"\n  {r['kernel']}, {r['role'] or 'shipped'}, {r['arch'].split(':')[0]}"
                + (f", {r['heads']} heads" if r["heads"] else "")
                + f": {r['shape']}: {r['spills']} B spilled"
                for r in bad
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
