"""`Model`: shared sessions + tokenizer + chat format, ready to serve (made by `load_model`).

A `Model` holds what every request shares, read-only: the ONNX Runtime sessions (the weights,
packed once), the tokenizer, the manifest, and the cost-model policy's cross-request estimates
(guarded). Each call of `generate` or `stream` takes one request's state from a bounded pool
(`SlotPool`: KV buffers, bindings and cache length) and makes its own drafter and policy view,
so calls from several threads, and streams consumed alternately, give exactly what serial calls
give.

    model = load_model("models/exported/smollm2-135m-instruct-fp32")
    result = model.generate("Summarise: ...", chat=True, options=SpeculativeOptions(128))
    print(result.text, result.counters.mean_tokens_per_call)
    for piece in model.stream("Rewrite this function ...", chat=True):
        print(piece, end="", flush=True)
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any, Generator, Iterator, Sequence

from .ort import manifest as mf
from .decoding.counters import DecodeCounters
from .batching.backend import OrtBatchBackend
from .batching.rows import BatchRow
from .batching.runner import BatchRunner
from .batching.prefix_cache import DEFAULT_PREFIX_CACHE_MIB, MIB
from .draft_length.calibration import CalibrationKey, CostSurface, calibrated_cost_curve, \
    calibrated_cost_surface, step_cost_ratio
from .decoding.loop import DecodeStream, plain_decode_steps, speculative_decode_steps
from .decoding.options import SpeculativeDecodeResult, SpeculativeOptions
from .draft_length.policy import AdaptiveDraftLength, BatchCosts
from .drafters import DRAFTER_NAMES, NEEDS_DRAFT_MODEL
from .drafters.composite import CostAwareDrafter
from .drafters.draft_model import DEFAULT_DRAFT_CONTEXT, DraftModelDrafter, check_draft_context
from .drafters.prompt_lookup import PromptLookupSpeculator, check_lookup_sizes
from .drafters.ngram_counts import NgramCountsDrafter
from .drafters.target_cache import TargetCacheDrafter
from .errors import InvalidOptionError, InvalidPromptError
from .ort.decoder import OrtDecoder, kv_compatible
from .decoding.protocols import DraftLengthPolicy, Drafter
from .ort.sessions import OrtSessions
from .slots import DecodeSlot, SlotPool, WhenBusy

DEFAULT_MAX_CONCURRENT = 4  # decode slots a model makes at most unless told otherwise


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """A drafter by name with its options, made afresh for each request on the request's own
    slot by `Model.generate` and `stream` (as a bare name is): what to pass for a draft model
    drafter with options other than the defaults, since its draft decoder belongs to the slot."""

    name: str
    ngram_size: int = 3
    max_draft_len: int = 8
    draft_context: int | None = DEFAULT_DRAFT_CONTEXT


class Model:
    """A loaded model: shared sessions and tokenizer, per-request state from `slots`.

    `decoder` and `draft` are decoders of the caller's own (made on first use, outside the
    pool) for low-level work such as `plain_decode(model.decoder, ...)`; `generate` and
    `stream` never touch them. Like any decoder, each serves one request at a time.
    """

    def __init__(self, *, sessions: OrtSessions, tokenizer: Any, manifest: mf.Manifest, path: Path,
                 draft_sessions: OrtSessions | None = None, max_concurrent: int = DEFAULT_MAX_CONCURRENT,
                 when_busy: WhenBusy = "wait", busy_timeout: float | None = None,
                 batch: bool | None = None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_MIB * MIB) -> None:
        self.sessions = sessions
        self.tokenizer = tokenizer  # tokenizers.Tokenizer: encode/decode are read-only
        self.manifest = manifest
        self.path = path
        self.draft_sessions = draft_sessions
        # concurrent requests share one call a step when the graph takes several rows
        if batch is None:
            batch = manifest.max_batch > 1 and max_concurrent > 1
        self.runner: BatchRunner | None = None
        if batch:
            backend = OrtBatchBackend(sessions, max_rows=max_concurrent)
            self.runner = BatchRunner(backend, max_verify_len=sessions.max_verify_len,
                                      prefix_cache_bytes=prefix_cache_bytes)
            max_concurrent = backend.max_rows
        # a draft whose graph takes several rows batches the requests' draft steps likewise
        self.draft_runner: BatchRunner | None = None
        if self.runner is not None and draft_sessions is not None \
                and draft_sessions.manifest.max_batch > 1:
            draft_backend = OrtBatchBackend(draft_sessions, max_rows=max_concurrent)
            self.draft_runner = BatchRunner(draft_backend,
                                            max_verify_len=draft_sessions.max_verify_len,
                                            prefix_cache_bytes=prefix_cache_bytes)
            max_concurrent = min(max_concurrent, draft_backend.max_rows)
        self.slots = SlotPool(self._new_slot, max_slots=max_concurrent, when_busy=when_busy,
                              timeout=busy_timeout)
        self._surface: CostSurface | None = None
        self._draft_surface: CostSurface | None = None  # the draft runner's, when it batches
        self._lock = threading.Lock()  # guards the lazily made own decoders
        self._policy_lock = threading.Lock()  # held while the shared policy is made
        self._policy: AdaptiveDraftLength | None = None
        self._decoder: OrtDecoder | None = None
        self._draft: OrtDecoder | None = None

    @property
    def providers(self) -> list[str]:
        return self.sessions.providers

    @property
    def capacity(self) -> int:
        return self.sessions.capacity

    @property
    def decoder(self) -> OrtDecoder:
        """A target decoder of the caller's own, outside the pool."""
        with self._lock:
            if self._decoder is None:
                self._decoder = OrtDecoder.on(self.sessions)
            return self._decoder

    @property
    def draft(self) -> OrtDecoder | None:
        """A draft decoder of the caller's own (None without a draft model), with KV buffers of
        its own: a drafter made on it serves any target. (A request's slot pairs its draft with
        its target's buffers instead; `OrtDecoder.sharing_kv` does it by hand.)"""
        if self.draft_sessions is None:
            return None
        with self._lock:
            if self._draft is None:
                self._draft = OrtDecoder.on(self.draft_sessions)
            return self._draft

    @property
    def draft_shares_kv(self) -> bool:
        """A request's draft runs on its slot target's KV buffers (`OrtDecoder.sharing_kv`):
        same KV layout, and the target is not a row of a batch."""
        return (self.draft_sessions is not None and self.runner is None
                and kv_compatible(self.draft_sessions, self.sessions) is None)

    def check_drafter_spec(self, spec: DrafterSpec) -> None:
        """InvalidOptionError unless `spec` names a drafter this model can make with those
        options; `generate` and `stream` check it before decoding (the drafter is made on the
        request's slot)."""
        self._check_drafter_name(spec.name)
        check_lookup_sizes(spec.ngram_size, 1, spec.max_draft_len)
        if spec.name in NEEDS_DRAFT_MODEL:
            assert self.draft_sessions is not None  # _check_drafter_name saw the draft
            check_draft_context(spec.draft_context, capacity=self.draft_sessions.capacity,
                                follows=self.draft_shares_kv, name="draft_context")

    def _draft_for(self, target: OrtDecoder | Any) -> OrtDecoder | BatchRow:
        assert self.draft_sessions is not None
        if self.draft_runner is not None:
            return self.draft_runner.row()
        if self.draft_shares_kv:
            return OrtDecoder.sharing_kv(self.draft_sessions, target)
        return OrtDecoder.on(self.draft_sessions)

    @property
    def slot_bytes(self) -> int:
        """Memory one decode slot takes: KV buffers and logits buffers, target and draft (a
        draft on the target's KV buffers adds its logits buffer only)."""
        total = self.sessions.kv_bytes_per_decoder + self.sessions.logits_bytes_per_decoder
        if self.draft_sessions is not None:
            total += self.draft_sessions.logits_bytes_per_decoder
            if not self.draft_shares_kv:
                total += self.draft_sessions.kv_bytes_per_decoder
        return total

    def _new_slot(self) -> DecodeSlot:
        target = self.runner.row() if self.runner is not None else OrtDecoder.on(self.sessions)
        draft = self._draft_for(target) if self.draft_sessions is not None else None
        return DecodeSlot(target, draft)

    # -- text <-> tokens ------------------------------------------------------------------------

    def encode(self, text: str, *, chat: bool = False, system: str | None = None) -> list[int]:
        """Token ids for `text`; with `chat`, as one user turn through the chat format."""
        if not isinstance(text, str):
            raise InvalidPromptError(f"the prompt must be a string, got {type(text).__name__}")
        if chat:
            if self.manifest.chat_format is None:
                raise InvalidOptionError(f"{self.path} has no chat format; use chat=False")
            messages = [{"role": "user", "content": text}]
            if system is not None:
                messages.insert(0, {"role": "system", "content": system})
            text = self.manifest.chat_format.render(messages)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.manifest.bos_token_id
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        if not ids:
            raise InvalidPromptError("the prompt is empty; at least one token is needed")
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- generation -----------------------------------------------------------------------------

    def make_drafter(self, name: str = "prompt-lookup", *, ngram_size: int = 3, max_draft_len: int = 8,
                     draft_decoder: OrtDecoder | None = None,
                     draft_context: int | None = DEFAULT_DRAFT_CONTEXT) -> Drafter | None:
        """A drafter by name: one of DRAFTER_NAMES ("none" gives None: plain decoding).

        The draft-model drafters run on `draft_decoder` (default: `self.draft`, the caller's
        own); `generate` and `stream` make theirs per request on the request's slot. The draft
        model reads the last `draft_context` tokens of the history (None: all of it; see
        `DraftModelDrafter`)."""
        self._check_drafter_name(name)
        if name == "none":
            return None
        lookup = PromptLookupSpeculator(ngram_size=ngram_size, max_draft_len=max_draft_len)
        if name == "prompt-lookup":
            return lookup
        if name == "ngram-counts":
            return NgramCountsDrafter(ngram_size=ngram_size, max_draft_len=max_draft_len)
        if name == "target-cache":
            return TargetCacheDrafter(ngram_size=ngram_size, max_draft_len=max_draft_len)
        # (the draft's vocabulary was checked against the target's by load_model)
        model_drafter = DraftModelDrafter(draft_decoder or self.draft, max_draft_len=max_draft_len,
                                          prior=self._draft_agreement(), context=draft_context)
        return model_drafter if name == "draft-model" else CostAwareDrafter(lookup, model_drafter)

    def _check_drafter_name(self, name: str) -> None:
        if name not in DRAFTER_NAMES:
            raise InvalidOptionError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTER_NAMES)}")
        if name in NEEDS_DRAFT_MODEL and self.draft_sessions is None:
            raise InvalidOptionError(
                f"drafter {name!r} needs a draft model: export one with "
                f"`ortspec export --draft-quant int4` or `--draft-layers N`, then load_model(path, draft=...)"
            )

    def _draft_agreement(self) -> float | None:
        """The top-1 agreement with the target that the draft's export measured, if recorded."""
        if self.draft_sessions is None:
            return None
        agreement = self.draft_sessions.manifest.extra.get("agreement", {}).get("top1")
        return float(agreement) if isinstance(agreement, (int, float)) else None

    def _prepare(self, prompt: str | Sequence[int], options: SpeculativeOptions | None, chat: bool,
                 system: str | None) -> tuple[list[int], SpeculativeOptions]:
        ids = self.encode(prompt, chat=chat, system=system) if isinstance(prompt, str) else list(prompt)
        if options is None:
            options = SpeculativeOptions(max_new_tokens=128)
        if not options.stop_token_ids:
            options = dataclasses.replace(options, stop_token_ids=self.manifest.stop_token_ids)
        return ids, options

    def draft_length_policy(self, *, refresh: bool = False) -> AdaptiveDraftLength:
        """The cost-model draft-length policy whose estimates `generate` and `stream` share.

        Made on first use (the cost curve is read from the calibration cache, or measured in a
        few seconds on a slot of the pool) and shared by this model's requests, each through a
        `for_request()` view, so what it learns about acceptance and call costs carries over,
        as in a server. `refresh` re-measures the curve."""
        with self._policy_lock:  # one thread measures; the others wait for its policy
            if self._policy is not None and not refresh:
                return self._policy
            with self.slots.slot() as slot:  # measured on request state, never a running request's
                key = _calibration_key(self.sessions)
                curve = calibrated_cost_curve(slot.decoder, key, refresh=refresh)
                draft_cost = 0.0
                if slot.draft is not None:
                    # timings taken at different moments are not comparable on a drifting
                    # machine: the draft's step is measured against the target's, interleaved
                    draft_cost = step_cost_ratio(slot.draft, slot.decoder) * curve.cost(1)
            if self.runner is not None:
                self._surface = self.runner.exclusive(
                    lambda backend, floors: calibrated_cost_surface(
                        backend, key, max_len=self.runner.max_verify_len, floors=floors,
                        refresh=refresh))
            if self.draft_runner is not None:  # its one-token calls by rows: d(B, 1)
                draft_key = _calibration_key(self.draft_sessions)
                self._draft_surface = self.draft_runner.exclusive(
                    lambda backend, floors: calibrated_cost_surface(
                        backend, draft_key, max_len=1, floors=floors, refresh=refresh))
            self._policy = AdaptiveDraftLength(curve, draft_step_seconds=draft_cost)
            return self._policy

    def _request_policy(self, draft_length: Any, options: SpeculativeOptions
                        ) -> DraftLengthPolicy | None:
        if draft_length != "auto":
            return draft_length
        shared = self.draft_length_policy()
        if options.seed is not None and options.temperature > 0:
            return shared.for_seeded_request()  # the seed fixes the output
        if self.runner is not None and self._surface is not None:
            runner = self.runner
            return shared.for_batch_row(BatchCosts(self._surface, lambda: runner.active_rows,
                                                   draft=self._draft_surface))
        return shared.for_request()

    def _check_request(self, drafter: Any, draft_length: Any) -> None:
        """What a request can get wrong, checked when it is made, before any decoding."""
        if isinstance(drafter, str):
            self._check_drafter_name(drafter)
        if isinstance(drafter, DrafterSpec):
            self.check_drafter_spec(drafter)
        if isinstance(draft_length, str) and draft_length != "auto":
            raise InvalidOptionError(
                f"draft_length must be 'auto' (the cost model), None (always verify the whole "
                f"draft) or a policy object; got {draft_length!r}")

    def _steps(self, ids: list[int], drafter: Drafter | str | DrafterSpec | None, options: SpeculativeOptions,
               draft_length: Any, counters: DecodeCounters | None = None
               ) -> Generator[list[int], None, SpeculativeDecodeResult]:
        """One request: its policy view, then a slot, then its drafter, then the decode loop.
        The slot goes back to the pool when the decode ends, fails or is abandoned."""
        if drafter == "none" or (isinstance(drafter, DrafterSpec) and drafter.name == "none"):
            drafter = None
        policy = self._request_policy(draft_length, options) if drafter is not None else None
        with self.slots.slot() as slot:
            if isinstance(drafter, str):
                drafter = DrafterSpec(drafter)
            if isinstance(drafter, DrafterSpec):
                drafter = self.make_drafter(drafter.name, ngram_size=drafter.ngram_size,
                                            max_draft_len=drafter.max_draft_len,
                                            draft_context=drafter.draft_context,
                                            draft_decoder=slot.draft)
            if drafter is None:
                return (yield from plain_decode_steps(slot.decoder, ids, options, counters=counters))
            return (yield from speculative_decode_steps(slot.decoder, ids, drafter, options,
                                                        draft_length=policy, counters=counters))

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        drafter: Drafter | str | DrafterSpec | None = "prompt-lookup",
        options: SpeculativeOptions | None = None,
        chat: bool = False,
        system: str | None = None,
        draft_length: Any = "auto",
    ) -> SpeculativeDecodeResult:
        """Decode `prompt` (text, or token ids) with `drafter` (a name from DRAFTER_NAMES, a
        `DrafterSpec`, a drafter object, or None: plain decoding). A name or a spec makes the
        drafter on the request's own slot, whose draft decoder runs on the slot's KV buffers
        (`draft_shares_kv`); a drafter object built on `model.draft` has buffers of its own.

        `options.stop_token_ids` defaults to the model's; `result.text` holds the decoded text.
        `draft_length`: "auto" (default) lets the model's cost-model policy pick how many drafted
        tokens to verify each step (`draft_length_policy()`); None verifies every draft whole;
        or any `DraftLengthPolicy`. The model's policy learns across requests and from timed
        calls; a request with a seed above temperature 0 gets a copy that learns from that
        request alone and times nothing, so the same seed gives the same output (the
        distribution is exact either way).

        Safe to call from several threads: each call takes a decode slot (waiting or failing
        with ModelBusyError when all are taken, as `load_model`'s `when_busy` says). A drafter
        or policy object passed in serves one request at a time.
        """
        self._check_request(drafter, draft_length)
        ids, options = self._prepare(prompt, options, chat, system)
        result = DecodeStream(self._steps(ids, drafter, options, draft_length)).run()
        result.text = self.decode(result.tokens)
        return result

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        drafter: Drafter | str | DrafterSpec | None = "prompt-lookup",
        options: SpeculativeOptions | None = None,
        chat: bool = False,
        system: str | None = None,
        draft_length: Any = "auto",
    ) -> "TextStream":
        """Like `generate`, yielding text as tokens are accepted; `.result` when done. The slot
        is taken at the first iteration and given back when the stream ends or is closed.
        `.tokens` and `.counters` hold what was emitted and counted so far, also after the
        caller stopped early (a stop string, a client gone)."""
        self._check_request(drafter, draft_length)
        ids, options = self._prepare(prompt, options, chat, system)
        counters = DecodeCounters()
        return TextStream(self, DecodeStream(self._steps(ids, drafter, options, draft_length, counters)),
                          counters)


class TextStream:
    """Yields decoded text pieces; holds back an incomplete UTF-8 sequence until it completes."""

    def __init__(self, model: Model, stream: DecodeStream, counters: DecodeCounters) -> None:
        self._model, self._stream = model, stream
        self.result: SpeculativeDecodeResult | None = None
        self.tokens: list[int] = []  # emitted so far
        self.counters = counters  # filled in as the decode goes

    def __iter__(self) -> Iterator[str]:
        # incremental detokenisation: decode only the tokens since the last piece (plus the one
        # before, for tokenizers whose pieces depend on their left neighbour), not the whole text
        tokens = self.tokens
        prefix = read = 0  # tokens[prefix:read] is the text already shown, decoded on its own
        shown = 0  # characters yielded
        for new in self._stream:
            tokens.extend(new)
            before = self._model.decode(tokens[prefix:read])
            after = self._model.decode(tokens[prefix:])
            if len(after) > len(before) and not after.endswith("\ufffd"):  # not mid-character
                piece = after[len(before):]
                shown += len(piece)
                yield piece
                prefix, read = read, len(tokens)
        self.result = self._stream.result
        assert self.result is not None
        self.result.text = self._model.decode(self.result.tokens)
        if len(self.result.text) > shown:  # a character completed by the last token
            yield self.result.text[shown:]


def _calibration_key(sessions: OrtSessions) -> CalibrationKey:
    """What the cost curve or surface measured on these sessions' calls is cached under."""
    return CalibrationKey(str(sessions.model_dir), sessions.graph_digest, tuple(sessions.providers),
                          sessions.intra_op_threads, sessions.min_call_rows)
