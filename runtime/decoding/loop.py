"""The decode loops: `plain_decode` (the reference) and `speculative_decode_with`.

Both keep the same invariant: the decoder's cache holds every token of the history except the
last one, the *pending* token. A step feeds the pending token, alone (a plain step) or followed
by k drafted tokens (one verify call of k + 1 tokens), and gets the target's logits for every
position it needs: row 0 judges the first draft, row k gives the bonus token. After the rule has
run, the cache is truncated to the history that survived and the last emitted token becomes
the new pending one. Because the last token is never fed, `prompt + new tokens` may reach
`capacity + 1` tokens.

`decode_steps` is the loop itself, a generator of the tokens each target call emits (a plain
step when there is no drafter); `plain_decode`, `speculative_decode_with` and
`speculative_decode` check their inputs (`check_decode_inputs`) and run it to the end.
`Model.start` checks a request once (`ortspec.runtime.request.check_request`) and iterates it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Generator, Iterator, Sequence

import numpy as np

from .counters import DecodeCounters
from ..errors import ConcurrentUseError, DrafterError
from .history import TokenHistory
from .options import FinishReason, SpeculativeDecodeResult, SpeculativeOptions, check_options, \
    check_prompt
from .protocols import Decoder, DraftLengthPolicy, Drafter, as_decoder, check_drafter
from .sampling import DraftBlock, sample_from, verify_block, warp
from ..validation import check_logits

Steps = Generator[list[int], None, SpeculativeDecodeResult]  # tokens per target call; the result

def check_decode_inputs(decoder: object, prompt: Sequence[int], options: object) -> list[int]:
    """What the decode entry points check before any work: the decoder's contract
    (`as_decoder`, DecoderContractError), the options' type (InvalidOptionError) and the prompt
    against the decoder's vocabulary and capacity (InvalidPromptError). Returns the prompt as a
    list of ints."""
    dec = as_decoder(decoder)
    check_options(options)
    return check_prompt(prompt, vocab_size=dec.vocab_size, capacity=dec.capacity)


def run_to_end(steps: Steps) -> SpeculativeDecodeResult:
    """Iterate `steps` to the end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def _prefill(decoder: Decoder, prompt: list[int], counters: DecodeCounters) -> int:
    """Reset, feed all but the last prompt token, return the pending token."""
    t0 = time.perf_counter()
    decoder.reset()
    if len(prompt) > 1:
        decoder.prefill(prompt[:-1])
    counters.prefill_tokens = len(prompt) - 1
    counters.prefill_seconds = time.perf_counter() - t0
    counters.model_seconds += counters.prefill_seconds
    return prompt[-1]


_claims_lock = threading.Lock()
_claimed: set[int] = set()  # id() of the decoders, drafters and policies a decode holds


@contextlib.contextmanager
def _claim(**objects: object) -> Iterator[None]:
    """Hold `objects` (a request's decoder, drafter, policy) for one decode: a second decode
    that reaches for any of them before this one ends is a ConcurrentUseError, never two
    requests interleaving one KV cache or one drafter's index."""
    items = {name: obj for name, obj in objects.items() if obj is not None}
    with _claims_lock:
        for name, obj in items.items():
            if id(obj) in _claimed:
                raise ConcurrentUseError(
                    f"this {name} ({type(obj).__name__}) is in use by another decode that has "
                    f"not finished; each concurrent request needs its own (Model.generate and "
                    f"Model.stream give every request its own decoder, drafter and policy)")
        ids = {id(obj) for obj in items.values()}  # one object may play two parts
        _claimed.update(ids)
    try:
        yield
    finally:
        with _claims_lock:
            _claimed.difference_update(ids)


def plain_decode(
    decoder: Decoder, prompt: Sequence[int], options: SpeculativeOptions
) -> SpeculativeDecodeResult:
    """One `forward_token` per new token, sampled from `warp(logits)`: the reference."""
    ids = check_decode_inputs(decoder, prompt, options)
    return run_to_end(decode_steps(decoder, ids, None, options))


def speculative_decode_with(
    decoder: Decoder,
    prompt: Sequence[int],
    drafter: Drafter,
    options: SpeculativeOptions,
    *,
    draft_length: DraftLengthPolicy | None = None,
) -> SpeculativeDecodeResult:
    """Speculative decoding with any drafter; the output is distributed exactly as `plain_decode`'s.
    """
    ids = check_decode_inputs(decoder, prompt, options)
    check_drafter(drafter)
    return run_to_end(decode_steps(decoder, ids, drafter, options, draft_length=draft_length))


def decode_steps(
    decoder: Decoder,
    prompt: list[int],
    drafter: Drafter | None,
    options: SpeculativeOptions,
    *,
    draft_length: DraftLengthPolicy | None = None,
    counters: DecodeCounters | None = None,
) -> Steps:
    """The decode loop as a generator of the tokens each target call emits; returns the
    `SpeculativeDecodeResult`. `drafter=None` is plain decoding (one `forward_token` per token);
    otherwise speculative decoding with `drafter`, whose output is distributed exactly as the
    plain decode's. `counters` (a fresh one by default) is filled in as the decode goes, so a
    caller that stops early still has the counts so far.

    The prompt and options are taken as checked (`check_decode_inputs`, or
    `ortspec.runtime.request.check_request` for a model's request); the decoder passes through
    `as_decoder` here, so a decoder with only the seven members of `Decoder` decodes too.

    Per request: `drafter.begin(options, draft_length)` and `draft_length.begin(options)`.
    Per step: unless the policy's `should_propose` says a plain step (it has lately judged no
    draft worth verifying while other requests share the calls), ask the drafter for up to k
    tokens (k bounded by `options.max_draft_len`, the
    tokens still wanted, the KV capacity and the decoder's `max_verify_len`; a drafter whose
    drafts cost model steps asks the policy's `limit` itself), keep the first
    `draft_length.choose(block)` of them, verify pending + drafts in one call, apply the rule,
    tell the policy the call's wall time (`observe_cost`) and outcome (`observe`), roll the
    cache back to what survived, hand the drafter the target's logits for the emitted positions
    (`observe_target`). An empty draft is a plain single-token step. The policy
    chooses from the history, the draft and what earlier steps showed, never from the random
    draws of the verify it sizes, so the output distribution is unchanged.

    The decoder (as given, before `as_decoder`), drafter and policy are held for the whole
    decode: another decode reaching for one of them meanwhile raises ConcurrentUseError.
    """
    held = decoder
    decoder = as_decoder(decoder)
    counters = counters if counters is not None else DecodeCounters()
    if drafter is None:
        return _plain_steps(decoder, held, prompt, options, counters)
    return _speculative_steps(decoder, held, prompt, drafter, options, draft_length, counters)


def _plain_steps(decoder: Decoder, held: object, prompt: list[int], options: SpeculativeOptions,
                 counters: DecodeCounters) -> Steps:
    with _claim(decoder=held):
        t_start = time.perf_counter()
        ort_start = decoder.ort_seconds
        rng = np.random.default_rng(options.seed)
        stops = frozenset(options.stop_token_ids)
        pending = _prefill(decoder, prompt, counters)
        new: list[int] = []
        finish: FinishReason = "length"
        while len(new) < options.max_new_tokens:
            if decoder.length + 1 > decoder.capacity:
                finish = "capacity"
                break
            t0 = time.perf_counter()
            logits = decoder.forward_token(pending)
            t1 = time.perf_counter()
            if options.temperature == 0:  # the point mass on the argmax, without building it
                check_logits(logits)
                tok = int(np.argmax(logits))
            else:
                p_target = warp(logits, temperature=options.temperature, top_k=options.top_k, top_p=options.top_p)
                tok = sample_from(p_target, rng)
            t2 = time.perf_counter()
            counters.model_seconds += t1 - t0
            counters.sample_seconds += t2 - t1
            counters.forward_token_calls += 1
            counters.bonus += 1
            new.append(tok)
            pending = tok
            yield [tok]
            if tok in stops:
                finish = "stop"
                break
        counters.total_seconds = time.perf_counter() - t_start
        counters.ort_seconds = decoder.ort_seconds - ort_start
        return SpeculativeDecodeResult(new, finish, counters)


def _speculative_steps(decoder: Decoder, held: object, prompt: list[int], drafter: Drafter,
                       options: SpeculativeOptions, draft_length: DraftLengthPolicy | None,
                       counters: DecodeCounters) -> Steps:
    with _claim(decoder=held, drafter=drafter, policy=draft_length):
        t_start = time.perf_counter()
        ort_start = decoder.ort_seconds
        rng = np.random.default_rng(options.seed)
        stops = frozenset(options.stop_token_ids)
        vocab = decoder.vocab_size
        verify_cap = decoder.max_verify_len
        history = TokenHistory(prompt)  # the drafter sees this list; it only ever grows
        drafter.begin(options, draft_length)
        if draft_length is not None:
            draft_length.begin(options)
        pending = _prefill(decoder, prompt, counters)
        n_new = 0
        finish: FinishReason = "length"
        while n_new < options.max_new_tokens:
            room = decoder.capacity - decoder.length  # tokens the cache can still take
            if room < 1:
                finish = "capacity"
                break
            k_max = min(options.max_new_tokens - n_new - 1, room - 1)
            if options.max_draft_len is not None:
                k_max = min(k_max, options.max_draft_len)
            if verify_cap is not None:
                k_max = min(k_max, verify_cap - 1)
            block = proposed = DraftBlock.empty()
            if k_max > 0 and (draft_length is None or draft_length.should_propose()):
                t0 = time.perf_counter()
                block = proposed = drafter.propose(history, k_max)
                _check_block(block, k_max, vocab)
                if draft_length is not None and len(block):
                    block = block.truncated(max(0, int(draft_length.choose(block))))
                counters.draft_seconds += time.perf_counter() - t0
            base = decoder.length
            t0 = time.perf_counter()
            if len(block):
                logits = decoder.forward_batch([pending, *block.tokens])  # [k + 1, vocab]
                counters.verify_calls += 1
            else:
                logits = decoder.forward_token(pending)[None, :]  # [1, vocab]
                counters.forward_token_calls += 1
            t1 = time.perf_counter()
            outcome = verify_block(
                logits, block, rng, temperature=options.temperature, top_k=options.top_k, top_p=options.top_p
            )
            counters.model_seconds += t1 - t0
            t2 = time.perf_counter()
            counters.sample_seconds += t2 - t1
            if draft_length is not None:
                draft_length.observe_cost(len(block) + 1, t2 - t0)
                first_accept_prob = None
                if not len(block) and len(proposed) and outcome.p_bonus is not None:
                    # the plain step's own target row says how likely the first draft was to pass
                    d0 = proposed.dists[0]
                    first_accept_prob = float(np.minimum(outcome.p_bonus[d0.token_ids], d0.probs).sum())
                draft_length.observe(proposed, len(block), outcome.n_accepted, outcome.tokens[0],
                                     first_accept_prob=first_accept_prob)
            # emit one by one: a stop token ends the decode even inside an accepted block
            emitted = 0
            for tok in outcome.tokens:
                history.append(tok)
                emitted += 1
                if tok in stops:
                    finish = "stop"
                    break
            n_new += emitted
            # the rows of the emitted positions, for a drafter that keeps the target's distributions
            t3 = time.perf_counter()
            drafter.observe_target(len(history) - emitted, logits[:emitted])
            counters.draft_seconds += time.perf_counter() - t3
            counters.count_block(block, min(outcome.n_accepted, emitted))
            if emitted > outcome.n_accepted:
                if outcome.recovered:
                    counters.recovered += 1
                else:
                    counters.bonus += 1
            # the cache keeps pending + the accepted drafts that were emitted, except the last
            # emitted token, which becomes the new pending one
            decoder.truncate(base + emitted)
            pending = history[-1]
            yield history[len(history) - emitted :]
            if finish == "stop":
                break
        counters.total_seconds = time.perf_counter() - t_start
        counters.ort_seconds = decoder.ort_seconds - ort_start
        return SpeculativeDecodeResult(history[len(prompt):], finish, counters)


def _check_block(block: DraftBlock, k_max: int, vocab: int) -> None:
    if not isinstance(block, DraftBlock):
        raise DrafterError(f"a drafter must return a DraftBlock, got {type(block).__name__}")
    if len(block) > k_max:
        raise DrafterError(f"the drafter returned {len(block)} tokens; at most {k_max} were allowed")
    if block.tokens and not (min(block.tokens) >= 0 and max(block.tokens) < vocab):
        i, t = next((i, t) for i, t in enumerate(block.tokens) if not 0 <= t < vocab)
        raise DrafterError(f"drafted token {i} is {t}; token ids must be in 0..{vocab - 1}")
    for i, d in enumerate(block.dists):
        # a point mass's one id is its token (DraftBlock checks it), checked just above
        if d.token_ids.size > 1 and int(d.token_ids.max()) >= vocab:
            raise DrafterError(
                f"draft distribution {i} has token id {int(d.token_ids.max())} >= vocab {vocab}"
            )


def speculative_decode(
    decoder: Decoder,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] = (),
    ngram_size: int = 3,
    max_draft_len: int = 8,
) -> SpeculativeDecodeResult:
    """Speculative decoding with prompt lookup: the common case in one call."""
    from ..drafters.prompt_lookup import PromptLookupSpeculator

    options = SpeculativeOptions(
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop_token_ids=tuple(stop_token_ids),
        max_draft_len=max_draft_len,
    )
    drafter = PromptLookupSpeculator(ngram_size=ngram_size, max_draft_len=max_draft_len)
    return speculative_decode_with(decoder, prompt, drafter, options)
