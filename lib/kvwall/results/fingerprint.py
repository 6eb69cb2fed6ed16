"""The code a recorded result depends on: found from its experiment's imports, hashed so only code counts.

An experiment's fingerprint covers the import closure of its module inside ``kvwall`` (``lib/kvwall/``)
and ``kvwall.kernels`` (``kernels/``): every project module an ``import`` or ``from ... import``
statement of the module names (function-local imports too), followed transitively; plus the data
files (``*.json``, ``*.cu``, ``*.cuh``: tuned tables, CUDA twins) that the kernel modules in the closure read. A
package's ``__init__.py`` belongs to the closure only where its own code is used (``import kvwall.kernels``, or a name
it defines); a name it re-exports leads to the module that defines it (``from kvwall.kernels import gather_cast``
reaches ``kernels/gather/kernel.py``, not every kernel). The bookkeeping modules (:data:`BOOKKEEPING`: recording
results, describing experiments) are not followed: they file the numbers, they do not produce them.

Python files are hashed after normalizing (parse, drop docstrings, write out the syntax tree without
positions): comments, docstrings and formatting do not change a fingerprint, a line of code does. CUDA sources
(``*.cu``, ``*.cuh``) are hashed after stripping their comments and the whitespace that does not separate two words
(:func:`normalized_cuda`): a comment fix or a re-indent leaves a result fresh, an edited statement stales it. Other
data files (tuned tables, diffs) are hashed by their bytes.

What a data file holds is what its readers depend on, so a table the code reads holds only that: the dispatcher's
``kernels/mla_decode/kernel_paths.json`` holds its choices (the fastest path per measured point), and re-timing every
point without changing a choice writes the same bytes. The times behind the choices, the run's caption and date live in
a sidecar, ``kernels/mla_decode/kernel_paths_measured.json``, that no code of the kernels reads. It is kept out of every
fingerprint by the rule for data files, not by an exception (:func:`_kernel_data_files`): a data file counts only
where a closure module *of its own folder* names it in a string (by name, or by suffix), and the sidecar is named
only by the experiment that writes it (``kvwall.experiments.fused_decode.kernel_paths``, whose ``MEASURED_FILE``
chapter 5's report imports). A module of ``kernels/mla_decode/`` that named it -- or a string that is just
``".json"`` there -- would put it in the fingerprint of every result that runs the dispatcher
(``tests/test_fingerprint.py`` checks that none does).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import re
import stat
from pathlib import Path
from typing import Iterable

from kvwall.results.locations import PACKAGE_DIRS, PROJECT_ROOT

__all__ = [
    "BOOKKEEPING",
    "CUDA_SUFFIXES",
    "DATA_SUFFIXES",
    "import_closure",
    "normalized_code",
    "normalized_cuda",
    "source_fingerprint",
    "source_hashes",
]

#: Files of a kernel folder that its code reads at run time or compiles (tuned tables, CUDA sources).
DATA_SUFFIXES = (".json", ".cu", ".cuh", ".diff")
#: The data files hashed as CUDA C++ (comments and layout whitespace stripped, :func:`normalized_cuda`).
CUDA_SUFFIXES = (".cu", ".cuh")
_PROJECT_PACKAGE = "kvwall"
#: Modules (and their submodules) left out of every closure: they record and describe results.
BOOKKEEPING = ("kvwall.results", "kvwall.experiments.registry", "kvwall.experiments.schemas")


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _module_file(module: str, root: Path) -> Path | None:
    """The file that defines ``module`` in the tree at ``root``, or None if the tree has none."""
    for package, folder in PACKAGE_DIRS:
        if not _within(module, package):
            continue
        parts = module[len(package) + 1 :].split(".") if module != package else []
        base = root.joinpath(folder, *parts)
        candidates = ([base.with_name(base.name + ".py")] if parts else []) + [base / "__init__.py"]
        return next((c for c in candidates if c.is_file()), None)
    return None


def _import_statements(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """``(imported module, [names imported from it])`` for each import statement in ``tree`` (the source of
    ``module``); plain ``import a.b`` gives ``("a.b", [])``."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.append((base, [alias.name for alias in node.names if alias.name != "*"]))
    return found


def _counts(module: str) -> bool:
    return _within(module, _PROJECT_PACKAGE) and not any(_within(module, b) for b in BOOKKEEPING)


def _re_exported_from(package: str, name: str, root: Path, depth: int = 0) -> str | None:
    """The module a package's ``__init__.py`` takes ``name`` from (``from .gather.kernel import gather_cast``),
    followed through further re-exports; None when the ``__init__.py`` defines ``name`` itself."""
    path = _module_file(package, root)
    if path is None or path.name != "__init__.py" or depth > 8:
        return None
    tree = ast.parse(path.read_bytes(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for base, names in _import_statements(ast.Module(body=[node], type_ignores=[]), package, True):
                for alias in node.names:
                    if (alias.asname or alias.name) == name and alias.name in names:
                        if _module_file(f"{base}.{alias.name}", root) is not None:
                            return f"{base}.{alias.name}"
                        deeper = _re_exported_from(base, alias.name, root, depth + 1)
                        return deeper or base
    return None


def _imported_modules(tree: ast.Module, module: str, is_package: bool, root: Path) -> set[str]:
    """Project modules whose code the import statements in ``tree`` (the source of ``module``) reach.

    ``from package import name`` reaches the module ``package.name`` if there is one, else the module the
    package's ``__init__.py`` re-exports ``name`` from (``from kvwall.kernels import mla_decode_reference``
    reaches ``kernels/mla_decode/reference.py`` alone, not every kernel), else the ``__init__.py`` itself."""
    modules: set[str] = set()
    for base, names in _import_statements(tree, module, is_package):
        if not names:
            modules.add(base)
            continue
        for name in names:
            if _module_file(f"{base}.{name}", root) is not None:
                modules.add(f"{base}.{name}")
            else:
                modules.add(_re_exported_from(base, name, root) or base)
    return {m for m in modules if _counts(m)}


def import_closure(module: str, root: Path = PROJECT_ROOT) -> list[Path]:
    """Files of ``module`` and of every project module it imports, transitively, in the tree at ``root``.

    Names that are not modules (``from kvwall.kernels import gather_cast``, a function) lead to the module
    that defines them (see :func:`_imported_modules`).
    """
    start = _module_file(module, root)
    if start is None:
        raise ModuleNotFoundError(
            f"{module!r} is not a module of this project under {root} (folders: "
            + ", ".join(f"{p} -> {f}/" for p, f in PACKAGE_DIRS)
            + ")."
        )
    seen: dict[str, Path] = {module: start}
    todo = [module]
    while todo:
        current = todo.pop()
        path = seen[current]
        tree = ast.parse(path.read_bytes(), filename=str(path))
        for name in _imported_modules(tree, current, path.name == "__init__.py", root):
            if name not in seen and (found := _module_file(name, root)) is not None:
                seen[name] = found
                todo.append(name)
    return sorted(set(seen.values()))


def _kernel_data_files(files: Iterable[Path], root: Path) -> list[Path]:
    """The data files (:data:`DATA_SUFFIXES`) beside a closure module that it names in a string: by name
    (``Path(__file__).with_name("tuned.json")``, ``with_name("gather_cast.cu")``), or by suffix where it builds the
    name (``f"{name}.diff"``: every ``*.diff`` of its folder). Kernel folders and the peers' packages hold them."""
    del root
    found: set[Path] = set()
    for f in files:
        if f.suffix != ".py":
            continue
        data = [p for p in f.parent.iterdir() if p.is_file() and p.suffix in DATA_SUFFIXES]
        if not data:
            continue
        strings = {
            node.value
            for node in ast.walk(ast.parse(f.read_bytes()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        }
        found.update(p for p in data if p.name in strings or p.suffix in strings)
    return sorted(found)


def _canonical(node: object) -> str:
    """An AST as text, without positions, empty fields or empty f-string parts: Python 3.12 added fields
    (``type_params``) that are empty in this project's code and writes nested f-string format specs differently,
    and the same code must fingerprint alike under 3.11 (this machine's CI) and 3.12 (the GPU machine)."""
    if isinstance(node, ast.JoinedStr):
        # Python 3.12.0-3.12.x end a nested format spec (f"{n:>{w}}") with an empty Constant('') that 3.11 and
        # 3.13 do not write: empty parts of an f-string are left out, so all three give the same text.
        node = ast.JoinedStr(values=[v for v in node.values if not (isinstance(v, ast.Constant) and v.value == "")])
    if isinstance(node, ast.AST):
        fields = ", ".join(
            f"{name}={_canonical(value)}" for name, value in ast.iter_fields(node) if value is not None and value != []
        )
        return f"{type(node).__name__}({fields})"
    if isinstance(node, list):
        return "[" + ", ".join(_canonical(item) for item in node) + "]"
    return repr(node)


def normalized_code(source: str | bytes) -> str:
    """Python source reduced to what runs: parsed, docstrings dropped, written out as its syntax tree
    (comments, docstrings and formatting are gone; an edited line of code shows)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            is_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            if is_docstring and isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return _canonical(tree)


#: One lexical unit of CUDA C++ for :func:`normalized_cuda`: a comment, a string or character literal (kept whole), a
#: line break, a run of other whitespace, or one other character.
_CUDA_TOKEN = re.compile(r"""//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|\n|[ \t\f\v\r]+|.""", re.S)


def _is_word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


#: Symbols that can join a neighbour into another token (``- -`` is not ``--``, ``> >`` is not ``>>``).
_JOINING = frozenset("+-*/%<>=&|!^:.?~#")


def _separates(prev: str, nxt: str) -> bool:
    """Whether whitespace between characters ``prev`` and ``nxt`` of one line can change what the line means."""
    if _is_word(prev) or _is_word(nxt):
        return _is_word(prev) and _is_word(nxt)
    return prev in _JOINING and nxt in _JOINING


def normalized_cuda(source: str | bytes) -> str:
    """CUDA C++ source reduced to its tokens' text: comments dropped (each counts as a space), line breaks and
    indentation treated as spaces, and whitespace kept only where it separates two words (``unsigned int``) or two
    symbols that could join (``a - -b``, ``> >``); so re-wrapping or re-indenting a statement, or fixing a comment,
    does not change it, and editing a statement does. Preprocessor directives stay one per line with every
    separating space (``#define F (x)`` is not ``#define F(x)``; a continued line is joined). String and character
    literals are kept byte for byte."""
    text = source.decode() if isinstance(source, bytes) else source
    lines: list[str] = []
    line: list[str] = []
    pending_space = at_line_start = False

    def end_line() -> None:
        if line:
            lines.append("".join(line))
        line.clear()

    for match in _CUDA_TOKEN.finditer(text):
        tok = match.group()
        directive = bool(line) and line[0] == "#"
        if tok == "\n" or (tok.startswith("/*") and "\n" in tok and directive):
            if directive and line[-1] == "\\":
                line.pop()  # a continued directive: the next line is part of it
                while line and line[-1] == " ":
                    line.pop()
            elif directive:
                end_line()
            pending_space = at_line_start = True
        elif tok.startswith(("//", "/*")) or tok.isspace():
            pending_space = True
        else:
            if at_line_start and tok == "#":
                end_line()
            elif pending_space and line and (directive or _separates(line[-1][-1], tok[0])):
                line.append(" ")
            line.append(tok)
            pending_space = at_line_start = False
    end_line()
    return "\n".join(lines)


@functools.lru_cache(maxsize=512)
def _hash_file(path: Path, _mtime_ns: int, _size: int) -> str:
    data = path.read_bytes()
    if path.suffix == ".py":
        try:
            data = normalized_code(data).encode()
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            pass  # a file that does not parse is hashed as it is: it differs from any recorded hash
    elif path.suffix in CUDA_SUFFIXES:
        try:
            data = normalized_cuda(data).encode()
        except UnicodeDecodeError:
            pass  # not text: hashed as it is
    return hashlib.sha256(data).hexdigest()[:16]


def _file_hash(path: Path) -> str | None:
    """The file's hash; None where it is gone, or is not a plain file (a pipe or a device is never read)."""
    try:
        info = path.stat()
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(info.st_mode):
        return None
    try:
        return _hash_file(path, info.st_mtime_ns, info.st_size)
    except OSError:
        return None


def source_hashes(paths: Iterable[str], root: Path = PROJECT_ROOT) -> dict[str, str | None]:
    """Hash of each file (relative to ``root``) as it is now; None where it is gone."""
    return {p: _file_hash(root / p) for p in paths}


def source_fingerprint(module: str, root: Path = PROJECT_ROOT) -> dict[str, str]:
    """``{path relative to root: hash}`` of the code ``module``'s results depend on (see the module docstring)."""
    code = import_closure(module, root)
    files = code + _kernel_data_files(code, root)
    return {f.relative_to(root).as_posix(): h for f in files if (h := _file_hash(f)) is not None}
