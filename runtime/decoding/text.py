"""Token ids -> text as they arrive: `Detokenizer`, `detokenize`, and `TextStream` (what
`Model.stream` returns: the text of a `Model.start` token stream).

Incremental detokenisation decodes only the tokens since the last piece (plus the one before,
for tokenizers whose pieces depend on their left neighbour), not the whole text each time, and
holds back a piece that ends in the middle of a UTF-8 character (decoded as U+FFFD) until the
next token completes it. The pieces joined are `decode(all tokens)`.

    detok = Detokenizer(model.decode)
    for ids in model.start(prompt):          # or any iterator of ids, or of lists of ids
        print(detok.add(ids), end="")
    print(detok.finish())
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Protocol, Sequence

from .counters import DecodeCounters
from .options import SpeculativeDecodeResult

Decode = Callable[[list[int]], str]  # token ids -> text (e.g. Model.decode)


class Detokenizer:
    """Feed token ids with `add` (one id or a list), get the text they complete; `finish` gives
    what is still held back. `tokens` holds every id fed."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.tokens: list[int] = []
        self._prefix = self._read = 0  # tokens[_prefix:_read]: the text shown, decoded on its own
        self.shown = 0  # characters returned so far

    def add(self, ids: int | Sequence[int]) -> str:
        """The new text `ids` complete ("" while a character is incomplete)."""
        tokens = self.tokens
        tokens.extend([ids] if isinstance(ids, int) else ids)
        before = self._decode(tokens[self._prefix:self._read])
        after = self._decode(tokens[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):  # not mid-character
            piece = after[len(before):]
            self.shown += len(piece)
            self._prefix, self._read = self._read, len(tokens)
            return piece
        return ""

    def finish(self, text: str | None = None) -> str:
        """The rest of the text: `decode(tokens)` (or `text`, when the caller has it) past what
        `add` returned; a character completed by the last token, or one left incomplete."""
        text = self._decode(self.tokens) if text is None else text
        tail = text[self.shown:]
        self.shown = len(text)
        return tail


def detokenize(token_ids: Iterable[int | Sequence[int]], decode: Decode) -> Iterator[str]:
    """Text pieces as `token_ids` (ids, or lists of ids per step) arrive; closing this iterator
    closes `token_ids` if it can be closed (a model's token stream gives its slot back)."""
    detok = Detokenizer(decode)
    try:
        for ids in token_ids:
            if piece := detok.add(ids):
                yield piece
        if tail := detok.finish():
            yield tail
    finally:
        close = getattr(token_ids, "close", None)
        if close is not None:
            close()


class TokenSource(Protocol):
    """What `TextStream` reads of a token stream (`model.TokenStream`)."""

    tokens: list[int]
    counters: DecodeCounters
    result: SpeculativeDecodeResult | None

    def __iter__(self) -> Iterator[list[int]]: ...

    def close(self) -> None: ...


class TextStream:
    """The text of a token stream (`Model.start`'s): iterating yields text pieces
    (`detokenize`); `.tokens`, `.counters` and `.result` are the token stream's: what was
    emitted and counted so far, and the result with its `.text` once the decode has ended."""

    def __init__(self, tokens: TokenSource, decode: Decode) -> None:
        self.token_stream = tokens
        self._decode = decode
        # the token stream's own list and counters, which it fills in place
        self.tokens: list[int] = tokens.tokens
        self.counters: DecodeCounters = tokens.counters

    def __iter__(self) -> Iterator[str]:
        return detokenize(self.token_stream, self._decode)

    @property
    def result(self) -> SpeculativeDecodeResult | None:
        return self.token_stream.result

    def close(self) -> None:
        self.token_stream.close()
