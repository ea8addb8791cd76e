"""The int4 quality benchmark's metrics, on cases computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ortspec.runtime.bench.int4_quality import perplexity, token_nll, top1_agreement
from ortspec.runtime.errors import InvalidOptionError


def test_token_nll_is_minus_the_log_softmax_of_the_target():
    logits = np.array([[0.0, 0.0, 0.0, 0.0],          # uniform: -log(1/4)
                       [math.log(3.0), 0.0, 0.0, -np.inf]])  # p = 3/5, 1/5, 1/5, 0
    nll = token_nll(logits, [2, 0])
    assert nll == pytest.approx([math.log(4.0), -math.log(3 / 5)], rel=1e-12)
    # logits shifted by a constant give the same distribution
    assert token_nll(logits[:1] + 1e4, [1]) == pytest.approx([math.log(4.0)], rel=1e-9)


def test_perplexity_of_a_uniform_model_is_its_vocabulary_size():
    logits = np.zeros((5, 7), dtype=np.float32)
    assert perplexity(token_nll(logits, [0, 1, 2, 3, 6])) == pytest.approx(7.0, rel=1e-12)
    # geometric mean of 1/p: p = 1/2 and 1/8 give sqrt(2 * 8) = 4
    assert perplexity(np.array([math.log(2.0), math.log(8.0)])) == pytest.approx(4.0)


def test_top1_agreement_counts_equal_positions():
    assert top1_agreement(np.array([1, 2, 3, 4]), np.array([1, 0, 3, 0])) == 0.5
    with pytest.raises(InvalidOptionError, match="equal, non-empty"):
        top1_agreement(np.array([1, 2]), np.array([1]))
    with pytest.raises(InvalidOptionError, match="disagree"):
        token_nll(np.zeros((2, 3)), [0])
