"""Prompt lookup: hand-worked cases."""

import pytest

from ortspec.runtime import InvalidOptionError, PromptLookupSpeculator

# words as token ids
THE, CAT, SAT, ON, A, MAT, DOT, DOG, RAN = range(9)


def propose(history, max_tokens=8, **kw):
    return list(PromptLookupSpeculator(**kw).propose(history, max_tokens).tokens)


def test_no_match_gives_an_empty_block():
    assert propose([THE, CAT, SAT]) == []
    assert propose([THE]) == []


def test_the_continuation_of_the_earlier_occurrence_is_drafted():
    history = [THE, CAT, SAT, ON, A, MAT, DOT, THE, CAT, SAT]
    assert propose(history, ngram_size=3, max_draft_len=4) == [ON, A, MAT, DOT]
    block = PromptLookupSpeculator(ngram_size=3).propose(history, 8)
    assert block.match_len == 3 and all(d.is_point for d in block.dists)


def test_the_longest_ngram_wins_over_a_more_recent_shorter_one():
    # "cat sat" -> DOG most recently, but "the cat sat" (3 tokens) matched earlier -> ON
    history = [THE, CAT, SAT, ON, A, CAT, SAT, DOG, RAN, THE, CAT, SAT]
    assert propose(history, ngram_size=3, max_draft_len=2) == [ON, A]
    # with n capped at 2, the most recent "cat sat" wins
    assert propose(history, ngram_size=2, max_draft_len=2) == [DOG, RAN]


def test_ties_go_to_the_most_recent_occurrence_by_default_or_the_first_on_request():
    history = [CAT, ON, A, DOT, CAT, DOG, RAN, DOT, CAT]
    assert propose(history, ngram_size=1, max_draft_len=2) == [DOG, RAN]
    assert propose(history, ngram_size=1, max_draft_len=2, prefer="first") == [ON, A]


def test_backoff_stops_at_min_ngram_size():
    history = [CAT, DOG, RAN, SAT, CAT]  # only the 1-gram CAT repeats
    assert propose(history, ngram_size=3, min_ngram_size=1) == [DOG, RAN, SAT, CAT]
    assert propose(history, ngram_size=3, min_ngram_size=2) == []


def test_the_draft_is_cut_at_max_tokens_and_max_draft_len():
    history = [THE, CAT, SAT, ON, A, MAT, DOT, THE, CAT, SAT]
    assert propose(history, max_tokens=2) == [ON, A]
    assert propose(history, max_tokens=0) == []
    assert propose(history, max_draft_len=1) == [ON]


def test_a_match_may_run_into_the_tail_itself():
    # repeating pattern: "a b a b a" -> tail "a b a" matched at start -> continues "b a"
    assert propose([A, DOG, A, DOG, A], ngram_size=3, max_draft_len=4) == [DOG, A]


def test_the_index_follows_a_growing_history_and_a_new_one():
    spec = PromptLookupSpeculator(ngram_size=2, max_draft_len=3)
    history = [THE, CAT, SAT, ON]
    assert list(spec.propose(history, 8).tokens) == []
    history += [THE, CAT]
    assert list(spec.propose(history, 8).tokens) == [SAT, ON, THE]
    # a different history (not an extension) rebuilds the index: no stale matches
    assert list(spec.propose([DOG, RAN, THE, CAT], 8).tokens) == []
    # and the input is never modified
    h = [THE, CAT, THE]
    spec.propose(h, 8)
    assert h == [THE, CAT, THE]


def test_bad_options_are_refused():
    for kw in (dict(ngram_size=0), dict(min_ngram_size=4, ngram_size=3), dict(max_draft_len=-1), dict(prefer="x")):
        with pytest.raises(InvalidOptionError):
            PromptLookupSpeculator(**kw)
