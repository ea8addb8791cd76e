"""Progress of a long command: a live bar on a terminal, plain lines in a log.

A tqdm bar redraws itself with carriage returns, which off a terminal (CI, `make demo | tee
log`, a service's journal) pile up as one long line of frames. `progress_bar` gives the bar
only where its stream is a terminal, and elsewhere a `LineProgress`: one line per step of the
count, or per tenth of it when the count is longer than ten, never a carriage return.

The runtime does not depend on tqdm: the caller passes the bar class it imported itself
(`bar_factory`), or None to have lines everywhere.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


class LineProgress:
    """The part of tqdm's interface the commands use (update, set_postfix_str, close, a context
    manager), written as whole lines: `desc: n/total units (postfix), elapsed` each time the
    count reaches the next tenth of `total` (every step when total <= 10). stream None prints
    nothing."""

    def __init__(self, total: int, desc: str, unit: str, stream: TextIO | None):
        self.total, self.desc, self.unit, self.stream = total, desc, unit, stream
        self.n = 0
        self.postfix = ""
        self._printed = 0  # the count of the last line written
        self._started = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.stream is None or self.n <= self._printed:
            return
        step = max(self.total / 10, 1)  # a line per tenth (one per step up to 10)
        if self.n >= self.total or self.n // step > self._printed // step:
            self._printed = self.n
            units = self.unit if self.total == 1 else f"{self.unit}s"
            postfix = f" ({self.postfix})" if self.postfix else ""
            seconds = time.perf_counter() - self._started
            print(f"{self.desc}: {self.n}/{self.total} {units}{postfix}, {seconds:.1f}s",
                  file=self.stream, flush=True)

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def close(self) -> None:
        pass

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(total: int, desc: str, unit: str, *, enabled: bool = True,
                 stream: TextIO | None = None,
                 bar_factory: Callable[..., Any] | None = None) -> Any:
    """A progress display over `total` units on `stream` (default: sys.stderr): the caller's
    `bar_factory` (tqdm) when the stream is a terminal, else a LineProgress. enabled=False
    gives one that prints nothing."""
    stream = sys.stderr if stream is None else stream
    if not enabled:
        return LineProgress(total, desc, unit, None)
    if bar_factory is not None and on_terminal(stream):
        return bar_factory(total=total, desc=desc, unit=unit, file=stream)
    return LineProgress(total, desc, unit, stream)


def on_terminal(stream: TextIO | None = None) -> bool:
    """Whether `stream` (default: sys.stderr) is a terminal, where a live bar belongs."""
    return _is_terminal(sys.stderr if stream is None else stream)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
