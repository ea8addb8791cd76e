"""`PromptPrefixes`: the batch runner's use of the prefix cache for prompts read into empty rows.

A prompt read into an empty row, wanting only its last logits, is kept in the `PrefixCache`
once read (`keep`); a later prompt copies the keys and values of the longest cached prefix it
starts with into its row and reads on from there (`reuse`): exact, as the backend's calls are
row-invariant. A prompt that would copy at least PREFIX_WAIT_TOKENS more tokens from an older
prompt still being read waits for it (`waits`), so chat requests arriving together compute
their shared system prompt once. Called on the runner's thread only.
"""

from __future__ import annotations

from .backend import BatchBackend
from .prefix_cache import PrefixCache, shared_prefix
from .rows import BatchJob, BatchStats

PREFIX_WAIT_TOKENS = 16  # a prompt waits for an older one's if it then copies this many more


class PromptPrefixes:
    """`cache` over `backend`'s rows; hits and queries are counted in `stats`."""

    def __init__(self, cache: PrefixCache, backend: BatchBackend, stats: BatchStats) -> None:
        self.cache, self.backend, self.stats = cache, backend, stats

    @staticmethod
    def applies(job: BatchJob) -> bool:
        """Whether a begun prefill reads a prompt into an empty row and wants only its last
        logits (the prefills the cache serves and keeps)."""
        return job.start == 0 and not job.keep_all

    def waits(self, job: BatchJob, older: list[BatchJob]) -> bool:
        """Whether a prompt not begun yet is better read later: an older prompt being read
        (into the cache once done) shares PREFIX_WAIT_TOKENS more leading tokens with it than
        the cache holds now. The oldest prompt never waits."""
        if job.keep_all or job.row.length != 0:
            return False
        limit = job.tokens.size - 1
        coming = max((min(limit, shared_prefix(job.tokens, j.tokens)) for j in older
                      if j.start is not None and self.applies(j)
                      and j.tokens.size * self.backend.token_bytes <= self.cache.max_bytes),
                     default=0)
        if coming < PREFIX_WAIT_TOKENS:
            return False
        return coming - self.cache.match(job.tokens)[1] >= PREFIX_WAIT_TOKENS

    def reuse(self, job: BatchJob) -> None:
        """A prompt on an empty row: copy the keys and values of the longest cached prefix it
        starts with, and prefill from there (only its last chunk's logits are wanted)."""
        if not self.applies(job):
            return
        row = job.row
        entry, n = self.cache.match(job.tokens)
        self.stats.record_prefix(queried=job.tokens.size, hit=n)
        if entry is not None:
            assert row.index is not None
            self.backend.load(row.index, entry.kv, n)
            row.length = job.offset = n

    def keep(self, job: BatchJob) -> None:
        """A prompt read from an empty row: its keys and values go into the cache."""
        if not self.applies(job):
            return
        row, n = job.row, job.tokens.size
        nbytes = n * self.backend.token_bytes
        if self.cache.wants(job.tokens, nbytes):
            assert row.index is not None
            try:
                saved = self.backend.save(row.index, n)
            except MemoryError:  # the cache is an optimisation: the request goes on without it
                return
            self.cache.add(job.tokens, saved, nbytes)
