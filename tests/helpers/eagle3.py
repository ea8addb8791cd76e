"""A target that hands out hidden states and a small EAGLE-3-shaped draft head, both NumPy: what
the eagle3 drafter is tested against without onnxruntime or torch."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ortspec.runtime import ReferenceDecoder
from ortspec.runtime.errors import InvalidOptionError


class HiddenReference(ReferenceDecoder):
    """`ReferenceDecoder` as a `HiddenStateSource`: the "hidden states" of a row are its logits
    and the one-hot of the token it processed ([rows, 2 * vocab]), a function of the prefix as
    a real model's are. Like OrtDecoder's, they cover the rows whose logits the last call
    returned (prefill: its last row only)."""

    hidden_state_layers = (1, 2)

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._states = np.zeros((0, 2 * self.vocab_size), np.float32)

    def _record(self, tokens: Sequence[int], logits: np.ndarray) -> np.ndarray:  # [n, vocab]
        onehot = np.eye(self.vocab_size)[np.asarray(tokens, np.int64)]
        self._states = np.concatenate([logits, onehot], axis=1).astype(np.float32)
        return logits

    def forward_token(self, token: int) -> np.ndarray:  # [vocab]
        return self._record([token], super().forward_batch([token]))[0]

    def forward_batch(self, tokens: Sequence[int]) -> np.ndarray:  # [n, vocab]
        return self._record(tokens, super().forward_batch(tokens))

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:  # [vocab]
        logits = super().forward_batch(tokens)
        self._record(tokens[-1:], logits[-1:])
        return logits[-1]

    def last_hidden_states(self) -> np.ndarray:  # [rows, 2 * vocab]
        return self._states


class NumpyHead:
    """A `DraftHead` with random weights: an entry is tanh(W [embed(token); h]) with h the
    target's states through `fc` (from_target) or the head's previous hidden output; its
    output mixes in the mean of the cache's entries, so what the cache holds changes every
    later output, as attention does. `fed` mirrors the tokens in the cache (for tests)."""

    def __init__(self, *, vocab: int, target_ids: Sequence[int], in_dim: int, hidden: int = 8,
                 capacity: int = 64, seed: int = 0, scale: float = 3.0) -> None:
        rng = np.random.default_rng(seed)
        self.target_ids = np.asarray(target_ids, np.int64)
        self.draft_vocab_size = self.target_ids.size
        self.capacity = capacity
        self.embed = rng.normal(size=(vocab, hidden))  # [vocab, H]
        self.fc = rng.normal(size=(in_dim, hidden)) / np.sqrt(in_dim)  # [K * Ht, H]
        self.w = rng.normal(size=(2 * hidden, hidden)) / np.sqrt(2 * hidden)  # [2H, H]
        self.out = rng.normal(size=(hidden, self.draft_vocab_size)) * scale  # [H, Vd]
        self._entries = np.zeros((capacity, hidden))  # [capacity, H]
        self.fed: list[int] = []

    @property
    def length(self) -> int:
        return len(self.fed)

    def reset(self) -> None:
        self.fed = []

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise InvalidOptionError(f"truncate({length}): length must be in 0..{self.length}")
        del self.fed[length:]

    def forward(self, tokens: Sequence[int], hidden: np.ndarray, *,
                from_target: bool) -> tuple[np.ndarray, np.ndarray]:
        h_in = hidden @ self.fc if from_target else hidden  # [n, H]
        if self.length + len(tokens) > self.capacity:
            raise InvalidOptionError("head cache full")
        logits, outs = [], []
        for tok, h in zip(tokens, h_in):
            x = np.tanh(np.concatenate([self.embed[int(tok)], h]) @ self.w)  # [H]
            self._entries[self.length] = x
            self.fed.append(int(tok))
            y = np.tanh(x + self._entries[:self.length].mean(axis=0))  # [H]
            outs.append(y)
            logits.append(y @ self.out)
        return np.array(logits, np.float32), np.array(outs, np.float32)



def tiny_llama_and_head(root):
    """A tiny random Llama (8 layers) in root/src and a tiny speculators-format EAGLE-3 head for
    it (layers 2, 4, 5; a draft vocabulary of 100) in root/head: (src, head) directories, for
    `export_model(src, draft_head=head, ...)`. Needs the export extra (torch)."""
    from pathlib import Path

    from ortspec.export.eagle3 import SPECULATORS
    from ortspec.export.tiny import make_tiny_llama, tiny_eagle3_weights, write_eagle3_head

    root = Path(root)
    src = make_tiny_llama(root / "src", seed=4, num_hidden_layers=8)
    head = write_eagle3_head(root / "head", tiny_eagle3_weights(draft_vocab=100, seed=3),
                             fmt=SPECULATORS, layer_ids=[2, 4, 5])
    return src, head
