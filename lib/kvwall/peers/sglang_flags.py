"""SGLang 0.5.23's server flags and the values each accepts, read from its source with ``ast`` (SGLang not imported).

Where they are declared in 0.5.23: every input field of a namespace class in ``sglang/srt/arg_groups/fields/*.py``
listed in ``_INPUT_NAMESPACES`` (``sglang/srt/server_args.py``), as ``A[type, "help"]`` or ``A[type, Arg(...)]``;
``arg_utils.add_cli_args_from_dataclass`` turns each into ``--field-name`` (or ``Arg.cli_name``, plus
``Arg.aliases``), a ``bool`` field into a switch, ``Literal[...]`` or ``Arg.choices`` into argparse choices (a name
like ``ATTENTION_BACKEND_CHOICES`` is a list in ``arg_groups/choices.py``). ``ServerArgs.add_cli_args`` adds the
few flags with dynamic choices or deprecated spellings by hand (``parser.add_argument``). A flag whose choices are
computed at run time is recorded with ``choices=None`` (any value passes here).

One flag is checked after parsing, not by argparse: ``--speculative-algorithm`` takes any string, and resolution
upper-cases it and raises ``Unknown speculative algorithm name`` unless it names a ``SpeculativeAlgorithm`` member
or a reserved alias (``NEXTN``) (``sglang/srt/speculative/spec_info.py``, ``spec_registry.py``).

:func:`check_command` finds every ``--flag [value]`` in a text and says what 0.5.23 would reject. argparse's
``allow_abbrev`` is honoured: a unique prefix of a flag is that flag; an ambiguous one is rejected.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FlagSpec", "parse_flags", "sglang_flags", "check_command", "flags_in_markdown", "flags_in_python"]

FIELDS = "sglang/srt/arg_groups/fields"
CHOICES = "sglang/srt/arg_groups/choices.py"
SERVER_ARGS = "sglang/srt/server_args.py"
SPEC_INFO = "sglang/srt/speculative/spec_info.py"
SPEC_REGISTRY = "sglang/srt/speculative/spec_registry.py"


@dataclass(frozen=True)
class FlagSpec:
    """One command-line flag of ``sglang serve`` / ``python -m sglang.launch_server``."""

    flag: str  # the spelling given (``--attention-backend``)
    field: str  # the ServerArgs field it sets
    takes_value: bool
    choices: tuple[str, ...] | None  # argparse choices (as strings); None: any value
    resolution_choices: tuple[str, ...] | None = None  # checked after parsing (upper-cased), else None
    source: str = ""  # path:line of the declaration inside the wheel


def _list_literal(node: ast.AST, consts: dict[str, list[str]]) -> list[str] | None:
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        out = []
        for e in node.elts:
            if not isinstance(e, ast.Constant):
                return None
            out.append(str(e.value))
        return out
    if isinstance(node, ast.Name) and node.id in consts:
        return list(consts[node.id])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _list_literal(node.left, consts), _list_literal(node.right, consts)
        return None if a is None or b is None else a + b
    return None


def _choice_lists(root: Path) -> dict[str, list[str]]:
    tree = ast.parse((root / CHOICES).read_text())
    consts: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            vals = _list_literal(node.value, consts)
            if vals is not None:
                consts[node.targets[0].id] = vals
    return consts


def _input_namespaces(root: Path) -> set[str]:
    tree = ast.parse((root / SERVER_ARGS).read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in node.targets)
            and isinstance(node.value, ast.List)
        ):
            return {e.id for e in node.value.elts if isinstance(e, ast.Name)}
    raise ValueError(f"{SERVER_ARGS}: no _INPUT_NAMESPACES list; the flag parser needs updating for this SGLang")


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_bool(tp: ast.AST) -> bool:
    if isinstance(tp, ast.Name):
        return tp.id == "bool"
    if isinstance(tp, ast.Subscript) and isinstance(tp.value, ast.Name) and tp.value.id == "Optional":
        return _is_bool(tp.slice)
    return False


def _literal_values(tp: ast.AST) -> list[str] | None:
    if isinstance(tp, ast.Subscript) and isinstance(tp.value, ast.Name):
        if tp.value.id == "Optional":
            return _literal_values(tp.slice)
        if tp.value.id == "Literal":
            elts = tp.slice.elts if isinstance(tp.slice, ast.Tuple) else [tp.slice]
            return [str(e.value) for e in elts if isinstance(e, ast.Constant)]
    return None


def _field_flags(root: Path, consts: dict[str, list[str]], namespaces: set[str]) -> list[FlagSpec]:
    out: list[FlagSpec] = []
    for path in sorted((root / FIELDS).glob("*.py")):
        rel = path.relative_to(root).as_posix()
        for cls in ast.parse(path.read_text()).body:
            if not isinstance(cls, ast.ClassDef) or cls.name not in namespaces:
                continue
            for node in cls.body:
                if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                    continue
                ann = node.annotation
                if not (
                    isinstance(ann, ast.Subscript)
                    and isinstance(ann.value, ast.Name)
                    and ann.value.id == "A"
                    and isinstance(ann.slice, ast.Tuple)
                    and len(ann.slice.elts) >= 2
                ):
                    continue
                tp, meta = ann.slice.elts[0], ann.slice.elts[1]
                call = meta if isinstance(meta, ast.Call) and getattr(meta.func, "id", "") == "Arg" else None
                if call is None and not (isinstance(meta, ast.Constant) and isinstance(meta.value, str)):
                    continue  # Derived / NS metadata: not a CLI input (arg_utils._unwrap_annotated)
                field = node.target.id
                no_cli = (
                    call is not None and isinstance(_kw(call, "no_cli"), ast.Constant) and _kw(call, "no_cli").value
                )
                if no_cli:
                    continue
                cli = _kw(call, "cli_name") if call is not None else None
                names = [cli.value if isinstance(cli, ast.Constant) else "--" + field.replace("_", "-")]
                aliases = _kw(call, "aliases") if call is not None else None
                if aliases is not None:
                    names += _list_literal(aliases, consts) or []
                action = _kw(call, "action") if call is not None else None
                choices_node = _kw(call, "choices") if call is not None else None
                choices = _list_literal(choices_node, consts) if choices_node is not None else _literal_values(tp)
                if action is not None:
                    action_text = ast.unparse(action)
                    takes_value = "BooleanOptional" not in action_text and "store_true" not in action_text
                    if "BooleanOptional" in action_text:
                        names += ["--no-" + n[2:] for n in names]
                else:
                    takes_value = not _is_bool(tp)
                for name in names:
                    out.append(
                        FlagSpec(
                            name, field, takes_value, tuple(choices) if choices else None, source=f"{rel}:{node.lineno}"
                        )
                    )
    return out


def _manual_flags(root: Path, consts: dict[str, list[str]]) -> list[FlagSpec]:
    out: list[FlagSpec] = []
    for node in ast.walk(ast.parse((root / SERVER_ARGS).read_text())):
        if not (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
        ):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
        if not names:
            continue
        action = _kw(node, "action")
        action_text = ast.unparse(action) if action is not None else ""
        nargs = _kw(node, "nargs")
        takes_value = not (action_text in ("'store_true'", "'store_false'") or "StoreTrue" in action_text) and not (
            isinstance(nargs, ast.Constant) and nargs.value == 0
        )
        if "StoreConst" in action_text:  # DeprecatedStoreConstAction takes the old value (nargs=None)
            takes_value = True
        choices_node = _kw(node, "choices")
        choices = _list_literal(choices_node, consts) if choices_node is not None else None
        field = (
            _kw(node, "dest").value if isinstance(_kw(node, "dest"), ast.Constant) else names[0][2:].replace("-", "_")
        )
        for name in names:
            out.append(
                FlagSpec(
                    name, field, takes_value, tuple(choices) if choices else None, source=f"{SERVER_ARGS}:{node.lineno}"
                )
            )
    return out


def _speculative_algorithms(root: Path) -> tuple[str, ...]:
    members: list[str] = []
    for cls in ast.parse((root / SPEC_INFO).read_text()).body:
        if isinstance(cls, ast.ClassDef) and cls.name == "SpeculativeAlgorithm":
            members = [
                t.id
                for n in cls.body
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name) and t.id.isupper()
            ]
    aliases: list[str] = []
    for node in ast.parse((root / SPEC_REGISTRY).read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and any(getattr(t, "id", "") == "_RESERVED_ALIASES" for t in node.targets)
            and isinstance(node.value, ast.Call)
            and node.value.args
        ):
            aliases = _list_literal(node.value.args[0], {}) or []
    if not members:
        raise ValueError(f"{SPEC_INFO}: no SpeculativeAlgorithm enum found; the flag parser needs updating")
    return tuple(members + aliases)


def parse_flags(root: Path | str) -> dict[str, FlagSpec]:
    """Every flag ``sglang serve`` accepts in the source folder ``root`` (holding ``sglang/``), by spelling."""
    root = Path(root)
    consts = _choice_lists(root)
    flags = {f.flag: f for f in _field_flags(root, consts, _input_namespaces(root))}
    for f in _manual_flags(root, consts):
        flags.setdefault(f.flag, f)
    spec = flags.get("--speculative-algorithm")
    if spec is not None:
        flags["--speculative-algorithm"] = FlagSpec(
            spec.flag, spec.field, True, spec.choices, _speculative_algorithms(root), spec.source
        )
    return flags


@functools.lru_cache(maxsize=None)
def sglang_flags() -> dict[str, FlagSpec]:
    """:func:`parse_flags` of SGLang 0.5.23's wheel (obtained through
    :func:`kvwall.peers.sglang_source.sglang_source`)."""
    from kvwall.peers.sglang_source import sglang_source  # pylint: disable=import-outside-toplevel

    return parse_flags(sglang_source())


_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z0-9][A-Za-z0-9_-]*)(?:=(\S+))?")
_PLACEHOLDER = re.compile(r"^[<{\[]|^\$|^\.\.\.$")


def _resolve(name: str, flags: dict[str, FlagSpec]) -> tuple[FlagSpec | None, str | None]:
    if name in flags:
        return flags[name], None
    hits = sorted(f for f in flags if f.startswith(name))
    if len(hits) == 1:
        return flags[hits[0]], None
    if hits:
        return None, f"{name}: ambiguous abbreviation (argparse: could match {', '.join(hits[:6])})"
    return None, f"{name}: unknown flag (sglang {_version()} has no such option)"


def _version() -> str:
    from kvwall.peers.sglang_source import VERSION  # pylint: disable=import-outside-toplevel

    return VERSION


def check_command(text: str, flags: dict[str, FlagSpec] | None = None) -> list[str]:
    """What SGLang 0.5.23 would reject among the ``--flag [value]`` pairs in ``text``: unknown or ambiguous flags,
    values outside a flag's choices, a value given to a switch. Placeholders (``<NAME>``, ``{...}``, ``$X``) are
    not values. ``flags`` defaults to :func:`sglang_flags`."""
    flags = sglang_flags() if flags is None else flags
    tokens = text.replace("`", " ").replace("\\\n", " ").split()
    problems: list[str] = []
    i = 0
    while i < len(tokens):
        m = _FLAG.fullmatch(tokens[i].rstrip(",;:.)"))
        i += 1
        if m is None:
            continue
        name, inline = m.group(1), m.group(2)
        spec, err = _resolve(name, flags)
        if err:
            problems.append(err)
            continue
        value = inline
        if value is None and spec.takes_value and i < len(tokens) and not tokens[i].startswith("--"):
            value = tokens[i].rstrip(",;:.)")
            i += 1
        if value is None or _PLACEHOLDER.search(value):
            continue
        if not spec.takes_value:
            problems.append(f"{name} {value}: {name} is a switch and takes no value")
        elif spec.choices is not None and value not in spec.choices:
            problems.append(f"{name} {value}: not one of {', '.join(spec.choices)} ({spec.source})")
        elif spec.resolution_choices is not None and value.upper() not in spec.resolution_choices:
            problems.append(
                f"{name} {value}: resolution raises 'Unknown speculative algorithm name'; known: "
                f"{', '.join(spec.resolution_choices)}"
            )
    return problems


_NOT_SGLANG = re.compile(r"\b(kvwall|vllm|pip|ncu|nsys|compute-sanitizer|pytest|jupyter-book|papermill)\b", re.I)


def _sglang_span(span: str, flags: dict[str, FlagSpec]) -> bool:
    """A command fragment is SGLang's when it names at least one SGLang flag exactly and no other tool."""
    return bool(_NOT_SGLANG.search(span)) is False and any(m.group(1) in flags for m in _FLAG.finditer(span))


def flags_in_markdown(text: str, flags: dict[str, FlagSpec] | None = None) -> list[str]:
    """The SGLang command fragments in a MyST page: the lines of fenced code blocks and the inline code spans of
    each paragraph, that name an SGLang flag and no other tool. A notebook's code cells (```{code-cell}``) are its
    program, not commands it shows, and are left out (chapter 6 describes SGLang's flags in one). In a page about
    vLLM (its title names vLLM) a fragment counts only if it names SGLang."""
    flags = sglang_flags() if flags is None else flags
    title = next((ln for ln in text.splitlines() if ln.startswith("# ")), "")
    about_vllm = "vllm" in title.lower()
    spans: list[str] = []
    prose: list[str] = []
    fence = None
    code_cell = False
    for ln in text.splitlines():
        opener = re.match(r"^\s*(`{3,}|~{3,})", ln)
        if fence is None and opener:
            fence = opener.group(1)
            code_cell = ln.strip()[len(fence) :].startswith("{code-cell}")
            prose.append("")
        elif fence is not None:
            if ln.strip().startswith(fence):
                fence = None
            elif not code_cell:
                spans.append(ln)
        else:
            prose.append(ln)
    for para in re.split(r"\n\s*\n", "\n".join(prose)):
        spans += re.findall(r"`([^`]+)`", para)
    return [s for s in spans if _sglang_span(s, flags) and (not about_vllm or "sglang" in s.lower())]


def _fragments(text: str) -> list[str]:
    """Markdown text: its inline code spans (a flag's value is never taken from the prose around one); plain text:
    itself."""
    spans = [s for s in re.findall(r"`([^`]+)`", text) if "\n\n" not in s]
    return spans if spans else [text]


def flags_in_python(source: str, flags: dict[str, FlagSpec] | None = None) -> list[str]:
    """The SGLang command fragments among a Python module's string constants (an f-string as one text, a formatted
    part left as a ``{...}`` placeholder; Markdown strings by their code spans), plus ``--attention-backend <v>`` for
    each value of a module-level dict named ``SGLANG_BACKEND`` (what it maps to is printed as that flag's value)."""
    flags = sglang_flags() if flags is None else flags
    tree = ast.parse(source)
    out: list[str] = []
    in_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        texts: list[str] = []
        if isinstance(node, ast.JoinedStr):
            texts = [("".join(v.value if isinstance(v, ast.Constant) else "{...}" for v in node.values))]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstrings:
            texts = [node.value]
        elif (
            isinstance(node, ast.Assign)
            and any(getattr(t, "id", "") == "SGLANG_BACKEND" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            out += [f"--attention-backend {v.value}" for v in node.value.values if isinstance(v, ast.Constant)]
        out += [f for t in texts for f in _fragments(t) if _sglang_span(f, flags)]
    return list(dict.fromkeys(out))
