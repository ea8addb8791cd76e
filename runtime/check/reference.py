"""A small NumPy transformer with a real KV cache: the `Decoder` tests decode with.

Random weights from a fixed seed, any vocabulary size, float64 throughout. `forward_batch`
computes a block in one pass with a causal mask and equals a sequence of `forward_token` calls
(to ~1e-13); `truncate` is a length change, like the ONNX decoder's. Also useful to try a
custom drafter without exporting a model.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ..errors import CapacityError, InvalidOptionError, InvalidPromptError
from ..decoding.protocols import DecoderBase


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
    vocab_size: int = 6
    d_model: int = 16
    n_layers: int = 2
    n_heads: int = 2
    capacity: int = 64
    logit_scale: float = 2.0  # larger: peakier next-token distributions
    seed: int = 0


def _norm(x: np.ndarray) -> np.ndarray:  # RMSNorm without a gain
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)


class ReferenceDecoder(DecoderBase):
    def __init__(self, config: ReferenceConfig = ReferenceConfig(), *, max_verify_len: int | None = None) -> None:
        c = config
        if c.d_model % c.n_heads:
            raise ValueError(f"d_model {c.d_model} must be a multiple of n_heads {c.n_heads}")
        self.config = c
        self.vocab_size = c.vocab_size
        self.capacity = c.capacity
        self.max_verify_len = max_verify_len
        rng = np.random.default_rng(c.seed)
        d, s = c.d_model, 1.0 / np.sqrt(c.d_model)
        self.embed = rng.normal(size=(c.vocab_size, d))  # [vocab, d]
        self.pos = rng.normal(size=(c.capacity, d)) * 0.5  # [capacity, d]
        self.layers = [
            {
                "wqkv": rng.normal(size=(d, 3 * d)) * s,
                "wo": rng.normal(size=(d, d)) * s,
                "w1": rng.normal(size=(d, 4 * d)) * s,
                "w2": rng.normal(size=(4 * d, d)) * s / 2,
            }
            for _ in range(c.n_layers)
        ]
        self.unembed = rng.normal(size=(d, c.vocab_size)) * s * c.logit_scale  # [d, vocab]
        hd = d // c.n_heads
        self._k = np.zeros((c.n_layers, c.n_heads, c.capacity, hd))  # [layers, heads, capacity, hd]
        self._v = np.zeros_like(self._k)
        self._length = 0
        self.token_calls = 0
        self.batch_calls = 0

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._length = 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise InvalidOptionError(f"truncate({length}): length must be in 0..{self._length}")
        self._length = length

    @property
    def kv_token_bytes(self) -> int:
        """Bytes of keys and values a cache position holds."""
        return self._k[:, :, 0].nbytes + self._v[:, :, 0].nbytes

    def kv_prefix(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """A copy of the keys and values of the first `length` positions [layers, heads, length, hd]."""
        return self._k[:, :, :length].copy(), self._v[:, :, :length].copy()

    def load_kv_prefix(self, saved: tuple[np.ndarray, np.ndarray], length: int) -> None:
        """Take the first `length` positions of a `kv_prefix` copy: the cache holds `length` tokens."""
        k, v = saved
        self._k[:, :, :length] = k[:, :, :length]
        self._v[:, :, :length] = v[:, :, :length]
        self._length = int(length)

    def forward_token(self, token: int) -> np.ndarray:  # [vocab]
        self.token_calls += 1
        return self._forward([token])[0]

    def forward_batch(self, tokens: Sequence[int]) -> np.ndarray:  # [n, vocab]
        self.batch_calls += 1
        return self._forward(tokens)

    def _forward(self, tokens: Sequence[int]) -> np.ndarray:
        c = self.config
        ids = np.asarray(tokens, dtype=np.int64)
        n = ids.size
        if n == 0:
            raise InvalidPromptError("forward of an empty block")
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise InvalidPromptError(f"token ids must be in 0..{c.vocab_size - 1}, got {ids.tolist()}")
        start = self._length
        if start + n > c.capacity:
            raise CapacityError(f"{start} + {n} tokens exceed the capacity {c.capacity}")
        end = start + n
        h, hd = c.n_heads, c.d_model // c.n_heads
        x = self.embed[ids] + self.pos[start:end]  # [n, d]
        # query i (absolute position start + i) sees keys 0..start + i
        mask = np.arange(end)[None, :] <= (start + np.arange(n))[:, None]  # [n, end]
        for li, w in enumerate(self.layers):
            qkv = _norm(x) @ w["wqkv"]  # [n, 3d]
            q, k, v = (a.reshape(n, h, hd).transpose(1, 0, 2) for a in np.split(qkv, 3, axis=-1))
            self._k[li, :, start:end] = k
            self._v[li, :, start:end] = v
            att = q @ self._k[li, :, :end].transpose(0, 2, 1) / np.sqrt(hd)  # [h, n, end]
            att = np.where(mask[None], att, -np.inf)
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = (att @ self._v[li, :, :end]).transpose(1, 0, 2).reshape(n, c.d_model)  # [n, d]
            x = x + o @ w["wo"]
            x = x + np.tanh(_norm(x) @ w["w1"]) @ w["w2"]
        self._length = end
        return _norm(x) @ self.unembed  # [n, vocab]
