"""`TokenHistory`: the list of tokens a decode loop hands its drafter, with an edit counter.

Drafters keep indexes over the history (prompt lookup's n-gram index, a draft model's KV cache)
and bring them up to date with the tokens appended since their last call. To do that in O(new
tokens) they must know that nothing before was changed. A plain list cannot tell them; this
one counts every change that is not an append, so "same object, same edit count" proves the
old prefix is intact.
"""

from __future__ import annotations

from typing import Any


class TokenHistory(list):
    """A list of token ids; `edits` increases on any change other than append/extend."""

    __slots__ = ("edits",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.edits = 0


# every list method that changes it other than at its end: each counts an edit, then runs
EDITING_METHODS = ("__setitem__", "__delitem__", "__imul__", "pop", "insert", "remove", "clear",
                   "sort", "reverse")


def _counting_an_edit(inherited: Any) -> Any:
    """`inherited` (a method of list), counting an edit before it runs."""

    def method(self: TokenHistory, *a: Any, **k: Any) -> Any:
        self.edits += 1
        return inherited(self, *a, **k)

    method.__name__ = inherited.__name__
    method.__qualname__ = f"TokenHistory.{inherited.__name__}"
    method.__doc__ = inherited.__doc__
    return method


for _name in EDITING_METHODS:
    setattr(TokenHistory, _name, _counting_an_edit(getattr(list, _name)))
del _name


class HistoryFollower:
    """Keeps a drafter's token index level with the histories it is shown: `sync` appends what
    is new, or asks for a fresh index when the history diverged from what the index holds.

    O(new tokens) when the history is the `TokenHistory` seen last time with no edit since (what
    the decode loops pass); otherwise the old prefix is compared in full. The index needs a
    `tokens` list and an `extend` method (the n-gram indexes of the drafters)."""

    def __init__(self) -> None:
        self._source: Any = None  # the history object last seen
        self._edits = -1  # its edit count then, if it is a TokenHistory

    def sync(self, index: Any, history: Any, fresh: Any) -> Any:
        """The index brought up to `history` (`fresh()` makes an empty one when it diverged)."""
        n_old = len(index.tokens)
        unedited = (history is self._source and isinstance(history, TokenHistory)
                    and history.edits == self._edits)
        if not (len(history) >= n_old and (unedited or list(history[:n_old]) == index.tokens)):
            index, n_old = fresh(), 0
        self._source = history
        self._edits = history.edits if isinstance(history, TokenHistory) else -1
        if len(history) > n_old:
            index.extend(history[n_old:])
        return index
