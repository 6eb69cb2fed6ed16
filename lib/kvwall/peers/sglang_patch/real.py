"""SGLang 0.5.23's own ``flashinfer_mla`` backend, imported from SGLang's real modules, unpatched and patched.

:func:`import_sglang` puts a folder holding SGLang's Python sources (``sglang/...``, e.g. the wheel's files) first on
``sys.path`` and imports what the backend imports -- ``sglang.srt.layers.attention.flashinfer_mla_backend``, its
``MLATokenToKVPool``, ``ReqToTokenPool``, ``KVIndexTranslator``, ``ForwardMode``, ``EagleVerifyInput``, ``ServerArgs``
and the runtime context -- then publishes a ``ServerArgs(model_path="dummy")`` context as SGLang's own tests do
(``sglang.test.test_utils.published_topology``).

A module that cannot be imported on the machine gets a stand-in (:class:`StandInFinder`) only where SGLang imports it
*unguarded* (an import not inside a ``try`` that catches ``ImportError``): a guarded import fails as SGLang designed
it to (its fallback runs). Every stand-in is recorded with the SGLang file that imported it, and once the import is
done (:meth:`StandInFinder.arm`) no new stand-in is made: an import at run time fails loudly. A stand-in callable
that is called after arming is recorded too (:attr:`StandInFinder.calls`): a driven step must call none.

A stand-in has no behaviour, so it never pretends to: only a decorator (a call on an ``@`` line) passes its function
through; any other call of a stand-in (``dill.dumps(cls)`` at import time, say) returns a :class:`StandInValue`,
which raises :class:`StandInUsed` -- naming the missing module, the importing file and the call site -- as soon as
anything needs it to behave (an attribute, a call, iteration, truth, conversion). A module the chain really needs
then fails the import there, plainly, instead of running on a fake (carry its wheel).

:func:`load_variant` gives the backend module of one variant: ``unpatched`` is SGLang's module itself (checked byte
for byte against the pinned wheel's file, :func:`kvwall.peers.sglang_patch.upstream_source`); a patch is applied
with ``git apply --check`` then ``git apply`` to a copy of that file in a temporary folder and that file is imported
as a module of its own.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import linecache
import os
import subprocess
import sys
import tempfile
import time
import types
from importlib import resources
from typing import Any

__all__ = [
    "StandInFinder",
    "StandInUsed",
    "StandInValue",
    "import_sglang",
    "load_variant",
    "git_apply",
    "BACKEND_MODULE",
]

BACKEND_MODULE = "sglang.srt.layers.attention.flashinfer_mla_backend"
#: Never stood in for: what the check is about (or what must be real for it to mean anything).
NEVER = frozenset({"sglang", "torch", "triton", "kvwall", "flashinfer", "numpy", "transformers", "pydantic", "msgspec"})
_CATCHES_IMPORT = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _StandInMeta(type):
    """A class standing in for any attribute of a missing module; usable as a base, a decorator, a type hint."""

    finder: "StandInFinder | None" = None

    def __new__(mcs, name, bases, ns, **kwargs):  # a subclass may pass class keywords (TypedDict's total=False)
        return super().__new__(mcs, name, bases, ns)

    def __init__(cls, name, bases, ns, **kwargs):
        super().__init__(name, bases, ns)

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stand_in_class(f"{cls.__qualname__}.{name}")

    def __call__(cls, *a, **k):
        if "__kvwall_standin__" not in cls.__dict__:  # SGLang's own subclass of a stand-in: a real class, built
            return super().__call__(*a, **k)
        f = _StandInMeta.finder
        if f is not None and f.armed:
            f.calls.append(cls.__qualname__)
        site, decorating = _call_site()
        if decorating:  # `@missing.deco` passes the function through; `@missing.deco(...)` gives a pass-through
            return a[0] if len(a) == 1 and callable(a[0]) and not k else _pass_through
        return StandInValue(cls.__qualname__, site)

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False


def _any_schema(cls, source, handler):  # a pydantic model with a stand-in field type accepts anything there
    from pydantic_core import core_schema  # pylint: disable=import-outside-toplevel

    return core_schema.any_schema()


class StandInUsed(RuntimeError):
    """What a stood-in module's call returned was used as if the module were there."""


def _call_site() -> tuple[str, bool]:
    """``file:line`` of the code calling a stand-in, and whether that line is a decorator."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename == __file__:
        f = f.f_back
    if f is None:
        return "?", False
    fn, line = f.f_code.co_filename, f.f_lineno
    src = linecache.getline(fn, line).lstrip()
    short = fn[fn.rfind(os.sep + "sglang" + os.sep) + 1 :] if os.sep + "sglang" + os.sep in fn else fn
    return f"{short}:{line}", src.startswith("@")


def _pass_through(fn):
    return fn


class StandInValue:
    """What a call of a stand-in returns: anything that needs it to behave raises :class:`StandInUsed`."""

    __slots__ = ("_what", "_site")

    def __init__(self, what: str, site: str) -> None:
        object.__setattr__(self, "_what", what)
        object.__setattr__(self, "_site", site)

    def _used(self, how: str):
        what = object.__getattribute__(self, "_what")
        top = what.split(".")[0]
        f = _StandInMeta.finder
        where = f.standins.get(top, "?") if f is not None else "?"
        raise StandInUsed(
            f"{what}(...) called at {object.__getattribute__(self, '_site')} returned a stand-in, and "
            f"its {how} was used: module {top!r} is missing on this machine (imported unguarded at "
            f"{where}) and a stand-in has no behaviour; install or carry {top!r}"
        )

    def __getattr__(self, name):
        self._used(f".{name}")

    def __setattr__(self, name, value):
        self._used(f".{name} =")

    def __call__(self, *a, **k):
        self._used("call")

    def __iter__(self):
        self._used("iteration")

    def __len__(self):
        self._used("len()")

    def __bool__(self):
        self._used("truth value")

    def __getitem__(self, item):
        self._used("[...]")

    def __str__(self):
        self._used("str()")

    def __format__(self, spec):
        self._used("format()")

    def __bytes__(self):
        self._used("bytes()")

    def __int__(self):
        self._used("int()")

    def __float__(self):
        self._used("float()")

    def __index__(self):
        self._used("index")

    def __repr__(self):
        get = object.__getattribute__
        return f"<stand-in value of {get(self, '_what')}(...) at {get(self, '_site')}>"


def _stand_in_class(name: str) -> type:
    return _StandInMeta(
        name.rsplit(".", 1)[-1],
        (),
        {
            "__qualname__": name,
            "__init__": lambda self, *a, **k: None,
            "__kvwall_standin__": True,
            "__init_subclass__": classmethod(lambda c, **k: None),
            "__get_pydantic_core_schema__": classmethod(_any_schema),
            "__getattr__": lambda self, n: _stand_in_class(n),
        },
    )


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        v = _stand_in_class(f"{self.__name__}.{name}")
        setattr(self, name, v)
        return v


def _guarded(filename: str, lineno: int, cache: dict[str, list[tuple[int, int]]]) -> bool:
    """Whether line ``lineno`` of ``filename`` is inside a ``try`` body one of whose handlers catches ImportError."""
    spans = cache.get(filename)
    if spans is None:
        spans = []
        try:
            tree = ast.parse(open(filename, encoding="utf-8").read())
        except (OSError, SyntaxError, ValueError):
            tree = None
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.Try) and node.body:
                names: set[str] = set()
                for h in node.handlers:
                    if h.type is None:
                        names.add("BaseException")
                    for t in (h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]) if h.type else []:
                        names.add(getattr(t, "id", getattr(t, "attr", "")))
                if names & _CATCHES_IMPORT:
                    spans.append((node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno))
        cache[filename] = spans
    return any(lo <= lineno <= hi for lo, hi in spans)


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: a stand-in for a top-level module no other finder found, only when a file under
    ``root`` imports it outside a ``try`` that catches ImportError. ``standins``: ``{module: importing file}``."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root) + os.sep
        self.tops: set[str] = set()
        self.standins: dict[str, str] = {}
        self.guarded_missing: dict[str, str] = {}  # missing modules SGLang imports guarded (its fallback ran)
        self.armed = False
        self.calls: list[str] = []
        self._spans: dict[str, list[tuple[int, int]]] = {}
        _StandInMeta.finder = self

    def arm(self) -> None:
        """From now on no new stand-in is made, and calls into stand-ins are recorded."""
        self.armed = True

    def _importer(self) -> tuple[str, int]:
        f = sys._getframe(2)
        while f is not None:
            fn = f.f_code.co_filename
            if not fn.startswith("<frozen") and "importlib" not in fn:
                return fn, f.f_lineno
            f = f.f_back
        return "", 0

    def find_spec(self, name, path=None, target=None):  # importlib's protocol
        top = name.split(".")[0]
        if top in NEVER:
            return None
        if "." in name:
            return importlib.machinery.ModuleSpec(name, self, is_package=True) if top in self.tops else None
        if self.armed:
            return None
        fn, line = self._importer()
        real = os.path.realpath(fn) if fn else ""
        if not real.startswith(self.root):
            return None
        rel = real[len(self.root) - len(os.sep) - len("sglang") :] if "sglang" in real else real
        if _guarded(real, line, self._spans):
            self.guarded_missing.setdefault(top, f"{rel}:{line}")
            return None
        self.tops.add(top)
        self.standins.setdefault(top, f"{rel}:{line}")
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = _StandInModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def import_sglang(root: str, *, server_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """Import SGLang's backend chain from ``root`` (a folder holding ``sglang/``), stand-ins as the module docstring
    says, and publish a test runtime context. Returns what was imported: the modules (``sglang`` classes and
    functions the driver uses), the finder, how many SGLang files were loaded, and each loaded file's sha256 checked
    against the wheel's ``RECORD`` when ``root`` holds it."""
    t0 = time.perf_counter()
    root = os.path.realpath(root)
    if root not in sys.path:
        sys.path.insert(0, root)
    try:  # before any stand-in exists: transformers probes optional packages with find_spec at import
        importlib.import_module("transformers.processing_utils")
    except Exception:  # noqa: BLE001 - transformers is optional here; SGLang says if it needs it
        pass
    finder = StandInFinder(os.path.join(root, "sglang"))
    sys.meta_path.append(finder)
    mods = {}
    mods["backend"] = importlib.import_module(BACKEND_MODULE)
    mods["memory_pool"] = importlib.import_module("sglang.srt.mem_cache.memory_pool")
    mods["translator"] = importlib.import_module("sglang.srt.mem_cache.kv_index_translator")
    mods["forward_batch_info"] = importlib.import_module("sglang.srt.model_executor.forward_batch_info")
    mods["eagle_info"] = importlib.import_module("sglang.srt.speculative.eagle_info")
    mods["spec_info"] = importlib.import_module("sglang.srt.speculative.spec_info")
    mods["runtime_context"] = importlib.import_module("sglang.srt.runtime_context")
    mods["server_args"] = importlib.import_module("sglang.srt.server_args")
    t_import = time.perf_counter() - t0
    rc, sa = mods["runtime_context"], mods["server_args"]
    args = sa.ServerArgs(model_path="dummy", **(server_args or {}))
    rc.reset_context()
    rc.publish(args, role="test", ranks=rc.SpawnRanks(world_rank=0))
    finder.arm()
    files = sorted(
        {
            os.path.realpath(m.__file__)
            for k, m in list(sys.modules.items())
            if (k == "sglang" or k.startswith("sglang.")) and getattr(m, "__file__", None)
        }
    )
    record = _wheel_record(root)
    mismatched = []
    checked = 0
    for f in files:
        rel = os.path.relpath(f, root)
        want = record.get(rel)
        if want is None:
            continue
        checked += 1
        if _record_hash(open(f, "rb").read()) != want:
            mismatched.append(rel)
    return {
        "modules": mods,
        "finder": finder,
        "root": root,
        "sglang_files": len(files),
        "files_checked_against_record": checked,
        "files_mismatched": mismatched,
        "has_record": bool(record),
        "import_s": t_import,
        "server_args": dict(server_args or {}),
        "published": args,
    }


def _record_hash(data: bytes) -> str:
    import base64  # pylint: disable=import-outside-toplevel

    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")


def _wheel_record(root: str) -> dict[str, str]:
    for name in sorted(os.listdir(root)):
        if name.startswith("sglang-") and name.endswith(".dist-info"):
            path = os.path.join(root, name, "RECORD")
            if os.path.exists(path):
                out = {}
                for line in open(path, encoding="utf-8"):
                    parts = line.rstrip("\n").rsplit(",", 2)
                    if len(parts) == 3 and parts[1]:
                        out[parts[0]] = parts[1]
                return out
    return {}


def git_apply(diff_name: str, workdir: str) -> dict[str, Any]:
    """Copy the pinned wheel's file (:func:`kvwall.peers.sglang_patch.upstream_source`) to
    ``workdir/python/sglang/srt/layers/attention/flashinfer_mla_backend.py``, then ``git apply --check`` and ``git
    apply`` the package's ``<diff_name>.diff`` there. Returns the patched file's path and both commands' exit codes
    and output."""
    from kvwall.peers.sglang_patch import UPSTREAM_PATH, upstream_source  # pylint: disable=import-outside-toplevel

    pkg = resources.files("kvwall.peers.sglang_patch")
    target = os.path.join(workdir, UPSTREAM_PATH)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "wb") as fh:
        fh.write(upstream_source().encode("utf-8"))
    diff = os.path.join(workdir, f"{diff_name}.diff")
    with open(diff, "wb") as fh:
        fh.write(pkg.joinpath(f"{diff_name}.diff").read_bytes())
    out: dict[str, Any] = {"path": target}
    for key, cmd in (("check", ["git", "apply", "--check", diff]), ("apply", ["git", "apply", diff])):
        p = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, check=False)
        out[f"{key}_rc"] = p.returncode
        out[f"{key}_output"] = (p.stdout + p.stderr).strip()[-500:]
        if p.returncode:
            break
    return out


def load_variant(variant: str, imported: dict[str, Any]) -> tuple[types.ModuleType, dict[str, Any]]:
    """The backend module of ``variant`` over the imported SGLang (see the module docstring) and how it was made."""
    from kvwall.peers.sglang_patch import upstream_source  # pylint: disable=import-outside-toplevel

    real = imported["modules"]["backend"]
    wheel_sha = _sha(upstream_source().encode("utf-8"))
    if variant == "unpatched":
        sha = _sha(open(real.__file__, "rb").read())
        return real, {
            "source": os.path.relpath(real.__file__, imported["root"]),
            "sha256": sha,
            "identical_to_wheel": sha == wheel_sha,
        }
    work = tempfile.mkdtemp(prefix=f"kvwall_sglang_{variant}_")
    info = git_apply(variant, work)
    if info.get("apply_rc", 1):
        raise RuntimeError(f"git apply {variant}.diff failed: {info}")
    name = f"{BACKEND_MODULE}__kvwall_{variant}"
    spec = importlib.util.spec_from_file_location(name, info["path"])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    info.update(
        source=f"git apply {variant}.diff onto the pinned wheel's file",
        sha256=_sha(open(info["path"], "rb").read()),
        identical_to_wheel=False,
    )
    return module, info
