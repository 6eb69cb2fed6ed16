"""The SGLang patches (kvwall.peers.sglang_patch) and their check (experiment ``sglang_patch_check``), on the CPU."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import sys

import pytest
import torch

from kvwall.experiments import run_experiment
from kvwall.experiments.sglang_patch import GEOMETRY, _reference64, check_variant
from kvwall.peers.sglang_patch import (PATCHES, VARIANTS, PatchError, apply_diff, apply_patch, load_patched_backend,
                                       patch_text, patched_source, upstream_source)
from kvwall.peers.sglang_patch.harness import make_decode_inputs, run_decode
from kvwall.results import validate_rows

UPSTREAM_SHA256 = "85ba5db394df47f12e8edc69282954b9f000b37c519194f56418424ee718bf2e"
WHOLE_POOL_CAST = "k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)"


def _function(source: str, name: str) -> ast.FunctionDef:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"no function {name}")


def _casts(nodes: list[ast.stmt]) -> list[ast.Call]:
    """Calls ``<something>.to(q.dtype)`` in ``nodes``."""
    return [n for stmt in nodes for n in ast.walk(stmt)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "to"
            and ast.unparse(n.args[:1]) == "q.dtype"]


def test_upstream_copy_is_the_wheels_file():
    assert hashlib.sha256(upstream_source().encode("utf-8")).hexdigest() == UPSTREAM_SHA256


@pytest.mark.parametrize("name", PATCHES)
def test_patch_applies_and_compiles(name):
    text = patch_text(name)
    assert text.startswith("--- a/python/sglang/srt/layers/attention/flashinfer_mla_backend.py\n")
    patched = apply_patch(name)
    assert patched != upstream_source()
    compile(patched, f"{name}.py", "exec")
    assert "kvwall_plan_decode" in patched


@pytest.mark.parametrize("name", PATCHES)
def test_patch_refuses_a_modified_file(name):
    src = upstream_source()
    changed = src.replace(WHOLE_POOL_CAST, WHOLE_POOL_CAST + "  # edited")
    assert changed != src
    with pytest.raises(PatchError, match="does not apply: line 822"):
        apply_patch(name, changed)
    # a context line elsewhere (the decode wrapper's construction) changed too
    moved = src.replace('        self.decode_wrapper = BatchMLAPagedAttentionWrapper(\n            self.workspace_buffer, '
                        'backend="auto"', '        self.decode_wrapper = BatchMLAPagedAttentionWrapper(\n            '
                        'self.workspace_buffer, backend="fa2"')
    assert moved != src
    with pytest.raises(PatchError, match="hunk 2"):
        apply_patch(name, moved)
    with pytest.raises(PatchError, match="runs past the end"):
        apply_patch(name, "\n".join(src.splitlines()[:700]))


def test_apply_diff_rejects_malformed_diffs():
    with pytest.raises(PatchError, match="no hunk"):
        apply_diff("a\n", "--- a/x\n+++ b/x\n")
    with pytest.raises(PatchError, match="truncated"):
        apply_diff("a\nb\n", "@@ -1,2 +1,2 @@\n a\n")
    assert apply_diff("a\nb\nc\n", "@@ -2,1 +2,2 @@\n b\n+B\n") == "a\nb\nB\nc\n"


def test_only_the_unpatched_decode_casts_the_whole_pool():
    src = upstream_source()
    decode = _function(src, "forward_decode")
    assert WHOLE_POOL_CAST in ast.unparse(decode) or WHOLE_POOL_CAST.split(" = ")[1] in ast.unparse(decode)
    assert len(_casts(decode.body)) == 1
    for name, flag in (("gather_cast", "self.kvwall_gather"), ("fused", "self.kvwall_fused")):
        decode = _function(apply_patch(name), "forward_decode")
        text = ast.unparse(decode)
        assert "get_key_buffer(layer.layer_id).to(" not in text
        branches = [n for n in ast.walk(decode) if isinstance(n, ast.If) and ast.unparse(n.test) == flag]
        assert len(branches) == 1, name
        branch = branches[0]
        assert not _casts(branch.body), f"{name}: the patched branch casts"
        if name == "gather_cast":  # the 16-bit fallback is the else branch
            assert len(_casts(branch.orelse)) == 1
        else:  # the fused branch returns; the fallback follows it
            assert isinstance(branch.body[-1], ast.Return)


def test_prefill_is_left_alone():
    """forward_extend's paged path casts the whole pool too; the patches leave it as upstream has it."""
    up = ast.unparse(_function(upstream_source(), "forward_extend"))
    assert "get_key_buffer(layer.layer_id).to(q.dtype)" in up
    for name in PATCHES:
        assert ast.unparse(_function(apply_patch(name), "forward_extend")) == up


def test_loading_leaves_no_sglang_stand_ins_behind():
    before = {k for k in sys.modules if k == "sglang" or k.startswith("sglang.")}
    for variant in VARIANTS:
        mod = load_patched_backend(variant, wrappers={"BatchMLAPagedAttentionWrapper": object,
                                                      "BatchPrefillWithRaggedKVCacheWrapper": object}, device="cpu")
        assert hasattr(mod, "FlashInferMLAAttnBackend")
    assert {k for k in sys.modules if k == "sglang" or k.startswith("sglang.")} == before
    with pytest.raises(ValueError, match="unknown variant"):
        patched_source("nope")


def test_small_experiment_runs_and_every_check_passes():
    result = run_experiment("sglang_patch_check", torch.device("cpu"), scale="small")
    validate_rows("sglang_patch_check", result.rows)
    checks = [r for r in result.rows if r["section"] == "checks"]
    assert {(r["variant"], r["case"]) for r in checks} == {(v, c) for v in VARIANTS
                                                           for c in ("batch1", "mixed", "shared_prefix")}
    assert all(r["ok"] for r in checks), [r["problems"] for r in checks if not r["ok"]]
    assert any(r["tokens"] % 2 for r in checks)
    for r in checks:
        if r["variant"] == "gather_cast":
            assert r["bit_identical_vs_unpatched"] and r["max_abs_diff_vs_unpatched"] == 0.0
        assert r["rel_err_vs_f64"] < 1e-2
        assert ("reference" in r["attention"]) or r["variant"] == "fused"


@pytest.fixture(scope="module")
def step():
    inp = make_decode_inputs(GEOMETRY, [3, 1, 8], pool_slots=64, layers=2, seed=5)
    return inp, _reference64(inp), run_decode("unpatched", inp, flashinfer=False)


def _check(run, step, variant):
    inp, ref64, base = step
    return check_variant(dataclasses.replace(run, variant=variant), base, inp, ref64, case="t", attention="test")


def _altered(variant, **names):
    mod = load_patched_backend(variant, device="cpu", wrappers={"BatchMLAPagedAttentionWrapper": object,
                                                                "BatchPrefillWithRaggedKVCacheWrapper": object})
    mod.__dict__.update(names)
    return mod


def test_check_catches_a_whole_pool_cast_behind_compact_indices(step):
    mod = _altered("gather_cast", launch_gather=lambda plan, pool: pool.to(torch.bfloat16))
    row = _check(run_decode("gather_cast", step[0], flashinfer=False, module=mod), step, "gather_cast")
    assert not row["ok"]
    assert row["whole_pool_casts"] == 2 and row["rows_read_exact"] is False


def test_check_catches_wrong_gather_indices(step):
    mod = load_patched_backend("gather_cast", device="cpu", wrappers={})
    real = mod.launch_gather
    mod.launch_gather = lambda plan, pool: real(dataclasses.replace(plan, kv_indices=plan.kv_indices.flip(0)),
                                                pool=pool)
    row = _check(run_decode("gather_cast", step[0], flashinfer=False, module=mod), step, "gather_cast")
    assert not row["ok"]
    assert row["whole_pool_casts"] == 0 and row["rows_read_exact"] is False
    assert not row["bit_identical_vs_unpatched"]


def test_check_catches_the_unpatched_path_posing_as_a_patch(step):
    row = _check(step[2], step, "gather_cast")
    assert not row["ok"]
    assert any("planned_indices" in p for p in row["problems"])
    assert any("whole_pool_casts" in p for p in row["problems"])


def test_check_catches_a_fused_call_on_the_wrong_slots(step):
    mod = load_patched_backend("fused", device="cpu", wrappers={})
    real = mod.mla_decode_fp8

    def shifted(q_nope, q_pe, ckv, kpe, kv_indptr, kv_indices, sm_scale, **kw):
        return real(q_nope, q_pe, ckv, kpe, kv_indptr, (kv_indices + 1) % ckv.shape[0], sm_scale, **kw)

    mod.mla_decode_fp8 = shifted
    row = _check(run_decode("fused", step[0], flashinfer=False, module=mod), step, "fused")
    assert not row["ok"]
    assert not row["within_bf16_tolerance"]
