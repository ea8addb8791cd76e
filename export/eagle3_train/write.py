"""Writing a trained head: the speculators format export/eagle3.py reads (config.json with
`speculators_model_type: "eagle3"`, the layer's Llama config under `transformer_layer_config`,
model.safetensors with fc, layers.0.*, norm, lm_head, d2t, t2d), plus recipe.json (seed and
hyper-parameters) and data_manifest.json (sources, licences, token counts, the sha256 of every
file written)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from .loop import HeadShape


def speculators_config(shape: HeadShape, *, vocab: int, target_hidden: int,
                       layer_ids: tuple[int, ...]) -> dict[str, Any]:
    llama = dict(model_type="llama", hidden_size=shape.hidden,
                 intermediate_size=shape.intermediate, num_hidden_layers=1,
                 num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                 head_dim=shape.head_dim, vocab_size=vocab, rms_norm_eps=shape.rms_norm_eps,
                 rope_theta=shape.rope_theta,
                 max_position_embeddings=shape.max_position_embeddings, hidden_act="silu",
                 tie_word_embeddings=False)
    return dict(speculators_model_type="eagle3", architectures=["Eagle3Speculator"],
                transformer_layer_config=llama, draft_vocab_size=shape.draft_vocab,
                norm_before_residual=False, target_hidden_size=target_hidden,
                eagle_aux_hidden_state_layer_ids=list(layer_ids))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_head(out: Path, weights: dict[str, torch.Tensor], config: dict[str, Any], *,
               recipe: dict[str, Any], data: dict[str, Any]) -> Path:
    """Write the head directory `out`; data_manifest.json ends with the files' sha256."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors")
    (out / "recipe.json").write_text(json.dumps(recipe, indent=2), encoding="utf-8")
    return _write_data_manifest(out, data)


def _write_data_manifest(out: Path, data: dict[str, Any]) -> Path:
    """data_manifest.json: `data` ending with the sha256 of the head's three files."""
    files = {p: sha256(out / p) for p in ("config.json", "model.safetensors", "recipe.json")}
    (out / "data_manifest.json").write_text(json.dumps(dict(data, files=files), indent=2),
                                            encoding="utf-8")
    return out


def store_half(head: Path, out: Path) -> Path:
    """Copy the head directory `head` to `out` with its floating-point tensors stored as float16
    (half the size; the importer widens them to float32, and the export validates the ONNX head
    against those weights); d2t and t2d unchanged. recipe.json records the storage and
    data_manifest.json the new files' sha256."""
    from safetensors.torch import load_file, save_file

    head, out = Path(head), Path(out)
    tensors = load_file(head / "model.safetensors")
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: (v.half() if v.is_floating_point() else v).contiguous()
               for k, v in tensors.items()}, out / "model.safetensors")
    (out / "config.json").write_text((head / "config.json").read_text(encoding="utf-8"),
                                     encoding="utf-8")
    recipe = json.loads((head / "recipe.json").read_text(encoding="utf-8"))
    recipe["stored"] = "float16 (trained in float32; write.store_half)"
    (out / "recipe.json").write_text(json.dumps(recipe, indent=2), encoding="utf-8")
    data = json.loads((head / "data_manifest.json").read_text(encoding="utf-8"))
    return _write_data_manifest(out, data)
