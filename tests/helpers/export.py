"""Model directories for tests: a graph built straight from random NumPy weights, no checkpoint
(the random checkpoints themselves are `ortspec.export.tiny`'s)."""

from __future__ import annotations

from pathlib import Path

from ortspec.export.tiny import EOS_ID, VOCAB, make_tokenizer


def write_graph_dir(directory: Path, *, poison: bool = False, capacity: int = 32) -> Path:
    """A model directory built straight from random NumPy weights (no checkpoint, no
    validation); `poison` puts a NaN in the final norm so every logit is NaN."""
    import numpy as np

    from ortspec.export.graph_spec import DecoderSpec, GraphOptions
    from ortspec.export.graphs import build_decoder
    from ortspec.runtime.ort import manifest as mf

    spec = DecoderSpec(family="llama", num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                       hidden_size=32, intermediate_size=32, vocab_size=VOCAB, rms_norm_eps=1e-5,
                       tied_embeddings=True, attention_scale=16 ** -0.5)
    rng = np.random.default_rng(0)
    shapes = {"embed": (VOCAB, 32), "norm": (32,), "layers.0.attn_norm": (32,),
              "layers.0.mlp_norm": (32,), "layers.0.q": (32, 32), "layers.0.k": (16, 32),
              "layers.0.v": (16, 32), "layers.0.o": (32, 32), "layers.0.gate": (32, 32),
              "layers.0.up": (32, 32), "layers.0.down": (32, 32)}
    weights = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    if poison:
        weights["norm"][3] = np.nan
    angles = np.arange(capacity)[:, None] * (1e4 ** (-np.arange(8) / 8))[None]  # [cap, 8]
    directory.mkdir(parents=True, exist_ok=True)
    build_decoder(spec, GraphOptions(capacity=capacity, dtype="fp32"), weights.get,
                  np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32),
                  graph_path=directory / "model.onnx", data_path=directory / "model.onnx.data")
    make_tokenizer().backend_tokenizer.save(str(directory / "tokenizer.json"))
    names = ("model.onnx", "model.onnx.data", "tokenizer.json")
    mf.Manifest(
        source={"kind": "hf", "path": "generated", "sha256": "0" * 64},
        architecture=spec.architecture(), dtype="fp32", capacity=capacity, max_verify_len=4,
        entry_points={"step": mf.EntryPoint("model.onnx", 1, 1),
                      "verify": mf.EntryPoint("model.onnx", 1, 4)},
        stop_token_ids=(EOS_ID,), tokenizer="tokenizer.json", chat_format=None,
        files={n: mf.sha256_file(directory / n) for n in names},
    ).write(directory)
    return directory
