"""`ortspec generate` end to end on the hand-written tiny graph: the text on stdout, one summary
line on stderr that says what the drafter did."""

from __future__ import annotations

import re

import pytest

from ortspec.runtime.cli.main import main as cli_main

TINY_EXPORT = None  # helpers.export.write_graph_dir: no torch


@pytest.mark.parametrize("drafter, drafts", [("none", False), ("prompt-lookup", True)])
def test_the_summary_line_counts_what_was_drafted(capsys, tiny_dir, drafter, drafts):
    # ids repeat in the prompt, so prompt lookup finds continuations to draft
    rc = cli_main(["generate", "--model", str(tiny_dir), "--prompt", "a b c a b c a b c a b",
                   "--max-new-tokens", "12", "--temperature", "0", "--drafter", drafter,
                   "--fixed-draft-len"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    summary = err.strip().splitlines()[-1]
    assert re.match(r"\[\d+ tokens, [0-9.]+ tok/s, finish=\w+, ", summary), summary
    found = re.search(r"acceptance [0-9.]+% \((\d+)/(\d+)\)", summary)
    if drafts:
        assert found and int(found[2]) > 0 and int(found[1]) <= int(found[2]), summary
    else:
        assert found is None and "nothing drafted" in summary, summary


def _short_generate(tiny_dir, capsys) -> tuple[list[str], str]:
    """A short greedy `generate` command without its prompt, and what it prints for the prompt
    "a b c a b"."""
    args = ["generate", "--model", str(tiny_dir), "--max-new-tokens", "6", "--temperature", "0",
            "--drafter", "none"]
    assert cli_main([*args, "--prompt", "a b c a b"]) == 0
    return args, capsys.readouterr().out


def test_a_prompt_file_of_dash_is_standard_input(capsys, tiny_dir, monkeypatch):
    import io

    args, want = _short_generate(tiny_dir, capsys)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("a b c a b".encode())))
    assert cli_main([*args, "--prompt-file", "-"]) == 0
    assert capsys.readouterr().out == want
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a b \xff")))
    assert cli_main([*args, "--prompt-file", "-"]) == 2
    assert "standard input is not UTF-8 text" in capsys.readouterr().err


class _Terminal:
    """A standard input that is a terminal: never read without --prompt-file -."""

    def isatty(self) -> bool:
        return True

    def read(self, *args):  # pragma: no cover - the test fails if it is read
        raise AssertionError("standard input read")


def test_a_prompt_piped_to_standard_input_is_read_without_flags(capsys, tiny_dir, monkeypatch):
    import io

    args, want = _short_generate(tiny_dir, capsys)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("a b c a b".encode())))
    assert cli_main(args) == 0  # `echo ... | ortspec generate`
    assert capsys.readouterr().out == want
    # nothing piped (an empty stream, or a terminal): the flags are named, nothing is read
    for stdin in (io.TextIOWrapper(io.BytesIO(b"")), _Terminal()):
        monkeypatch.setattr("sys.stdin", stdin)
        assert cli_main(args) == 2
        err = capsys.readouterr().err
        assert "give --prompt TEXT or --prompt-file PATH" in err and "pipe the prompt" in err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a b \xff")))
    assert cli_main(args) == 2
    assert "standard input is not UTF-8 text" in capsys.readouterr().err
    # a flag given: piped text is not read
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"x y z")))
    assert cli_main([*args, "--prompt", "a b c a b"]) == 0
    assert capsys.readouterr().out == want
