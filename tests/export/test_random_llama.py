"""Random-weight Llamas of named shapes (`make_random_llama`), the scale benchmark's checkpoints:
a shape builds a Hugging Face directory that transformers loads back with that shape, the
tokenizer's vocabulary and its special ids, and an unknown shape is refused before any work."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # builds torch checkpoints

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ortspec.export.errors import ExportOptionError  # noqa: E402
from ortspec.export.tiny import RANDOM_LLAMA_SHAPES, make_random_llama, make_tokenizer  # noqa: E402


def test_a_shape_builds_a_checkpoint_that_loads_back_with_that_shape(tmp_path):
    tok = make_tokenizer()
    out = make_random_llama(tmp_path / "m", shape="tiny", tokenizer=tok, seed=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    c = model.config
    for key, value in RANDOM_LLAMA_SHAPES["tiny"].items():
        assert getattr(c, key) == value, key
    assert c.vocab_size == len(tok) and c.tie_word_embeddings
    assert (c.bos_token_id, c.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32
    stored = transformers.AutoConfig.from_pretrained(out).torch_dtype
    assert stored == torch.float16  # saved at half precision: the 1.07B shape is 2.1 GB
    again = transformers.AutoTokenizer.from_pretrained(out)
    assert again("Hello, world!")["input_ids"] == tok("Hello, world!")["input_ids"]
    assert again.chat_template == tok.chat_template
    ids = torch.tensor([again("The quick brown fox")["input_ids"]])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_the_same_seed_gives_the_same_weights_and_another_seed_others(tmp_path):
    tok = make_tokenizer()
    a, b, c = (make_random_llama(tmp_path / n, shape="tiny", tokenizer=tok, seed=s)
               for n, s in (("a", 0), ("b", 0), ("c", 1)))
    from safetensors.torch import load_file

    wa, wb, wc = (load_file(d / "model.safetensors") for d in (a, b, c))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.layers.0.mlp.up_proj.weight"],
                           wc["model.layers.0.mlp.up_proj.weight"])


def test_the_timed_shapes_have_their_published_sizes():
    # parameters with the tied embedding at SmolLM2's vocabulary (49152)
    def params(s: dict) -> int:
        h, i, n = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
        head = h // s["num_attention_heads"]
        kv = s["num_key_value_heads"] * head
        return 49152 * h + n * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h

    assert round(params(RANDOM_LLAMA_SHAPES["360m"]) / 1e6) == 362
    assert round(params(RANDOM_LLAMA_SHAPES["1b"]) / 1e7) == 107


def test_an_unknown_shape_is_refused_naming_the_shapes(tmp_path):
    with pytest.raises(ExportOptionError, match="shape must be one of tiny, 360m, 1b, got '7b'"):
        make_random_llama(tmp_path / "m", shape="7b", tokenizer=make_tokenizer())
    assert not (tmp_path / "m").exists()


def test_the_scale_benchmark_names_the_exports_shapes_and_default_precision():
    from ortspec.export.graph_spec import DEFAULT_QUANT
    from ortspec.runtime.bench import scale

    assert set(scale.SHAPES) <= set(RANDOM_LLAMA_SHAPES)
    assert scale.DEFAULT_QUANT == DEFAULT_QUANT


def test_the_command_line_refuses_an_unknown_shape(tmp_path, capsys):
    from ortspec.export.tiny import main

    assert main([str(tmp_path / "m"), "--shape", "7b"]) == 2
    assert "shape must be one of" in capsys.readouterr().err
