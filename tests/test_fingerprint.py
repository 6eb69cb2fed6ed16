"""Provenance from imports: a result goes stale when the code it imports changes, and only then."""

import ast
import json
import shutil
import textwrap
from pathlib import Path

import torch

from kvwall.results import PROJECT_ROOT, Result, collect_provenance, source_fingerprint
from kvwall.results import fingerprint
from kvwall.results.fingerprint import _canonical, import_closure, normalized_code, normalized_cuda

EXPERIMENT = "kvwall.experiments.gather_cast"


def _copy_tree(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    for folder in ("lib/kvwall", "kernels"):
        shutil.copytree(PROJECT_ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _result(root: Path) -> Result:
    prov = collect_provenance(torch.device("cpu"), EXPERIMENT)
    prov.sources = source_fingerprint(EXPERIMENT, root)
    return Result("gather_cast_bench", {}, [], prov)


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: no {old!r} to edit"
    path.write_text(text.replace(old, new, 1))


def test_fingerprint_covers_the_import_closure_and_the_kernel_tables():
    sources = source_fingerprint(EXPERIMENT)
    assert "lib/kvwall/experiments/gather_cast.py" in sources
    assert "kernels/gather/kernel.py" in sources and "kernels/gather/tuned.json" in sources
    assert "kernels/gather/gather_cast.cu" in sources
    # Bookkeeping is not measurement: recording a result or describing an experiment does not stale it.
    assert not any(p.startswith("lib/kvwall/results/") or "experiments/schemas" in p for p in sources)
    assert "lib/kvwall/experiments/registry.py" not in sources
    # Chapter 2's FlashInfer release machinery is not imported by chapter 4's experiments.
    assert not any(p.startswith("lib/kvwall/peers/") for p in sources)


def test_comment_and_docstring_edits_keep_a_result_fresh(tmp_path):
    root = _copy_tree(tmp_path)
    result = _result(root)
    assert result.changed_sources(root) == []
    kernel = root / "kernels/gather/kernel.py"
    text = kernel.read_text()
    assert text.startswith('"""')
    kernel.write_text('"""A reworded module docstring."""\n# a new comment\n' + text.split('"""', 2)[2])
    _edit(kernel, "\ndef ", "\n\n\n# a comment between functions\ndef ")
    assert result.changed_sources(root) == []


def _module_name(rel: str) -> str:
    dotted = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    return dotted.replace("lib.kvwall", "kvwall", 1) if dotted.startswith("lib.") else "kvwall." + dotted


def test_a_code_edit_in_a_transitive_dependency_stales_it(tmp_path):
    root = _copy_tree(tmp_path)
    result = _result(root)
    experiment_source = (root / "lib/kvwall/experiments/gather_cast.py").read_text()
    transitive = [
        p for p in result.provenance.sources if p.endswith(".py") and _module_name(p) not in experiment_source
    ]
    assert transitive, "the experiment should import some project code only through other modules"
    victim = transitive[0]
    with (root / victim).open("a") as f:
        f.write("\nTRANSITIVE_EDIT = 1\n")
    assert result.changed_sources(root) == [victim]


def test_an_edit_outside_the_closure_keeps_it_fresh(tmp_path):
    root = _copy_tree(tmp_path)
    result = _result(root)
    outside = "lib/kvwall/peers/flashinfer/releases.py"
    assert outside not in result.provenance.sources
    with (root / outside).open("a") as f:
        f.write("\nUNRELATED = 1\n")
    (root / "kernels/new_kernel.py").write_text("X = 1\n")  # a kernel added later does not stale old results
    assert result.changed_sources(root) == []


def test_editing_a_tuned_table_or_removing_a_file_stales_it(tmp_path):
    root = _copy_tree(tmp_path)
    result = _result(root)
    tuned = root / "kernels/gather/tuned.json"
    tuned.write_text(tuned.read_text() + "\n")
    (root / "kernels/gather/gather_cast.cu").unlink()
    assert result.changed_sources(root) == ["kernels/gather/gather_cast.cu", "kernels/gather/tuned.json"]
    assert "STALE" not in result.caption()  # the caption compares with the real tree, not the copy


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_closure_rules_on_a_small_tree(tmp_path):
    """Relative and function-local imports are followed; a package's __init__ only where its own code is used;
    a name a package re-exports leads to the module defining it; kernel modules bring the data files they name."""
    root = tmp_path
    for rel in ("lib/kvwall/__init__.py", "lib/kvwall/model/__init__.py", "kernels/k/__init__.py"):
        _write(root, rel, "import kvwall.model.unused\n")
    _write(root, "kernels/__init__.py", "import kvwall.model.unused\nfrom kvwall.kernels.k.kernel import launch\n")
    _write(root, "lib/kvwall/experiments/__init__.py", "")
    _write(
        root,
        "lib/kvwall/experiments/toy.py",
        """\
        from kvwall.model.a import helper
        from kvwall.kernels import launch
        def run():
            from . import sibling
            return helper() + launch()
        """,
    )
    _write(root, "lib/kvwall/experiments/sibling.py", "X = 1\n")
    _write(root, "lib/kvwall/model/a.py", "from kvwall.kernels.k.kernel import launch as helper\n")
    _write(root, "lib/kvwall/model/unused.py", "Y = 2\n")
    _write(
        root,
        "kernels/k/kernel.py",
        "from pathlib import Path\nTABLE = Path(__file__).with_name('tuned.json')\ndef launch():\n    return 1\n",
    )
    _write(root, "kernels/k/tuned.json", "{}\n")
    _write(root, "kernels/k/unread.json", "{}\n")
    _write(root, "kernels/k/NOTES.md", "notes do not count\n")
    _write(root, "kernels/other/tuned.json", "{}\n")
    closure = {p.relative_to(root).as_posix() for p in import_closure("kvwall.experiments.toy", root)}
    assert closure == {
        "lib/kvwall/experiments/toy.py",
        "lib/kvwall/experiments/sibling.py",
        "lib/kvwall/model/a.py",
        "kernels/k/kernel.py",
    }
    assert set(source_fingerprint("kvwall.experiments.toy", root)) == closure | {"kernels/k/tuned.json"}


def test_normalized_code_ignores_what_does_not_run():
    a = 'def f(x):\n    """Doc."""\n    # comment\n    return x+1\n'
    b = "def f( x ):\n    return (x + 1)  # another\n"
    assert normalized_code(a) == normalized_code(b)
    assert normalized_code(a) != normalized_code(b.replace("1", "2"))


def test_nested_format_specs_hash_alike_under_python_3_11_and_3_12():
    """Python 3.12 parses f"{n:>{w}}" with an extra empty Constant at the end of the format spec (3.11 and 3.13
    do not); the GPU machine runs 3.12, CI runs 3.11: both must give the same fingerprint."""
    source = 'def f(n, w):\n    return f"{n:>{w}} |"\n'
    tree = ast.parse(source)
    spec = next(node for node in ast.walk(tree) if isinstance(node, ast.FormattedValue) and node.format_spec)
    spec.format_spec.values.append(ast.Constant(value=""))  # what Python 3.12 writes
    assert normalized_code(ast.unparse(tree)) == normalized_code(source)
    assert _canonical(tree) == _canonical(ast.parse(source))


def test_a_comment_or_layout_edit_in_a_cuda_source_keeps_a_result_fresh(tmp_path):
    root = _copy_tree(tmp_path)
    result = _result(root)
    cu = root / "kernels/gather/gather_cast.cu"
    assert "kernels/gather/gather_cast.cu" in result.provenance.sources
    text = cu.read_text()
    first_brace = text.index("{")
    cu.write_text(
        "// a new header comment\n/* and a block\n   comment */\n"
        + text[:first_brace]
        + "\n   {  "
        + text[first_brace + 1 :].replace("\n", "\n\n", 3)
        + "\n\n"
    )
    assert result.changed_sources(root) == []


def test_a_code_edit_in_a_cuda_source_stales_a_result(tmp_path):
    root = _copy_tree(tmp_path)
    result = _result(root)
    cu = root / "kernels/gather/gather_cast.cu"
    _edit(cu, "kThreads = 256", "kThreads = 128")
    assert result.changed_sources(root) == ["kernels/gather/gather_cast.cu"]


def test_normalized_cuda_drops_comments_and_layout_but_keeps_meaning():
    a = "int x = a - -b; // note\n  /* block\n comment */ unsigned int y = 2;\nf( a ,\n   b );\n"
    b = "int x=a- -b;\nunsigned int y=2; f(a, b);"
    assert normalized_cuda(a) == normalized_cuda(b)
    # What changes meaning shows: a token, a joined operator, a literal, a preprocessor line's space.
    differ = [
        (a, a.replace("- -b", "--b")),
        (a, a.replace("y = 2", "y = 3")),
        ('s = "a  b";', 's = "a b";'),
        ('s = "a // b";', 's = "a";'),
        ("#define F (x)\nint z;", "#define F(x)\nint z;"),
        ("#pragma unroll\nfor (;;) {}", "#pragma unroll for (;;) {}"),
    ]
    for x, y in differ:
        assert normalized_cuda(x) != normalized_cuda(y), (x, y)
    continued, joined = "#define G(x) \\\n  x + 1\nint z;", "#define G(x) x + 1\nint z;"  # a continued line
    assert normalized_cuda(continued) == normalized_cuda(joined)


# ----------------------------------------------------------------------------------------------
# The dispatcher's table: fingerprinted by its choices; the times beside it in no fingerprint
# ----------------------------------------------------------------------------------------------

#: decode_step_paths / decode_step_batches: they run ours, whose dispatcher reads kernel_paths.json.
STEP = "kvwall.experiments.answer.step"
CHOICES = "kernels/mla_decode/kernel_paths.json"
SIDECAR = "kernels/mla_decode/kernel_paths_measured.json"


def test_a_time_in_the_sidecar_keeps_a_result_fresh_and_a_changed_choice_stales_it(tmp_path):
    root = _copy_tree(tmp_path)
    before = source_fingerprint(STEP, root)
    assert CHOICES in before and SIDECAR not in before
    sidecar = root / SIDECAR
    measured = json.loads(sidecar.read_text())
    gpu = next(iter(measured))
    measured[gpu]["points"][0][3] += 1.5  # a re-timed point, a new caption and date
    measured[gpu]["recorded"] = "Recorded on NVIDIA H200, 2027-01-01, commit 0000000 (fused_decode_paths.json)."
    sidecar.write_text(json.dumps(measured, indent=1))
    assert source_fingerprint(STEP, root) == before
    table_file = root / CHOICES
    table = json.loads(table_file.read_text())
    point = table[gpu]["points"][0]
    point[3] = "triton" if point[3] != "triton" else "wgmma"  # another path measured fastest at one point
    table_file.write_text(json.dumps(table, indent=1))
    after = source_fingerprint(STEP, root)
    assert set(after) == set(before) and {k for k in after if after[k] != before[k]} == {CHOICES}


def test_the_sidecar_is_in_no_experiments_fingerprint():
    """It is named only outside its folder (by the experiment that writes it and the chapter's report), so no
    closure module brings it in; the choices are in the fingerprint of the experiments that run ours."""
    folder = PROJECT_ROOT / "lib/kvwall/experiments"
    modules = {_module_name(p.relative_to(PROJECT_ROOT).as_posix()) for p in folder.rglob("*.py")}
    modules = {m for m in modules if not m.startswith(fingerprint.BOOKKEEPING)}
    assert "kvwall.experiments.fused_decode.kernel_paths" in modules and STEP in modules
    prints = {m: source_fingerprint(m) for m in sorted(modules)}
    assert not [m for m, sources in prints.items() if SIDECAR in sources]
    runs_ours = (
        STEP,
        "kvwall.experiments.answer.sweep",
        "kvwall.experiments.fused_decode.bench",
        "kvwall.experiments.fused_decode.validation",
    )
    assert all(CHOICES in prints[m] for m in runs_ours)
