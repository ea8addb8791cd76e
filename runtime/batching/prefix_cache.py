"""Prompt prefixes whose keys and values a batching runner copies instead of computing them.

A prompt's keys and values at position j depend only on its tokens 0..j, and the batched
graph's rows are bitwise independent of the call they ran in (`backend.py`). So the
cache a finished prefill left in its row holds exactly what a later prompt sharing its first n
tokens would compute for them: the runner (`BatchRunner`) copies those n positions into the
new request's row and prefills the rest. Chat requests share their system prompt and template;
a conversation's next turn repeats the whole of the previous prompt.

`PrefixCache` keeps the prompts of recent prefills, least recently used first out, within a
byte budget. It belongs to the runner's thread (no lock). A lookup never covers a whole
prompt: its last token is always computed, since its logits are the prefill's result.
`SharedPrefixCache` is one behind a lock, for the decoders of a model that decodes each request
on calls of its own (`OrtDecoder.on(..., prefixes=)`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Callable

import numpy as np

from ..errors import InvalidOptionError
from ..validation import check_int

MIB = 1 << 20
# the default model at int4 (a float16 KV cache): about 23 KiB a token, ~11,400 tokens; in fp32
# about 46 KiB a token, ~5,700 tokens
DEFAULT_PREFIX_CACHE_MIB = 256


def prefix_cache_bytes(mib: object, *, name: str = "prefix_cache_mib") -> int:
    """A prefix cache size in MiB, checked, in bytes (0: no cache); InvalidOptionError naming
    `name` otherwise."""
    if isinstance(mib, bool) or not isinstance(mib, (int, float)) or not 0 <= mib < float("inf"):
        raise InvalidOptionError(f"{name} must be a number of MiB >= 0 (0 turns the prefix "
                                 f"cache off), got {mib!r}")
    return int(mib * MIB)


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens a [n] and b [m] have in common."""
    m = min(a.size, b.size)
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if differ.size else m


@dataclasses.dataclass(eq=False)
class CachedPrefix:
    tokens: np.ndarray  # [n] int64
    kv: Any  # the backend's copy of a row's first n positions (`BatchBackend.save`)
    nbytes: int


class PrefixCache:
    """Recent prompts' keys and values, at most `max_bytes` of them."""

    def __init__(self, max_bytes: int) -> None:
        check_int("prefix cache size", max_bytes, minimum=0, what=" bytes")
        self.max_bytes = int(max_bytes)
        self._entries: collections.OrderedDict[int, CachedPrefix] = collections.OrderedDict()
        self._next_id = 0
        self.stored_bytes = 0

    def match(self, tokens: np.ndarray) -> tuple[CachedPrefix | None, int]:
        """The cached prefix sharing the most leading tokens with `tokens` [n], and how many
        (at most n - 1, so the last token is computed); (None, 0) when none shares any."""
        best, best_n, best_key = None, 0, None
        limit = tokens.size - 1
        for key, entry in self._entries.items():
            if min(limit, entry.tokens.size) <= best_n:
                continue
            n = shared_prefix(entry.tokens, tokens[:limit])
            if n > best_n:
                best, best_n, best_key = entry, n, key
        if best is not None:
            self._entries.move_to_end(best_key)
        return best, best_n

    def wants(self, tokens: np.ndarray, nbytes: int) -> bool:
        """Whether a prefill of `tokens` taking `nbytes` would be stored: it fits the budget
        and no cached prefix already starts with all of it."""
        if nbytes > self.max_bytes or tokens.size == 0:
            return False
        return not any(e.tokens.size >= tokens.size and np.array_equal(e.tokens[:tokens.size], tokens)
                       for e in self._entries.values())

    def add(self, tokens: np.ndarray, kv: Any, nbytes: int) -> None:
        """Store a prompt's prefix (call `wants` first); cached prefixes it extends are dropped,
        then the least recently used ones until the budget holds."""
        for key in [k for k, e in self._entries.items() if e.tokens.size <= tokens.size
                    and np.array_equal(tokens[:e.tokens.size], e.tokens)]:
            self._drop(key)
        while self._entries and self.stored_bytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[self._next_id] = CachedPrefix(np.array(tokens, np.int64), kv, int(nbytes))
        self._next_id += 1
        self.stored_bytes += int(nbytes)

    def _drop(self, key: int) -> None:
        self.stored_bytes -= self._entries.pop(key).nbytes

    def __len__(self) -> int:
        return len(self._entries)


class SharedPrefixCache:
    """A `PrefixCache` that the decoders of a model which serves each request on calls of its
    own share (`OrtDecoder`'s `prefixes`): their requests run on several threads, so every look
    at the cache holds its lock. A decoder's prefill of a prompt into an empty cache copies in the
    longest cached prefix (`reuse`) and computes the rest; once read, the prompt's keys and
    values are kept (`keep`). Exact where the decoder computes a position alike in any call,
    which its sessions' `rows_exact` says. A stored copy is never written again: `reuse` copies
    out of it without the lock."""

    def __init__(self, max_bytes: int) -> None:
        self._cache = PrefixCache(max_bytes)
        self._lock = threading.Lock()
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # ... and found (copied, not computed)

    @property
    def max_bytes(self) -> int:
        return self._cache.max_bytes

    def reuse(self, tokens: np.ndarray, load: Callable[[Any, int], None]) -> int:
        """The longest cached prefix of `tokens` [n] (at most n - 1 of them): `load(kv, m)`
        copies its m positions in; returns m (0: nothing cached, nothing loaded)."""
        with self._lock:
            entry, n = self._cache.match(tokens)
            self.queried_tokens += int(tokens.size)
            self.hit_tokens += n
        if entry is not None:
            load(entry.kv, n)
        return n

    def keep(self, tokens: np.ndarray, save: Callable[[int], Any], nbytes: int) -> None:
        """A prompt just read into an empty cache: `save(n)` copies its n = tokens.size
        positions out, stored when the budget takes them and no cached prefix already holds
        them all. A failing copy (MemoryError) stores nothing: the cache is an optimisation."""
        with self._lock:
            if not self._cache.wants(tokens, nbytes):
                return
        try:
            kv = save(tokens.size)
        except MemoryError:
            return
        with self._lock:
            if self._cache.wants(tokens, nbytes):  # another request may have stored it meanwhile
                self._cache.add(tokens, kv, nbytes)

    def snapshot(self) -> tuple[int, int]:
        """(prompt tokens looked up, those found)."""
        with self._lock:
            return self.queried_tokens, self.hit_tokens

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)
