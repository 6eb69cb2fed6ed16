"""Two patches for SGLang 0.5.23's ``flashinfer_mla`` backend that remove every whole-pool FP8 -> BF16 cast (decode,
target-verify, draft-extend, paged prefill with a cached prefix, the DCP buffer), as unified diffs a reader applies
to ``python/sglang/srt/layers/attention/flashinfer_mla_backend.py`` with ``git apply`` (one of them: they do not
stack).

- ``gather_cast.diff``: wherever the BF16 MLA wrapper is planned, it is planned over a compact BF16 buffer with
  indices ``0..n-1``; each layer gathers+casts only the rows the step references (:mod:`.compact`).
- ``fused.diff``: decode, target-verify and draft-extend run ours (:func:`kvwall.kernels.mla_decode`, through
  :mod:`.graph_plan`) straight on the FP8 pool, one plan per step; under CUDA graphs a graph plan per captured
  (batch size, query tokens), refilled before each replay. No BF16 copy of the pool is reserved; prefill with a
  cached prefix gathers its rows per call, as ``gather_cast.diff`` does eagerly.

``UPSTREAM.md`` in this folder says what each changes, how CUDA graphs are handled and what remains.
The upstream file is not shipped: :func:`upstream_source` takes it from the pinned SGLang wheel
(:func:`kvwall.peers.sglang_source.sglang_source`: downloaded once from PyPI, sha256-checked, cached) and checks its
own sha256 (:data:`UPSTREAM_SHA256`); offline with an empty cache it raises
:class:`~kvwall.peers.sglang_source.SGLangSourceUnavailable`, saying what to do.
:func:`apply_patch` applies a diff in pure Python and refuses any hunk whose lines differ from the file's;
:func:`load_patched_backend` executes the (un)patched source as a module, with the stand-ins of
:mod:`kvwall.peers.sglang_patch.stubs` for its sglang imports.
"""

from __future__ import annotations

import re
import sys
import types
from importlib import resources
from typing import Any

import torch

from kvwall.peers.sglang_patch.stubs import BLOCKER, StubSettings, device_torch, stub_modules

__all__ = [
    "PATCHES",
    "VARIANTS",
    "UPSTREAM_PATH",
    "UPSTREAM_VERSION",
    "UPSTREAM_SHA256",
    "WHEEL_PATH",
    "BLOCKER",
    "PatchError",
    "upstream_source",
    "upstream_file",
    "patch_text",
    "apply_patch",
    "apply_diff",
    "patched_source",
    "load_patched_backend",
]

#: The patches, by name (``<name>.diff`` in this package).
PATCHES = ("gather_cast", "fused")
#: What :func:`load_patched_backend` loads: the upstream file, or one of :data:`PATCHES` applied to it.
VARIANTS = ("unpatched",) + PATCHES
#: The patched file's path in SGLang's repository (the diffs' ``a/`` and ``b/`` names).
UPSTREAM_PATH = "python/sglang/srt/layers/attention/flashinfer_mla_backend.py"
UPSTREAM_VERSION = "sglang 0.5.23 (PyPI wheel)"
#: The file inside the wheel.
WHEEL_PATH = "sglang/srt/layers/attention/flashinfer_mla_backend.py"
#: sha256 of that file as the wheel ships it (1445 lines); the diffs are made against exactly these bytes.
UPSTREAM_SHA256 = "85ba5db394df47f12e8edc69282954b9f000b37c519194f56418424ee718bf2e"

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """A diff that does not apply: the hunk, the line, what it expected and what the file holds."""


def _read(name: str) -> str:
    return resources.files(__name__).joinpath(name).read_bytes().decode("utf-8")


def upstream_file():
    """The path of SGLang 0.5.23's ``flashinfer_mla_backend.py`` in the unpacked pinned wheel
    (:func:`kvwall.peers.sglang_source.sglang_source`), its sha256 checked against :data:`UPSTREAM_SHA256`.
    Raises :class:`~kvwall.peers.sglang_source.SGLangSourceUnavailable` (offline, empty cache) or
    :class:`PatchError` (a file that differs)."""
    import hashlib  # pylint: disable=import-outside-toplevel

    from kvwall.peers.sglang_source import sglang_source  # pylint: disable=import-outside-toplevel

    path = sglang_source() / WHEEL_PATH
    if not path.is_file():
        raise PatchError(f"{path} is missing from the unpacked SGLang wheel.")
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if got != UPSTREAM_SHA256:
        raise PatchError(
            f"{path} has sha256 {got}, expected {UPSTREAM_SHA256} (SGLang 0.5.23's file): the diffs are "
            "made against that file only."
        )
    return path


_UPSTREAM: list[str] = []


def upstream_source() -> str:
    """SGLang 0.5.23's ``flashinfer_mla_backend.py``, exactly as the pinned wheel ships it (:func:`upstream_file`;
    read once per process)."""
    if not _UPSTREAM:
        _UPSTREAM.append(upstream_file().read_bytes().decode("utf-8"))
    return _UPSTREAM[0]


def patch_text(name: str) -> str:
    """The unified diff of patch ``name`` (one of :data:`PATCHES`)."""
    if name not in PATCHES:
        raise ValueError(f"unknown patch {name!r}; the patches are {PATCHES}.")
    return _read(f"{name}.diff")


def _hunks(diff: str) -> list[tuple[int, int, list[str]]]:
    """``(old_start, old_count, lines)`` per hunk; lines keep their ``' '``/``'-'``/``'+'`` prefix and newline."""
    hunks: list[tuple[int, int, list[str]]] = []
    lines = diff.splitlines(keepends=True)
    i = 0
    while i < len(lines) and not lines[i].startswith("@@"):
        i += 1
    if i == len(lines):
        raise PatchError("the diff has no hunk (no line starting with '@@').")
    while i < len(lines):
        m = _HUNK.match(lines[i])
        if not m:
            raise PatchError(f"diff line {i + 1} should start a hunk ('@@ -a,b +c,d @@'): {lines[i]!r}")
        old_start, old_count = int(m.group(1)), int(m.group(2) or 1)
        new_count = int(m.group(4) or 1)
        body: list[str] = []
        i += 1
        seen_old = seen_new = 0
        while i < len(lines) and (seen_old < old_count or seen_new < new_count):
            line = lines[i]
            if line.startswith("\\"):  # "\ No newline at end of file": the previous line has no newline
                body[-1] = body[-1].rstrip("\n")
            elif line[:1] in (" ", "-", "+"):
                body.append(line)
                seen_old += line[0] != "+"
                seen_new += line[0] != "-"
            elif line in ("\n", ""):  # an empty context line some editors strip to nothing
                body.append(" \n")
                seen_old += 1
                seen_new += 1
            else:
                raise PatchError(f"diff line {i + 1} is not a hunk line: {line!r}")
            i += 1
        if (seen_old, seen_new) != (old_count, new_count):
            raise PatchError(
                f"hunk @@ -{old_start},{old_count} is truncated: {seen_old} old and {seen_new} new lines "
                f"of {old_count} and {new_count}."
            )
        while i < len(lines) and lines[i].startswith("\\"):
            body[-1] = body[-1].rstrip("\n")
            i += 1
        hunks.append((old_start, old_count, body))
    return hunks


def apply_diff(source: str, diff: str, *, label: str = "diff") -> str:
    """``source`` with the unified ``diff`` applied, strictly: every hunk where it says (after the shifts of the
    hunks before it), its context and removed lines byte-identical to the file's, no fuzz. Raises
    :class:`PatchError` naming the hunk and the first line that differs."""
    src = source.splitlines(keepends=True)
    out: list[str] = []
    pos = 0  # next source line (0-based) not yet copied
    for n, (old_start, old_count, body) in enumerate(_hunks(diff), 1):
        start = old_start - 1 if old_count else old_start
        if start < pos:
            raise PatchError(f"{label}: hunk {n} (@@ -{old_start},{old_count}) overlaps the hunk before it.")
        old = [line[1:] for line in body if line[0] != "+"]
        if start + len(old) > len(src):
            raise PatchError(
                f"{label}: hunk {n} (@@ -{old_start},{old_count}) runs past the end of the file ({len(src)} lines)."
            )
        for k, want in enumerate(old):
            have = src[start + k]
            if have != want:
                raise PatchError(
                    f"{label}: hunk {n} (@@ -{old_start},{old_count}) does not apply: line "
                    f"{start + k + 1} should be {want!r} but the file has {have!r}."
                )
        out.extend(src[pos:start])
        out.extend(line[1:] for line in body if line[0] != "-")
        pos = start + len(old)
    out.extend(src[pos:])
    return "".join(out)


def apply_patch(name: str, source: str | None = None) -> str:
    """Patch ``name`` applied to ``source`` (default: the pristine upstream file); fails loudly
    (:class:`PatchError`) if any hunk does not apply."""
    return apply_diff(upstream_source() if source is None else source, patch_text(name), label=f"{name}.diff")


def patched_source(variant: str) -> str:
    """The backend's source for one of :data:`VARIANTS`."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}.")
    return upstream_source() if variant == "unpatched" else apply_patch(variant)


def load_patched_backend(
    name: str, *, wrappers: dict[str, Any] | None = None, device: torch.device | None = None
) -> types.ModuleType:
    """The backend module for ``name`` (one of :data:`VARIANTS`), executed from its (patched) source with the
    stand-ins of :mod:`~kvwall.peers.sglang_patch.stubs` in ``sys.modules`` for its sglang imports (removed
    afterwards, so a real sglang imported later is unaffected).

    ``wrappers``: classes to use instead of FlashInfer's (``{"BatchMLAPagedAttentionWrapper": ...,
    "BatchPrefillWithRaggedKVCacheWrapper": ...}``); then FlashInfer is not imported (its kernels need a GPU).
    ``device``: where the backend's hard-coded ``device="cuda"`` allocations go (default: CUDA, as in SGLang; give
    a CPU device to run the decode path on the CPU). Each call returns a fresh module."""
    source = patched_source(name)
    settings = StubSettings(flashinfer_available=wrappers is None)
    stubs = stub_modules(settings)
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    module_name = f"kvwall_sglang_{name}_flashinfer_mla_backend"
    module = types.ModuleType(module_name)
    module.__file__ = f"<{name}: {UPSTREAM_PATH}>"
    code = compile(source, module.__file__, "exec")
    for k in saved:
        del sys.modules[k]
    sys.modules.update(stubs)
    sys.modules[module_name] = module  # dataclasses look their module up while the file executes
    try:
        exec(code, module.__dict__)  # the upstream file (or its patch), as SGLang would import it
    finally:
        for k in stubs:
            sys.modules.pop(k, None)
        sys.modules.update(saved)
    if wrappers:
        module.__dict__.update(wrappers)
    if device is not None and torch.device(device).type != "cuda":
        module.torch = device_torch(torch.device(device))
    module.kvwall_stub_settings = settings
    return module
