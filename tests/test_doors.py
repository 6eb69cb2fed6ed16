"""Chapter 3: FlashInfer's other MLA doors. The matrix, its evidence, and the helpers behind it."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import BOOK
from kvwall.experiments.doors import _reference
from kvwall.peers.flashinfer.calls import make_inputs
from kvwall.peers.flashinfer.citations import CHECKS, CheckSpec, cite, cite_all
from kvwall.peers.flashinfer.doors import DOOR_BY_KEY, DOORS, FAMILIES, STATUSES, DoorCase, door_matrix, glm5_cases
from kvwall.peers.flashinfer.releases import release_root
from kvwall.peers.flashinfer.replay import replay_cases

flashinfer = pytest.importorskip(
    "flashinfer",
    reason="chapter 3 reads and replays the installed FlashInfer release: flashinfer-python is not installed",
)
RELEASE, ROOT = release_root(None)


slow = pytest.mark.slow


@pytest.fixture(scope="module")
def chapter_record(executed):
    """Chapter 3 under papermill, as on a fresh machine without network (an empty FlashInfer release
    cache, pip's index unreachable): it reads and replays the pinned FlashInfer, so it needs neither.
    The session's one run of chapter 3 is this one (conftest.SESSION_RUNS), and the book shows it."""
    return executed(BOOK / "03_the_other_doors.md", offline=True)


# ---------------------------------------------------------------- the chapter, under papermill


@slow
def test_matrix_is_complete_and_every_cell_carries_evidence(chapter_record):
    v = chapter_record["values"]
    cells = {(c["door"], c["family"]): c for c in v["matrix"]}
    assert set(cells) == {(d.key, f) for d in DOORS for f in FAMILIES}
    for c in cells.values():
        assert c["status"] in STATUSES
        assert c["evidence"], f"{c['door']} on {c['family']} has no evidence"
        for ev in c["evidence"]:
            assert ev["kind"] in ("gpu", "replay", "source") and ev["where"] and ev["text"]
        if c["status"] == "accepted":
            assert c["conditions"], "an accepted cell must say under which heads / page sizes"


@slow
def test_cited_lines_really_hold_the_check(chapter_record):
    """Read each cited line again from the installed release: it must match the claimed check."""
    v = chapter_record["values"]
    assert v["release"] == RELEASE
    assert len(v["citations"]) == len(CHECKS)
    for c in v["citations"]:
        lines = (ROOT / c["file"]).read_text(errors="replace").splitlines()
        assert re.search(c["pattern"], lines[c["line"] - 1]), f"{c['file']}:{c['line']} does not hold {c['claim']!r}"
        assert lines[c["line"] - 1].strip() == c["text"]


@slow
def test_refusal_evidence_points_at_a_raise_in_the_release(chapter_record):
    """A replayed refusal names file:line; that line of the installed release raises (or asserts)."""
    for c in chapter_record["values"]["matrix"]:
        for ev in c["evidence"]:
            if ev["kind"] != "replay" or not re.match(r"flashinfer/.*:\d+$", ev["where"]):
                continue
            file, line = ev["where"].rsplit(":", 1)
            text = (ROOT / file).read_text(errors="replace").splitlines()[int(line) - 1]
            assert re.search(r"raise|assert", text), f"{ev['where']} is not a raise: {text!r}"


@slow
def test_matrix_reads_as_the_release_decides(chapter_record):
    """What the replays and sources of the installed release say, cell by cell (computed live by the
    chapter; nothing here is a typed-in expected output of a run that did not happen — the
    expectations are the checks cited in kvwall.peers.flashinfer.citations.CHECKS)."""
    cells = {(c["door"], c["family"]): c for c in chapter_record["values"]["matrix"]}
    for fam in ("SM100", "SM120"):  # plan(): FP8 KV only on SM90
        assert cells[("fa2", fam)]["status"] == cells[("fa3", fam)]["status"] == "refused"
        assert "SM90" in cells[("fa2", fam)]["evidence"][0]["text"]
    assert cells[("fa2", "SM90")]["status"] in ("runs", "accepted")
    for fam in FAMILIES:  # 128 heads only
        assert cells[("cutlass", fam)]["status"] == "refused"
        assert cells[("xqa", fam)]["status"] == "refused"
    assert cells[("trtllm-gen", "SM120")]["status"] == "refused"
    assert any(
        e["kind"] == "source" and "fmhaRunner.cuh" in e["where"] for e in cells[("trtllm-gen", "SM120")]["evidence"]
    )
    assert cells[("sm120-sparse", "SM120")]["status"] == "accepted"
    assert "page 64" in cells[("sm120-sparse", "SM120")]["conditions"]


@slow
def test_xqa_generator_refuses_glm5_heads_live(chapter_record):
    builds = {b["build"]: b for b in chapter_record["values"]["live_builds"]}
    for name in ("xqa_mla_fp8_h16_p64_sm120a", "xqa_mla_fp8_h64_p64_sm120a"):
        assert builds[name]["status"] == "generator_refused"
        assert builds[name]["exc_type"] == "AssertionError"
        file, line = builds[name]["where"].rsplit(":", 1)
        # quoted: FlashInfer's source
        assert "assert head_group_ratio == 128" in (ROOT / file).read_text().splitlines()[int(line) - 1]


# ---------------------------------------------------------------- helpers


def test_cite_finds_the_line_and_errors_name_the_file():
    spec = next(s for s in CHECKS if s.door == "cutlass" and "128" in s.claim)
    c = cite(spec)
    assert c.release == RELEASE and "128" in c.text and c.where.startswith("flashinfer/mla/_core.py:")
    assert any(n == c.line for n, _ in c.excerpt) and ">" in c.render()
    bad = CheckSpec(
        "cutlass", "x", "flashinfer/mla/_core.py", r"def _check_cutlass_shape\(", r"no such line at all", ()
    )
    with pytest.raises(LookupError, match="_core.py"):
        cite(bad)
    with pytest.raises(LookupError, match="no flashinfer/nope.py"):
        cite(CheckSpec("x", "x", "flashinfer/nope.py", "a", "b", ()))


def test_door_case_validates():
    with pytest.raises(ValueError, match=rf"'fa4'.*{re.escape(', '.join(DOOR_BY_KEY))}"):  # given, and allowed
        DoorCase("fa4", 16, 1)
    with pytest.raises(ValueError, match=rf"'SM89'.*{re.escape(', '.join(FAMILIES))}"):
        DoorCase("fa2", 16, 1, family="SM89")
    cases = glm5_cases()
    assert {c.family for c in cases} == set(FAMILIES) and {c.heads for c in cases} == {16, 64}
    assert any(c.door == "xqa" and c.q_dtype == "float8_e4m3fn" for c in cases)


def test_make_inputs_slots_match_the_page_table():
    case = DoorCase("trtllm-gen", 16, 64)
    inp = make_inputs(case, "cpu", context_lens=(300, 77))
    assert inp["pool"].dtype == torch.float8_e4m3fn and inp["pool"].shape[1:] == (64, 576)
    assert inp["table"].shape[1] % 2 == 0  # 128 / page size
    for b, n in enumerate((300, 77)):
        slots = inp["slots"][b]
        assert len(slots) == n and len(set(slots)) == n
        pages = inp["table"][b, : -(-n // 64)].tolist()
        assert [s // 64 for s in slots[::64]] == pages
        assert 0 not in pages  # page 0 unused, as in SGLang


def test_reference_check_rejects_a_wrong_output():
    """The check the GPU run applies would catch a wrong kernel (here: softmax over the wrong slots)."""
    case = DoorCase("fa2", 16, 1)
    inp = make_inputs(case, "cpu", context_lens=(50, 13))
    ref = _reference(inp)
    shuffled = dict(inp, slots=[s[::-1][:-1] + [s[0]] if len(s) > 1 else s for s in inp["slots"]])
    assert torch.allclose(_reference(shuffled), ref)  # same set of slots: same answer
    total = inp["pool"].shape[0] * inp["pool"].shape[1]
    wrong = dict(inp, slots=[[(x + 1) % total for x in s] for s in inp["slots"]])
    assert float((_reference(wrong) - ref).norm() / ref.norm()) > 5e-2


def test_replay_accepts_and_refuses_per_family():
    rows = replay_cases(
        [
            DoorCase("fa2", 16, 1, family="SM90"),
            DoorCase("fa2", 16, 1, family="SM120"),
            DoorCase("sm120-sparse", 64, 64, family="SM120"),
        ]
    )["rows"]
    assert rows[0]["outcome"] == "kernel_reached" and "gen_batch_mla_module(fa2" in rows[0]["kernel"]
    assert rows[1]["outcome"] == "refused" and rows[1]["where"].startswith("flashinfer/mla/_core.py:")
    assert rows[2]["outcome"] == "kernel_reached" and "sparse_mla_sm120" in rows[2]["kernel"]


def test_door_matrix_prefers_gpu_evidence():
    citations = cite_all(None)
    replays = [
        {
            "door": d.key,
            "family": f,
            "heads": 16,
            "page_size": 1,
            "q_dtype": "bfloat16",
            "outcome": "refused",
            "exc_type": "ValueError",
            "message": "no",
            "where": "flashinfer/x.py:1",
        }
        for d in DOORS
        for f in FAMILIES
    ]
    gpu = [
        {
            "door": "fa2",
            "family": "SM90",
            "heads": 16,
            "page_size": 1,
            "q_dtype": "bfloat16",
            "outcome": "runs",
            "rel_err_vs_float64": 3e-3,
            "ms": 0.05,
        }
    ]
    cells = {(c["door"], c["family"]): c for c in door_matrix(citations, replays, gpu)}
    assert cells[("fa2", "SM90")]["status"] == "runs" and cells[("fa2", "SM90")]["evidence"][0]["kind"] == "gpu"
    assert cells[("fa3", "SM90")]["status"] == "refused"
    assert cells[("trtllm-gen", "SM90")]["evidence"][0]["kind"] == "source"  # decisive C++ check
