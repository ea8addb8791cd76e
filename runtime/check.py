"""`ortspec check`: is speculative decoding lossless with *this* export on *this* provider?

    ortspec check [--model DIR] [--providers CUDAExecutionProvider,CPUExecutionProvider]

Three checks, each printed as a row with its figures, pass or fail:

1. verify vs step: the verify entry point over a prompt (in blocks of max_verify_len, so every
   block after the first has a past) against the step entry point token by token; the max
   |difference| of the logits must stay within the export's own bound (export/validate.py:
   max(1e-4, 4e-6 x the largest |logit|) in fp32, 1% of the largest |logit| in fp16; here the
   largest |logit| is the step entry point's, there being no PyTorch). Speculative decoding
   reads the target's distribution from verify calls, plain decoding from steps: if they
   disagree, the two decodes sample different distributions.
2. greedy identity: speculative decoding with prompt lookup and plain decoding, 48 new tokens
   on four built-in prompts, must give the same tokens.
3. the sampler on the model's own distributions: p = the target's temperature-1 distribution
   at three positions of a real prompt; two deliberately bad drafts (a point mass on a token p
   rarely picks; q = the temperature-1.6 distribution, draws taken from q); N = 20,000 draws
   through `accept_or_resample` each; a chi-squared goodness-of-fit test of the emitted tokens
   against p over the whole vocabulary (cells with expected count < 5 pooled). Each test passes
   when its p-value exceeds alpha = 0.001 (six tests: a false alarm about 0.6% of the time; the
   seed is fixed, so a run repeats exactly).

The p-value is Q(df/2, x/2), the regularized upper incomplete gamma function, computed here
(series and continued fraction, Numerical Recipes 6.2): the runtime does not depend on scipy.

Exit status: 0 all checks passed, 1 a check failed, 2 a bad model directory, provider or option
(one line on stderr).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Sequence

import numpy as np

from .decode import SpeculativeOptions, plain_decode, speculative_decode_with
from .drafters.prompt_lookup import PromptLookupSpeculator
from .errors import InvalidOptionError, OrtspecError
from .sampling import DraftDist, accept_or_resample, warp

# verify-vs-step bounds, as export/validate.py's TOLERANCES.step_vs_verify (the runtime cannot
# import the export package): max(absolute, relative x the largest |logit|)
STEP_VS_VERIFY = {"fp32": (1e-4, 4e-6), "fp16": (0.0, 1e-2)}
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


# -- the chi-squared distribution, without scipy -------------------------------------------------

_MAX_ITER = 100_000
_EPS = 1e-15
_TINY = 1e-300


def regularized_gamma_q(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a), the regularized upper incomplete gamma function.

    a > 0, x >= 0. The power series of P = 1 - Q for x < a + 1, the continued fraction of Q
    (modified Lentz) otherwise; each converges fast in its region.
    """
    if not (a > 0 and math.isfinite(a)):
        raise ValueError(f"a must be finite and > 0, got {a!r}")
    if not x >= 0:  # NaN too
        raise ValueError(f"x must be >= 0, got {x!r}")
    if x == 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)  # log(e^-x x^a / Gamma(a))
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(_MAX_ITER):
            ap += 1.0
            term *= x / ap
            total += term
            if term < total * _EPS:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    b = x + 1.0 - a
    c = 1.0 / _TINY
    d = 1.0 / b
    h = d
    for i in range(1, _MAX_ITER):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = _TINY if abs(d) < _TINY else d
        c = b + an / c
        c = _TINY if abs(c) < _TINY else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            break
    return min(1.0, math.exp(log_prefactor) * h)


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-squared with `df` degrees of freedom: Q(df / 2, x / 2)."""
    if isinstance(df, bool) or not isinstance(df, (int, np.integer)) or df < 1:
        raise ValueError(f"df must be an integer >= 1, got {df!r}")
    return regularized_gamma_q(df / 2.0, max(0.0, float(x)) / 2.0)


@dataclasses.dataclass(frozen=True)
class ChiSquared:
    statistic: float
    df: int
    p_value: float
    cells: int  # after pooling
    outside_support: int  # draws of tokens with probability 0 (must be 0)


def chi_squared_test(observed: np.ndarray, expected_p: np.ndarray) -> ChiSquared:
    """Goodness of fit of counts `observed` [cells] to probabilities `expected_p` [cells].

    Every cell counts, drawn or not. Cells of probability 0 must be empty (any draw there makes
    the p-value 0). Cells with expected count < 5 are pooled into one; if that pool is itself
    below 5 it joins the smallest remaining cell.
    """
    observed = np.asarray(observed, dtype=np.float64)
    expected_p = np.asarray(expected_p, dtype=np.float64)
    if observed.shape != expected_p.shape or observed.ndim != 1:
        raise ValueError(f"observed {observed.shape} and expected {expected_p.shape} must be 1-D "
                         f"and the same length")
    n = observed.sum()
    zero = expected_p <= 0
    outside = int(observed[zero].sum())
    exp = n * expected_p[~zero] / expected_p[~zero].sum()
    obs = observed[~zero]
    small = exp < 5
    if small.any():
        pool_e, pool_o = exp[small].sum(), obs[small].sum()
        exp, obs = exp[~small], obs[~small]
        if pool_e >= 5 or exp.size == 0:
            exp, obs = np.append(exp, pool_e), np.append(obs, pool_o)
        else:
            i = int(np.argmin(exp))
            exp[i] += pool_e
            obs[i] += pool_o
    if exp.size < 2:  # one cell: nothing to test
        return ChiSquared(0.0, 0, 0.0 if outside else 1.0, int(exp.size), outside)
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = int(exp.size - 1)
    p = 0.0 if outside else chi2_sf(stat, df)
    return ChiSquared(stat, df, p, int(exp.size), outside)


# -- the checks ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckRow:
    name: str
    figure: str
    bound: str
    passed: bool


def _prompt_ids(model, text: str) -> list[int]:
    return model.encode(text, chat=model.manifest.chat_format is not None)


def check_verify_vs_step(model) -> CheckRow:
    """Max |logits(verify) - logits(step)| over a prompt of min(capacity, max(48,
    2 * max_verify_len + 5)) tokens (as export/validate.py does)."""
    dec = model.decoder
    n = min(dec.capacity, max(48, 2 * dec.max_verify_len + 5))
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
    absolute, relative = STEP_VS_VERIFY[model.manifest.dtype]
    bound = max(absolute, relative * float(np.abs(step).max()))
    return CheckRow(f"verify vs step logits ({n} positions)", f"max |diff| {diff:.2e}",
                    f"<= {bound:.1e}", diff <= bound)


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
    return [check_verify_vs_step(model), *check_greedy_identity(model, new_tokens),
            *check_sampler(model, draws=draws, seed=seed, alpha=alpha)]


# -- the command ---------------------------------------------------------------------------------


def build_parser():
    from .cli import UserErrorParser

    ap = UserErrorParser(prog="ortspec check",
                         description="check an export and provider for losslessness")
    ap.add_argument("--model", help="model directory (default: the exported default model)")
    ap.add_argument("--providers",
                    help="comma-separated, e.g. CUDAExecutionProvider,CPUExecutionProvider")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--draws", type=int, default=20_000, help="draws per sampler test")
    ap.add_argument("--new-tokens", type=int, default=48, help="tokens per greedy-identity prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alpha", type=float, default=ALPHA, help="significance level per test")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        for name, lo in (("draws", 100), ("new_tokens", 1), ("seed", 0)):
            v = getattr(args, name)
            if v < lo:
                raise InvalidOptionError(f"--{name.replace('_', '-')} must be >= {lo}, got {v}")
        if not 0 < args.alpha < 1:
            raise InvalidOptionError(f"--alpha must be in (0, 1), got {args.alpha}")
        return _run(args)
    except OrtspecError as e:
        print(f"ortspec: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from .cli import _model_arg, _providers_arg
    from .model import load_model

    t0 = time.perf_counter()
    path = _model_arg(args.model)
    model = load_model(path, providers=_providers_arg(args.providers), threads=args.threads)
    m = model.manifest
    print(f"ortspec check: {path} ({m.dtype}, capacity {m.capacity}, verify up to "
          f"{m.max_verify_len}) on {', '.join(model.decoder.providers)}", flush=True)
    rows = run_checks(model, draws=args.draws, seed=args.seed, new_tokens=args.new_tokens,
                      alpha=args.alpha)
    print(format_table(rows))
    failed = [r for r in rows if not r.passed]
    print(f"{len(rows) - len(failed)}/{len(rows)} checks passed "
          f"({time.perf_counter() - t0:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
