"""Shared fixtures: each chapter executed once per session under papermill (``executed``), the book built once
per session from those executed notebooks (``built_book``), and slow work of other tests done in the same
background process (``background``)."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvwall.peers.flashinfer.sources import find_definition, include_dir

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
CHAPTERS = sorted(p for p in BOOK.glob("[0-9][0-9]_*.md"))


def run_chapter(path: Path, out_dir: Path, **parameters) -> dict:
    """Execute a MyST chapter with papermill (as CI and readers do) and return its execution record, after checking
    what its outputs show a reader (tests/rendered_checks.py: no unformatted placeholder, ratio columns that say
    their direction, no long table inline, CPU-live figures titled as such)."""
    from kvwall.reports.execute import execute_chapter
    from rendered_checks import notebook_problems

    record = execute_chapter(path, out_dir, **parameters)
    problems = notebook_problems(Path(out_dir) / f"{Path(path).stem}.ipynb")
    assert not problems, "what the executed chapter shows a reader is wrong:\n" + "\n".join(problems)
    return record


#: How the session's one run of a chapter is made where it is not the plain one: chapter 3 runs as on a fresh machine
#: without network (an empty FlashInfer release cache, pip's index unreachable); it reads and replays the pinned
#: FlashInfer, so it needs neither (tests/test_doors.py). The book is built from these same runs.
SESSION_RUNS: dict[str, dict] = {"03_the_other_doors": {"offline": True}}


class ChapterRunFailed(AssertionError):
    """A session run of a chapter failed (in the background process): the error as it was raised there."""


#: Slow work some tests check that reads no chapter run (registered with :func:`background_job`), by
#: ``module:name``. When the session builds the book, :meth:`ExecutedChapters.start` queues each after the book
#: in the background process; the test process takes one back and runs it itself when a test (or a wait for a
#: chapter run) reaches it before the background has started it (:meth:`ExecutedChapters.job`): each runs once,
#: where a core is free first.
BACKGROUND_JOBS: dict[str, object] = {}


def background_job(fn):
    """Register ``fn(out: Path)`` (a module-level function of a test module; ``out`` a folder of its own) as a
    background job: a test reads what it returns with ``background(fn)`` (the ``background`` fixture). It may call
    ``pytest.skip``: the test skips with its reason."""
    BACKGROUND_JOBS[f"{fn.__module__}:{fn.__name__}"] = fn
    return fn


def _claim(folder: Path) -> bool:
    """Whether this process is the first to take the job whose folder is ``folder`` (one winner, across processes:
    the first to create ``<folder>.claimed``); the winner's ``folder`` is made."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder.with_name(f"{folder.name}.claimed"), os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    folder.mkdir()
    return True


def _error_text(exc: BaseException) -> str:
    """A background run's failure, in words, for the tests that read it."""
    import traceback

    return f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()[-6000:]}"


@contextlib.contextmanager
def _timed(label: str):
    """Log how long the block took, with the clock time, into the background log."""
    import time

    t0 = time.time()
    try:
        yield
    finally:
        print(f"[{time.strftime('%H:%M:%S')}] {label}: {time.time() - t0:.1f} s (pid {os.getpid()})", flush=True)


def _do_job(key: str, out: str, claimed: bool = False) -> tuple[str, object]:
    """Run background job ``key`` into ``out`` unless another process took it: ("ok", what it returned),
    ("skip", the reason), ("error", the error in words) or ("taken", None)."""
    import importlib

    if not claimed and not _claim(Path(out)):
        return "taken", None
    module, name = key.split(":")
    with _timed(key):
        try:
            return "ok", getattr(importlib.import_module(module), name)(Path(out))
        except pytest.skip.Exception as exc:
            return "skip", str(exc.msg)
        except pytest.fail.Exception as exc:
            return "error", str(exc.msg)
        except Exception as exc:  # noqa: BLE001 - said to the test that reads it
            return "error", _error_text(exc)


def _quiet_worker(log: str) -> None:
    """The background process: its output (and its kernels') into ``log``, not into a test's captured output."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)


def _run_job(path: str, out: str, offline: bool, parameters: dict) -> tuple[dict | None, str | None]:
    """One chapter run in the background process: (its execution record, None), or (None, the error, in words)."""
    with _timed(Path(path).name):
        try:
            with pytest.MonkeyPatch.context() as monkeypatch:
                monkeypatch.setenv("KVWALL_LIVE_DIR", str(Path(out) / "live"))
                if offline:
                    go_offline(monkeypatch, Path(out) / "empty-cache")
                return run_chapter(Path(path), Path(out), **parameters), None
        except Exception as exc:  # noqa: BLE001 - said to every test that reads this run
            return None, _error_text(exc)


def _build_job(root: str, runs: list[tuple[str, str]]) -> tuple[str | None, str | None]:
    """The book built from the session's runs (``runs``: each chapter and its executed notebook), in the background
    process: (the built site, None), or (None, what went wrong)."""
    with _timed("the book"):
        return _build(Path(root), runs)


def _build(root_dir: Path, runs: list[tuple[str, str]]) -> tuple[str | None, str | None]:
    try:
        cache, records = root_dir / "jupyter_cache", root_dir / "execution"
        records.mkdir(parents=True, exist_ok=True)
        for chapter, notebook in runs:
            chapter, notebook = Path(chapter), Path(notebook)
            record = notebook.parent / "execution" / f"{notebook.stem}.json"
            if not notebook.is_file() or not record.is_file():
                return None, f"{chapter.name} did not run to its end in this session: no book was built from it"
            seed_execution_cache(cache, chapter, notebook)
            shutil.copy(record, records / record.name)
        proc = build_book(root_dir, env={"KVWALL_EXECUTION_DIR": str(records)}, execute="cache", cache=cache)
        log = f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
        if proc.returncode != 0:
            return None, f"the book build failed ({proc.returncode}):\n{log}"
        reused = proc.stdout.count("Using cached notebook")
        if reused != len(runs):
            return None, f"the build took {reused} of {len(runs)} chapters from the session's runs:\n{log}"
        return str(root_dir / "_build" / "html"), None
    except Exception as exc:  # noqa: BLE001 - said to every test that reads the book
        return None, _error_text(exc)


class ExecutedChapters:
    """Every chapter executed at most once per test session under papermill (``execute_chapter``, as CI and
    ``python -m kvwall execute`` do), keyed by chapter, parameters and environment; each run's notebook is checked
    by :func:`run_chapter` (tests/rendered_checks.py) when it is made. Chapter tests read the runs from here, and
    the session's book (``built_book``) is built from them instead of executing every chapter again.

    ``executed(path)`` is the chapter's session run (``mode="cpu"`` where the chapter takes a mode; chapter 3
    offline, :data:`SESSION_RUNS`): its execution record, a copy a test may change. A run that failed fails
    every test that reads it, with the same error, without running again. ``executed.live(path, experiment)`` is
    the live run of an experiment the chapter measured in that run (the tests of that run read it, not a second run).

    When the session builds the book, :meth:`start` runs every chapter and then the build in one background process
    while the other tests run (two CPU cores: the tests on one, the chapters on the other), in the order of
    :func:`kvwall.reports.execute.chapter_files`, and after them the background jobs (:func:`background_job`); the
    tests that read them run last (``pytest_collection_modifyitems``). While a test waits for a run, the test process
    takes a job the background process has not started. Other runs (other parameters or environment) run in the test
    process when a test asks."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._runs: dict[tuple, list] = {}  # key -> [record, notebook, error, future or None]
        self._pool = None
        self._book = None
        self._jobs: dict[str, list] = {}  # background job -> [its folder, future or None, outcome or None]

    def _key(self, path: Path, offline: bool | None, parameters: dict) -> tuple:
        from kvwall.reports.execute import chapter_parameters

        import jupytext

        path = Path(path)
        if offline is None:
            offline = SESSION_RUNS.get(path.stem, {}).get("offline", False)
        if "mode" in chapter_parameters(jupytext.read(path)):
            parameters = {"mode": "cpu", **parameters}
        return path.stem, bool(offline), tuple(sorted(parameters.items()))

    def _out(self, key: tuple) -> Path:
        return self.root / f"{len(self._runs):02d}-{key[0]}"

    def start(self, chapters: list[Path], book: bool, jobs: list[str] = ()) -> None:
        """Run ``chapters`` (their session runs) and then, with ``book``, the book build, then the background
        ``jobs`` (:data:`BACKGROUND_JOBS` keys) not yet taken by the test process, in a background process."""
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self._pool = ProcessPoolExecutor(
            1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_quiet_worker,
            initargs=(str(self.root / "background.log"),),
        )
        runs = []
        for path in chapters:
            key = self._key(path, None, {})
            if key not in self._runs:
                out = self._out(key)
                future = self._pool.submit(_run_job, str(path), str(out), key[1], dict(key[2]))
                self._runs[key] = [None, out / f"{key[0]}.ipynb", None, future]
            runs.append((str(path), str(self._runs[key][1])))
        if book:
            self._book = self._pool.submit(_build_job, str(self.root / "book"), runs)
        for key in jobs:
            folder = self._job_folder(key)
            self._jobs[key] = [folder, self._pool.submit(_do_job, key, str(folder)), None]

    def _job_folder(self, key: str) -> Path:
        return self.root / "jobs" / key.replace(":", "-")

    def _take_a_job(self) -> bool:
        """Run here one background job the background process has not started (False: none is left)."""
        for key, job in self._jobs.items():
            if job[2] is None and _claim(job[0]):
                job[2] = _do_job(key, str(job[0]), claimed=True)
                return True
        return False

    def _wait(self, future):
        """``future``'s result, running background jobs here while the background process works on it."""
        while not future.done() and self._take_a_job():
            pass
        return future.result()

    def job(self, fn):
        """What background job ``fn`` (:func:`background_job`) returned: from the background process where it ran
        there, else run here now (once per session)."""
        key = f"{fn.__module__}:{fn.__name__}"
        if key not in BACKGROUND_JOBS:
            raise KeyError(f"{key} is not a background job: decorate it with @background_job")
        job = self._jobs.setdefault(key, [self._job_folder(key), None, None])
        if job[2] is None:
            if _claim(job[0]):
                job[2] = _do_job(key, str(job[0]), claimed=True)
            else:  # started in the background: its answer (or, where the process was stopped, a failure)
                job[2] = self._wait(job[1])
        kind, value = job[2]
        if kind == "skip":
            pytest.skip(value)
        if kind != "ok":
            raise ChapterRunFailed(f"background job {key} failed in this session:\n{value}")
        return value

    def stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def book(self) -> Path:
        """The book built in the background (:meth:`start`, started here if it was not)."""
        if self._book is None:
            from kvwall.reports.execute import chapter_files

            self.start(chapter_files(), book=True)
        site, error = self._wait(self._book)
        if error:
            raise ChapterRunFailed(error)
        return Path(site)

    def __call__(self, path: Path, *, offline: bool | None = None, **parameters) -> dict:
        key = self._key(path, offline, parameters)
        if key not in self._runs:
            out = self._out(key)
            record, error = None, None
            try:
                with pytest.MonkeyPatch.context() as monkeypatch:
                    monkeypatch.setenv("KVWALL_LIVE_DIR", str(out / "live"))
                    if key[1]:
                        go_offline(monkeypatch, out / "empty-cache")
                    record = run_chapter(Path(path), out, **dict(key[2]))
            except Exception as exc:  # noqa: BLE001 - kept, and raised to every test that reads this run
                error = exc
            self._runs[key] = [record, out / f"{key[0]}.ipynb", error, None]
        run = self._runs[key]
        if run[3] is not None:  # in the background: wait for it
            record, text = self._wait(run[3])
            run[:] = [
                record,
                run[1],
                ChapterRunFailed(f"{key[0]} failed in this session:\n{text}") if text else None,
                None,
            ]
        if run[2] is not None:
            raise run[2]
        return copy.deepcopy(run[0])

    def notebook(self, path: Path, *, offline: bool | None = None, **parameters) -> Path:
        """The executed notebook of ``executed(path, ...)`` (running it first if need be)."""
        self(path, offline=offline, **parameters)
        return self._runs[self._key(path, offline, parameters)][1]

    def live(self, path: Path, experiment: str, *, offline: bool | None = None, **parameters):
        """The live run of ``experiment`` that ``executed(path, ...)`` measured (``chapter.measure``, at the
        chapter's scale, with the chapter's overrides), read back from the result file the chapter saved
        (``KVWALL_LIVE_DIR``): the tests that check that run read it here instead of running it again."""
        from kvwall.results import load_result

        return load_result(experiment, self.notebook(path, offline=offline, **parameters).parent / "live")


#: The fixtures whose tests read the session's chapter runs or background jobs: they run after every other test.
CHAPTER_FIXTURES = {"executed", "built_book", "background"}


@pytest.fixture(scope="session")
def executed(tmp_path_factory) -> ExecutedChapters:
    """The session's chapter runs (:class:`ExecutedChapters`)."""
    runs = ExecutedChapters(tmp_path_factory.mktemp("chapters"))
    yield runs
    runs.stop()


@pytest.fixture(scope="session")
def background(executed):
    """``background(fn)``: what background job ``fn`` (:func:`background_job`) returned in this session."""
    return executed.job


@pytest.fixture(scope="session", autouse=True)
def _chapters_in_background(request):
    """When this session builds the book, every chapter runs (once) and the book is built in the background from
    the start, while the tests that do not read them run; then the background jobs of the modules whose tests read
    them, where the test process has not taken them first.

    The two processes then share the machine's cores: each (and every process it starts: the chapters' kernels, the
    child Pythons of tests) keeps torch's CPU threads to its half of them, one each on two cores, where two threads
    each would contend for both (an explicit ``OMP_NUM_THREADS`` is kept)."""
    items = request.session.items
    if not any("built_book" in item.fixturenames for item in items):
        yield
        return
    from kvwall.reports.execute import chapter_files

    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 2) // 2))
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(threads)
        modules = {getattr(item.module, "__name__", None) for item in items if "background" in item.fixturenames}
        jobs = [key for key in BACKGROUND_JOBS if key.split(":")[0] in modules]
        request.getfixturevalue("executed").start(chapter_files(), book=True, jobs=jobs)
        yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def _one_ptxas_report_per_build():
    """ptxas's report on a Hopper kernel's object build (``hopper.ptxas_check``: nvcc for sm_90a, 5-10 s) made once
    per session per build -- what :func:`~kvwall.kernels.mla_decode.hopper.build_key` hashes: the kind's source and
    headers, nvcc's flags and version, the architecture -- and read again after: one compile holds the decode and
    the multi-token instantiations that tests/test_mla_decode_wgmma*.py check one by one, and the rows
    tests/test_arch_check.py checks."""
    from kvwall.kernels.mla_decode import hopper

    ptxas_check, reports = hopper.ptxas_check, {}

    def once(kind, nvcc=None, *, trace=False):
        nvcc = nvcc or hopper.find_nvcc()
        if nvcc is None:  # no nvcc: its own error, each time
            return ptxas_check(kind, nvcc, trace=trace)
        key = (kind, nvcc, trace, hopper.build_key(kind, nvcc, hopper._flags(trace, shared=False)))
        if key not in reports:
            reports[key] = ptxas_check(kind, nvcc, trace=trace)
        return reports[key]

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(hopper, "ptxas_check", once)
        yield


def seed_execution_cache(cache: Path, chapter: Path, executed_notebook: Path) -> None:
    """Put ``executed_notebook`` (papermill's run of ``chapter``) into the Jupyter Book execution cache at ``cache``
    as the executed form of ``chapter``: the notebook exactly as myst-nb reads the MyST file (the cache matches on
    its code cells and their metadata), each code cell given the outputs the run gave it (papermill's injected
    parameters cell left out: it sets what the chapter's own parameters cell does on this machine)."""
    import nbformat
    import yaml
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn
    from myst_nb.core.read import read_myst_markdown_notebook
    from myst_parser.config.main import MdParserConfig

    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    extensions = set(config.get("parse", {}).get("myst_enable_extensions", []))
    source = read_myst_markdown_notebook(
        chapter.read_text(), config=MdParserConfig(enable_extensions=extensions), add_source_map=True, path=chapter
    )
    ran = nbformat.read(executed_notebook, as_version=4)
    ran_code = [
        c for c in ran.cells if c.cell_type == "code" and "injected-parameters" not in c.metadata.get("tags", [])
    ]
    code = [c for c in source.cells if c.cell_type == "code"]
    assert [c.source.strip() for c in code] == [c.source.strip() for c in ran_code], (
        f"{executed_notebook} is not a run of {chapter} as it is now"
    )
    for cell, run in zip(code, ran_code):
        cell.outputs, cell.execution_count = run.outputs, run.execution_count
    for key in ("language_info", "widgets"):
        if key in ran.metadata:
            source.metadata[key] = ran.metadata[key]
    get_cache(str(cache)).cache_notebook_bundle(
        CacheBundleIn(source, str(chapter)), check_validity=False, overwrite=True
    )


def build_book(
    out: Path, env: dict | None = None, execute: str = "force", cache: Path | None = None, timeout: int = 1200
) -> subprocess.CompletedProcess:
    """``jupyter-book build`` of the book into ``out/_build/html`` with `make book`'s flags and the book's
    ``_config.yml``, its execution mode replaced by ``execute`` (``cache``: the execution cache at ``cache``)."""
    import yaml

    makefile = (ROOT / "Makefile").read_text()
    flags = next(line.split(":=", 1)[1].split() for line in makefile.splitlines() if line.startswith("BOOK_FLAGS"))
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["execute"]["execute_notebooks"] = execute
    if cache is not None:
        config["execute"]["cache"] = str(cache)
    out.mkdir(parents=True, exist_ok=True)
    (out / "_config.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    command = [
        str(Path(sys.prefix) / "bin" / "jupyter-book"),
        "build",
        str(ROOT),
        "--config",
        str(out / "_config.yml"),
        "--path-output",
        str(out),
        *flags,
    ]
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout
    )


@pytest.fixture(scope="session")
def built_book(executed) -> Path:
    """The book, built as `make book` builds it (the same ``jupyter-book build`` flags, warnings as errors, the
    book's own ``_config.yml``), from the session's runs of the chapters instead of executing each again: every
    chapter's executed notebook is put in a fresh Jupyter Book execution cache (``execute_notebooks: cache``), its
    execution record where the reproducibility page reads them; the pages that are not chapters (the front page,
    the reproducibility page) execute in the build. The build must take every chapter from the cache (`make
    test-site` builds with `make book` itself: every chapter executed by Jupyter Book)."""
    return executed.book()


@pytest.fixture(scope="session")
def site() -> Path:
    """The site the browser checks read (`make test-site`): built by `make book` exactly as readers and the publishing
    workflow build it, every chapter executed by Jupyter Book. The target runs `make book` first and names its
    ``_build/html`` in ``KVWALL_SITE``; without it, `make book` runs here."""
    if os.environ.get("KVWALL_SITE"):
        html = Path(os.environ["KVWALL_SITE"]).resolve()
        assert (html / "book" / "index.html").is_file(), f"KVWALL_SITE={html}: no built book there (run `make book`)"
        return html
    env = {**os.environ, "VENV": str(Path(sys.prefix))}
    proc = subprocess.run(
        ["make", "book", f"VENV={sys.prefix}"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=1200
    )
    if proc.returncode != 0:
        pytest.fail(f"make book failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    return ROOT / "_build" / "html"


#: Test modules whose CPU tests run the Triton kernels in Triton's interpreter.
INTERPRETER_MODULES = {"test_gather_cast.py", "test_mla_decode_fp8.py", "test_ours.py"}


def _interpreter_gap() -> str:
    """Why this Triton's CPU interpreter cannot run the kernels ('' when it can).

    Triton 3.7's interpreter has no bfloat16 constants (InterpreterBuilder.get_bf16); 3.9 does. On GPU
    machines torch pins its own Triton (torch 2.13.0 -> 3.7.1), so there the interpreter tests skip
    and the GPU tests of the same kernels run instead.
    """
    import triton

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) < (3, 9):
        return (
            f"Triton {triton.__version__}'s CPU interpreter cannot run these kernels (no bfloat16 constants "
            "before 3.9; requirements-triton-cpu.txt pins 3.9.0 on machines without a GPU)"
        )
    return ""


def pytest_collection_modifyitems(config, items):
    gap = None
    for item in items:
        if item.path.name in INTERPRETER_MODULES and "gpu" not in item.keywords:
            gap = _interpreter_gap() if gap is None else gap
            if gap:
                item.add_marker(pytest.mark.skip(reason=gap))

    # The tests that read the session's chapter runs, then those that read background jobs, then the book's, run last:
    # by then the background process (_chapters_in_background) has run the chapters (and maybe the jobs queued after
    # the book) while every other test ran, those of the same modules included. The sort is stable: within each of
    # the four groups the tests keep their order, each module's together (a module-scoped fixture that both a test
    # that reads a run and one that does not use is made once for each group: tests/test_sglang_dsa.py's source).
    def group(item) -> int:
        uses = CHAPTER_FIXTURES & set(item.fixturenames)
        return 3 if "built_book" in uses else 2 if "background" in uses else 1 if uses else 0

    items[:] = sorted(items, key=group)


#: A skip for want of a GPU (the reasons the GPU tests give): such a test must be marked ``gpu``, or `make gpu-test`
#: (``-m gpu``) never runs it.
GPU_SKIP = re.compile(r"NVIDIA GPU|H100 / H200|sm_90a code")
_unmarked_gpu: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.skipped and "gpu" not in item.keywords:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if GPU_SKIP.search(reason):
            _unmarked_gpu.append(f"{item.nodeid}: {reason}")


def pytest_terminal_summary(terminalreporter):
    if _unmarked_gpu:
        terminalreporter.section("GPU tests without the gpu marker")
        terminalreporter.line(
            f"{len(_unmarked_gpu)} tests skipped for want of a GPU are not marked gpu, so `make "
            "gpu-test` (pytest -m gpu) does not select them; mark them @pytest.mark.gpu:"
        )
        for line in _unmarked_gpu:
            terminalreporter.line(f"  {line}")


def static_assert_line(release: str) -> int:
    """The line of ``static_assert(sizeof(DType) == 2`` inside ``m16k16_rowsum_f16f16f32``, read from the
    installed release's own ``mma.cuh`` (never typed into a test)."""
    locs = find_definition(release, "mma::m16k16_rowsum_f16f16f32")
    assert len(locs) == 1 and locs[0].file == "flashinfer/mma.cuh", locs
    src = (include_dir(release) / "flashinfer" / "mma.cuh").read_text().splitlines()
    for n in range(locs[0].line, locs[0].line + 10):
        if "static_assert(sizeof(DType) == 2" in src[n - 1]:
            return n
    raise AssertionError("no static_assert(sizeof(DType) == 2) in m16k16_rowsum_f16f16f32")


def go_offline(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """What a fresh machine without network has: an empty FlashInfer release cache at ``cache``, and a
    pip whose index and proxies refuse every connection (no wheelhouse either)."""
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("KVWALL_CACHE", str(cache))
    monkeypatch.delenv("KVWALL_WHEELHOUSE", raising=False)
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)


def hopper() -> bool:
    """An H100 / H200 is here: the only GPUs sm_90a code (the wgmma paths) runs on."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def on_hopper(test):
    """A GPU test of an sm_90a kernel: marked ``gpu`` and skipped, saying why, without an H100 / H200."""
    return pytest.mark.gpu(pytest.mark.skipif(not hopper(), reason="needs an H100 / H200 (sm_90a code)")(test))
