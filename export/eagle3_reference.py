"""The PyTorch reference forward of an EAGLE-3 head (eagle3.Eagle3Head): what an exported head
graph is validated against, and what the tests check the reader with.

It follows vLLM's `vllm/model_executor/models/llama_eagle3.py` (`LlamaDecoderLayer.forward` for
layer 0, `LlamaModel.forward`, `Eagle3LlamaForCausalLM.compute_logits`) step by step; the same
layer is speculators' `Eagle3DecoderLayer`. For n new positions, H = hidden_size:

    hidden   = fc(aux)                       first step: aux [n, 3 * Ht], the target's states
             | the previous step's `hidden`  later steps: [n, H], the head's own output
    e        = input_layernorm(embeds)        embeds [n, H]: the head's embed_tokens, else
                                              the target's, of the tokens at these positions
    residual = hidden;  h = hidden_norm(hidden)      (norm_before_residual: residual = h)
    attn     = o_proj(causal_attention(rotary(q, k, v of cat([e, h]) [n, 2H])))
    residual = attn + residual                       the embedding is in no residual
    prenorm  = mlp(post_attention_layernorm(residual)) + residual
    logits   = lm_head(norm(prenorm))                [n, draft_vocab]

The next step's hidden input is `prenorm`, the state *before* the final norm: vLLM's
`LlamaModel.forward` returns (norm output, prenorm), the proposer samples from the first and
feeds the second back. Draft logits map to target ids by target_id = draft_id + d2t[draft_id]
(`to_target_logits`; vLLM fills the unmapped target ids with -inf).

The attention is Llama's: rotate-half RoPE from transformers' LlamaRotaryEmbedding (the rope
type and scaling of the head's config), grouped KV heads, scale 1/sqrt(head_dim); a query sees
the head's whole past KV and the new positions up to its own.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .eagle3 import Eagle3Head


@dataclasses.dataclass
class HeadKV:
    """The head's own KV cache: keys and values [kv_heads, past, head_dim] float32."""

    keys: torch.Tensor
    values: torch.Tensor

    @classmethod
    def empty(cls, head: Eagle3Head) -> HeadKV:
        shape = (head.num_kv_heads, 0, head.head_dim)
        return cls(torch.zeros(shape), torch.zeros(shape))

    @property
    def length(self) -> int:
        return self.keys.shape[1]


@dataclasses.dataclass
class HeadStep:
    """One call of the head on n positions."""

    logits: torch.Tensor  # [n, draft_vocab]
    hidden: torch.Tensor  # [n, H] the pre-norm state: the next step's hidden input
    kv: HeadKV  # the cache after this call (past + n)


def _t(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def embed(head: Eagle3Head, ids, target_embed: np.ndarray | None = None) -> torch.Tensor:
    """The embeddings [n, H] of target token ids [n]: the head's own table, else the target's
    (`target_embed` [vocab, H], required then)."""
    table = head.embed if head.embed is not None else target_embed
    if table is None:
        raise ValueError("this head has no embed_tokens: pass the target's embedding table")
    return _t(table)[torch.as_tensor(np.asarray(ids), dtype=torch.int64)]


def project_aux(head: Eagle3Head, aux) -> torch.Tensor:
    """fc: the target's concatenated hidden states [n, 3 * Ht] -> [n, H]."""
    out = torch.as_tensor(aux, dtype=torch.float32) @ _t(head.fc).T
    return out if head.fc_bias is None else out + _t(head.fc_bias)


def rms_norm(x: torch.Tensor, weight: np.ndarray, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * _t(weight)


def rope(head: Eagle3Head, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, head_dim] (rotate-half layout) at `positions` [n]."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=head.hidden_size, num_attention_heads=head.num_heads,
                         num_key_value_heads=head.num_kv_heads, head_dim=head.head_dim,
                         max_position_embeddings=head.max_position_embeddings,
                         rope_theta=head.rope_theta, rope_scaling=head.rope_scaling)
    pos = torch.as_tensor(np.asarray(positions), dtype=torch.int64)[None]  # [1, n]
    with torch.no_grad():
        cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), pos)
    return cos[0], sin[0]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2  # x [heads, n, D]; rotate_half(x) = cat(-x2, x1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention(head: Eagle3Head, x: torch.Tensor, positions, kv: HeadKV) -> \
        tuple[torch.Tensor, HeadKV]:
    """Self-attention of x [n, 2H] over the past `kv` and the new positions: [n, H]."""
    n, d = x.shape[0], head.head_dim
    q = (x @ _t(head.q).T).view(n, head.num_heads, d).transpose(0, 1)  # [heads, n, D]
    k = (x @ _t(head.k).T).view(n, head.num_kv_heads, d).transpose(0, 1)  # [kv_heads, n, D]
    v = (x @ _t(head.v).T).view(n, head.num_kv_heads, d).transpose(0, 1)
    cos, sin = rope(head, positions)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    keys, values = torch.cat([kv.keys, k], dim=1), torch.cat([kv.values, v], dim=1)
    group = head.num_heads // head.num_kv_heads
    scores = q @ keys.repeat_interleave(group, 0).transpose(1, 2) / d ** 0.5  # [heads, n, P+n]
    past = kv.length
    visible = torch.arange(past + n)[None, :] <= past + torch.arange(n)[:, None]  # [n, P+n]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values.repeat_interleave(group, 0)  # [heads, n, D]
    out = out.transpose(0, 1).reshape(n, head.num_heads * d) @ _t(head.o).T
    return out, HeadKV(keys, values)


def head_forward(head: Eagle3Head, hidden, embeds, positions, kv: HeadKV | None = None) -> \
        HeadStep:
    """One call of the head's decoder layer (see the module docstring).

    hidden: [n, H], `project_aux(head, aux)` on the first step, the previous HeadStep.hidden
    after it; embeds: [n, H] (`embed`); positions: [n] int, the positions of these tokens;
    kv: the head's cache so far (empty when None)."""
    eps = head.rms_norm_eps
    hidden = torch.as_tensor(hidden, dtype=torch.float32)
    embeds = torch.as_tensor(embeds, dtype=torch.float32)
    kv = kv if kv is not None else HeadKV.empty(head)
    with torch.no_grad():
        e = rms_norm(embeds, head.input_norm, eps)
        h = rms_norm(hidden, head.hidden_norm, eps)
        residual = h if head.norm_before_residual else hidden
        attn, kv = attention(head, torch.cat([e, h], dim=-1), positions, kv)
        residual = attn + residual
        x = rms_norm(residual, head.post_attn_norm, eps)
        mlp = (torch.nn.functional.silu(x @ _t(head.gate).T) * (x @ _t(head.up).T)) \
            @ _t(head.down).T
        prenorm = mlp + residual
        logits = rms_norm(prenorm, head.norm, eps) @ _t(head.lm_head).T
    return HeadStep(logits, prenorm, kv)


def to_target_logits(head: Eagle3Head, draft_logits: torch.Tensor, target_vocab: int) -> \
        torch.Tensor:
    """Draft logits [n, draft_vocab] -> [n, target_vocab]: each draft id's logit at its target
    id (draft_id + d2t[draft_id]), -inf at the target ids no draft id maps to."""
    out = torch.full((draft_logits.shape[0], target_vocab), float("-inf"))
    out[:, torch.from_numpy(head.target_ids())] = draft_logits
    return out
