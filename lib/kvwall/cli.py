"""``python -m kvwall``: record experiments, list them, check recorded results, execute a chapter, predict costs.

    python -m kvwall list
    python -m kvwall record decode_profile        # one experiment, full scale, into book/results/
    python -m kvwall record all                   # what `make record` runs
    python -m kvwall check                        # validate every file in book/results/ (exit 1: stale or refused)
    python -m kvwall execute book/01_the_86ms_profile.md --out /tmp/run -p mode=gpu
                                                  # run a chapter headless (papermill)
    python -m kvwall cost --gpu all --tp 8        # the cost model's prediction of every path (chapter 6)

``record`` checks everything before it runs anything: the experiment names, that ``--out`` is a
writable folder where each result file can be written, every experiment's prerequisites, and that no
full-scale result would be replaced by a small-scale one; it creates ``--out`` only once nothing stops
it. ``--force`` records anyway (a result then says what its run lacked). ``execute`` checks the chapter,
its parameters and both of its outputs (``<out>/<stem>.ipynb``, ``<out>/execution/<stem>.json``) before
it runs. Relative paths are taken against the current directory. ``check`` exits 0 only when every
result is valid and fresh (a gate for scripts): 1 when any is stale, refused or missing.

Exit status: 0 done; 2 refused before anything ran (a usage error, or something in the way: the message
names the argument and what to do); 1 a run that failed or a ``check`` that found problems; 3 ``record``
wrote results that are already stale; 130 interrupted; 141 the reader of the output went away (``| head``).
"""

from __future__ import annotations

import argparse
import ast
import errno
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvwall.experiments import EXPERIMENTS, Experiment, missing_prerequisites, run_experiment
from kvwall.model.cost import GPUS, MODEL_PRESETS, TRANSFER_RULES
from kvwall.model.original import ORIGINAL
from kvwall.results import (
    RESULTS_DIR, ResultFileError, ResultMissingError, check_writable_target, load_result, recorded_scale, save_result,
)

__all__ = ["main"]

#: Exit status when the reader of our output went away (``| head``): what tools killed by SIGPIPE return.
_EXIT_BROKEN_PIPE = 128 + 13


def _fail(message: str) -> int:
    print(f"kvwall: {message}", file=sys.stderr)
    return 2


def _path(text: str) -> Path:
    """An argparse type: a path, made absolute against the current directory (so messages say where it is)."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a path: give a file or folder name")
    return Path(os.path.abspath(text))


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number (1, 2, ...)")
    return value


def _out_problem(out: Path) -> str | None:
    """Why files cannot be written into the folder ``out`` (None if, as far as can be told, they can), without
    creating anything: ``out`` or its nearest existing parent must be a folder this user may write in."""
    existing = out.absolute()
    try:
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
    except OSError as exc:  # a name too long, say
        return f"--out {out}: cannot write results there ({exc.strerror or exc}); give a folder you can write in"
    if not existing.is_dir():
        return f"--out {out}: cannot write results there ({existing} is not a folder); give a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--out {out}: cannot write results there ({existing} is not writable)"
    return None


def _make_out(out: Path) -> str | None:
    """Create the folder ``out`` and try writing in it; why that failed, or None."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        return f"--out {out}: cannot write results there ({exc.strerror or exc}); give a folder you can write in"
    return None


def _missing_by_experiment(experiments: list[Experiment]) -> dict[str, dict[str, str]]:
    """``{experiment: {prerequisite: why missing}}`` for the experiments that lack something here."""
    missing = missing_prerequisites(r for exp in experiments for r in exp.requires)
    lacks = {exp.name: {r: missing[r] for r in exp.requires if r in missing} for exp in experiments}
    return {name: why for name, why in lacks.items() if why}


def _record_refusals(experiments: list[Experiment], lacking: dict[str, dict[str, str]], scale: str,
                     out: Path) -> list[str]:
    """Everything that stops ``record`` before it runs anything (without ``--force``)."""
    lines = []
    for prerequisite in sorted({r for why in lacking.values() for r in why}):
        names = [n for n, why in lacking.items() if prerequisite in why]
        reason = next(why[prerequisite] for why in lacking.values() if prerequisite in why)
        lines.append(f"missing {prerequisite} ({reason}), needed by {', '.join(names)}")
    if scale == "small":
        full = [e.name for e in experiments if recorded_scale(e.name, out) == "full"]
        if full:
            lines.append(f"{', '.join(full)} in {out} are full-scale results; a small-scale run would replace them")
    return lines


def _target_problems(experiments: list[Experiment], out: Path) -> list[str]:
    """Where a result file could not be written (a folder, pipe or link in its place): not lifted by --force."""
    problems = []
    for exp in experiments:
        try:
            check_writable_target(out / f"{exp.name}.json")
        except ResultFileError as exc:
            problems.append(f"{exc.path}: {exc.problem}; move it out of the way or record into another --out")
    return problems


def _record(experiments: list[Experiment], scale: str, out: Path, force: bool) -> int:
    problem = _out_problem(out)
    if problem:
        return _fail(problem)
    lacking = _missing_by_experiment(experiments)
    in_the_way = _target_problems(experiments, out)
    refusals = _record_refusals(experiments, lacking, scale, out)
    if in_the_way or (refusals and not force):
        hint = ("\nRun on a machine that has what is missing (`python -m kvwall list` shows what each experiment "
                "requires), record into another --out, or pass --force to record anyway (results note what "
                "their run lacked)." if refusals else "") + (
            "\n--force does not lift what is in the way: nothing but a result file is ever replaced." if in_the_way
            else "")
        print("kvwall record: nothing was run:\n" + "\n".join(f"  - {line}" for line in in_the_way + refusals)
              + hint, file=sys.stderr)
        return 2
    problem = _make_out(out)
    if problem:
        return _fail(problem)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"kvwall record: {len(experiments)} experiment(s) at {scale} scale into {out}", file=sys.stderr)
    interactive = sys.stderr.isatty()
    started = time.time()
    saved: list[str] = []
    with tqdm(total=len(experiments), unit="experiment", file=sys.stderr, disable=not interactive) as bar:
        for i, exp in enumerate(experiments, 1):
            bar.set_description(f"record {exp.name}")
            if not interactive:
                print(f"[{i}/{len(experiments)}] {exp.name} ({scale} scale) ...", file=sys.stderr, flush=True)
            t0 = time.time()
            try:
                result = run_experiment(exp.name, device, scale)
            except Exception as exc:  # noqa: BLE001 - said in one line; the traceback goes to a file, named
                done = ", ".join(e.name for e in experiments[: i - 1]) or "none"
                log = Path(tempfile.gettempdir()) / f"kvwall-record-{exp.name}-{os.getpid()}.txt"
                log.write_text(traceback.format_exc())
                tqdm.write(f"kvwall record: {exp.name} failed after {time.time() - t0:.1f} s: "
                           f"{type(exc).__name__}: {str(exc)[:500]} (its traceback: {log}); recorded before it: "
                           f"{done}; not run: {', '.join(e.name for e in experiments[i:]) or 'none'}.", file=sys.stderr)
                return 1
            result.provenance.missing = sorted(lacking.get(exp.name, {}))
            path = save_result(result, out)
            saved.append(result.experiment)
            tqdm.write(f"recorded {exp.name} in {time.time() - t0:.1f} s -> {path}", file=sys.stdout)
            derive = getattr(exp, "after_record", None)
            if derive is not None and scale == "full":
                # What the kernels read is derived from this result before anything recorded after it runs.
                for written in derive(result):
                    tqdm.write(f"  {exp.name}: wrote {written}", file=sys.stdout)
            bar.update()
    print(f"recorded {len(experiments)} experiment(s) in {time.time() - started:.1f} s", file=sys.stderr)
    return _stale_after_recording(saved, out)


def _stale_after_recording(saved: list[str], out: Path) -> int:
    """0 when every result this run wrote is fresh against the code as it is now; else name them and return 3 (a
    table derived after a result was recorded changed code it depends on: record in dependency order)."""
    stale = []
    for name in dict.fromkeys(saved):
        try:
            result = load_result(name, out)
        except (ResultFileError, ResultMissingError) as exc:
            stale.append(f"{name}: {exc}")
            continue
        if result.stale:
            stale.append(f"{name}: changed since it was recorded: {', '.join(result.changed_sources())}")
    recorded = set(saved)
    others = []
    for name in EXPERIMENTS:
        if name in recorded or not (out / f"{name}.json").is_file():
            continue
        try:
            if load_result(name, out).stale:
                others.append(name)
        except (ResultFileError, ResultMissingError):
            continue  # `check` reports unreadable files; this is about what the run changed
    if others:
        print("kvwall record: other results in " f"{out} are stale now (the code or a table they read changed): "
              + ", ".join(others) + "; re-record them (`make record` records everything in dependency order).",
              file=sys.stderr)
    if stale:
        print("kvwall record: results of this run are already stale:\n"
              + "\n".join(f"  - {line}" for line in stale), file=sys.stderr)
        return 3
    return 0


def _parameter(item: str) -> tuple[str, Any]:
    """An argparse type: ``NAME=VALUE``, VALUE a Python literal where it is one, else the string itself."""
    name, sep, raw = item.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{item!r} is not NAME=VALUE (for example -p mode=cpu)")
    try:
        return name, ast.literal_eval(raw)
    except Exception:  # pylint: disable=broad-exception-caught  # not a literal ({[]: 1} raises TypeError): text
        return name, raw


def _parameter_values(items: list[tuple[str, Any]], parser: argparse.ArgumentParser) -> dict[str, Any]:
    twice = sorted({name for name, _ in items if [n for n, _ in items].count(name) > 1})
    if twice:
        parser.error(f"argument -p/--param: {', '.join(twice)} given more than once; give each parameter once")
    return dict(items)


def _execute(chapter: Path, out: Path, values: dict[str, Any]) -> int:
    # Imported here, not at the top: `record` must run on GPU machines that have no Jupyter (papermill,
    # jupytext, nbformat), and only `execute` needs the notebook layer's execution.
    import papermill  # pylint: disable=import-outside-toplevel
    # pylint: disable-next=import-outside-toplevel
    from kvwall.reports.execute import ChapterError, ChapterRunError, execute_chapter

    problem = _out_problem(out)
    if problem:
        return _fail(f"execute: {problem}")
    notebook = out / f"{chapter.stem}.ipynb"  # where execute_chapter puts them (out and chapter are absolute)
    try:
        record = execute_chapter(chapter, out, progress_bar=sys.stderr.isatty(), **values)
    except ChapterError as exc:
        return _fail(f"execute: {exc}")
    except ChapterRunError as exc:
        print(f"kvwall execute: {exc}", file=sys.stderr)
        return 1
    except papermill.PapermillExecutionError as exc:
        print(f"kvwall execute: {chapter.name} stopped in cell {exc.exec_count} (full traceback in {notebook}):\n"
              f"{exc.ename}: {exc.evalue}", file=sys.stderr)
        return 1
    print(json.dumps({**{k: record.get(k) for k in ("chapter", "mode", "device", "scale", "duration_s")},
                      "notebook": str(notebook), "record": str(out / "execution" / f"{chapter.stem}.json")}))
    return 0


#: ``--rule`` values: both transfer rules (a range), or one of them.
_RULES: dict[str, str | None] = {"both": None, **{r.replace(" ", "-"): r for r in TRANSFER_RULES}}


def _cost(args: argparse.Namespace) -> int:
    # The notebook layer (plotly, IPython) only for this command, as for `execute`.
    # pylint: disable=import-outside-toplevel
    from kvwall.reports.answer_report import fit_sweep
    from kvwall.reports.tables import fmt_range
    from kvwall.reports.original_gpu_report import rest_without_attention_ms
    from kvwall.reports.cost_explorer import ORIGINAL_STATE, cost_rows, rates_note

    given = {f: getattr(args, f) for f in ("model", "tp", "context", "batch", "pool", "layers", "heads")
             if getattr(args, f) is not None}
    base = replace(ORIGINAL_STATE, **given)
    problem = base.problem()
    if problem:
        heads = base.heads or MODEL_PRESETS[base.model].num_heads
        hint = ("; raise --pool or lower --batch / --context" if not base.fits else
                f"; give a --tp that divides {heads}" if heads % base.tp else "")
        return _fail(f"cost: {problem}{hint}.")
    try:
        sweep = load_result("path_sweep")
    except ResultFileError as exc:
        return _fail(f"cost: the cost model is fitted on the recorded path_sweep, which cannot be read: {exc}")
    model, rule, g = fit_sweep(sweep).model, _RULES[args.rule], base.geometry
    spread = f"low–high over the rules {' / '.join(TRANSFER_RULES)}" if rule is None else f"rule: {rule}"
    print(f"Rates: {rates_note(model, model.reference)}. {sweep.caption()} Other GPUs: datasheet ceilings, "
          f"rates transferred from the {model.reference.name} ({spread}).")
    print(f"{g.name}: {g.heads_per_gpu} heads per GPU (TP {base.tp}), {base.batch} × {base.context:,} tokens, pool "
          f"{base.pool:,} tokens. KV work per step = preparation + attention, all {g.num_layers} layers.")
    for key in GPUS if args.gpu == "all" else [args.gpu or ORIGINAL_STATE.gpu]:
        state, gpu = replace(base, gpu=key), GPUS[key]
        print(f"\n{gpu.name} ({gpu.arch}): {rates_note(model, gpu)}")
        print(f"  {'path':20s} {'cache':5s} {'KV B/token':>10s} {'µs per layer':>14s} {'ms KV work/step':>16s}  label")
        for r in cost_rows(model, state, rule):
            print(f"  {r.path:20s} {r.cache:5s} {r.kv_bytes_per_token:>10,} "
                  f"{fmt_range(r.layer_lo_us, r.layer_hi_us):>14s} {fmt_range(r.step_lo_ms, r.step_hi_ms, 2):>16s}  "
                  f"{r.label}")
        if state == ORIGINAL_STATE:
            lo, hi = rest_without_attention_ms(model, state.point, gpu)
            print(f"  The original's step here: {ORIGINAL.step_ms} ms, {ORIGINAL.cast_ms} ms of it the cast. Without "
                  f"the cast and its own attention (FlashInfer fa2 BF16, predicted), {fmt_range(lo, hi)} ms remain: "
                  "a path's step is about that plus its KV work.")
    return 0


def _check(directory: Path) -> int:
    """Every experiment's result in ``directory``: 0 when all are valid and fresh, else 1 (a gate for scripts)."""
    if not directory.is_dir():
        return _fail(f"check: {directory} is not a folder of results (the default is {RESULTS_DIR}).")
    counts = {"ok": 0, "stale": 0, "invalid": 0, "missing": 0}
    for name in EXPERIMENTS:
        try:
            result = load_result(name, directory)
        except ResultFileError as exc:
            kind = "missing" if isinstance(exc, ResultMissingError) else "invalid"
            print(f"{kind.upper():7s} {exc}")
            counts[kind] += 1
            continue
        counts["stale" if result.stale else "ok"] += 1
        print(("STALE   " if result.stale else "ok      ") + result.caption())
    bad = len(EXPERIMENTS) - counts["ok"]
    if bad:
        print(f"kvwall check: {bad} of {len(EXPERIMENTS)} results are not valid and fresh ("
              + ", ".join(f"{n} {k}" for k, n in counts.items() if n and k != "ok")
              + "): re-record the stale and missing ones (`python -m kvwall record <experiment>`, on a GPU), restore "
              "or re-record the invalid ones.", file=sys.stderr)
    return 1 if bad else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvwall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the experiments and what each requires")
    rec = sub.add_parser("record", help="run experiments and write their results (full scale needs a GPU)")
    rec.add_argument("experiments", nargs="+", help=f"'all' or any of: {', '.join(EXPERIMENTS)}")
    rec.add_argument("--scale", choices=("full", "small"), default="full")
    rec.add_argument("--out", type=_path, default=Path(os.path.abspath(RESULTS_DIR)),
                     help=f"folder for the result files (default: {RESULTS_DIR})")
    rec.add_argument("--force", action="store_true",
                     help="record even where prerequisites are missing or a full-scale result would be replaced")
    chk = sub.add_parser("check", help="validate the recorded results and report stale ones")
    chk.add_argument("--dir", type=Path, default=RESULTS_DIR)
    exe = sub.add_parser("execute", help="run a chapter (book/NN_slug.md) headless with papermill")
    exe.add_argument("chapter", type=_path)
    exe.add_argument("--out", type=_path, required=True,
                     help="folder (outside book/) for the executed <stem>.ipynb and its record, execution/<stem>.json")
    exe.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE", type=_parameter,
                     help="a parameter, VALUE as a Python literal (strings may be bare): -p mode=gpu -p layers=8")
    cst = sub.add_parser("cost", help="predict every path's KV work per decode step (chapter 6's cost model)")
    cst.add_argument("--model", choices=list(MODEL_PRESETS), help="model preset (default: the original's, glm-5)")
    cst.add_argument("--gpu", choices=[*GPUS, "all"], help="GPU, or 'all' (default: the original's, rtx-pro-6000)")
    cst.add_argument("--tp", type=_positive, help="tensor parallel degree: heads per GPU = the model's heads / TP "
                                                  "(default: the original's)")
    cst.add_argument("--context", type=_positive, help="tokens per request (default: the original's)")
    cst.add_argument("--batch", type=_positive, help="requests, each of --context tokens (default: 1)")
    cst.add_argument("--pool", type=_positive, help="KV pool tokens (default: the original's)")
    cst.add_argument("--layers", type=_positive, help="your model's layers (a user shape: overrides the preset's)")
    cst.add_argument("--heads", type=_positive, help="your model's attention heads, all GPUs (overrides the preset's)")
    cst.add_argument("--rule", choices=list(_RULES), default="both",
                     help="how the H200's fitted rates transfer to other GPUs: both (a range) or one rule")
    ans = sub.add_parser("answer", help="print the book's answer (the front page's table) as Markdown")
    ans.add_argument("--readme", action="store_true", help="write it into README.md between its markers instead")
    return parser


def _answer(readme: bool) -> int:
    from kvwall.reports import decision  # pylint: disable=import-outside-toplevel

    if not readme:
        print(decision.readme_answer())
        return 0
    path = Path(__file__).resolve().parents[2] / "README.md"
    changed = decision.write_readme_answer(path)
    print(f"{path}: {'answer rewritten' if changed else 'already current'}")
    return 0


def _run(argv: list[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "list":
        for exp in EXPERIMENTS.values():
            needs = ", ".join(exp.requires) or "nothing"
            print(f"{exp.name:24s} {exp.about} [requires {needs}]")
        return 0
    if args.command == "record":
        names = list(EXPERIMENTS) if args.experiments == ["all"] else args.experiments
        unknown = [n for n in names if n not in EXPERIMENTS]
        if "all" in unknown:
            parser.error("record: give 'all' alone (it is every experiment), or name experiments without it")
        if unknown:
            parser.error(f"unknown experiment(s) {unknown}; choose 'all' or from {list(EXPERIMENTS)}")
        order = list(EXPERIMENTS)  # dependency order: what writes a table runs before what reads it
        names = sorted(dict.fromkeys(names), key=order.index)
        return _record([EXPERIMENTS[n] for n in names], args.scale, args.out, args.force)
    if args.command == "execute":
        return _execute(args.chapter, args.out, _parameter_values(args.param, parser))
    if args.command == "cost":
        return _cost(args)
    if args.command == "answer":
        return _answer(args.readme)
    return _check(args.dir)


class _StdoutError(Exception):
    """Writing our standard output failed (``exc``: the OSError): the reader went away, or the disk is full."""

    def __init__(self, exc: OSError) -> None:
        super().__init__(str(exc))
        self.exc = exc


class _WatchedStdout:
    """``sys.stdout`` whose write and flush errors become :class:`_StdoutError`, so they are told apart from the
    errors of files the command writes."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise _StdoutError(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise _StdoutError(exc) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    if sys.stdout is None:  # started with stdout closed (`python -m kvwall list >&-`)
        return _fail("standard output is closed, so there is nowhere to print; run with it open "
                     "(redirect it to a file, or to /dev/null to discard it).")
    if sys.stderr is None:  # started with stderr closed (`2>&-`): refusals and failures would go unsaid
        print("kvwall: standard error is closed, so refusals and progress would be lost; run with it open "
              "(2>/dev/null discards it).")
        return 2
    stream = sys.stdout
    sys.stdout = _WatchedStdout(stream)  # type: ignore[assignment]
    try:
        status = _run(argv)
        sys.stdout.flush()  # inside the try: a closed pipe shows up here, not in the interpreter's exit
        return status
    except KeyboardInterrupt:
        print("\nkvwall: interrupted; what was finished is kept (each result recorded so far; execute's notebook "
              "up to the cell it reached), nothing else was written.", file=sys.stderr)
        return 130
    except _StdoutError as error:
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        if isinstance(error.exc, BrokenPipeError) or error.exc.errno == errno.EPIPE:
            return _EXIT_BROKEN_PIPE  # the reader went away (`python -m kvwall list | head`): stop quietly
        return _fail(f"cannot write to standard output ({error.exc.strerror or error.exc}); the output is lost. "
                     "Free space where it goes, or send it elsewhere.")
    finally:
        sys.stdout = stream


if __name__ == "__main__":
    raise SystemExit(main())
