"""The driver's import stage under the GPU machine's import conditions, on a CPU: ``sglang_patch_check``'s CPU dry
run imports SGLang's real modules with whatever this machine has, so a package the GPU machine lacks (``dill``, the
first recorded run's failure) is found there, not here. :func:`simulate` hides every top-level module whose
distributions are all absent from the GPU machine -- its image's packages (:data:`H200_IMAGE_PACKAGES`, as the
device notes list them, read there 2026-11-17), the wheels the run carries (``.whl``) and the project itself --
from ``import``, ``importlib.util.find_spec`` and ``importlib.metadata`` alike, then runs the import stage as
:func:`kvwall.peers.sglang_patch.realrows.real_rows` does (:func:`~kvwall.peers.sglang_patch.real.import_sglang`
under :func:`~kvwall.peers.sglang_patch.verdicts.guarded`). A hidden module SGLang imports unguarded gets a
stand-in there as it would on the machine, and a stand-in that the import needs to behave fails it
(:class:`~kvwall.peers.sglang_patch.real.StandInUsed`).

What it cannot see: versions (a package the image has is taken to be one SGLang accepts) and modules that only a
package present there but absent here would import. Run it in a fresh interpreter (it refuses when a module it must
hide is already imported)::

    python -m kvwall.peers.sglang_devicesim SOURCE [--wheels .whl] [--deps DIR ...]

``SOURCE`` holds ``sglang/`` (the wheel's files); ``--wheels``: the folder of wheels the run carries (its
pure-Python ones are importable here too, after this machine's own packages); ``--deps``: folders put on
``sys.path`` for packages the GPU machine has and this one lacks (msgspec, transformers, ...). Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.metadata
import json
import os
import re
import sys
import time
import types
from typing import Any, Iterable

__all__ = ["H200_IMAGE_PACKAGES", "INSTALLED_BY_RUN", "wheel_packages", "hidden_modules", "hide", "simulate"]

#: The GPU machine image's Python distributions (the device notes' list, 2026-11-17): never hidden.
H200_IMAGE_PACKAGES = frozenset(
    {
        "absl-py",
        "accelerate",
        "aiofiles",
        "aiohappyeyeballs",
        "aiohttp",
        "aiosignal",
        "annotated-doc",
        "anyio",
        "attrs",
        "botorch",
        "build",
        "certifi",
        "charset-normalizer",
        "chex",
        "click",
        "cloudpickle",
        "cmake",
        "colorama",
        "contourpy",
        "coverage",
        "cuda-bindings",
        "cuda-core",
        "cuda-pathfinder",
        "cuda-toolkit",
        "cupy-cuda13x",
        "cycler",
        "cython",
        "diffrax",
        "e3nn",
        "einops",
        "equinox",
        "etils",
        "execnet",
        "filelock",
        "flatbuffers",
        "flax",
        "fonttools",
        "formulaic",
        "frozenlist",
        "fsspec",
        "gpytorch",
        "grpcio",
        "h11",
        "h5py",
        "hf-xet",
        "httpcore",
        "httpx",
        "huggingface-hub",
        "humanize",
        "hypothesis",
        "idna",
        "imageio",
        "iniconfig",
        "interface-meta",
        "jax",
        "jax-cuda13-pjrt",
        "jax-cuda13-plugin",
        "jaxlib",
        "jaxtyping",
        "jinja2",
        "joblib",
        "kiwisolver",
        "lazy-loader",
        "lightning",
        "lightning-utilities",
        "linear-operator",
        "lineax",
        "llvmlite",
        "lxml",
        "markdown",
        "markdown-it-py",
        "markupsafe",
        "matplotlib",
        "mdurl",
        "meson",
        "ml-dtypes",
        "mpi4py",
        "mpmath",
        "msgpack",
        "multidict",
        "multipledispatch",
        "mypy-extensions",
        "nanobind",
        "narwhals",
        "networkx",
        "ninja",
        "numba",
        "numba-cuda",
        "numpy",
        "numpyro",
        "nvidia-cublas",
        "nvidia-cuda-cupti",
        "nvidia-cuda-nvrtc",
        "nvidia-cuda-runtime",
        "nvidia-cudnn-cu13",
        "nvidia-cufft",
        "nvidia-cufile",
        "nvidia-curand",
        "nvidia-cusolver",
        "nvidia-cusparse",
        "nvidia-cusparselt-cu13",
        "nvidia-ml-py",
        "nvidia-nccl-cu13",
        "nvidia-nvjitlink",
        "nvidia-nvshmem-cu13",
        "nvidia-nvtx",
        "onnx",
        "onnx-ir",
        "onnxruntime",
        "onnxscript",
        "opencv-python-headless",
        "optax",
        "opt-einsum",
        "opt-einsum-fx",
        "optimistix",
        "orbax-checkpoint",
        "packaging",
        "pandas",
        "pathspec",
        "patsy",
        "peft",
        "pillow",
        "pip",
        "pluggy",
        "portalocker",
        "prometheus-client",
        "propcache",
        "protobuf",
        "psutil",
        "pyarrow",
        "pybind11",
        "py-cpuinfo",
        "pygments",
        "pyparsing",
        "pyproject-hooks",
        "pyre-extensions",
        "pytest",
        "pytest-benchmark",
        "pytest-cov",
        "pytest-mock",
        "pytest-timeout",
        "pytest-xdist",
        "python-dateutil",
        "pytorch-lightning",
        "pyyaml",
        "regex",
        "requests",
        "rich",
        "sacrebleu",
        "safetensors",
        "scikit-build-core",
        "scikit-image",
        "scikit-learn",
        "scipy",
        "seaborn",
        "sentencepiece",
        "sentence-transformers",
        "setuptools",
        "shellingham",
        "simplejson",
        "six",
        "sortedcontainers",
        "statsmodels",
        "sympy",
        "tabulate",
        "tensorboard",
        "tensorboard-data-server",
        "tensorstore",
        "threadpoolctl",
        "tifffile",
        "tiktoken",
        "timm",
        "tokenizers",
        "toolz",
        "torch",
        "torchaudio",
        "torchdiffeq",
        "torch-geometric",
        "torchmetrics",
        "torchvision",
        "tqdm",
        "transformers",
        "treescope",
        "triton",
        "typer",
        "typing-extensions",
        "typing-inspect",
        "urllib3",
        "uvloop",
        "wadler-lindig",
        "werkzeug",
        "wheel",
        "wrapt",
        "xarray",
        "xxhash",
        "yarl",
        "zipp",
    }
)
#: Installed on the GPU machine by the device script itself (``pip install -e .``), not from the image.
INSTALLED_BY_RUN = frozenset({"kvwall"})


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_packages(folder: str | None) -> set[str]:
    """The distributions of the ``*.whl`` files in ``folder`` (normalized names)."""
    if not folder or not os.path.isdir(folder):
        return set()
    return {_norm(f.split("-")[0]) for f in os.listdir(folder) if f.endswith(".whl")}


def hidden_modules(present: Iterable[str]) -> dict[str, list[str]]:
    """``{top-level module: its distributions}`` for every module importable here none of whose distributions is in
    ``present`` (the standard library is never hidden)."""
    have = {_norm(p) for p in present}
    out = {}
    for top, dists in importlib.metadata.packages_distributions().items():
        if top in sys.stdlib_module_names or not top.isidentifier():
            continue
        if not {_norm(d) for d in dists} & have:
            out[top] = sorted(set(dists))
    return out


class _Hiding(importlib.abc.MetaPathFinder):
    """One of ``sys.meta_path``'s finders with the hidden modules and distributions taken out."""

    def __init__(self, inner: Any, tops: set[str], dists: set[str]) -> None:
        self.inner, self.tops, self.dists = inner, tops, dists

    def find_spec(self, name, path=None, target=None):  # importlib's protocol
        if name.partition(".")[0] in self.tops or not hasattr(self.inner, "find_spec"):
            return None
        return self.inner.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):  # importlib.metadata's protocol
        find = getattr(self.inner, "find_distributions", None)
        if find is None:
            return iter(())
        return (d for d in find(*args, **kwargs) if _norm(d.metadata["Name"] or "") not in self.dists)

    def invalidate_caches(self):
        if hasattr(self.inner, "invalidate_caches"):
            self.inner.invalidate_caches()


def hide(hidden: dict[str, list[str]]) -> None:
    """Wrap every finder on ``sys.meta_path`` so that the ``hidden`` modules (and their distributions) are not
    found. Refuses when one of them is already imported (the simulation would not be the machine's)."""
    tops = set(hidden)
    loaded = sorted(tops & {k.partition(".")[0] for k in sys.modules})
    if loaded:
        raise RuntimeError(f"already imported, cannot be hidden: {loaded} (run in a fresh interpreter)")
    dists = {_norm(d) for ds in hidden.values() for d in ds}
    sys.meta_path[:] = [f if isinstance(f, _Hiding) else _Hiding(f, tops, dists) for f in sys.meta_path]
    importlib.invalidate_caches()


def simulate(
    source: str, *, wheels: str | None = None, deps: Iterable[str] = (), log=lambda s: print(s, file=sys.stderr)
) -> dict[str, Any]:
    """The import stage under the GPU machine's import conditions (module docstring). Returns ``ok``, the stage's
    ``error`` (as the ``real_meta`` row would record it), the modules hidden, the stand-ins made and the guarded
    imports that failed, and ``device_lacks``: the hidden modules SGLang imports unguarded (each a wheel to carry,
    or a stand-in that must not be needed)."""
    for d in deps:
        if d not in sys.path:
            sys.path.append(d)
    if wheels and os.path.isdir(wheels):  # a pure-Python wheel imports from its zip (after this machine's own)
        sys.path.extend(os.path.join(wheels, f) for f in sorted(os.listdir(wheels)) if f.endswith("-none-any.whl"))
    present = set(H200_IMAGE_PACKAGES) | wheel_packages(wheels) | INSTALLED_BY_RUN
    hidden = hidden_modules(present)
    hide(hidden)
    # this machine's torchvision build may not match its torch (the GPU machine's does): its meta registrations only
    # serve torch.compile, which the import never runs
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    from kvwall.peers.sglang_patch.real import import_sglang  # pylint: disable=import-outside-toplevel
    from kvwall.peers.sglang_patch.verdicts import guarded  # pylint: disable=import-outside-toplevel

    t0 = time.perf_counter()
    imp, err = guarded(log, "import sglang", lambda: import_sglang(source))
    from kvwall.peers.sglang_patch import real  # pylint: disable=import-outside-toplevel

    finder = imp["finder"] if imp else real._StandInMeta.finder  # pylint: disable=protected-access
    standins = dict(finder.standins) if finder else {}
    guarded_missing = dict(finder.guarded_missing) if finder else {}
    return {
        "ok": imp is not None,
        "error": err,
        "seconds": round(time.perf_counter() - t0, 1),
        "sglang_files": imp["sglang_files"] if imp else None,
        "hidden": sorted(hidden),
        "wheels": sorted(wheel_packages(wheels)),
        "standins": standins,
        "guarded_missing": guarded_missing,
        "device_lacks": {m: standins[m] for m in sorted(set(standins) & set(hidden))},
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m kvwall.peers.sglang_devicesim``: exit 0 when the import stage got through."""
    ap = argparse.ArgumentParser(
        prog="python -m kvwall.peers.sglang_devicesim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("source")
    ap.add_argument("--wheels", default=None, help="the wheels the run carries (default: none)")
    ap.add_argument("--deps", nargs="*", default=[], help="folders for packages the GPU machine has, this one not")
    a = ap.parse_args(argv)
    out = simulate(a.source, wheels=a.wheels, deps=a.deps)
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
