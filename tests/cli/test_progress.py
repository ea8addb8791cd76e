"""`ortspec.runtime.cli.progress`: a tqdm bar on a terminal, whole lines (no carriage returns)
anywhere else."""

from __future__ import annotations

import io

from ortspec.runtime.cli.progress import LineProgress, on_terminal, progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _factory(calls):
    def make(**kwargs):
        calls.append(kwargs)
        return "bar"
    return make


def test_a_terminal_gets_the_callers_bar():
    calls, stream = [], _Terminal()
    assert progress_bar(5, "export", "stage", stream=stream, bar_factory=_factory(calls)) == "bar"
    assert calls == [{"total": 5, "desc": "export", "unit": "stage", "file": stream}]
    assert on_terminal(stream) and not on_terminal(io.StringIO())


def test_off_a_terminal_each_step_of_a_short_count_is_one_line():
    calls, stream = [], io.StringIO()
    with progress_bar(3, "export", "stage", stream=stream, bar_factory=_factory(calls)) as bar:
        assert isinstance(bar, LineProgress) and not calls
        for name in ("load", "build", "save"):
            bar.set_postfix_str(name)
            bar.update()
    out = stream.getvalue()
    assert "\r" not in out
    lines = out.splitlines()
    assert [line.rsplit(",", 1)[0] for line in lines] == [
        "export: 1/3 stages (load)", "export: 2/3 stages (build)", "export: 3/3 stages (save)"]


def test_off_a_terminal_a_long_count_prints_a_line_per_tenth():
    stream = io.StringIO()
    bar = progress_bar(95, "bench", "prompt", stream=stream)  # no factory: lines everywhere
    for _ in range(95):
        bar.update(1)
    bar.close()
    lines = stream.getvalue().splitlines()
    counts = [int(line.split(": ")[1].split("/")[0]) for line in lines]
    assert counts == [10, 19, 29, 38, 48, 57, 67, 76, 86, 95]
    assert "\r" not in stream.getvalue()


def test_disabled_progress_prints_nothing():
    stream = _Terminal()
    with progress_bar(2, "x", "stage", enabled=False, stream=stream,
                      bar_factory=_factory([])) as bar:
        bar.set_postfix_str("a")
        bar.update()
        bar.update()
    assert stream.getvalue() == ""
