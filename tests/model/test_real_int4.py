"""The default model at int4 (`ortspec export --quant int4`, the GGUF's own Q4_1 blocks), as the
demo runs it: every verify row bitwise its step on real prompts, speculative greedy output
token for token plain decoding on Spec-Bench dev prompts of every category, and the demo itself
(`scripts/demo.py`, whose exit status is that identity).

Marked slow; CI runs them. The export needs the export extra the first time.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ortspec.runtime.bench.workload import default_questions_path, interleave_categories, load_questions
from ortspec.runtime import PromptLookupSpeculator, SpeculativeOptions, plain_decode, \
    speculative_decode_with
from ortspec.runtime.load import load_model
from ortspec.runtime.ort import kernels
from ortspec.runtime.ort.row_invariance import row_differences

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(int4_model_dir):
    return load_model(int4_model_dir)


def test_the_int4_export_runs_a_lone_token_as_it_is_or_pads_it_where_it_must(model):
    """On ortspec's kernels the default export attends with ortspec.CacheAttention: a step is
    one row, as a verify row is. Without them it attends with GroupQueryAttention, pads a lone
    query and carries the row probe that decides whether its products may run one row."""
    m = model.manifest
    if kernels.available():
        assert m.extra["attention"] == "CacheAttention"
        assert (m.min_attention_rows, m.row_probe, model.decoder.min_call_rows) == (1, None, 1)
        assert model.decoder.capacity == m.capacity
    else:
        assert (m.min_attention_rows, m.row_probe) == (2, "row_probe.onnx")
        assert model.decoder.min_call_rows in (1, 2)  # 2 where the probe finds a one-row path
        assert model.decoder.capacity == m.capacity - 1


def test_every_verify_row_equals_its_step_on_a_real_prompt(model):
    ids = model.encode("Explain in three sentences why the sky is blue, then list two "
                       "colours of a sunset.", chat=True)
    cont = model.encode("The sky looks blue because air scatters short wavelengths of "
                        "sunlight more than long ones, so blue light reaches")[:18]
    res = row_differences(model.decoder, ids, cont, block_lengths=(1, 2, 3, 4, 8, 16),
                          offsets=(0, 1))
    assert res.rows == 2 * (1 + 2 + 3 + 4 + 8 + 16)
    assert res.differing == 0 and res.max_abs == 0.0


def test_speculative_greedy_is_token_for_token_plain_on_spec_bench(model):
    path = default_questions_path()
    if not path.is_file():
        pytest.skip(f"Spec-Bench questions not found at {path}")
    prompts = interleave_categories(load_questions(path, split="dev", per_category=1))
    drafted = 0
    for p in prompts:
        ids = model.encode(p.text, chat=True)
        options = SpeculativeOptions(48, stop_token_ids=model.manifest.stop_token_ids)
        ref = plain_decode(model.decoder, ids, options)
        res = speculative_decode_with(model.decoder, ids,
                                      PromptLookupSpeculator(ngram_size=3, max_draft_len=8),
                                      options)
        assert res.tokens == ref.tokens, (p.question_id, p.category)
        drafted += res.counters.drafted
    assert len({p.category for p in prompts}) == 6 and drafted > 0


def test_the_demo_runs_the_int4_model_and_its_outputs_agree(int4_model_dir):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"),
                           "--max-new-tokens", "48"], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"loaded {int4_model_dir.name}" in done.stdout
    assert "outputs identical: True" in done.stdout
