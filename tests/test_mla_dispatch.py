"""Ours -- the dispatcher between the paths of the fused FP8 MLA decode (kvwall.kernels.mla_decode.dispatch) --
its measured table (kernels/mla_decode/kernel_paths.json), and the contracts every path keeps, each one test body
parametrized over the paths ("triton", "wgmma", "wgmma_tokens"), skipped with a reason where a path cannot run here.

The rule (choose_path / decide_path): the Triton path where the wgmma paths cannot run (not compute capability 9.0,
other widths, misaligned rows); else the measured entry of this GPU, else one of the same compute capability: among
its points of the call's head count, the point of the call's shape (batch, tokens, longest request), else the nearest
in batch and tokens; with no entry, no point of that head count or a refused (malformed) table, the tokens-on-M wgmma
path up to 32 heads, the wgmma path above -- never the nearest point of another head count. A table point is
[heads, context, batch, path, tokens, max_len] (kernels.mla_decode.path_table); the times behind it are in the
sidecar kernel_paths_measured.json, which the dispatcher does not read. tests/test_dispatch_rule.py holds the rule to
the recorded run.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings

import pytest
import torch

from kvwall.kernels.mla_decode import dispatch
from kvwall.kernels.mla_decode import path_table
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode import wgmma_tokens as tokens_path
from kvwall.kernels.mla_decode.cases import SM_SCALE
from kvwall.kernels.mla_decode.dispatch import choose_path, mla_decode, plan_mla_decode
from kvwall.kernels.mla_decode.path_table import (
    KERNEL_PATHS,
    PATHS_FILE,
    POINT_COLUMNS,
    SAID,
    capability_rule,
    decide_path,
    fastest,
    measured_choice,
    path_point,
    read_table,
    reload_table,
    table_entry,
    table_problem,
    table_refusal,
    table_text,
)
from kvwall.kernels.mla_decode.plan import MLADecodePlan
from kvwall.kernels.mla_decode.triton_path import mla_decode_fp8, plan_mla_decode_triton
from kvwall.kernels.mla_decode.reference import make_mla_inputs

DC, DR = 512, 64
FP8 = torch.float8_e4m3fn
H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"
RTX = "NVIDIA RTX PRO 6000"
TABLE = {
    H200: {
        "capability": [9, 0],
        "page_size": 1,
        "points": [
            path_point(16, 4096, 1, 15.0, 18.0),
            path_point(16, 131072, 64, 620.0, 570.0, tokens=2_000_000, max_len=120_000),
            path_point(128, 32768, 32, 700.0, 220.0, tokens=262_144, max_len=30_000),
        ],
    }
}
#: A table with the tokens-on-M path: fastest at 16 heads, slower at 128 heads, not timed at one point, a mixed
#: batch of 64 heads where the heads-on-M path wins; and one point as tables before points carried their shape wrote
#: it (times after the path: read as batch requests of context tokens).
TABLE3 = {
    H200: {
        "capability": [9, 0],
        "page_size": 1,
        "points": [
            path_point(16, 4096, 1, 15.0, 18.0, 12.0),
            path_point(16, 131072, 32, 320.0, 314.0, 224.0, tokens=1_048_576, max_len=87_000),
            path_point(32, 131072, 1, 89.0, 57.0, None),
            path_point(128, 32768, 32, 700.0, 220.0, 400.0),
            path_point(64, 32768, 8, 98.0, 76.3, 90.7, tokens=65_536, max_len=23_878),
            [64, 4096, 8, "wgmma_tokens", 30.0, 26.0, 21.0],
        ],
    }
}


def _numbers(text: str) -> set[int]:
    """The whole numbers a reason names (``1,048,576`` read as one number)."""
    return {int(n.replace(",", "")) for n in re.findall(r"\d+(?:,\d{3})*", text)}


def _names_point(why: str, path: str, point: list, gpu: str) -> bool:
    """The dispatcher's reason names the path chosen, the point it read (heads, batch, tokens, the longest request;
    a batch of one: its tokens) and the GPU that measured it."""
    heads, _, batch, _, tokens, max_len = point
    shape = {heads, tokens, max_len} | ({batch} if batch > 1 else set())
    return why.startswith(f"{SAID[path]}:") and gpu in why and shape <= _numbers(why)


@pytest.fixture(autouse=True)
def _fresh_tables():
    """Each test reads tables (and warns about them) afresh."""
    reload_table()
    yield
    reload_table()


# ----------------------------------------------------------------------------------------------
# The rule and the table (no GPU needed)
# ----------------------------------------------------------------------------------------------


def test_a_point_names_the_faster_path_and_its_shape():
    assert path_point(16, 64, 1, 9.876, 8.951) == [16, 64, 1, "wgmma", 64, 64]
    assert path_point(16, 131072, 1, 50.11, 53.48) == [16, 131072, 1, "triton", 131072, 131072]
    assert path_point(16, 4096, 1, 15.0, None) == [16, 4096, 1, "triton", 4096, 4096]
    assert path_point(64, 4096, 8, 28.9, 26.2, 21.2, tokens=8192, max_len=3013) == [
        64,
        4096,
        8,
        "wgmma_tokens",
        8192,
        3013,
    ]
    assert len(POINT_COLUMNS) == 6 and POINT_COLUMNS[3] == "path"


def test_a_point_names_the_fastest_of_three_paths():
    assert path_point(16, 131072, 32, 320.4, 314.01, 224.333)[3] == "wgmma_tokens"
    assert path_point(128, 32768, 32, 751.4, 222.95, 400.0)[3] == "wgmma"
    assert path_point(16, 131072, 1, 49.82, 54.52, 50.0)[3] == "triton"
    assert path_point(16, 64, 1, 9.0, None, 8.0)[3] == "wgmma_tokens"
    assert path_point(16, 64, 1, 9.0, 9.0, 9.0)[3] == "triton"  # a tie: the earlier path
    assert path_point(16, 64, 1, 9.5, 9.0, 9.0)[3] == "wgmma"
    assert path_point(16, 64, 1, 9.0, 9.004, None)[3] == "triton"  # compared at 0.01 µs, as the sidecar keeps them
    assert fastest({"triton": None, "wgmma": 3.0, "wgmma_tokens": None}) == "wgmma"
    with pytest.raises(ValueError, match="timed"):
        fastest({"triton": None})


def test_a_recorded_shape_is_matched_exactly():
    """The issue-35 case: 64 heads, batch 8 of mixed lengths -- the point of that shape, whatever is near it."""
    entry = TABLE3[H200]
    point = TABLE3[H200]["points"][4]
    assert measured_choice(entry, 64, 8, 23_878, 65_536) == ("wgmma", point)
    path, why = decide_path(64, 8, 23_878, tokens=65_536, gpu=H200, capability=(9, 0), refusal=None, table=TABLE3)
    assert path == "wgmma" and _names_point(why, path, point, H200) and point[1] in _numbers(why)
    assert "nearest" not in why
    path, why = decide_path(16, 1, 4096, tokens=4096, gpu=H200, capability=(9, 0), refusal=None, table=TABLE3)
    assert path == "wgmma_tokens" and _names_point(why, path, TABLE3[H200]["points"][0], H200)
    assert "nearest" not in why and "µs" not in why


def test_within_a_measured_head_count_the_nearest_point_in_batch_and_tokens():
    entry = TABLE3[H200]
    assert measured_choice(entry, 16, 48, 100_000, 1_500_000)[1][:3] == [16, 131072, 32]
    assert measured_choice(entry, 16, 2, 3000, 5000)[1][:3] == [16, 4096, 1]
    # tokens decide before the longest request: a batch of 8 with 70K tokens is the 64K-token point, not the 32K one
    assert measured_choice(entry, 64, 8, 4096, 32_768)[0] == "wgmma_tokens"  # the older point: 8 x 4096 tokens
    assert measured_choice(entry, 64, 8, 60_000, 70_000)[0] == "wgmma"
    path, why = decide_path(16, 48, 100_000, tokens=1_500_000, gpu=H200, capability=(9, 0), refusal=None, table=TABLE3)
    assert path == "wgmma_tokens" and _names_point(why, path, TABLE3[H200]["points"][1], H200)
    assert "nearest" in why
    # without tokens: every request the longest (batch x max_len)
    assert measured_choice(TABLE[H200], 16, 64, 120_000)[1][:3] == [16, 131072, 64]


@pytest.mark.parametrize("heads", [20, 48, 96, 256])
def test_a_head_count_never_measured_goes_by_the_capability_rule_not_a_neighbour(heads):
    """20, 48, 96 and 256 heads sit between (or beyond) the measured 16, 32, 64 and 128: no point of another head
    count decides for them."""
    assert measured_choice(TABLE3[H200], heads, 8, 32_768) is None
    path, why = decide_path(heads, 8, 23_878, tokens=65_536, gpu=H200, capability=(9, 0), refusal=None, table=TABLE3)
    assert path == ("wgmma_tokens" if heads <= path_table.TOKENS_MAX_HEADS else "wgmma")
    measured = sorted({p[0] for p in TABLE3[H200]["points"]})
    assert why.startswith(f"{SAID[path]}:") and H200 in why and ", ".join(map(str, measured)) in why
    assert {heads, path_table.TOKENS_MAX_HEADS} <= _numbers(why) and "nearest" not in why


def test_older_points_are_read_as_uniform_batches():
    """A point written before points carried their shape ([heads, context, batch, path, *times]) reads as batch
    requests of context tokens: its path at that shape."""
    entry = TABLE3[H200]
    assert table_problem(TABLE3) is None
    path, point = measured_choice(entry, 64, 8, 4096, 32_768)
    assert path == "wgmma_tokens" and point == [64, 4096, 8, "wgmma_tokens", 32_768, 4096]
    assert measured_choice(entry, 32, 1, 131072)[0] == "wgmma"  # the tokens-on-M path not timed there
    assert measured_choice(entry, 128, 32, 32768)[0] == "wgmma"


def test_choose_path_reads_a_paths_json_with_the_third_path(tmp_path, monkeypatch):
    """choose_path on a (pretended) H200 with a kernel_paths.json file naming the tokens-on-M path: the file's choice,
    and the Triton path for misaligned rows whatever the file says."""
    table_file = tmp_path / "kernel_paths.json"
    table_file.write_text(table_text(TABLE3))
    monkeypatch.setattr(dispatch.wgmma_path, "wgmma_refusal", lambda device: None)
    monkeypatch.setattr(dispatch, "gpu_name", lambda device: H200)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    assert choose_path(16, 32, 87_000, cuda, tokens=1_048_576, table_file=table_file)[0] == "wgmma_tokens"
    assert choose_path(128, 32, 32768, cuda, table_file=table_file)[0] == "wgmma"
    assert choose_path(64, 8, 23_878, cuda, tokens=65_536, table_file=table_file)[0] == "wgmma"
    raw = torch.zeros(256 * 577 + 16, dtype=torch.uint8)
    odd = raw[1 : 1 + 256 * 577].view(-1, 577).view(FP8)
    path, why = choose_path(
        16, 32, 131072, cuda, ckv_cache=odd[:, :DC], kpe_cache=odd[:, DC : DC + DR], table_file=table_file
    )
    assert path == "triton" and "16-byte" in why
    assert choose_path(16, 1, 4096, cuda, dims=(256, 64), table_file=table_file)[0] == "triton"


def test_the_plan_asks_the_dispatcher_with_the_batchs_tokens(monkeypatch):
    """plan_mla_decode gives choose_path the rows (q_len x heads), the batch, the longest request and the batch's
    tokens (a graph plan: its capacity, batch x graph_max_len); the plan records the path and the reason."""
    asked = []

    def spy(heads, batch, max_len, device, **kw):
        asked.append((heads, batch, max_len, kw["tokens"]))
        return "triton", "spy-reason"

    monkeypatch.setattr(dispatch, "choose_path", spy)
    inp = make_mla_inputs([7, 65, 30], 16, seed=6, layout="pool_view", pool_slots=512, device="cpu")
    plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM_SCALE, lengths=[7, 65, 30])
    assert asked[-1] == (16, 3, 65, 102) and plan.path == "triton" and plan.why == "spy-reason"
    plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM_SCALE, lengths=[7, 65, 30], q_len=2)
    assert asked[-1] == (32, 3, 65, 102)
    plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM_SCALE, lengths=[7, 65, 30], graph_max_len=100)
    assert asked[-1] == (16, 3, 100, 300)


def test_the_table_is_looked_up_by_gpu_name():
    path, why = decide_path(16, 1, 4096, gpu=H200, capability=(9, 0), refusal=None, table=TABLE)
    assert path == "triton" and _names_point(why, path, TABLE[H200]["points"][0], H200)
    assert why.count(H200) == 1 and "nearest" not in why  # its own entry: no other GPU named
    path, why = decide_path(128, 32, 30_000, tokens=262_144, gpu=H200, capability=(9, 0), refusal=None, table=TABLE)
    assert path == "wgmma" and _names_point(why, path, TABLE[H200]["points"][2], H200)


def test_a_gpu_without_an_entry_uses_the_entry_of_its_compute_capability():
    """An H100 runs the H200's crossovers: the same point gives the same path, and the reason says whose table."""
    assert table_entry(TABLE, H100, (9, 0)) == (H200, TABLE[H200])
    assert table_entry(TABLE, H100, (10, 0)) is None and table_entry(TABLE, H100, None) is None
    for point in TABLE[H200]["points"]:
        on_h100 = decide_path(
            point[0], point[2], point[5], tokens=point[4], gpu=H100, capability=(9, 0), refusal=None, table=TABLE
        )
        assert on_h100[0] == point[3] and _names_point(on_h100[1], point[3], point, H200)
        assert H100 in on_h100[1] and "nearest" not in on_h100[1]


def test_without_a_table_the_capability_rule_decides():
    """The tokens-on-M wgmma path up to 32 heads, the wgmma path above."""
    path, why = decide_path(16, 1, 131072, gpu=H100, capability=(9, 0), refusal=None, table={})
    assert path == "wgmma_tokens" and table_entry({}, H100, (9, 0)) is None
    assert H100 in why and "9.0" in why and {16, path_table.TOKENS_MAX_HEADS} <= _numbers(why)
    assert decide_path(32, 8, 4096, gpu=H100, capability=(9, 0), refusal=None, table={})[0] == "wgmma_tokens"
    assert decide_path(33, 8, 4096, gpu=H100, capability=(9, 0), refusal=None, table={})[0] == "wgmma"
    path, why = decide_path(128, 1, 131072, gpu=H100, capability=(9, 0), refusal=None, table={})
    assert path == capability_rule(128) == "wgmma" and 128 in _numbers(why)
    other = {"NVIDIA B200": {**TABLE[H200], "capability": [10, 0]}}
    assert decide_path(16, 1, 131072, gpu=H100, capability=(9, 0), refusal=None, table=other)[0] == "wgmma_tokens"
    assert decide_path(64, 1, 131072, gpu=H100, capability=(9, 0), refusal=None, table=other)[0] == "wgmma"
    empty = {H200: {"capability": [9, 0], "page_size": 1, "points": []}}
    path, why = decide_path(64, 1, 4096, gpu=H200, capability=(9, 0), refusal=None, table=empty)
    assert path == "wgmma" and H200 in why and 64 in _numbers(why) and "none" in why


def test_where_wgmma_cannot_run_the_triton_path_runs_whatever_the_table_says():
    refusal = "compute capability 12.0: the wgmma path is built for sm_90a (9.0) only"
    path, why = decide_path(128, 32, 32768, gpu=RTX, capability=(12, 0), refusal=refusal, table=TABLE)
    assert path == "triton" and why.startswith(f"{SAID[path]}:") and refusal in why
    assert decide_path(16, 1, 4096, gpu=RTX, capability=(12, 0), refusal=refusal, table=TABLE3)[0] == "triton"


def test_misaligned_rows_go_to_the_triton_path():
    """Rows 577 bytes apart, one byte past a 16-byte boundary: the wgmma path's 16-byte loads cannot read them."""
    raw = torch.zeros(256 * 577 + 16, dtype=torch.uint8)
    odd = raw[1 : 1 + 256 * 577].view(-1, 577).view(FP8)
    refusal = wgmma_path.rows_refusal((DC, DR), {"ckv_cache": odd[:, :DC], "kpe_cache": odd[:, DC : DC + DR]})
    assert refusal and refusal.startswith("ckv_cache:") and {16, 1, 577} <= _numbers(refusal)  # data_ptr % 16, stride
    path, why = decide_path(128, 32, 32768, gpu=H200, capability=(9, 0), refusal=refusal, table=TABLE)
    assert path == "triton" and "16-byte" in why
    assert wgmma_path.rows_refusal((DC, DR), {"ckv_cache": raw[16 : 16 + 256 * 576].view(-1, 576).view(FP8)}) is None


def test_on_cpu_the_dispatcher_runs_the_triton_path():
    cpu_refusal = wgmma_path.wgmma_refusal(torch.device("cpu"))
    path, why = choose_path(16, 1, 131072, torch.device("cpu"))
    assert path == "triton" and cpu_refusal and cpu_refusal in why
    inp = make_mla_inputs([7, 65, 0], 3, seed=5, layout="pool_view", pool_slots=512, device="cpu")
    plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=3, sm_scale=SM_SCALE)
    assert plan.path == "triton" and type(plan.work) is MLADecodePlan and cpu_refusal in plan.why
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache)
    want = mla_decode_fp8(*args, inp.kv_indptr, inp.kv_indices, SM_SCALE, plan=plan.work)
    assert torch.equal(mla_decode(*args, plan), want)


def test_a_bad_path_name_is_refused():
    inp = make_mla_inputs([7, 65], 16, seed=6, layout="pool_view", pool_slots=512, device="cpu")
    for bad in ("fast", "cuda", "tokens"):
        allowed = ", ".join(map(repr, KERNEL_PATHS))
        with pytest.raises(ValueError, match=f"^plan_mla_decode: path .*{re.escape(allowed)}.*{bad!r}"):
            plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM_SCALE, path=bad)


def test_each_forced_path_plans_its_own_work_list_and_names_it(monkeypatch):
    """A forced path's plan holds that path's work list (the tokens-on-M path: 16 rows x 64 tokens a CTA); where a
    Hopper path cannot run, forcing it is refused at plan time, before any launch."""
    inp = make_mla_inputs([7, 65], 16, seed=6, layout="pool_view", pool_slots=512, device="cpu")
    refusal = re.escape(wgmma_path.wgmma_refusal(torch.device("cpu")))
    with pytest.raises(ValueError, match=f"^plan_mla_decode: the {SAID['wgmma_tokens']} path .*{refusal}"):
        plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM_SCALE, path="wgmma_tokens")
    monkeypatch.setattr(wgmma_path, "wgmma_refusal", lambda device: None)
    kinds = {"triton": MLADecodePlan, "wgmma": wgmma_path.WgmmaPlan, "wgmma_tokens": tokens_path.WgmmaTokensPlan}
    for path in KERNEL_PATHS:
        plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM_SCALE, path=path)
        assert type(plan.work) is kinds[path] and plan.path == path and "forced" in plan.why
    tokens = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM_SCALE, path="wgmma_tokens")
    assert tokens.work.config.block_h == 16 and tokens.work.config.block_n == 64
    assert tokens.launch.startswith(f"{SAID['wgmma_tokens']}:")
    assert {tokens_path.heads_per_cta(16), tokens.work.config.block_n, tokens.work.items} <= _numbers(tokens.launch)


# ----------------------------------------------------------------------------------------------
# A malformed table: refused, named, and the dispatch falls back by rule
# ----------------------------------------------------------------------------------------------


def _entry(**kw) -> dict:
    return {H200: {"capability": [9, 0], "page_size": 1, "points": [[64, 4096, 8, "wgmma", 8192, 3013]], **kw}}


def _point(p) -> dict:
    return _entry(points=[[16, 4096, 1, "triton", 4096, 4096], p])


#: (what the file holds, words the refusal says): every malformed shape a table can take.
MALFORMED = {
    "not JSON": ('{"NVIDIA H200": {', "not JSON"),
    "empty file": ("", "not JSON"),
    "NaN heads": ('{"NVIDIA H200": {"capability": [9, 0], "points": [[NaN, 64, 1, "triton", 64, 64]]}}', "heads nan"),
    "a list": ([_entry()], "a JSON list, not an object"),
    "a string": ('"paths"', "a JSON str"),
    "null": (None, "a JSON NoneType"),
    "GPU entry a list": ({H200: [[16, 64, 1, "triton", 64, 64]]}, f"entry '{H200}' is a list, not an object"),
    "GPU entry null": ({H200: None}, f"entry '{H200}' is a NoneType"),
    "GPU entry a string": ({H200: "wgmma"}, "is a str, not an object"),
    "capability missing": ({H200: {"page_size": 1, "points": []}}, "capability None"),
    "capability a string": (_entry(capability="9.0"), "capability '9.0'"),
    "capability short": (_entry(capability=[9]), "capability [9]"),
    "capability negative": (_entry(capability=[9, -1]), "capability [9, -1]"),
    "capability of booleans": (_entry(capability=[True, False]), "capability [True, False]"),
    "page size 0": (_entry(page_size=0), "page_size 0"),
    "page size a string": (_entry(page_size="64"), "page_size '64'"),
    "points missing": ({H200: {"capability": [9, 0], "page_size": 1}}, "points missing, not a list"),
    "points an object": (_entry(points={"16": "wgmma"}), "points dict, not a list"),
    "points a string": (_entry(points="wgmma"), "points str, not a list"),
    "a point an object": (_point({"heads": 16}), 'point 1 {"heads": 16} is a dict'),
    "a point a number": (_point(16), "point 1 16 is a int"),
    "heads 0": (_point([0, 4096, 1, "wgmma", 4096, 4096]), "heads 0: not a positive integer"),
    "heads negative": (_point([-16, 4096, 1, "wgmma", 4096, 4096]), "heads -16"),
    "heads a float": (_point([16.0, 4096, 1, "wgmma", 4096, 4096]), "heads 16.0"),
    "heads a boolean": (_point([True, 4096, 1, "wgmma", 4096, 4096]), "heads True"),
    "a negative context": (_point([16, -4096, 1, "wgmma", 4096, 4096]), "context -4096"),
    "a string batch": (_point([16, 4096, "8", "wgmma", 8192, 3013]), "batch '8'"),
    "batch 0": (_point([16, 4096, 0, "wgmma", 8192, 3013]), "batch 0"),
    "a missing path": (_point([16, 4096, 1, 4096, 4096]), "has 5 fields, not 6"),
    "an unknown path": (_point([16, 4096, 1, "cutlass", 4096, 4096]), "names the path 'cutlass'"),
    "a null path": (_point([16, 4096, 1, None, 4096, 4096]), "names the path None"),
    "a path in the wrong place": (_point(["wgmma", 16, 4096, 1, 4096, 4096]), "heads 'wgmma'"),
    "too many fields": (_point([16, 4096, 1, "wgmma", 4096, 4096, 7]), "has 7 fields"),
    "too few fields": (_point([16, 4096, 1]), "has 3 fields"),
    "an empty point": (_point([]), "has 0 fields"),
    "tokens 0": (_point([16, 4096, 1, "wgmma", 0, 4096]), "tokens 0"),
    "tokens a string": (_point([16, 4096, 8, "wgmma", "8192", 3013]), "tokens '8192'"),
    "fewer tokens than the longest request": (_point([16, 4096, 8, "wgmma", 100, 3013]), "100 tokens in 8 requests"),
    "more tokens than the batch holds": (_point([16, 4096, 2, "wgmma", 9000, 4096]), "9000 tokens in 2 requests"),
    "max_len negative": (_point([16, 4096, 1, "wgmma", 4096, -1]), "max_len -1"),
    "an older point with a bad time": (_point([16, 4096, 1, "wgmma", -3.0, 2.0]), "the time -3.0"),
    "two points of one shape": (_point([16, 4096, 1, "wgmma", 4096, 4096]), "points 0 and 1 are the same shape"),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_a_malformed_table_is_refused_by_name_and_the_dispatch_falls_back_by_rule(case, tmp_path, monkeypatch):
    content, words = MALFORMED[case]
    table_file = tmp_path / "kernel_paths.json"
    table_file.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.warns(RuntimeWarning, match="dispatcher's table") as caught:
        assert read_table(table_file) == {}
    said = str(caught[0].message)
    assert str(table_file) in said and words in said and "capability rule" in said, said
    assert words in table_refusal(table_file)
    with warnings.catch_warnings():  # once: the next reads and choices say nothing more
        warnings.simplefilter("error")
        assert read_table(table_file) == {}
        monkeypatch.setattr(dispatch.wgmma_path, "wgmma_refusal", lambda device: None)
        monkeypatch.setattr(dispatch, "gpu_name", lambda device: H200)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        for heads, want in ((16, "wgmma_tokens"), (64, "wgmma")):
            path, why = choose_path(heads, 8, 3013, torch.device("cuda", 0), tokens=8192, table_file=table_file)
            assert path == want and str(table_file) in why and words in why, why


@pytest.mark.parametrize("case", [c for c, (content, _) in MALFORMED.items() if not isinstance(content, str)])
def test_a_malformed_table_given_directly_is_refused_too(case):
    """decide_path checks a table it is handed (the reports hand it one): no exception, the capability rule, the
    reason saying why; never a math error on a wrong-shaped point."""
    content, words = MALFORMED[case]
    assert words in table_problem(content)
    with pytest.warns(RuntimeWarning, match="refused the dispatcher's table handed to decide_path"):
        path, why = decide_path(64, 8, 3013, tokens=8192, gpu=H200, capability=(9, 0), refusal=None, table=content)
    assert path == "wgmma" and "was refused" in why and words in why


def test_a_missing_table_is_no_refusal(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_table(tmp_path / "none.json") == {} and table_refusal(tmp_path / "none.json") is None


def test_a_table_is_read_once_and_again_after_a_reload(tmp_path):
    table_file = tmp_path / "kernel_paths.json"
    table_file.write_text(table_text(TABLE3))
    first = read_table(table_file)
    assert first == TABLE3 and read_table(table_file) is first and table_refusal(table_file) is None
    table_file.write_text("[]")
    assert read_table(table_file) is first  # cached
    reload_table()
    with pytest.warns(RuntimeWarning, match="refused"):
        assert read_table(table_file) == {}


def test_the_shipped_table_is_well_formed_and_holds_only_choices_and_its_sidecar_the_times():
    """kernel_paths.json: per GPU its compute capability, page size and points [heads, context, batch, path, tokens,
    max_len], nothing else (so re-timing without a changed choice rewrites the same bytes); the sidecar has the times
    at the same points, in the same order, and each choice is the fastest of them; the file is as the writer writes
    it."""
    from kvwall.experiments.fused_decode.kernel_paths import MEASURED_COLUMNS, MEASURED_FILE, choice_from_measured

    text = PATHS_FILE.read_text()
    table, measured = json.loads(text), json.loads(MEASURED_FILE.read_text())
    assert table and text == table_text(table) and set(measured) == set(table)
    assert table_problem(table) is None and table_refusal(PATHS_FILE) is None
    for gpu, entry in table.items():
        assert set(entry) == {"capability", "page_size", "points"}, gpu
        assert len(entry["capability"]) == 2 and all(isinstance(x, int) for x in entry["capability"]), gpu
        times = measured[gpu]
        assert {"by", "recorded", "page_size", "columns", "points"} <= set(times)
        assert times["page_size"] == entry["page_size"]
        columns = times["columns"]
        assert columns[: len(MEASURED_COLUMNS)] == list(MEASURED_COLUMNS)
        assert len(times["points"]) == len(entry["points"])
        for point, timed in zip(entry["points"], times["points"]):
            assert len(point) == len(POINT_COLUMNS) and point[3] in KERNEL_PATHS and timed[:3] == point[:3]
            assert len(timed) == len(columns) and choice_from_measured(columns, timed) == point[3], point


# ----------------------------------------------------------------------------------------------
# The contracts both paths keep: one body each, parametrized over the paths
# ----------------------------------------------------------------------------------------------

#: The paths as test parameters: the wgmma paths are sm_90a code, so their cases are marked ``gpu`` (``make gpu-test``
#: runs them; ``make test`` leaves them out instead of skipping them).
PATH_PARAMS = [p if p == "triton" else pytest.param(p, marks=pytest.mark.gpu) for p in KERNEL_PATHS]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _device(path: str, *, gpu_only: bool = False) -> torch.device:
    """Where ``path`` runs here (the Triton path on the CPU in its interpreter, unless ``gpu_only``), else skip."""
    if path in ("wgmma", "wgmma_tokens"):
        if not _hopper():
            pytest.skip(f"the {path} path needs an H100 / H200 (sm_90a code)")
        if shutil.which("nvcc") is None:
            pytest.skip("no nvcc on this machine: the wgmma path is built at first use")
        return torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if gpu_only:
        pytest.skip("CUDA graphs need an NVIDIA GPU")
    return torch.device("cpu")


def _inputs(device: torch.device, layout: str, heads: int = 16):
    small = device.type == "cpu"
    inp = make_mla_inputs(
        [30, 50, 9] if small else [300, 5000, 70],
        heads,
        seed=3,
        layout=layout,
        page_size=16 if small else 64,
        pool_slots=4096 if small else 100_000,
        device=device,
    )
    page_size = inp.ckv_cache.shape[1] if layout == "paged" else 1
    return inp, page_size, (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr)


def _plan(inp, page_size: int, path: str, heads: int = 16):
    return plan_mla_decode(
        inp.kv_indptr,
        inp.kv_indices,
        heads=heads,
        sm_scale=SM_SCALE,
        kv_len=inp.kv_len,
        page_size=page_size,
        path=path,
        ckv_cache=inp.ckv_cache,
        kpe_cache=inp.kpe_cache,
    )


@pytest.mark.parametrize("layout", ["pool_view", "paged"])
@pytest.mark.parametrize("path", PATH_PARAMS)
def test_an_out_of_range_index_written_after_the_plan_makes_exactly_its_request_nan(path, layout):
    """The plan checked the page table; an index the engine writes into it afterwards (the plan keeps the table by
    reference, as a graph replay reads it) that falls outside the cache makes request 1's rows NaN, and the other
    requests' rows are the bits of the same call with valid indices."""
    device = _device(path)
    inp, page_size, args = _inputs(device, layout)
    plan = _plan(inp, page_size, path)
    clean = mla_decode(*args[:4], plan)
    for bad in (10**8, -1):
        keep = inp.kv_indices.clone()
        inp.kv_indices[int(inp.kv_indptr[1]) + 2] = bad
        out = mla_decode(*args[:4], plan)
        inp.kv_indices.copy_(keep)
        assert [bool(out[b].isnan().all()) for b in range(3)] == [False, True, False]
        assert [bool(out[b].isnan().any()) for b in range(3)] == [False, True, False]
        assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2]) and not clean.isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["pool_view", "paged"])
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_a_planned_call_replayed_in_a_cuda_graph_equals_the_eager_call(path, layout):
    """Captured once, the graph replays what an eager call computes, bit for bit, also after the query and the
    scale tensors it reads change in place."""
    device = _device(path, gpu_only=True)
    inp, page_size, args = _inputs(device, layout)
    plan = _plan(inp, page_size, path)
    scales = dict(ckv_scale=torch.tensor([0.37], device=device), kpe_scale=torch.tensor([0.74], device=device))
    eager = mla_decode(*args[:4], plan, **scales)
    graphed = torch.empty_like(eager)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up outside the capture (the Triton kernels compile here)
        mla_decode(*args[:4], plan, out=graphed, **scales)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(*args[:4], plan, out=graphed, **scales)
    graphed.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(graphed, eager)
    inp.q_nope.mul_(-0.5)
    scales["ckv_scale"].fill_(1.5)
    scales["kpe_scale"].fill_(0.75)
    graphed.fill_(float("nan"))
    graph.replay()
    changed = mla_decode(*args[:4], plan, **scales)
    torch.cuda.synchronize(device)
    assert torch.equal(graphed, changed) and not torch.equal(changed, eager)


_CALL = {
    "triton": mla_decode_fp8,
    "wgmma": wgmma_path.mla_decode_fp8_wgmma,
    "wgmma_tokens": tokens_path.mla_decode_fp8_wgmma_tokens,
}
_PLAN = {
    "triton": plan_mla_decode_triton,
    "wgmma": wgmma_path.plan_mla_decode_wgmma,
    "wgmma_tokens": tokens_path.plan_mla_decode_wgmma_tokens,
}
_PLANNER = {
    "triton": r"plan_mla_decode_triton \(the Triton path\)",
    "wgmma": "plan_mla_decode_wgmma,",
    "wgmma_tokens": "plan_mla_decode_wgmma_tokens,",
}


@pytest.mark.parametrize("other", PATH_PARAMS)
@pytest.mark.parametrize("path", PATH_PARAMS)
def test_a_plan_of_another_path_is_refused_by_a_path_called_by_name(path, other):
    """Each path's own call (for tests and benchmarks) refuses another path's work list, before any launch."""
    if other == path:
        pytest.skip("a path's own plan")
    device = _device(path)
    inp, _, args = _inputs(device, "pool_view")
    plan = _PLAN[other](inp.kv_indptr, heads=16, device=device)
    with pytest.raises(TypeError, match=f"plan must come from {_PLANNER[path]}"):
        _CALL[path](*args, inp.kv_indices, SM_SCALE, check_range=False, plan=plan)


@pytest.mark.parametrize("path", PATH_PARAMS)
def test_an_unchecked_call_by_name_without_a_plan(path):
    """The wgmma paths refuse it (their plan is made once per step, outside graph capture); the Triton path runs its
    uniform launch, the same as the checked call's result."""
    device = _device(path)
    inp, _, args = _inputs(device, "pool_view")
    if path != "triton":
        with pytest.raises(ValueError, match=f"needs plan= from {_PLANNER[path][:-1]}"):
            _CALL[path](*args, inp.kv_indices, SM_SCALE, check_range=False)
        return
    out = mla_decode_fp8(*args, inp.kv_indices, SM_SCALE, check_range=False, num_splits=1)
    assert torch.equal(out, mla_decode_fp8(*args, inp.kv_indices, SM_SCALE, num_splits=1))


@pytest.mark.parametrize("path", PATH_PARAMS)
def test_misaligned_cache_rows(path):
    """Rows 577 bytes apart starting one byte past a 16-byte boundary: forcing a wgmma path on them is refused at
    plan time (naming the Triton path), the Triton path reads them, and "auto" routes them to the Triton path."""
    device = _device(path)
    inp, _, _ = _inputs(device, "pool_view")
    slots = inp.ckv_cache.shape[0]
    gen = torch.Generator(device=device).manual_seed(7)
    raw = torch.randint(0, 0x70, (slots * 577 + 16,), generator=gen, dtype=torch.uint8, device=device)  # no NaN
    odd = raw[1 : 1 + slots * 577].view(-1, 577).view(FP8)
    ckv, kpe = odd[:, :DC], odd[:, DC : DC + DR]

    def plan(p: str):
        return plan_mla_decode(
            inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM_SCALE, path=p, ckv_cache=ckv, kpe_cache=kpe
        )

    if path != "triton":
        with pytest.raises(ValueError, match=r"ckv_cache.*16-byte.*577"):
            plan(path)
        auto = plan("auto")
        assert auto.path == "triton"
        assert torch.equal(
            mla_decode(inp.q_nope, inp.q_pe, ckv, kpe, auto), mla_decode(inp.q_nope, inp.q_pe, ckv, kpe, plan("triton"))
        )
        return
    assert torch.isfinite(mla_decode(inp.q_nope, inp.q_pe, ckv, kpe, plan(path))).all()


@pytest.mark.parametrize(
    "q,words",
    [
        (lambda q: q[:0], r"q_nope must be a torch.bfloat16 tensor of shape \(2, 3, 512\)"),
        (lambda q: q.tolist(), "q_nope must be a torch.bfloat16 tensor .* got list"),
        (lambda q: q[0], r"q_nope must be a torch.bfloat16 tensor .* got torch.bfloat16 \(3, 512\)"),
    ],
)
def test_a_bad_query_is_refused_in_words(q, words):
    """Issue 24, finding 4: batch 0, a list or a 2-D q_nope is refused by name before any launch."""
    inp = make_mla_inputs([7, 65], 3, seed=5, layout="pool_view", pool_slots=512, device="cpu")
    plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=3, sm_scale=SM_SCALE)
    with pytest.raises(ValueError, match=f"^mla_decode: {words}"):
        mla_decode(q(inp.q_nope), inp.q_pe, inp.ckv_cache, inp.kpe_cache, plan)
    with pytest.raises(TypeError, match="^plan_mla_decode: kv_indices.*list"):
        plan_mla_decode(inp.kv_indptr, [0, 1], heads=3, sm_scale=SM_SCALE)
