"""The architectures `ortspec export` takes beyond the default model's, each on a tiny random
checkpoint built here from its transformers config (hidden 64, or 256 and 512 with
Phi-4-mini's heads; 2-6 layers; the 320-token test tokenizer): both entry points against
transformers' own forward pass over a prompt longer than any sliding window, greedy
speculative decoding with prompt lookup token for token against plain decoding, and
`ortspec check` on the export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from ortspec.export.tiny import EOS_ID, VOCAB, make_tokenizer, save_checkpoint, scale_up
from transformers import (AutoConfig, AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM,
                          Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, SmolLM3Config,
                          SmolLM3ForCausalLM)

from ortspec.export import export_model
from ortspec.runtime.check.tolerances import TOLERANCES
from ortspec.runtime import (PromptLookupSpeculator, SpeculativeOptions, load_model,
                             plain_decode, speculative_decode_with)
from ortspec.runtime.ort import graph_io as gio
from ortspec.runtime.ort import kernels
from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.cli.check import main as check_main
from ortspec.runtime.errors import ExportError
from ortspec.runtime.ort.decoder import OrtDecoder
from ortspec.runtime.ort.row_invariance import row_differences

CAP, VERIFY = 64, 4
PROMPT_LEN = 60  # longer than every sliding window below (16, 24)
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "eos_token_id": EOS_ID,
          "bos_token_id": 3, "pad_token_id": 0}


pytestmark = pytest.mark.slow  # builds and exports torch checkpoints


def _build(directory, model_cls, config, *, seed=0, biases=False):
    torch.manual_seed(seed)
    model = model_cls(config)
    scale_up(model)
    if biases:  # zero-initialised otherwise: would test nothing
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    return save_checkpoint(model, directory, make_tokenizer())


def llama3(directory):
    """Llama 3.x: rope_type llama3 (frequencies below original/high_freq_factor stretched by
    `factor`, a smooth band between), untied head, theta 5e5."""
    config = LlamaConfig(**COMMON, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 32,
                                          "rope_theta": 5e5})
    return _build(directory, LlamaForCausalLM, config)


def llama_mha(directory):
    """Llama with one query head a KV head (G = 1): the window graph runs a lone query twice."""
    config = LlamaConfig(**COMMON, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, tie_word_embeddings=True)
    return _build(directory, LlamaForCausalLM, config)


def qwen25(directory, *, tied):
    """Qwen2.5: q/k/v biases, theta 1e6, tied (0.5B-3B) or untied (7B+) head."""
    config = Qwen2Config(**COMMON, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=tied,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         use_sliding_window=False)
    return _build(directory, Qwen2ForCausalLM, config, seed=1, biases=True)


def qwen3(directory):
    """Qwen3: per-head RMSNorm on q and k before the rotary, no biases, head_dim set apart
    from hidden / heads (here 32 with 4 heads of a 64-wide model)."""
    config = Qwen3Config(**COMMON, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                         use_sliding_window=False)
    return _build(directory, Qwen3ForCausalLM, config, seed=2)


def mistral(directory):
    """Mistral with a sliding window of 16, shorter than the capacity 64."""
    config = MistralConfig(**COMMON, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, sliding_window=16, tie_word_embeddings=False)
    return _build(directory, MistralForCausalLM, config, seed=3)


def smollm3(directory):
    """SmolLM3: every second layer without rotary (no_rope_layers [1, 0, 1, 0])."""
    config = SmolLM3Config(**COMMON, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, no_rope_layer_interval=2,
                           tie_word_embeddings=True, use_sliding_window=False)
    assert config.no_rope_layers == [1, 0, 1, 0]
    return _build(directory, SmolLM3ForCausalLM, config, seed=4)


def phi3(directory):
    """Phi-3: fused qkv_proj and gate_up_proj, half the head rotating (partial_rotary_factor
    0.5), longrope with distinct short factors (the long ones apply beyond the original 64
    positions only) and an attention factor, and a sliding window of 24."""
    rotary_half = 8  # head_dim 32 * 0.5 / 2
    config = Phi3Config(**COMMON, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, partial_rotary_factor=0.5, sliding_window=24,
                        tie_word_embeddings=False, original_max_position_embeddings=64,
                        rope_parameters={"rope_type": "longrope",
                                         "short_factor": [1.0 + 0.25 * i
                                                          for i in range(rotary_half)],
                                         "long_factor": [4.0] * rotary_half,
                                         "original_max_position_embeddings": 64})
    return _build(directory, Phi3ForCausalLM, config, seed=5)


def phi4_mini(directory, *, head_dim=128):
    """Phi-4-mini's heads: 4 query heads and 2 KV heads of 128 dimensions, 96 of them rotating
    (partial_rotary_factor 0.75: cos/sin tables 48 wide, a quarter of each head passed
    through), tied embeddings, longrope with distinct short factors; hidden 4 * head_dim
    (512). head_dim 64 rotates 48 the same way. Step and verify logits 2.4e-5 apart at head_dim
    128 (6e-6 at 64) against the fp32 bound of 1e-4; over seeds 0-7 at most 3.0e-5 (3.9e-5 for
    the same models with the whole head rotating)."""
    rotary_half = head_dim * 3 // 8  # head_dim * 0.75 / 2
    config = Phi3Config(**{**COMMON, "hidden_size": 4 * head_dim}, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.75,
                        sliding_window=None, tie_word_embeddings=True,
                        original_max_position_embeddings=64,
                        rope_parameters={"rope_type": "longrope",
                                         "short_factor": [1.0 + 0.25 * i
                                                          for i in range(rotary_half)],
                                         "long_factor": [4.0] * rotary_half,
                                         "original_max_position_embeddings": 64})
    return _build(directory, Phi3ForCausalLM, config, seed=8)


def gemma2(directory):
    """Gemma 2: embedding times sqrt(hidden), GeGLU, (1 + weight) RMSNorms before and after
    attention and MLP, attention and final soft-capping (caps small enough to bite on these
    logits), sliding and full layers alternating, query_pre_attn_scalar apart from head_dim."""
    config = Gemma2Config(**COMMON, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                          sliding_window=16, attn_logit_softcapping=4.0,
                          final_logit_softcapping=6.0, tie_word_embeddings=True)
    assert config.layer_types[:2] == ["sliding_attention", "full_attention"]
    return _build(directory, Gemma2ForCausalLM, config, seed=6)


def gemma3(directory):
    """Gemma 3 text: Gemma 2's layout with q/k norms, no soft-capping, five sliding layers to
    one full one, the sliding layers' rotary on base 1e4 and the full ones' on 1e6 with linear
    scaling."""
    config = Gemma3TextConfig(**COMMON, num_hidden_layers=6, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                              sliding_window=16, tie_word_embeddings=True,
                              rope_parameters={
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 1e4},
                                  "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                     "rope_theta": 1e6}})
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    return _build(directory, Gemma3ForCausalLM, config, seed=7)


FAMILIES = {"llama3": llama3, "llama-mha": llama_mha,
            "qwen2.5-tied": lambda d: qwen25(d, tied=True),
            "qwen2.5-untied": lambda d: qwen25(d, tied=False), "qwen3": qwen3,
            "mistral-sliding": mistral, "smollm3": smollm3, "phi3": phi3,
            "phi4-mini": phi4_mini, "phi4-mini-hd64": lambda d: phi4_mini(d, head_dim=64),
            "gemma2": gemma2, "gemma3": gemma3}
STANDARD = ("llama3", "qwen3", "mistral-sliding", "smollm3", "phi3", "phi4-mini",
            "phi4-mini-hd64", "gemma2", "gemma3")  # the TensorRT flavour


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = FAMILIES[name](tmp_path_factory.mktemp("src") / name)
        return made[name]
    return get


@pytest.fixture(scope="module")
def exports(sources, tmp_path_factory):
    made = {}

    def get(name, attention="gqa"):
        if (name, attention) not in made:
            out = tmp_path_factory.mktemp("out") / f"{name}-{attention}"
            made[name, attention] = export_model(sources(name), out=out, capacity=CAP,
                                                 max_verify_len=VERIFY, attention=attention,
                                                 progress=False)
        return made[name, attention]
    return get


def _prompt() -> list[int]:
    rng = np.random.default_rng(0)
    return rng.integers(5, VOCAB, PROMPT_LEN).tolist()


def _reference_model(src):
    """The PyTorch model of a model directory, or the one transformers loads from a .gguf."""
    src = Path(src)
    if src.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                    dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def _check_logits(src, out):
    m = mf.read_manifest(out)
    ids = _prompt()
    model = _reference_model(src)
    with torch.no_grad():
        reference = model(torch.tensor([ids]), use_cache=False).logits[0].numpy()  # [n, vocab]
    decoder = OrtDecoder(out, manifest=m, providers=["CPUExecutionProvider"])
    verify = decoder.forward_batch(ids)  # blocks of VERIFY, each after a past
    decoder.reset()
    step = np.stack([decoder.forward_token(t) for t in ids])  # [n, vocab]
    tol = TOLERANCES["fp32"]
    scale = float(np.abs(reference).max())
    assert scale > 1.0  # logits that can tell a wrong graph from a right one
    assert np.abs(verify - step).max() <= tol.step_vs_verify.at(scale)
    assert np.abs(verify - reference).max() <= tol.vs_pytorch.at(scale)
    assert np.abs(step - reference).max() <= tol.vs_pytorch.at(scale)


def _check_greedy_identity(out):
    model = load_model(out, providers=["CPUExecutionProvider"])
    # a prompt that repeats itself, so that prompt lookup has something to draft
    prompt = _prompt()[:12] * 2
    options = SpeculativeOptions(max_new_tokens=CAP - len(prompt) - VERIFY, temperature=0.0)
    plain = plain_decode(model.decoder, prompt, options)
    spec = speculative_decode_with(model.decoder, prompt,
                                   PromptLookupSpeculator(ngram_size=3, max_draft_len=VERIFY - 1),
                                   options)
    assert spec.tokens == plain.tokens
    assert spec.counters.drafted > 0 and spec.counters.verify_calls > 0


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_exports_and_matches_transformers(name, sources, exports):
    out = exports(name)
    m = mf.read_manifest(out)
    assert m.extra["validation"]["verify_vs_pytorch"] <= 1e-3
    _check_logits(sources(name), out)
    _check_greedy_identity(out)
    assert check_main(["--model", str(out), "--draws", "2000"]) == 0


@pytest.mark.parametrize("name, opset", [(name, None) for name in FAMILIES]
                         + [("llama-mha", 21), ("gemma2", 21)])
def test_family_int4_export_is_exact_under_speculation(name, opset, sources, tmp_path):
    """--quant int4 on every row: validated against PyTorch on the dequantized weights (inside
    the export), every verify row bitwise its step, greedy identity, `ortspec check`. On
    ortspec's kernels the graph attends with ortspec.CacheAttention and pads no lone query;
    at opset 21 (and without the kernels) with GroupQueryAttention, padding it."""
    out = export_model(sources(name), out=tmp_path / "int4", capacity=CAP, max_verify_len=VERIFY,
                       progress=False, quant="int4", opset=opset)
    m = mf.read_manifest(out)
    v = m.extra["validation"]
    cache = kernels.available() and opset is None
    ops = [n.op_type for n in onnx.load(str(out / m.entry_points["verify"].graph),
                                        load_external_data=False).graph.node]
    if cache:  # the fused node where a layer rotates and has no q/k norms (not Qwen3, Gemma 3);
        # a float16 KV cache by default, read and written by the ...16 ops
        assert m.extra["kv_cache"] == "fp16"
        assert ops.count("CacheAttention16") + ops.count("RotaryCacheAttention16") == \
            m.architecture.num_layers
        assert ("RotaryCacheAttention16" in ops) == (name not in ("qwen3", "gemma3"))
        assert ops.count("Cast") >= 2 * ops.count("CacheAttention16")  # k, v before the scatter
    else:
        assert ops.count("GroupQueryAttention") == m.architecture.num_layers
    assert m.extra["attention"] == ("CacheAttention" if cache else "GroupQueryAttention")
    assert m.extra["opset"] == (opset or (24 if cache else 21))
    assert (m.min_call_rows, m.min_attention_rows) == (1, 1 if cache else 2)
    assert (m.row_probe is None) == cache and v["step_vs_verify"] == 0.0
    assert v["verify_vs_pytorch"] <= v["bound_vs_pytorch"]
    rows = row_differences(OrtDecoder(out), _prompt()[:20], _prompt()[20:20 + VERIFY + 1],
                           block_lengths=range(1, VERIFY + 1), offsets=(0, 1))
    assert rows.differing == 0
    _check_greedy_identity(out)
    assert check_main(["--model", str(out), "--draws", "2000"]) == 0


@pytest.mark.parametrize("name", STANDARD)
def test_family_standard_ops_flavour_matches_transformers(name, sources, exports):
    out = exports(name, "standard")
    _check_logits(sources(name), out)
    _check_greedy_identity(out)


def _check_batch_rows(out):
    """Rows of different lengths in one batched call: each bitwise its solo call, for a verify
    block and for a one-token step (which runs unpadded on several rows); and packed (only the
    real tokens computed: blocks of different lengths, a row riding along), each row's own
    tokens still bitwise their solo call's, and the row riding along left as it was."""
    from ortspec.runtime.batching.backend import OrtBatchBackend
    from ortspec.runtime.ort.sessions import OrtSessions

    sessions = OrtSessions(out, providers=["CPUExecutionProvider"])
    assert gio.TOKEN_ROWS in {i.name for i in sessions.by_entry["verify"].get_inputs()}
    backend = OrtBatchBackend(sessions, max_rows=3)
    solo = OrtDecoder.on(sessions)
    ids = _prompt()
    prompts, block = [ids[:5], ids[:PROMPT_LEN - VERIFY], ids[3:20]], ids[-VERIFY:]
    expected = []
    for p in prompts:
        solo.reset()
        solo.prefill(p)
        expected.append(solo.forward_batch(block))
    for i, p in enumerate(prompts):
        backend.run(i, i + 1, np.array([p]), np.array([0]))
    got = backend.run(0, 3, np.array([block] * 3), np.array([len(p) for p in prompts]))
    got = got.reshape(3, len(block), -1)  # [rows, S, vocab]
    for i in range(3):
        np.testing.assert_array_equal(got[i], expected[i])
    steps = []
    for p in prompts:
        solo.reset()
        solo.prefill(p)
        steps.append(solo.forward_token(block[0]))
    got = backend.run(0, 3, np.array([block[:1]] * 3), np.array([len(p) for p in prompts]))
    np.testing.assert_array_equal(got, np.stack(steps))
    # packed: row 0 verifies 1 token, row 1 rides along (its cache must stay as it is), row 2
    # the whole block; the grid is [3, VERIFY], padded with copies of each block's last token
    sizes = (1, 0, VERIFY)
    grid = np.array([np.concatenate([block[:n], np.full(VERIFY - n, block[max(n, 1) - 1])])
                     for n in sizes])
    real = np.concatenate([r * VERIFY + np.arange(n) for r, n in enumerate(sizes)])
    lengths = np.array([len(p) for p in prompts])
    got = backend.run(0, 3, grid, lengths, take=real, real=real)
    np.testing.assert_array_equal(got[:1], expected[0][:1])
    np.testing.assert_array_equal(got[1:], expected[2])
    got = backend.run(1, 2, np.array([block[:2]]), lengths[1:2])  # row 1 after riding along
    np.testing.assert_array_equal(got, expected[1][:2])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_window_flavour_matches_transformers_and_batches_exactly(name, sources, exports):
    """--attention window (the batched graph): PyTorch's logits, greedy identity, and rows of
    one batched call bitwise their solo calls (sliding windows, q/k norms and soft-caps
    included)."""
    out = exports(name, "window")
    m = mf.read_manifest(out)
    assert m.max_batch > 1 and m.min_call_rows == 2
    _check_logits(sources(name), out)
    _check_greedy_identity(out)
    _check_batch_rows(out)


@pytest.mark.skipif(not kernels.available(), reason="ortspec's kernel library is not built here")
@pytest.mark.parametrize("name", ["llama-mha", "mistral-sliding", "gemma2", "phi4-mini"])
def test_family_int4_window_flavour_attends_with_cache_attention_exactly(name, sources,
                                                                        tmp_path):
    """An int4 window export on ortspec's kernels attends with ortspec.CacheAttention (one query
    head a KV head, a sliding window, Gemma 2's soft-cap, 128-float heads): the export's own
    validation against PyTorch passes, greedy speculation is plain decoding, and rows of one
    batched call are bitwise their solo calls, a lone row's unpadded step included."""
    out = export_model(sources(name), out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                       attention="window", quant="int4", progress=False)
    m = mf.read_manifest(out)
    assert m.extra["weights"]["kernel"] == "ortspec"
    assert m.extra["attention"] == "CacheAttention"
    assert m.min_call_rows == 1  # no onnxruntime matmul left: a lone row needs no copy
    graph = onnx.load(str(out / m.entry_points["verify"].graph), load_external_data=False)
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("RotaryCacheAttention16") == m.architecture.num_layers  # rotary inside
    assert "Softmax" not in ops and "Slice" not in ops  # the cache is read in place
    assert "TensorScatter" not in ops and "RotaryEmbedding" not in ops
    _check_greedy_identity(out)
    _check_batch_rows(out)


def test_spec_records_what_each_family_needs(sources):
    from ortspec.export.checkpoint import load_checkpoint
    from ortspec.export.sources import identify_source

    def spec(name):
        return load_checkpoint(identify_source(sources(name)), capacity=CAP,
                               progress=False).spec

    assert spec("qwen3").qk_norm and spec("qwen3").head_dim == 32
    assert spec("mistral-sliding").windows == (16, 16)
    assert spec("smollm3").rope_layers == (True, False, True, False)
    phi = spec("phi3")
    config = AutoConfig.from_pretrained(sources("phi3"))
    assert config.rope_parameters["original_max_position_embeddings"] == CAP
    assert (phi.rotary_dims, phi.head_dim, phi.windows) == (16, 32, (24, 24))
    for name, head_dim, rotary in (("phi4-mini", 128, 96), ("phi4-mini-hd64", 64, 48)):
        phi4 = spec(name)
        assert (phi4.rotary_dims, phi4.head_dim, phi4.hidden_size) == (rotary, head_dim,
                                                                        4 * head_dim)
        assert (phi4.num_heads, phi4.num_kv_heads, phi4.windows) == (4, 2, ())
        assert phi4.tied_embeddings
    g2, g3 = spec("gemma2"), spec("gemma3")
    assert (g2.embed_scale, g2.mlp_act, g2.sandwich_norms) == (8.0, "gelu_tanh", True)
    assert (g2.attn_softcap, g2.final_softcap, g2.attention_scale) == (4.0, 6.0, 24 ** -0.5)
    assert g2.windows == (16, 0, 16, 0) and not g2.local_rope and not g2.qk_norm
    assert g3.windows == (16,) * 5 + (0,) and g3.local_rope and g3.qk_norm
    assert (g3.attn_softcap, g3.final_softcap) == (0.0, 0.0)
    assert not spec("qwen2.5-tied").windows and spec("qwen2.5-tied").tied_embeddings
    assert not spec("qwen2.5-untied").tied_embeddings


def test_a_window_at_least_the_capacity_keeps_the_plain_graph(sources):
    from ortspec.export.checkpoint import load_checkpoint
    from ortspec.export.sources import identify_source

    ckpt = load_checkpoint(identify_source(sources("mistral-sliding")), capacity=16,
                           progress=False)
    assert ckpt.spec.windows == ()  # a window of 16 over a cache of 16 narrows nothing


def test_phi3_longrope_beyond_its_original_context_is_refused(sources, tmp_path):
    with pytest.raises(ExportError, match=r"rope_type 'longrope' with "
                                          r"original_max_position_embeddings 64.*capacity 128"):
        export_model(sources("phi3"), out=tmp_path / "out", capacity=128, progress=False)
    assert not (tmp_path / "out").exists()


def _refused_configs():
    return {
        "qwen3 sliding layers": (Qwen3ForCausalLM, Qwen3Config(
            **COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, use_sliding_window=True, sliding_window=16),
            r"^use_sliding_window True is not supported for model_type 'qwen3'"),
        "gemma3 bidirectional": (Gemma3ForCausalLM, Gemma3TextConfig(
            **COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, use_bidirectional_attention=True),
            r"^use_bidirectional_attention True is not supported"),
        "llama dynamic rope": (LlamaForCausalLM, LlamaConfig(
            **COMMON, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
            r"^rope_type 'dynamic' is not supported"),
    }


@pytest.mark.parametrize("case", ["qwen3 sliding layers", "gemma3 bidirectional",
                                  "llama dynamic rope"])
def test_unimplemented_options_are_refused_before_the_weights_load(case, tmp_path, monkeypatch):
    import transformers

    model_cls, config, message = _refused_configs()[case]
    src = _build(tmp_path / "src", model_cls, config)

    def must_not_load(*a, **k):
        raise AssertionError("the weights were loaded before the configuration check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", must_not_load)
    with pytest.raises(ExportError, match=message) as info:
        export_model(src, out=tmp_path / "out", capacity=CAP, progress=False)
    assert "\n" not in str(info.value)  # one line
    assert not (tmp_path / "out").exists()


def test_phi3_int4_draft_reads_the_blocks_of_its_fused_weights(sources, tmp_path):
    # the draft's reference replaces q, k, v (and gate, up) inside qkv_proj (gate_up_proj)
    # with their dequantized blocks: a wrong row range fails the draft's validation
    out = export_model(sources("phi3"), out=tmp_path / "out", capacity=CAP, max_verify_len=VERIFY,
                       draft_quant="int4", progress=False)

    m = mf.read_manifest(out / "drafts" / "int4")
    assert m.extra["quantized_weights"] > 0
    v = m.extra["validation"]
    assert v["verify_vs_pytorch"] <= v["bound_vs_pytorch"]
