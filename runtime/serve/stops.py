"""`StopMatcher`: stop strings found in streamed text, across piece boundaries, never emitted.

Text that could still be the start of a stop string is held back until the next piece shows
whether it is one:

    m = StopMatcher(["\\n\\n", "END"])
    m.feed("Hello E")   # -> "Hello "   ("E" may begin "END")
    m.feed("ND more")   # -> ""         (stopped: "END" matched; m.stopped is True)
    m.flush()           # -> ""         (what is still held back when the text ends)
    m.through           # -> "Hello END" (the text up to the end of the stop string)

`tokens_through(decode, tokens, m.through)` then counts the tokens that made that text: the
answer's exact length, whatever the last decode step emitted past the stop.
"""

from __future__ import annotations

from typing import Callable, Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.stopped = False
        self.through: str | None = None  # once stopped: the text up to the stop string's end
        self._held = ""  # the longest suffix of the text so far that begins a stop string
        self._emitted: list[str] = []

    def feed(self, piece: str) -> str:
        """The part of `piece` (with what was held back) that is safe to emit."""
        if self.stopped:
            return ""
        text = self._held + piece
        found = [(i, len(s)) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if found:  # text before the held part never ends in a stop's prefix: no earlier match
            start, length = min(found)  # the first to begin; of those, the shortest
            self.stopped, self._held = True, ""
            self.through = "".join(self._emitted) + text[:start + length]
            self._emitted = []
            return text[:start]
        keep = self._prefix_suffix(text)
        self._held = text[len(text) - keep:]
        out = text[:len(text) - keep]
        self._emitted.append(out)
        return out

    def flush(self) -> str:
        """What is held back, at the end of the text (it was no stop string after all)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


def tokens_through(decode: Callable[[list[int]], str], tokens: Sequence[int], text: str) -> int:
    """The fewest leading `tokens` whose decoded text begins with `text` (all of them if none
    do). Binary search: a longer prefix of the tokens decodes to a longer prefix of the text."""
    lo, hi = 0, len(tokens)  # decode(tokens[:hi]) is taken to begin with `text`
    while lo < hi:
        mid = (lo + hi) // 2
        if decode(list(tokens[:mid])).startswith(text):
            hi = mid
        else:
            lo = mid + 1
    return hi
