"""SGLang 0.5.23 and DSA models: every cited fact against the wheel's own files, the flag checker, the book's SGLang
commands, and the forced-dense finding reproduced in SGLang's own memory-pool classes (CPU, Triton interpreter).

The wheel comes through :func:`kvwall.peers.sglang_source.sglang_source` (PyPI once, sha256-checked, cached); the
tests skip, saying why, only when it cannot be obtained.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml

from conftest import background_job
from kvwall.peers import sglang_dsa
from kvwall.peers.sglang_flags import check_command, flags_in_markdown, flags_in_python, parse_flags
from kvwall.peers.sglang_source import SGLangSourceUnavailable, sglang_import_deps, sglang_source

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def source() -> Path:
    try:
        return sglang_source()
    except SGLangSourceUnavailable as e:
        pytest.skip(f"SGLang 0.5.23's wheel cannot be obtained here: {e}")


@pytest.fixture(scope="module")
def flags(source):
    return parse_flags(source)


def test_every_citation_matches_a_line_of_the_wheel(source):
    assert sglang_dsa.check_citations(source) == []


def test_a_wrong_citation_is_reported(source):
    bad = sglang_dsa.Citation("sglang/srt/arg_groups/choices.py", r'"flashinfer_mla",')
    assert bad.line(source) is None


@pytest.mark.parametrize(
    "command",
    [
        "--attention-backend flashinfer_mla",
        "--attention-backend cutlass_mla",
        "--kv-cache-dtype fp8",
        "--speculative-algorithm MTP",
        "--nsa-decode-backend flashmla_kv",
        "--dsa-decode-backend flashinfer_mla",
    ],
)
def test_check_command_rejects(flags, command):
    assert check_command(command, flags), command


@pytest.mark.parametrize(
    "command",
    [
        "--attention-backend flashinfer",
        "--attention-backend flashmla --page-size 64 --kv-cache-dtype fp8_e4m3",
        "--attention-backend dsa --dsa-decode-backend flashmla_kv --dsa-prefill-backend flashmla_sparse",
        "--attention-backend=fa3 --kv-cache-dtype bfloat16",
        "--speculative-algorithm NEXTN --tp 4",
        "--speculative-algorithm EAGLE --attention-backend triton",
        "--attention-backend trtllm_mla",
    ],
)
def test_check_command_accepts(flags, command):
    assert check_command(command, flags) == []


def test_backends_the_facts_name_are_what_the_parser_reads(flags):
    choices = flags["--attention-backend"].choices
    assert set(sglang_dsa.ACCEPTED_DENSE_BACKENDS) <= set(choices)
    assert not set(sglang_dsa.REJECTED_BACKENDS) & set(choices)
    decode = set(flags["--dsa-decode-backend"].choices)
    assert {d.decode for d in sglang_dsa.DSA_DEFAULTS} <= decode


def test_layout_arithmetic():
    assert sglang_dsa.dsa_kv_row_bytes() == 656
    assert sglang_dsa.dsa_kv_row_bytes(raw_layout=True) == 576
    assert sglang_dsa.indexer_row_bytes() == 132
    assert [sglang_dsa.flashmla_kv_heads(h) for h in (16, 64, 65, 128, 129)] == [64, 64, 128, 128, 129]


def _book_fragments(flags):
    for path in sorted((REPO / "book").glob("*.md")):
        for frag in flags_in_markdown(path.read_text(encoding="utf-8"), flags):
            yield path.relative_to(REPO).as_posix(), frag
    # The answer's rows: the templates of book/answer.yml (a placeholder read as "{...}"), and decision.py's
    # SGLANG_BACKEND (the --attention-backend value of each FlashInfer door).
    answer = REPO / "book" / "answer.yml"
    texts = [re.sub(r"\{[^{}]*\}", "{...}", t) for t in _strings(yaml.safe_load(answer.read_text(encoding="utf-8")))]
    for frag in flags_in_python("\n".join(map(repr, texts)), flags):
        yield answer.relative_to(REPO).as_posix(), frag
    decision = REPO / "lib" / "kvwall" / "reports" / "decision.py"
    for frag in flags_in_python(decision.read_text(encoding="utf-8"), flags):
        yield decision.relative_to(REPO).as_posix(), frag


def _strings(data):
    if isinstance(data, str):
        yield data
    for value in data.values() if isinstance(data, dict) else data if isinstance(data, list) else ():
        yield from _strings(value)


def test_the_book_prints_only_sglang_commands_0_5_23_accepts(flags):
    rejected = [
        f"{where}: {problem}   [in: {frag[:90]}]"
        for where, frag in _book_fragments(flags)
        for problem in check_command(frag, flags)
    ]
    assert rejected == [], "\n".join(rejected)


@background_job
def forced_dense_run(out: Path) -> sglang_dsa.ForcedDenseResult:
    """The forced-dense reproduction in SGLang's own modules (a child Python, ~10 s of CPU): a background job."""
    try:
        source = sglang_source()
    except SGLangSourceUnavailable as e:
        pytest.skip(f"SGLang 0.5.23's wheel cannot be obtained here: {e}")
    try:
        sglang_import_deps()
    except SGLangSourceUnavailable as e:
        pytest.skip(f"the packages importing SGLang's modules needs cannot be installed here: {e}")
    return sglang_dsa.reproduce_forced_dense(tokens=64, heads=16, seed=0, source=source)


@pytest.fixture(scope="module")
def forced_dense(source, background):
    return background(forced_dense_run)


def test_forced_dense_keeps_the_dsa_pool_and_its_scaled_rows(forced_dense):
    r = forced_dense
    assert r.dsa_pool_class == "DSATokenToKVPool"
    assert r.dsa_row_bytes == sglang_dsa.dsa_kv_row_bytes() == 656
    assert r.dsa_row_bytes_trtllm == 576
    assert (r.key_buffer_dtype, r.key_buffer_last_dim) == ("torch.float8_e4m3fn", 656)
    assert r.mla_pool_row_bytes == 576
    assert r.dsa_dequant_rel_err < 0.1, "the DSA pool holds K correctly when read the DSA way"
    assert r.mla_pool_rel_err < 0.05 and r.mla_pool_output_rel_err < 0.1, "the control read is FP8-accurate"


def test_forced_dense_flashinfer_read_is_wrong(forced_dense):
    r = forced_dense
    assert r.dense_latent_rel_err > 10, "the latent is read without its per-128 scales"
    assert r.dense_rope_nan_tokens > 0, "scale and BF16 bytes decoded as e4m3 include NaN codes"
    assert math.isnan(r.dense_output_rel_err) or r.dense_output_rel_err > 1
    assert r.dense_output_rel_err_nan_zeroed > 1


def test_forced_dense_flashmla_triton_write_raises(forced_dense):
    assert forced_dense.set_kv_buffer_error.startswith("AssertionError")


def test_code_cells_are_not_commands_but_shell_blocks_are(flags):
    command = "python -m sglang.launch_server --kv-cache-dtype fp8"
    page = (
        "# A page\n\n```{code-cell} ipython3\nwords = '`--kv-cache-dtype` takes `fp8_e4m3`'\n```\n\n"
        f"```bash\n{command}\n```\n"
    )
    frags = flags_in_markdown(page, flags)
    assert frags == [command]  # the shell block's command, not the code cell's string
    assert check_command(frags[0], flags)  # `fp8` is not among the choices
