"""What a decoder graph is made of, apart from its nodes: the model's shape (`DecoderSpec`),
the graph's options (`GraphOptions`, `WeightQuant` for MatMulNBits drafts), the canonical weight
names, and the opsets each attention flavour needs.

Plain data (NumPy only, no onnx): the CLI reads its choices from here, and every module that
builds the graph (builder.py, attention.py, graphs.py) imports it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ortspec.runtime.ort import manifest as mf

MS = "com.microsoft"  # the domain of onnxruntime's contrib ops
ATTENTIONS = ("gqa", "standard", "window")
# gqa: Shape(start=, end=) needs 15, ReduceSum with axes as an input 13.
# standard: TensorScatter and Attention's nonpad_kv_seqlen need 24.
MIN_OPSET = {"gqa": 17, "standard": 24, "window": 24}
MAX_OPSET = 24  # the newest ai.onnx opset checked against onnxruntime 1.32 here
DEFAULT_OPSET = {"gqa": 21, "standard": 24, "window": 24}
FAMILIES = mf.FAMILIES  # what the exporter builds is what a manifest may record
NUMPY_DTYPES = {"fp32": np.float32, "fp16": np.float16}

# Canonical weight names. {i} is the layer index. Linear weights are [out, in].
WEIGHT_NAMES = (
    "embed",  # [vocab, hidden]
    "norm",  # [hidden], final RMSNorm
    "lm_head",  # [vocab, hidden]; absent when tied to `embed`
    "layers.{i}.attn_norm", "layers.{i}.mlp_norm",  # [hidden]
    "layers.{i}.q", "layers.{i}.k", "layers.{i}.v", "layers.{i}.o",
    "layers.{i}.q_bias", "layers.{i}.k_bias", "layers.{i}.v_bias", "layers.{i}.o_bias",  # optional
    "layers.{i}.gate", "layers.{i}.up", "layers.{i}.down",
    "layers.{i}.gate_bias", "layers.{i}.up_bias", "layers.{i}.down_bias",  # optional
    "layers.{i}.q_norm", "layers.{i}.k_norm",  # [head_dim], with DecoderSpec.qk_norm
    "layers.{i}.post_attn_norm", "layers.{i}.post_mlp_norm",  # [hidden], with sandwich_norms
)


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """The numbers that shape the graph; sources.py reads them from the checkpoint's config."""

    family: str  # one of FAMILIES
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tied_embeddings: bool
    attention_scale: float  # multiplies q.k; 1/sqrt(head_dim) for every supported family
    # per-head RMSNorm (weights layers.{i}.q_norm, .k_norm) on q and k before the rotary (Qwen3)
    qk_norm: bool = False
    # per layer, the sliding window W: a query sees itself and the W - 1 positions before it;
    # 0 is full attention; () means every layer attends fully (Mistral gives each layer one W)
    windows: tuple[int, ...] = ()
    # per layer, whether the rotary embedding applies; () means every layer (SmolLM3's NoPE
    # layers are False)
    rope_layers: tuple[bool, ...] = ()
    rotary_dim: int = 0  # dimensions of each head that rotate (partial rotary); 0 is head_dim
    # Gemma: the embedding times a constant (sqrt(hidden)), GeGLU (tanh-approximated GELU),
    # RMSNorms after attention and after the MLP too, soft-capping c * tanh(x / c) of the
    # attention scores and of the logits (0: none), and sliding layers with their own rotary
    # tables (graph inputs rope_cos_local, rope_sin_local; Gemma 3's local base)
    embed_scale: float = 1.0
    mlp_act: str = "silu"
    sandwich_norms: bool = False
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    local_rope: bool = False

    def window(self, i: int) -> int:
        """Layer i's sliding window in tokens, or 0 for full attention."""
        return self.windows[i] if self.windows else 0

    def uses_rope(self, i: int) -> bool:
        return self.rope_layers[i] if self.rope_layers else True

    def rope_tables(self, i: int) -> tuple[str, str]:
        """The cos, sin initializers layer i rotates with."""
        if self.local_rope and self.window(i):
            return "rope_cos_local", "rope_sin_local"
        return "rope_cos", "rope_sin"

    @property
    def rotary_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def query_group(self) -> int:
        """G: the query heads that share one KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_dim(self) -> int:
        """Width of the fused q, k, v projection."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def architecture(self) -> mf.Architecture:
        return mf.Architecture(
            family=self.family, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            hidden_size=self.hidden_size, vocab_size=self.vocab_size,
        )


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """Linear weights as `com.microsoft::MatMulNBits` (see quantize.py for the schemes).

    accuracy_level 4 lets the CPU kernel quantize each block of the activations to int8 and
    use integer dot products: 2-3x faster than 0 (float activations) at one token and the only
    level faster than float32 MatMul at 8 (measured on this machine's AVX-512 VNNI CPU, 576 x
    1536); its rounding of the activations is part of the draft's error.
    """

    bits: int = 4
    block_size: int = 32
    scheme: str = "block-min"  # "block-min", "zero-point" or "symmetric"
    accuracy_level: int = 4  # 0 (unset: float activations) .. 4 (int8 activations)
    lm_head_bits: int | None = 8  # None keeps the LM head float
    lm_head_scheme: str = "symmetric"
    # what runs the 4-bit block-min products: "onnxruntime" (MatMulNBits, plus a Gemm for the
    # block minima) or "ortspec" (ortspec.Q4Gemm, runtime/ort/_q4kernel.c: the Q4_1 blocks as
    # they are, d and m in float16, int8 activations as at accuracy level 4)
    kernel: str = "onnxruntime"

    @property
    def embed_shares_head(self) -> bool:
        """A tied embedding is read from the quantized LM head's bytes (GatherBlockQuantized)
        when the head is 8-bit symmetric, the one layout both ops share: MatMulNBits' default
        zero point for 8 bits is 128, as is GatherBlockQuantized's for uint8 data, and its B
        [N, n_blocks, block_size] is the table [vocab, hidden] row by row."""
        return self.lm_head_bits == 8 and self.lm_head_scheme == "symmetric"


# the --quant / --draft-quant presets
# "int4": 4-bit linear weights; the LM head (and a tied embedding, which shares its bytes) at
# 8 bits. Measured on SmolLM2-135M (Q4_1 layers, Q8_0 embedding) against the fp32 target, greedy
# top-1 agreement over 288 positions of 6 Spec-Bench prompts / step time: this preset 0.969 /
# 0.44x; the head at 4 bits (block-min) 0.854 / 0.38x; "zero-point" layers (onnxruntime's
# quantizer's scheme) 0.71 / 0.32x with an 8-bit head, 0.72 / 0.25x with a 4-bit one. The
# 8-bit head needs accuracy_level 4: at 0 its kernel is the slow path (2.3x the fp32 target).
QUANTS = {"int4": WeightQuant(bits=4, block_size=32, scheme="block-min", accuracy_level=4,
                              lm_head_bits=8, lm_head_scheme="symmetric")}
# the default model's default export (`ortspec export` with no source, dtype or quant;
# ensure_default_model()): its GGUF's Q4_1 blocks exactly, the precision runtime/paths.py's
# DEFAULT_MODEL_NAME names
DEFAULT_QUANT = "int4"
# an EAGLE-3 head's presets (--draft-head-quant, eagle3_graph.py): "int8", every linear weight and
# the LM head in 8-bit symmetric blocks of 32 (MatMulNBits, int8 activations), the embedding
# table likewise (GatherBlockQuantized). A head of SmolLM2-135M's shapes with a 32,000-id draft
# vocabulary: 0.39x the float32 head's step time (2 threads; scripts/bench_eagle3_head.py),
# 57 MiB against 199; its softmax 0.075 in total variation from the float one and the same
# argmax at 88.5% of 200 positions (random weights, logits up to 45). The drafter stays exact
# at any precision: only the acceptance changes
HEAD_QUANTS = {"int8": WeightQuant(bits=8, block_size=32, scheme="symmetric", accuracy_level=4,
                                   lm_head_bits=8, lm_head_scheme="symmetric")}
LM_HEADS = ("int8", "int4", "fp32")  # the LM head's (and a tied embedding's) precision
QUANT_SCHEMES = ("block-min", "zero-point", "symmetric")  # quantize.SCHEMES, for 4-bit weights
KERNELS = ("ortspec", "onnxruntime")  # WeightQuant.kernel
KV_CACHES = ("fp32", "fp16")  # GraphOptions.kv_dtype (export_model's kv_cache)
ORTSPEC_DOMAIN = "ortspec"  # the custom ops' domain (runtime/ort/kernels.py)


def weight_quant(quant: str, *, lm_head: str = "int8", scheme: str = "block-min",
                 kernel: str = "onnxruntime") -> WeightQuant:
    """The QUANTS preset with the LM head at `lm_head` ("int8": symmetric, shared with a tied
    embedding, a Q8_0 table exactly; "int4": the linear weights' scheme, embedding float;
    "fp32": float head and embedding), the linear weights in `scheme` and their block-min
    products run by `kernel`. The caller has checked the names."""
    heads = {"int8": (8, "symmetric"), "int4": (4, scheme), "fp32": (None, "symmetric")}
    bits, head_scheme = heads[lm_head]
    return dataclasses.replace(QUANTS[quant], scheme=scheme, lm_head_bits=bits,
                               lm_head_scheme=head_scheme, kernel=kernel)


@dataclasses.dataclass(frozen=True)
class GraphOptions:
    capacity: int  # rows of the KV buffers and of the cos/sin caches
    dtype: str  # "fp32" or "fp16": weights, activations and KV; logits are always fp32
    opset: int = DEFAULT_OPSET["gqa"]
    attention: str = "gqa"  # "gqa" (ORT contrib ops, the CPU graph) or "standard" (ONNX ops)
    quant: WeightQuant | None = None  # None: float MatMul weights (the target)
    # gqa: a one-token call's attention runs two query rows, the token and a copy of it (whose
    # key/value slot is one past the call's and is dropped), so a step attends on the path a
    # verify row takes (Manifest.min_attention_rows)
    pad_lone_query: bool = False
    # the layer ids whose entering residual stream the graph also returns (hidden_states.py):
    # () returns none, and the graph is the one without the option, node for node
    hidden_state_layers: tuple[int, ...] = ()
    # the KV cache's dtype ("fp32" or "fp16"; None: dtype's). A float16 cache under float32
    # activations only where the graph attends with ortspec's kernels (attention.py's
    # attends_with_cache), which read it as float16 and store into it rounded to nearest
    kv_dtype: str | None = None

    @property
    def cache_dtype(self) -> str:
        return self.kv_dtype or self.dtype


def check_opset(attention: str, opset: int) -> None:
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    lo = MIN_OPSET[attention]
    if not lo <= opset <= MAX_OPSET:
        raise ValueError(f"opset {opset} is outside {lo}..{MAX_OPSET} for {attention} attention")

