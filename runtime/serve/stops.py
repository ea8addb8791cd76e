"""`StopMatcher`: stop strings found in streamed text, across piece boundaries, never emitted.

Text that could still be the start of a stop string is held back until the next piece shows
whether it is one:

    m = StopMatcher(["\\n\\n", "END"])
    m.feed("Hello E")   # -> "Hello "   ("E" may begin "END")
    m.feed("ND more")   # -> ""         (stopped: "END" matched; m.stopped is True)
    m.flush()           # -> ""         (what is still held back when the text ends)
"""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.stopped = False
        self._held = ""  # the longest suffix of the text so far that begins a stop string

    def feed(self, piece: str) -> str:
        """The part of `piece` (with what was held back) that is safe to emit."""
        if self.stopped:
            return ""
        text = self._held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:  # text before the held part never ends in a stop's prefix: no earlier match
            self.stopped, self._held = True, ""
            return text[:min(found)]
        keep = self._prefix_suffix(text)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]

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
