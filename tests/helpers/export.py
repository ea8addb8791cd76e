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


def write_head_dir(directory: Path, *, capacity: int = 16, draft_vocab: int | None = 40,
                   seed: int = 0) -> Path:
    """An EAGLE-3 draft head directory (head.json, fc and head graphs, target_ids.npy) built
    straight from random NumPy weights for a target of hidden 32, VOCAB tokens and 8 layers
    (no checkpoint, no torch, no validation): what the runtime's OrtDraftHead opens."""
    import numpy as np

    from ortspec.export.eagle3 import SPECULATORS, Eagle3Head, Eagle3Target
    from ortspec.export.eagle3_export import write_head_files

    hidden, heads, kv_heads, head_dim, inter = 32, 2, 1, 16, 48
    vd = draft_vocab or VOCAB
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 2.0 / np.sqrt(shape[-1])).astype(np.float32)

    def norm():
        return (1.0 + 0.3 * rng.standard_normal(hidden)).astype(np.float32)

    kept = np.sort(rng.permutation(VOCAB)[:vd]).astype(np.int64)
    head = Eagle3Head(
        source_format=SPECULATORS, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=inter, rms_norm_eps=1e-5, rope_theta=1e4,
        rope_scaling=None, max_position_embeddings=512, target_hidden_size=hidden,
        vocab_size=VOCAB, draft_vocab_size=vd, layer_ids=(2, 4, 5), norm_before_residual=False,
        d2t=None if draft_vocab is None else kept - np.arange(vd),
        embed=rng.standard_normal((VOCAB, hidden)).astype(np.float32),
        fc=w(hidden, 3 * hidden), fc_bias=None, input_norm=norm(), hidden_norm=norm(),
        post_attn_norm=norm(), q=w(heads * head_dim, 2 * hidden),
        k=w(kv_heads * head_dim, 2 * hidden), v=w(kv_heads * head_dim, 2 * hidden),
        o=w(hidden, heads * head_dim), gate=w(inter, hidden), up=w(inter, hidden),
        down=w(hidden, inter), norm=norm(), lm_head=w(vd, hidden) * 4.0)
    write_head_files(directory, head, target=Eagle3Target(hidden, VOCAB, 8), capacity=capacity,
                     target_embed=None, source={"kind": "generated"})
    return directory
