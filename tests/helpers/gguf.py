"""A Hugging Face model directory written out as an F32 GGUF file the way llama.cpp's
convert_hf_to_gguf.py writes it: its metadata keys, its tensor names (gguf's own name map, the
one transformers reads back through), its value transforms (q/k rows permuted for 'llama', the
Gemma norms stored as 1 + weight), and a byte-level BPE vocabulary as tokenizer.ggml.* arrays."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

# Hugging Face model_type -> the GGUF general.architecture llama.cpp writes for it (Mistral 7B
# v0.1-v0.3 go out as 'llama')
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3", "smollm3": "smollm3"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: the rotate-half pairs interleaved."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _tensors(model, config, arch: str):
    archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    name_map = gguf.get_tensor_name_map(archs.get(arch, gguf.MODEL_ARCH.LLAMA),
                                        config.num_hidden_layers)
    tied = config.tie_word_embeddings
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp writes output.weight only for an untied head
        base, suffix = hf_name.rsplit(".", 1)
        name = name_map.get_name(base)
        assert name is not None, f"gguf has no name for {hf_name}"
        data = tensor.detach().float().numpy().copy()
        if arch == "llama" and base.endswith("self_attn.q_proj"):
            data = _permute(data, config.num_attention_heads)
        elif arch == "llama" and base.endswith("self_attn.k_proj"):
            data = _permute(data, config.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's RMSNorm multiplies by the weight alone
        yield f"{name}.{suffix}", data


def _rope(config) -> dict:
    rope = config.rope_parameters
    return rope.get("full_attention", rope)


def _rope_scaling(w: gguf.GGUFWriter, config, head_dim: int) -> None:
    """RoPE scaling as convert_hf_to_gguf.py writes it: linear and yarn as keys, Llama 3's
    frequency factors as the tensor rope_freqs, Phi-3's longrope factors as two tensors."""
    rope = _rope(config)
    kind = rope.get("rope_type", "default")
    if kind in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(kind))
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "llama3":
        dim = head_dim
        freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        old = rope["original_max_position_embeddings"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        factors = []
        for wavelen in 2 * np.pi / freqs:
            if wavelen < old / high:
                factors.append(1.0)
            elif wavelen > old / low:
                factors.append(rope["factor"])
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
        w.add_tensor("rope_freqs.weight", np.asarray(factors, np.float32))
    elif kind == "longrope":
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _hparams(w: gguf.GGUFWriter, config, arch: str) -> None:
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(float(_rope(config)["rope_theta"]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "llama":
        w.add_vocab_size(config.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma2", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "phi3":
        partial = _rope(config).get("partial_rotary_factor", 1.0)
        w.add_rope_dimension_count(int(head_dim * partial))
    if arch in ("phi3", "gemma2", "gemma3") and config.sliding_window:
        w.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(config.attn_logit_softcapping)
        w.add_final_logit_softcapping(config.final_logit_softcapping)
    _rope_scaling(w, config, head_dim)


def _tokenizer(w: gguf.GGUFWriter, directory: Path) -> None:
    data = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    settings = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = dict(data["model"]["vocab"])
    special = set()
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
        if added["special"]:
            special.add(added["id"])
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges(merges)
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                     ("unk_token", w.add_unk_token_id), ("pad_token", w.add_pad_token_id)):
        if settings.get(key) is not None:
            add(vocab[settings[key]])
    w.add_add_bos_token(False)
    template = settings.get("chat_template")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if template:
        w.add_chat_template(template)


def write_gguf(directory: Path, path: Path, *, name: str | None = None, arch: str | None = None,
               extra=None) -> Path:
    """The checkpoint in `directory` as the F32 GGUF file `path`. `arch` overrides the
    architecture llama.cpp would write; `extra(writer, arch)` adds keys or tensors (a file
    stating what transformers does not read)."""
    config = AutoConfig.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    arch = arch or GGUF_ARCH[config.model_type]
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name or f"Tiny {directory.name}")
    _hparams(w, config, arch)
    _tokenizer(w, directory)
    for tensor_name, data in _tensors(model, config, arch):
        w.add_tensor(tensor_name, data)
    if extra is not None:
        extra(w, arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
