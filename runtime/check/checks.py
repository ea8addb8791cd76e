"""The losslessness checks behind `ortspec check`: is speculative decoding lossless with *this*
export on *this* provider? Each check returns `CheckRow`s (a name, a figure, its bound, pass or
fail); `run_checks` runs them all and `format_table` prints them. The command itself is
`ortspec.runtime.cli.check`.

1. verify vs step: the verify entry point over a prompt (in blocks of max_verify_len, so every
   block after the first has a past) against the step entry point token by token; the max
   |difference| of the logits must stay within the export's own bound
   (`ortspec.runtime.check.tolerances`: max(1e-4, 4e-6 x the largest |logit|) in fp32, 1% of the
   largest |logit| in fp16; here the largest |logit| is the step entry point's, there being no
   PyTorch). Speculative decoding reads the target's distribution from verify calls, plain
   decoding from steps: if they disagree, the two decodes sample different distributions.
2. row invariance: the step logits of max(12, max_verify_len + 1) positions against the rows of verify calls of several
   lengths (1, 2, 3, 4, 8 and max_verify_len, where they fit), each starting 0 or 1 tokens in
   (`ortspec.runtime.ort.row_invariance`). A graph that pads a lone row (manifest.min_call_rows or
   min_attention_rows = 2: the int4 and window exports) must match bit for bit; a float GQA
   graph within the verify-vs-step bound of check 1 (its bitwise count is reported).
3. greedy identity: speculative decoding with prompt lookup and plain decoding, 48 new tokens
   on four built-in prompts, must give the same tokens.
4. the sampler on the model's own distributions: p = the target's temperature-1 distribution
   at three positions of a real prompt; two deliberately bad drafts (a point mass on a token p
   rarely picks; q = the temperature-1.6 distribution, draws taken from q); N = 20,000 draws
   through `accept_or_resample` each; a chi-squared goodness-of-fit test of the emitted tokens
   against p over the whole vocabulary (cells with expected count < 5 pooled;
   `ortspec.runtime.check.stats`). Each test passes when its p-value exceeds alpha = 0.001 (six
   tests: a false alarm about 0.6% of the time; the seed is fixed, so a run repeats exactly).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ..decoding.loop import plain_decode, speculative_decode_with
from ..decoding.options import SpeculativeOptions
from ..drafters.prompt_lookup import PromptLookupSpeculator
from ..ort.row_invariance import row_differences
from ..decoding.sampling import DraftDist, accept_or_resample, warp
from .stats import chi_squared_test
from .tolerances import TOLERANCES, comparison_length

ALPHA = 1e-3
DRAFT_TEMPERATURE = 1.6  # the "bad" draft q: flatter than the target
POINT_MASS_BELOW = 0.05  # the point-mass draft: the most likely token with p below this

PROMPTS = (
    "Summarize in one sentence: The city council met on Tuesday to discuss the new bicycle "
    "lanes. The council approved the plan for the bicycle lanes on Main Street and Oak Avenue.",
    "Rewrite this Python function with a docstring:\n\ndef area(width, height):\n"
    "    return width * height\n",
    "List the days of the week, one per line, then list them again in reverse order.",
    "What is the capital of France? Answer in one short sentence.",
)
SAMPLER_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."



@dataclasses.dataclass(frozen=True)
class CheckRow:
    name: str
    figure: str
    bound: str
    passed: bool


def _prompt_ids(model, text: str) -> list[int]:
    return model.encode(text, chat=model.manifest.chat_format is not None)


def check_verify_vs_step(model) -> CheckRow:
    """Max |logits(verify) - logits(step)| over a prompt of `comparison_length` tokens, within
    the export's verify-vs-step bound."""
    dec = model.decoder
    n = comparison_length(dec.capacity, dec.max_verify_len)
    ids = _prompt_ids(model, PROMPTS[0])
    while len(ids) < n:
        ids = ids + ids
    ids = ids[:n]
    dec.reset()
    k = dec.max_verify_len  # verify calls as speculative decoding makes them, each with a past
    verify = np.concatenate([dec.forward_batch(ids[lo:lo + k]) for lo in range(0, n, k)])
    dec.reset()
    step = np.stack([dec.forward_token(t) for t in ids])  # [n, vocab]
    dec.reset()
    diff = float(np.abs(verify - step).max())
    bound = TOLERANCES[model.manifest.dtype].step_vs_verify.at(float(np.abs(step).max()))
    return CheckRow(f"verify vs step logits ({n} positions)", f"max |diff| {diff:.2e}",
                    f"<= {bound:.1e}", diff <= bound)


ROW_POSITIONS = 12  # continuation tokens compared by check_row_invariance (at least)


def check_row_invariance(model) -> CheckRow:
    """Each verify row against the step at its position (see check 2 in the module doc)."""
    dec = model.decoder
    positions = min(max(ROW_POSITIONS, dec.max_verify_len + 1), dec.capacity // 2)
    prompt = _prompt_ids(model, PROMPTS[2])[-(dec.capacity - positions):]
    cont = (_prompt_ids(model, PROMPTS[3]) * positions)[:positions]
    lengths = sorted({n for n in (1, 2, 3, 4, 8, dec.max_verify_len)
                      if n <= min(dec.max_verify_len, positions - 1)})
    res = row_differences(dec, prompt, cont, block_lengths=lengths, offsets=(0, 1))
    exact = model.manifest.rows_exact
    figure = (f"{res.rows - res.differing}/{res.rows} rows bitwise equal, max |diff| "
              f"{res.max_abs:.2e}, {res.argmax_differing} argmax differ")
    if exact:
        why = "lone rows padded" if model.manifest.reserved_slots else "row-invariant kernels"
        return CheckRow(f"row invariance (blocks {','.join(map(str, lengths))}, {why})",
                        figure, "bitwise equal", res.differing == 0)
    bound = TOLERANCES[model.manifest.dtype].step_vs_verify.at(res.scale)
    return CheckRow(f"row invariance (blocks {','.join(map(str, lengths))})", figure,
                    f"<= {bound:.1e}", res.max_abs <= bound)


def check_greedy_identity(model, new_tokens: int = 48) -> list[CheckRow]:
    """Prompt lookup vs plain decoding at temperature 0: token for token."""
    dec = model.decoder
    rows = []
    new_tokens = max(1, min(new_tokens, dec.capacity // 2))
    k = max(1, min(8, dec.max_verify_len - 1))
    for i, text in enumerate(PROMPTS, 1):
        ids = _prompt_ids(model, text)[-(dec.capacity - new_tokens):]
        options = SpeculativeOptions(new_tokens)  # no stop tokens: compare all new_tokens
        plain = plain_decode(dec, ids, options)
        spec = speculative_decode_with(dec, ids, PromptLookupSpeculator(3, k), options)
        same = sum(a == b for a, b in zip(plain.tokens, spec.tokens))
        first = next((j for j, (a, b) in enumerate(zip(plain.tokens, spec.tokens)) if a != b), None)
        ok = spec.tokens == plain.tokens
        c = spec.counters
        figure = f"{same}/{len(plain.tokens)} equal, {c.accepted}/{c.drafted} drafts accepted"
        if not ok:
            figure += f", first difference at token {first if first is not None else same}"
        rows.append(CheckRow(f"greedy identity, prompt {i} ({len(ids)} tokens)", figure,
                             "identical", ok))
    return rows


def _draws(p_target: np.ndarray, draft: DraftDist, draft_tokens: np.ndarray,
           rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Push each drafted token through the rule: ([vocab] counts of emitted tokens, accepted)."""
    counts = np.zeros(p_target.shape[0], np.int64)
    accepted = 0
    for t in draft_tokens:
        tok, ok = accept_or_resample(p_target, draft, int(t), rng)
        counts[tok] += 1
        accepted += ok
    return counts, accepted


def check_sampler(model, *, draws: int = 20_000, seed: int = 0, alpha: float = ALPHA,
                  positions: int = 3) -> list[CheckRow]:
    """The rule on real distributions: emitted tokens ~ p whatever the draft (chi-squared)."""
    dec = model.decoder
    ids = _prompt_ids(model, SAMPLER_PROMPT)[-dec.capacity:]
    dec.reset()
    logits = dec.forward_batch(ids)  # [n, vocab]
    dec.reset()
    n = len(ids)
    where = sorted({max(0, (j * n) // positions - 1) for j in range(1, positions + 1)})
    rng = np.random.default_rng(seed)
    rows = []
    for pos in where:
        p = warp(logits[pos], temperature=1.0)  # [vocab]
        order = np.argsort(-p, kind="stable")
        low = order[p[order] < POINT_MASS_BELOW]
        token = int(low[0]) if low.size else int(order[-1])
        q = warp(logits[pos], temperature=DRAFT_TEMPERATURE)  # [vocab]
        cases = (
            (f"point mass on token {token} (p={p[token]:.3f})", DraftDist.point(token),
             np.full(draws, token)),
            (f"q = temperature {DRAFT_TEMPERATURE}", DraftDist.from_warped(q),
             rng.choice(q.size, size=draws, p=q)),  # tokens really drawn from q
        )
        for label, draft, tokens in cases:
            counts, accepted = _draws(p, draft, tokens, rng)
            res = chi_squared_test(counts, p)
            figure = (f"chi2 {res.statistic:.1f}, df {res.df}, p-value {res.p_value:.3f}, "
                      f"{accepted / draws:.1%} accepted")
            if res.outside_support:
                figure += f", {res.outside_support} draws outside the support"
            rows.append(CheckRow(f"sampler, position {pos}, {label}", figure, f"> {alpha:g}",
                                 res.p_value > alpha))
    return rows


def format_table(rows: Sequence[CheckRow]) -> str:
    head = ("check", "figure", "bound", "result")
    body = [(r.name, r.figure, r.bound, "pass" if r.passed else "FAIL") for r in rows]
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(3)]
    lines = []
    for cells in (head, *body):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells[:3], widths)) + "  " + cells[3])
    lines.insert(1, "  ".join("-" * w for w in widths) + "  ------")
    return "\n".join(lines)


def run_checks(model, *, draws: int = 20_000, seed: int = 0, new_tokens: int = 48,
               alpha: float = ALPHA) -> list[CheckRow]:
    return [check_verify_vs_step(model), check_row_invariance(model),
            *check_greedy_identity(model, new_tokens),
            *check_sampler(model, draws=draws, seed=seed, alpha=alpha)]
