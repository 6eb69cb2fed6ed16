"""Reading an installed FlashInfer release's own C++ sources: excerpts and definitions.

The chapters quote the lines a compiler error points at from the release itself, never from
memory: :func:`read_source` gives numbered lines around one, :func:`find_definition` finds where a
function is defined in the include tree. Both install the release on demand
(:func:`kvwall.peers.flashinfer.releases.install_release`), so without network they need it in
the cache already.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

from kvwall.peers.flashinfer.errors import FlashInferReleaseError, InvalidConfigError, ReleaseImportError
from kvwall.peers.flashinfer.releases import CacheRoot, install_release, release_dir

__all__ = [
    "SourceExcerpt",
    "SourceLocation",
    "include_dir",
    "why_sources_unavailable",
    "read_source",
    "find_definition",
]


@dataclass(frozen=True)
class SourceExcerpt:
    """Lines ``first``..``last`` of a file inside an installed release."""

    release: str
    file: str  # as resolved, relative to the release's include dir (or to flashinfer/data)
    path: str  # absolute path on this machine
    line: int  # the line asked for
    lines: Tuple[Tuple[int, str], ...]  # (number, text) pairs

    @property
    def text(self) -> str:
        """The line asked for, without its newline."""
        return dict(self.lines).get(self.line, "")

    def render(self, mark: str = ">") -> str:
        width = len(str(self.lines[-1][0])) if self.lines else 1
        out = []
        for n, t in self.lines:
            out.append(f"{mark if n == self.line else ' '} {n:>{width}} | {t}")
        return "\n".join(out)


@dataclass(frozen=True)
class SourceLocation:
    """Where a function is defined inside a release's include tree."""

    file: str  # relative to the include dir
    line: int  # the line holding the name
    text: str


def include_dir(release: str, cache_root: CacheRoot = None, install: bool = True) -> Path:
    """The release's C++ include root (``.../flashinfer/data/include``; it holds ``flashinfer/``)."""
    d = install_release(release, cache_root) if install else release_dir(release, cache_root)
    for cand in (d / "flashinfer" / "data" / "include", d / "flashinfer" / "include"):
        if cand.is_dir():
            return cand
    raise ReleaseImportError(f"flashinfer {release} installed at {d} has no include/ folder (flashinfer/data/include).")


def why_sources_unavailable(release: str, cache_root: CacheRoot = None) -> str:
    """``""`` when ``release``'s sources can be read here (installing it now if need be), else why
    not in one line (``"NetworkUnavailableError: ..."``): a chapter then shows recorded evidence."""
    try:
        include_dir(release, cache_root)
    except FlashInferReleaseError as why:
        return f"{type(why).__name__}: {str(why).splitlines()[0]}"
    return ""


def _resolve_source(release: str, file: str, cache_root: CacheRoot) -> Tuple[Path, str]:
    inc = include_dir(release, cache_root)
    data = inc.parent
    f = file.strip().lstrip("/")
    candidates = []
    for prefix in ("include/", "flashinfer/data/include/", "data/include/"):
        if f.startswith(prefix):
            candidates.append((inc / f[len(prefix) :], f[len(prefix) :]))
    candidates += [(inc / f, f), (inc / "flashinfer" / f, "flashinfer/" + f), (data / f, f)]
    if f.startswith("csrc/"):
        candidates.append((data / f, f))
    for path, rel in candidates:
        if path.is_file():
            return path, rel
    raise FileNotFoundError(
        f"{file!r} is not in FlashInfer {release}'s sources. Give a path relative to its include dir, "
        f"such as 'flashinfer/mma.cuh' or 'flashinfer/attention/mla.cuh' (looked under {inc})."
    )


def read_source(release: str, file: str, line: int, context: int = 5, *, cache_root: CacheRoot = None) -> SourceExcerpt:
    """Lines ``line - context`` .. ``line + context`` of ``file`` in the installed ``release``
    (installed on demand).  ``file`` is relative to the include dir (``"flashinfer/mma.cuh"``;
    ``"include/flashinfer/mma.cuh"`` and ``"attention/mla.cuh"`` work too) or to ``flashinfer/data``
    (``"csrc/batch_mla_run.cu"``)."""
    path, rel = _resolve_source(release, file, cache_root)
    text = path.read_text(errors="replace").splitlines()
    if not 1 <= line <= len(text):
        raise ValueError(f"{rel} in FlashInfer {release} has {len(text)} lines; line {line} is outside it.")
    lo, hi = max(1, line - context), min(len(text), line + context)
    return SourceExcerpt(
        release=release,
        file=rel,
        path=str(path),
        line=line,
        lines=tuple((n, text[n - 1]) for n in range(lo, hi + 1)),
    )


_NOT_A_TYPE = {"return", "else", "case", "new", "delete", "throw", "co_return", "goto", "sizeof", "decltype"}


def find_definition(release: str, function: str, *, cache_root: CacheRoot = None) -> List[SourceLocation]:
    """Where ``function`` is defined in ``release``'s include tree (``*.cuh``, ``*.h``, ``*.hpp``),
    as a list (overloads give several).  ``function`` may be qualified
    (``"flashinfer::mma::m16k16_rowsum_f16f16f32"`` or ``"mla::compute_mla_pv"``); the namespaces
    given must be opened in the file.  Calls and declarations ending in ``;`` are not definitions."""
    parts = [p for p in function.split("::") if p]
    if not parts:
        raise InvalidConfigError(f"Expected a function name such as 'mma::m16k16_rowsum_f16f16f32', got {function!r}.")
    name, namespaces = parts[-1], [p for p in parts[:-1] if p != "flashinfer"]
    inc = include_dir(release, cache_root)
    pat = re.compile(r"(?<![\w.>:])(?:\w+::)*" + re.escape(name) + r"\s*(?:<[^()]*>)?\s*\(")
    hits: List[SourceLocation] = []
    files = sorted(p for ext in ("*.cuh", "*.h", "*.hpp") for p in inc.rglob(ext))
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if name not in text:
            continue
        if namespaces and not all(re.search(r"namespace\s+" + re.escape(ns) + r"\b", text) for ns in namespaces):
            continue
        lines = text.splitlines()
        for i, ln in enumerate(lines):
            m = pat.search(ln)
            if not m:
                continue
            prefix = ln[: m.start()].strip()
            if prefix.startswith(("//", "*", "/*", "#")):
                continue
            if prefix:
                if re.search(r"[=(),.;{}\"]|->", prefix) or prefix.split()[-1] in _NOT_A_TYPE:
                    continue
                if prefix.split()[0] in _NOT_A_TYPE:
                    continue
            else:
                prev = lines[i - 1].rstrip() if i else ""
                if not re.search(r"[\w>*&]$", prev) or prev.strip().startswith(("//", "#")):
                    continue
            # a definition has its body before the next ';'
            rest = "\n".join(lines[i : i + 40])[m.end() :]
            brace, semi = rest.find("{"), rest.find(";")
            if brace == -1 or (semi != -1 and semi < brace):
                continue
            hits.append(SourceLocation(file=str(path.relative_to(inc)), line=i + 1, text=ln.rstrip()))
    return hits
