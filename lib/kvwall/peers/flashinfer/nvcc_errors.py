"""Reading nvcc's words: compiler errors in a ninja/nvcc log, located in FlashInfer's sources.

:func:`parse_nvcc_output` turns the log of a JIT build into :class:`CompilerError` objects, each
with the instantiation chain the compiler printed (innermost first). Paths are shortened against
the release's folders (:func:`path_roots`): its include dir maps to ``""`` so files read
``flashinfer/mma.cuh``, generated sources to ``generated/``, its ``csrc`` to ``csrc/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Tuple

__all__ = [
    "InstantiationFrame",
    "CompilerError",
    "parse_nvcc_output",
    "path_roots",
    "shorten_path",
    "clean_compiler_output",
]

#: ``(absolute prefix, short prefix)`` pairs, longest first.
PathRoots = Sequence[Tuple[str, str]]


@dataclass(frozen=True)
class InstantiationFrame:
    """One ``instantiation of "<signature>" at line N of FILE`` note: ``function`` was instantiated
    from ``file``:``line``."""

    function: str  # short qualified name, e.g. "flashinfer::mla::compute_mla_pv"
    file: str  # relative to FlashInfer's include dir where possible
    line: int
    signature: str = ""  # the compiler's full text, template arguments included

    def __str__(self) -> str:
        return f"{self.function} / {self.file}({self.line})"


@dataclass(frozen=True)
class CompilerError:
    """One compiler error, located in FlashInfer's sources."""

    file: str  # relative to the include dir (e.g. "flashinfer/mma.cuh"), "generated/..." or absolute
    line: int
    message: str
    source_line: str = ""  # the offending line as the compiler echoed it
    instantiation_chain: Tuple[InstantiationFrame, ...] = ()
    translation_unit: str = ""  # the .cu being compiled, e.g. "generated/batch_mla_run.cu"

    @property
    def chain(self) -> list[str]:
        """The instantiation chain as ``"function / file(line)"`` strings, innermost first."""
        return [str(f) for f in self.instantiation_chain]

    def __str__(self) -> str:
        return f"{self.file}({self.line}): error: {self.message}"


def path_roots(folders: Mapping[str, Any]) -> list[Tuple[str, str]]:
    """Shortening pairs from a JIT driver's report of the release's folders (``include_dir``,
    ``gen_dir``, ``csrc_dir``), longest prefix first."""
    pairs = []
    inc = folders.get("include_dir")
    if inc:
        pairs.append((str(Path(inc).resolve()) + "/", ""))
        pairs.append((inc.rstrip("/") + "/", ""))
    gen = folders.get("gen_dir")
    if gen:
        pairs.append((gen.rstrip("/") + "/", "generated/"))
    csrc = folders.get("csrc_dir")
    if csrc:
        pairs.append((csrc.rstrip("/") + "/", "csrc/"))
    pairs.sort(key=lambda p: -len(p[0]))
    return pairs


def shorten_path(path: str, roots: PathRoots) -> str:
    """``path`` relative to the first root it is under (generated sources keep only their name)."""
    path = path.strip()
    for prefix, short in roots:
        if path.startswith(prefix):
            rest = path[len(prefix) :]
            if short == "generated/":  # generated/<arch>/generated/<uri>/file -> generated/file
                rest = rest.split("/")[-1]
            return short + rest
    return path


_COMMAND_LINE = re.compile(r"^(\[\d+/\d+\]|FAILED:)?\s*(\S*nvcc|\S*c\+\+|\S*g\+\+)\s.*?\s-c\s+(\S+)")


def clean_compiler_output(output: str, roots: PathRoots) -> str:
    """The build log with paths shortened and long compiler command lines elided (last 40,000
    characters)."""
    lines = []
    for ln in output.splitlines():
        if ln.startswith("ninja: Entering directory"):
            continue
        if ln.startswith("FAILED:"):
            lines.append("FAILED: " + " ".join(Path(t).name for t in ln.split()[1:]))
            continue
        m = _COMMAND_LINE.match(ln)
        if m and len(ln) > 300:
            lines.append(f"{m.group(1) or ''} {Path(m.group(2)).name} ... -c {shorten_path(m.group(3), roots)}".strip())
            continue
        for prefix, short in roots:
            if short == "generated/":
                ln = re.sub(re.escape(prefix) + r"\S*/", "generated/", ln)
            else:
                ln = ln.replace(prefix, "include/" if short == "" else short)
        lines.append(ln)
    return "\n".join(lines)[-40000:]


_EDG_ERR = re.compile(r"^(?P<file>\S[^()]*?)\((?P<line>\d+)\): (?:catastrophic )?error(?: #[\w-]+)?: (?P<msg>.*)$")
_GCC_ERR = re.compile(r"^(?P<file>/\S+?):(?P<line>\d+):(?:\d+:)? (?:fatal )?error: (?P<msg>.*)$")
_OTHER_ERR = re.compile(r"^(?P<msg>(?:nvcc fatal|ptxas (?:fatal|error)|nvlink error)\s*:.*)$")
_INST = re.compile(
    r"^\s*(?:detected during(?::)?\s*)?(?P<kind>instantiation of|implicit generation of)\s+"
    r"(?:class |variable )?\"(?P<sig>.*)\"(?: based on [^\"]*\")?\s+at line (?P<line>\d+)(?: of (?P<file>.+?))?\s*$"
)
_TU = re.compile(r'^\d+ errors? detected in the compilation of "(?P<tu>[^"]+)"')


def _without_templates(text: str) -> str:
    """``text`` with every ``<...>`` at any depth removed."""
    out, depth = [], 0
    for ch in text:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def _short_name(sig: str) -> str:
    """``void flashinfer::mma::f<X>(float *, DType *) [with ...]`` -> ``flashinfer::mma::f``."""
    s = re.sub(r"\s*\[with .*\]\s*$", "", sig).strip()
    depth, cut = 0, len(s)
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = i
            break
    words = _without_templates(s[:cut]).split()  # the return type, then the name
    return words[-1] if words else s


def _new_error(file: str, line: int, message: str, source_line: str = "") -> dict[str, Any]:
    return {
        "file": file,
        "line": line,
        "message": message,
        "source_line": source_line,
        "instantiation_chain": [],
        "translation_unit": "",
    }


def parse_nvcc_output(output: str, roots: PathRoots = ()) -> list[CompilerError]:
    """Compiler errors in ninja/nvcc output, in order, with their instantiation chains.

    ``roots``: ``(absolute prefix, short prefix)`` pairs used to shorten paths (see
    :func:`path_roots`)."""
    errors: list[dict[str, Any]] = []
    cur: Optional[dict[str, Any]] = None
    pending: list[dict[str, Any]] = []  # errors of the current translation unit, to tag with its name
    lines = output.splitlines()
    for i, ln in enumerate(lines):
        m = _EDG_ERR.match(ln) or _GCC_ERR.match(ln)
        if m:
            src = ""
            if i + 1 < len(lines) and lines[i + 1].startswith(" ") and "detected during" not in lines[i + 1]:
                src = lines[i + 1].strip()
            cur = _new_error(shorten_path(m.group("file"), roots), int(m.group("line")), m.group("msg").strip(), src)
            errors.append(cur)
            pending.append(cur)
            continue
        m = _OTHER_ERR.match(ln.strip())
        if m:
            cur = None
            errors.append(_new_error("", 0, m.group("msg")))
            pending.append(errors[-1])
            continue
        m = _INST.match(ln)
        if m and cur is not None:
            cur["instantiation_chain"].append(
                InstantiationFrame(
                    function=_short_name(m.group("sig")),
                    # the compiler leaves out "of FILE" when it is the file of the error itself
                    file=shorten_path(m.group("file"), roots) if m.group("file") else cur["file"],
                    line=int(m.group("line")),
                    signature=m.group("sig"),
                )
            )
            continue
        m = _TU.match(ln)
        if m:
            for e in pending:
                e["translation_unit"] = shorten_path(m.group("tu"), roots)
            pending, cur = [], None
            continue
        if ln.startswith(("[", "FAILED:", "ninja:")):
            cur = None
    return [
        CompilerError(
            file=e["file"],
            line=e["line"],
            message=e["message"],
            source_line=e["source_line"],
            instantiation_chain=tuple(e["instantiation_chain"]),
            translation_unit=e["translation_unit"],
        )
        for e in errors
    ]
