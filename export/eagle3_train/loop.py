"""EAGLE-3's training-time test: the head is unrolled `steps` times over every position of a
sample, each step fed its own previous hidden output (as it is when drafting a chain), and
trained against the target's distribution mapped to the draft vocabulary (renormalised over
the kept ids), the loss of step k weighted decay**k; AdamW, seeded.

The trainable layer (`TrainableHead`) holds the speculators tensors as parameters and computes
eagle3_reference.py's forward (same norms, the same RoPE and rotate-half from there), with
attention over a training-time-test mask: the query of root j at step k (the chain that left
the target's states at position j, now k tokens deep, at position j + k) sees the step-0 keys of
positions <= j and the keys of its own chain at steps 1..k, as the drafter's KV cache holds.
The target's embedding table is frozen and shared (the head has no embed_tokens)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from ..eagle3_reference import _rotate, rope
from .teacher import Teacher


@dataclasses.dataclass(frozen=True)
class HeadShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    draft_vocab: int

    # eagle3_reference.rope reads these names
    @property
    def hidden_size(self) -> int:
        return self.hidden

    @property
    def num_heads(self) -> int:
        return self.heads

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads

    rope_scaling = None


class TrainableHead(torch.nn.Module):
    def __init__(self, shape: HeadShape, *, target_hidden: int, lm_head_init: torch.Tensor,
                 seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        s, H = shape, shape.hidden

        def lin(out: int, inp: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(out, inp, generator=g) / inp ** 0.5)

        self.shape = s
        named = {
            "fc.weight": lin(H, 3 * target_hidden),
            "layers.0.self_attn.q_proj.weight": lin(s.heads * s.head_dim, 2 * H),
            "layers.0.self_attn.k_proj.weight": lin(s.kv_heads * s.head_dim, 2 * H),
            "layers.0.self_attn.v_proj.weight": lin(s.kv_heads * s.head_dim, 2 * H),
            "layers.0.self_attn.o_proj.weight": lin(H, s.heads * s.head_dim),
            "layers.0.mlp.gate_proj.weight": lin(s.intermediate, H),
            "layers.0.mlp.up_proj.weight": lin(s.intermediate, H),
            "layers.0.mlp.down_proj.weight": lin(H, s.intermediate),
            **{f"layers.0.{n}.weight": torch.nn.Parameter(torch.ones(H))
               for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")},
            "norm.weight": torch.nn.Parameter(torch.ones(H)),
            "lm_head.weight": torch.nn.Parameter(lm_head_init.clone().float()),
        }
        # parameter names may not hold dots: "/" stands for them
        self.weights = torch.nn.ParameterDict({k.replace(".", "/"): v for k, v in named.items()})

    def w(self, name: str) -> torch.Tensor:
        return self.weights[name.replace(".", "/")]

    def state(self) -> dict[str, torch.Tensor]:
        """The speculators tensors by name."""
        return {k.replace("/", "."): v.detach().clone() for k, v in self.weights.items()}

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        eps = self.shape.rms_norm_eps
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.w(name)

    def unroll(self, aux: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """aux [m, 3Ht] (the target's states at positions 0..m-1), embeds [m + steps - 1, H]
        (the embedding of the token at position i + 1 is row i): the draft logits of each
        step, step k's [m - k, draft_vocab] for roots 0..m-k-1 (root j predicts the token
        after position j + k + 1)."""
        s, p = self.shape, "layers.0."
        m = aux.shape[0]
        hidden = aux @ self.w("fc.weight").T  # [m, H]
        keys, values, out = [], [], []
        for k in range(steps):
            n = m - k  # roots still inside the sample
            if n <= 0:
                break
            hidden = hidden[:n]
            e = self._norm(embeds[k:k + n], p + "input_layernorm.weight")
            h = self._norm(hidden, p + "hidden_norm.weight")
            x = torch.cat([e, h], dim=-1)  # [n, 2H]
            q = (x @ self.w(p + "self_attn.q_proj.weight").T).view(n, s.heads, s.head_dim) \
                .transpose(0, 1)
            kk = (x @ self.w(p + "self_attn.k_proj.weight").T).view(n, s.kv_heads, s.head_dim) \
                .transpose(0, 1)
            vv = (x @ self.w(p + "self_attn.v_proj.weight").T).view(n, s.kv_heads, s.head_dim) \
                .transpose(0, 1)
            cos, sin = rope(s, np.arange(n) + k)  # root j's entry sits at position j + k
            q, kk = _rotate(q, cos, sin), _rotate(kk, cos, sin)
            keys.append(kk)
            values.append(vv)
            group = s.heads // s.kv_heads
            # step-0 block: causal over roots; step-i blocks (1..k): the same root only
            blocks_k = [keys[0][:, :n]] + [kk_i[:, :n] for kk_i in keys[1:]]
            blocks_v = [values[0][:, :n]] + [vv_i[:, :n] for vv_i in values[1:]]
            K = torch.cat(blocks_k, dim=1).repeat_interleave(group, 0)  # [heads, n(k+1), D]
            V = torch.cat(blocks_v, dim=1).repeat_interleave(group, 0)
            scores = q @ K.transpose(1, 2) / s.head_dim ** 0.5  # [heads, n, n(k+1)]
            rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
            mask = torch.cat([cols <= rows] + [cols == rows] * k, dim=1)  # [n, n(k+1)]
            scores = scores.masked_fill(~mask, float("-inf"))
            attn = (torch.softmax(scores, -1) @ V).transpose(0, 1).reshape(n, -1)
            residual = attn @ self.w(p + "self_attn.o_proj.weight").T + hidden
            y = self._norm(residual, p + "post_attention_layernorm.weight")
            gated = torch.nn.functional.silu(y @ self.w(p + "mlp.gate_proj.weight").T) \
                * (y @ self.w(p + "mlp.up_proj.weight").T)
            mlp = gated @ self.w(p + "mlp.down_proj.weight").T
            hidden = mlp + residual  # the pre-norm state: the next step's input
            out.append(self._norm(hidden, "norm.weight") @ self.w("lm_head.weight").T)
        return out


def sample_loss(head: TrainableHead, t: Teacher, embed_table: torch.Tensor, *, steps: int, decay: float) -> tuple[torch.Tensor, list[float]]:
    """The weighted TTT loss of one sample and each step's top-1 agreement with the target."""
    m = t.ids.numel() - 1  # roots 0..m-1: root j is fed the token at j + 1
    embeds = embed_table[t.ids[1:]]  # [m, H]
    logits = head.unroll(t.aux[:m], embeds, steps)
    p_target = torch.softmax(t.logp.float(), dim=-1)  # [n, Vd] renormalised on the kept ids
    loss, agree, total = torch.zeros(()), [], 0.0
    for k, lg in enumerate(logits):
        n = lg.shape[0]
        pos = torch.arange(n) + k + 1  # the position whose next token root j predicts
        keep = pos >= t.loss_from
        if not keep.any():
            agree.append(float("nan"))
            continue
        pt = p_target[pos][keep]
        logq = torch.log_softmax(lg[keep], dim=-1)
        loss = loss + decay ** k * -(pt * logq).sum(-1).mean()
        total += decay ** k
        agree.append(float((lg[keep].argmax(-1) == pt.argmax(-1)).float().mean()))
    return loss / max(total, 1e-9), agree


@dataclasses.dataclass
class LoopResult:
    losses: list[float]  # per optimiser step
    top1: list[list[float]]  # per optimiser step, per TTT step


def train(head: TrainableHead, data: list[Teacher], embed_table: torch.Tensor, *, steps: int, ttt_steps: int = 3, decay: float = 0.8,
          lr: float = 1e-3, weight_decay: float = 0.0, seed: int = 0, schedule: str = "constant",
          report: Callable[[str], None] = lambda s: None) -> LoopResult:
    """`steps` AdamW steps, one sample each, in a seeded order (every sample once per pass).
    `schedule` "cosine": the learning rate warms up linearly over the first 2% of steps, then
    follows a cosine to zero; "constant": lr throughout."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    warm = max(1, steps // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 1.0 if schedule == "constant" else
        min((i + 1) / warm, 0.5 * (1 + np.cos(np.pi * i / steps))))
    result = LoopResult([], [])
    order: list[int] = []
    for step in range(steps):
        if not order:
            order = list(rng.permutation(len(data)))
        t = data[order.pop()]
        loss, agree = sample_loss(head, t, embed_table, steps=ttt_steps, decay=decay)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        result.losses.append(float(loss.detach()))
        result.top1.append(agree)
        if (step + 1) % max(1, steps // 10) == 0 or step + 1 == steps:
            report(f"step {step + 1}/{steps} loss {result.losses[-1]:.3f} top-1 "
                   + " ".join(f"{a:.2f}" for a in agree))
    return result
