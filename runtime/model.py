"""`Model`: shared sessions + tokenizer + chat format, ready to serve (made by `load_model`).

A `Model` holds what every request shares, read-only: the ONNX Runtime sessions (the weights,
packed once), the tokenizer, the manifest, and the cost model (`costs.ModelCosts`: the
draft-length policy's cross-request estimates, guarded). A request is `start`: it checks the
request (`request.check_request`), makes the request's policy view, and returns a
`stream.TokenStream`, which takes one request's state from a
bounded pool (`SlotPool`: KV buffers, bindings and cache length) when it is first iterated,
makes its drafter on it, and runs the decode loop (`decoding.loop.decode_steps`): two layers
from `Model` to the loop. `generate` runs a stream to its end; `stream` is its text
(`text.TextStream`). Calls from several threads, and streams consumed alternately, give exactly
what serial calls give.

Set-up happens up front and visibly: `prepare()` (or `load_model(..., calibrate=True)`) reads or
measures the cost curve; a `start` that needs it before then prepares before it returns, never
inside the stream. A draft model the manifest lists is loaded by the first request that needs
it, once (`load_draft`).

    model = load_model("models/exported/smollm2-135m-instruct-fp32", calibrate=True)
    result = model.generate("Summarise: ...", chat=True, options=SpeculativeOptions(128))
    print(result.text, result.counters.mean_tokens_per_call)
    for piece in model.stream("Rewrite this function ...", chat=True):
        print(piece, end="", flush=True)
    stream = model.start("Count to ten.", chat=True)    # token ids, a list per target call
    for ids in stream:
        ...
    print(stream.result.counters.acceptance_rate)
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from .ort import manifest as mf
from .batching.backend import OrtBatchBackend
from .batching.rows import BatchRow
from .batching.runner import BatchRunner
from .batching.prefix_cache import DEFAULT_PREFIX_CACHE_MIB, MIB, SharedPrefixCache
from .decoding.options import SpeculativeDecodeResult, SpeculativeOptions, is_token_sequence
from .draft_length.policy import AdaptiveDraftLength
from .drafters import NEEDS_DRAFT_HEAD, NEEDS_DRAFT_MODEL
from .drafters.composite import CostAwareDrafter
from .drafters.eagle3 import Eagle3Drafter
from .drafters.draft_model import DEFAULT_DRAFT_CONTEXT, DraftModelDrafter
from .drafters.prompt_lookup import PromptLookupSpeculator
from .drafters.ngram_counts import NgramCountsDrafter
from .drafters.target_cache import TargetCacheDrafter
from .errors import InvalidOptionError, InvalidPromptError
from .ort.decoder import OrtDecoder, kv_compatible
from .ort.head import HeadSessions, OrtDraftHead
from .decoding.protocols import Drafter
from .ort.sessions import OrtSessions
from .request import DrafterSpec, ModelFacts, check_drafter_spec, check_request, drafter_spec
from .slots import DecodeSlot, SlotPool, WhenBusy
from .decoding.text import TextStream
from .stream import TokenStream
from .costs import ModelCosts

DEFAULT_MAX_CONCURRENT = 4  # decode slots a model makes at most unless told otherwise
EAGLE3_MAX_DRAFT = 4  # the longest chain an eagle3 drafter drafts (EAGLE-3's training depth)


@dataclasses.dataclass(frozen=True)
class ListedDraft:
    """A draft model the target's manifest lists, not loaded yet: `open()` reads and checks its
    manifest and its pairing with the target, and opens its sessions with the providers and
    threads the target was loaded with. `Model.load_draft` calls it once. `max_batch`: the rows
    its graph takes, which bounds a batching model's pool."""

    path: Path
    max_batch: int
    open: Callable[[], OrtSessions]


class Model:
    """A loaded model: shared sessions and tokenizer, per-request state from `slots`.

    `decoder` and `draft` are decoders of the caller's own (made on first use, outside the
    pool) for low-level work such as `plain_decode(model.decoder, ...)`; requests never touch
    them. Like any decoder, each serves one request at a time.
    """

    def __init__(self, *, sessions: OrtSessions, tokenizer: Any, manifest: mf.Manifest, path: Path,
                 draft_sessions: OrtSessions | None = None, listed_draft: ListedDraft | None = None,
                 max_concurrent: int = DEFAULT_MAX_CONCURRENT,
                 when_busy: WhenBusy = "wait", busy_timeout: float | None = None,
                 batch: bool | None = None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_MIB * MIB) -> None:
        self.sessions = sessions
        self.tokenizer = tokenizer  # tokenizers.Tokenizer: encode/decode are read-only
        self.manifest = manifest
        self.path = path
        self.draft_sessions: OrtSessions | None = None  # set by _attach_draft
        self.listed_draft = listed_draft if draft_sessions is None else None
        self._prefix_cache_bytes = prefix_cache_bytes
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
            # (a listed draft too, when it loads): the pool holds no more rows than it takes
            draft_rows = draft_sessions.manifest.max_batch if draft_sessions is not None else \
                listed_draft.max_batch if listed_draft is not None else 1
            if draft_rows > 1:
                max_concurrent = min(max_concurrent, draft_rows)
        # a model decoding each request on calls of its own: its slots' prefills share one
        # prefix cache, where a position computes alike in any call (`OrtSessions.rows_exact`)
        self.prefixes: SharedPrefixCache | None = None
        if self.runner is None and prefix_cache_bytes and sessions.rows_exact:
            self.prefixes = SharedPrefixCache(prefix_cache_bytes)
        self.draft_runner: BatchRunner | None = None
        self.slots = SlotPool(self._new_slot, max_slots=max_concurrent, when_busy=when_busy,
                              timeout=busy_timeout)
        if draft_sessions is not None:
            self._attach_draft(draft_sessions)
        self._lock = threading.Lock()  # guards the lazily made own decoders
        self._draft_lock = threading.Lock()  # held while a listed draft loads
        self._decoder: OrtDecoder | None = None
        self._draft: OrtDecoder | None = None
        self._head_lock = threading.Lock()  # held while the draft head's sessions open
        self._head_sessions: HeadSessions | None = None
        self.costs = ModelCosts(self)  # the cost model: prepared once, shared by requests

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
        """A draft decoder of the caller's own (None while no draft model is loaded), with KV
        buffers of its own: a drafter made on it serves any target. (A request's slot pairs its
        draft with its target's buffers instead; `OrtDecoder.sharing_kv` does it by hand.)"""
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

    # -- the draft model ------------------------------------------------------------------------

    def load_draft(self) -> OrtSessions | None:
        """The draft model's sessions: the one loaded, else the one the manifest lists
        (`listed_draft`), opened now, once (concurrent first requests wait for one load); None
        without either. From then on each slot's memory includes the draft's (`slot_bytes`),
        and the cost model, if prepared, prices a draft step as measured against the target's.
        `start` calls it for a request whose drafter needs a draft, before returning."""
        if self.draft_sessions is not None or self.listed_draft is None:
            return self.draft_sessions
        with self._draft_lock:
            if self.draft_sessions is None:
                self._attach_draft(self.listed_draft.open())
                self.costs.draft_loaded()
        return self.draft_sessions

    def _attach_draft(self, draft_sessions: OrtSessions) -> None:
        if self.runner is not None and draft_sessions.manifest.max_batch > 1:
            draft_backend = OrtBatchBackend(draft_sessions, max_rows=self.slots.max_slots)
            self.draft_runner = BatchRunner(draft_backend,
                                            max_verify_len=draft_sessions.max_verify_len,
                                            prefix_cache_bytes=self._prefix_cache_bytes)
        self.draft_sessions = draft_sessions  # last: a request that sees it sees the runner

    def _draft_for(self, target: OrtDecoder | Any) -> OrtDecoder | BatchRow:
        assert self.draft_sessions is not None
        if self.draft_runner is not None:
            return self.draft_runner.row()
        if self.draft_shares_kv:
            return OrtDecoder.sharing_kv(self.draft_sessions, target)
        return OrtDecoder.on(self.draft_sessions)

    def slot_draft(self, slot: DecodeSlot) -> OrtDecoder | BatchRow | None:
        """The slot's draft decoder; made now for a slot made before the draft loaded."""
        if slot.draft is None and self.draft_sessions is not None:
            slot.draft = self._draft_for(slot.decoder)
        return slot.draft

    @property
    def slot_bytes(self) -> int:
        """Memory one decode slot takes: KV buffers and logits buffers, target and draft (a
        draft on the target's KV buffers adds its logits buffer only; a listed draft counts
        once it is loaded)."""
        total = self.sessions.kv_bytes_per_decoder + self.sessions.logits_bytes_per_decoder
        if self.draft_sessions is not None:
            total += self.draft_sessions.logits_bytes_per_decoder
            if not self.draft_shares_kv:
                total += self.draft_sessions.kv_bytes_per_decoder
        return total

    def prefix_counts(self) -> tuple[int, int] | None:
        """(prompt tokens looked up in the prefix cache, those found there), the batch
        runner's or the slots' cache; None without a prefix cache."""
        if self.runner is not None and self.runner.prefixes is not None:
            return self.runner.stats.prefix_snapshot()
        return self.prefixes.snapshot() if self.prefixes is not None else None

    def _new_slot(self) -> DecodeSlot:
        target = self.runner.row() if self.runner is not None else \
            OrtDecoder.on(self.sessions, prefixes=self.prefixes)
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

    # -- drafters -------------------------------------------------------------------------------

    def facts(self) -> ModelFacts:
        """What `request.check_request` checks a request against: vocabulary, capacity, draft."""
        draft = self.draft_sessions
        return ModelFacts(vocab_size=self.sessions.vocab_size, capacity=self.capacity,
                          path=str(self.path),
                          has_draft=draft is not None or self.listed_draft is not None,
                          draft_capacity=draft.capacity if draft is not None else None,
                          draft_follows=self.draft_shares_kv,
                          has_draft_head=self.manifest.draft_head is not None)

    @property
    def default_drafter(self) -> str:
        """The drafter "auto" (the default of `start`, the CLI and the server) stands for:
        "eagle3" on a model whose manifest lists a trained draft head and that decodes each
        request on its own calls, "prompt-lookup" otherwise."""
        if self.manifest.draft_head is not None and self.runner is None:
            return "eagle3"
        return "prompt-lookup"

    def load_head(self) -> HeadSessions:
        """The sessions of the draft head the manifest lists, opened on first use, once
        (concurrent first requests wait for one load), with the target's providers and
        threads; every request's head (`OrtDraftHead.on`) shares them. `start` calls it for a
        request whose drafter needs the head, before returning."""
        if self.manifest.draft_head is None:
            raise InvalidOptionError(f"{self.path} lists no draft head (export it with "
                                     f"`ortspec export SOURCE --draft-head HEAD_DIR`)")
        with self._head_lock:
            if self._head_sessions is None:
                self._head_sessions = HeadSessions(
                    self.path / self.manifest.draft_head, providers=self.sessions.providers,
                    threads=self.sessions.intra_op_threads)
        return self._head_sessions

    def check_drafter_spec(self, spec: DrafterSpec) -> None:
        """InvalidOptionError unless `spec` names a drafter this model can make with those
        options (`request.check_drafter_spec`); `start` checks it before decoding (the drafter
        is made on the request's slot)."""
        if spec.name in NEEDS_DRAFT_MODEL:
            self.load_draft()
        check_drafter_spec(spec, self.facts())

    def make_drafter(self, name: str = "auto", *, ngram_size: int = 3, max_draft_len: int = 8,
                     draft_decoder: OrtDecoder | BatchRow | None = None,
                     draft_context: int | None = DEFAULT_DRAFT_CONTEXT,
                     target: OrtDecoder | BatchRow | None = None) -> Drafter | None:
        """A drafter by name: one of DRAFTER_NAMES ("none" gives None: plain decoding; "auto"
        the model's `default_drafter`).

        The draft-model drafters run on `draft_decoder` (default: `self.draft`, the caller's
        own, the listed draft loaded first if need be); requests make theirs on their own
        slots. The draft model reads the last `draft_context` tokens of the history (None: all
        of it; see `DraftModelDrafter`). The eagle3 drafters read the hidden states of
        `target`, the decoder the request decodes on (default: `self.decoder`), with a head of
        their own over the shared head sessions (`load_head`)."""
        if name == "auto":
            name = self.default_drafter
        if draft_decoder is None and name in NEEDS_DRAFT_MODEL:
            self.load_draft()
        check_drafter_spec(DrafterSpec(name), self.facts())
        if name == "none":
            return None
        lookup = PromptLookupSpeculator(ngram_size=ngram_size, max_draft_len=max_draft_len)
        if name == "prompt-lookup":
            return lookup
        if name in NEEDS_DRAFT_HEAD:
            source = target if target is not None else self.decoder
            head_drafter = Eagle3Drafter(source, OrtDraftHead.on(self.load_head()),
                                         max_draft_len=min(max_draft_len, EAGLE3_MAX_DRAFT))
            return head_drafter if name == "eagle3" else CostAwareDrafter(lookup, head_drafter)
        if name == "ngram-counts":
            return NgramCountsDrafter(ngram_size=ngram_size, max_draft_len=max_draft_len)
        if name == "target-cache":
            return TargetCacheDrafter(ngram_size=ngram_size, max_draft_len=max_draft_len)
        # (the draft's vocabulary was checked against the target's by load_model)
        model_drafter = DraftModelDrafter(draft_decoder or self.draft, max_draft_len=max_draft_len,
                                          prior=self._draft_agreement(), context=draft_context)
        return model_drafter if name == "draft-model" else CostAwareDrafter(lookup, model_drafter)

    def slot_drafter(self, slot: DecodeSlot, drafter: Drafter | DrafterSpec | None
                     ) -> Drafter | None:
        """A request's drafter on its slot (`stream.StreamHost`): a `DrafterSpec` is made on the
        slot's target and draft decoders; a drafter object (or None) is the request's own."""
        if not isinstance(drafter, DrafterSpec):
            return drafter
        return self.make_drafter(drafter.name, ngram_size=drafter.ngram_size,
                                 max_draft_len=drafter.max_draft_len,
                                 draft_context=drafter.draft_context,
                                 draft_decoder=self.slot_draft(slot), target=slot.decoder)

    def _draft_agreement(self) -> float | None:
        """The top-1 agreement with the target that the draft's export measured, if recorded."""
        if self.draft_sessions is None:
            return None
        agreement = self.draft_sessions.manifest.extra.get("agreement", {}).get("top1")
        return float(agreement) if isinstance(agreement, (int, float)) else None

    # -- the cost model -------------------------------------------------------------------------

    @property
    def prepared(self) -> bool:
        """Whether the cost model is ready (`prepare` has run)."""
        return self.costs.policy is not None

    def prepare(self, *, refresh: bool = False) -> AdaptiveDraftLength:
        """Make the cost-model draft-length policy (`costs.ModelCosts.prepare`): read the cost
        curve from the calibration cache, or measure it (a few seconds) on a slot of the pool,
        with the draft's step cost and, for a batching model, the cost surface. Once per model
        (`refresh` measures again); `load_model(..., calibrate=True)` and every command-line
        command call it before the first request, and a `start` that needs it before then calls
        it before returning its stream. Returns the policy (`draft_length_policy`)."""
        return self.costs.prepare(refresh=refresh)

    def draft_length_policy(self, *, refresh: bool = False) -> AdaptiveDraftLength:
        """The cost-model draft-length policy whose estimates requests share (`prepare` makes
        it): each request gets a `for_request()` view, so what it learns about acceptance and
        call costs carries over, as in a server. `refresh` re-measures the curve."""
        return self.prepare(refresh=refresh)

    # -- requests -------------------------------------------------------------------------------

    def start(
        self,
        prompt: str | Sequence[int],
        *,
        drafter: Drafter | str | DrafterSpec | None = "auto",
        options: SpeculativeOptions | None = None,
        chat: bool = False,
        system: str | None = None,
        draft_length: Any = "auto",
    ) -> TokenStream:
        """Start one request: check it, make its policy view, and return its `TokenStream`.

        `prompt`: text (encoded, through the chat format with `chat`, `system` as a system
        turn) or token ids. `drafter`: a name from DRAFTER_NAMES, a `DrafterSpec`, a drafter
        object, or None (plain decoding); "auto" (the default) is the model's `default_drafter`
        (eagle3 where the manifest lists a draft head); a name or a spec makes the drafter on the request's own
        slot, whose draft decoder runs on the slot's KV buffers (`draft_shares_kv`); a drafter
        object built on `model.draft` has buffers of its own. A draft-model drafter on a model
        whose manifest lists a draft loads that draft first, once (`load_draft`).
        `options.stop_token_ids` defaults to the model's. `draft_length`: "auto" (default) lets
        the model's cost-model policy pick how many drafted tokens to verify each step; None
        verifies every draft whole; or any `DraftLengthPolicy`. The model's policy learns across
        requests and from timed calls; a request with a seed above temperature 0 gets a copy
        that learns from that request alone and times nothing, so the same seed gives the same
        output (the distribution is exact either way).

        Everything is checked here (`request.check_request`), and the set-up the request needs
        (the listed draft, the cost model if not prepared) is done here, before the stream is
        returned. The stream takes a decode slot when it is first iterated (waiting or failing
        with ModelBusyError when all are taken, as `load_model`'s `when_busy` says) and gives it
        back when it ends, fails or is closed. Safe to call from several threads; a drafter or
        policy object passed in serves one request at a time.
        """
        if isinstance(prompt, str):
            ids = self.encode(prompt, chat=chat, system=system)
        elif not is_token_sequence(prompt):
            raise InvalidPromptError(f"the prompt must be a string or a sequence of token ids, "
                                     f"got {type(prompt).__name__}")
        else:
            ids = prompt
        if options is None:
            options = SpeculativeOptions(max_new_tokens=128)
        if isinstance(options, SpeculativeOptions) and not options.stop_token_ids:
            options = dataclasses.replace(options, stop_token_ids=self.manifest.stop_token_ids)
        spec = drafter_spec(drafter)
        if spec is not None and spec.name == "auto":
            spec = dataclasses.replace(spec, name=self.default_drafter)
        if spec is not None and spec.name == "none":
            drafter = spec = None
        if spec is not None and spec.name in NEEDS_DRAFT_MODEL:
            self.load_draft()
        if spec is not None and spec.name in NEEDS_DRAFT_HEAD \
                and self.manifest.draft_head is not None:
            self.load_head()
        ids = check_request(ids, options, drafter=spec or drafter, draft_length=draft_length,
                            facts=self.facts())
        assert ids is not None
        policy = self.costs.request_policy(draft_length, options) if drafter is not None else None
        return TokenStream(self, ids, spec or drafter, options, policy)

    def generate(self, prompt: str | Sequence[int], **request: Any) -> SpeculativeDecodeResult:
        """`start(prompt, **request)` run to its end: the result, with the decoded text in
        `result.text`. `request` takes `start`'s keywords (drafter, options, chat, system,
        draft_length)."""
        stream = self.start(prompt, **request)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: str | Sequence[int], **request: Any) -> TextStream:
        """`start(prompt, **request)`'s tokens as text: iterating yields text pieces as tokens
        are accepted (`text.detokenize`); `.result` when done. The slot is taken at the first
        iteration and given back when the stream ends or is closed. `.tokens` and `.counters`
        hold what was emitted and counted so far, also after the caller stopped early (a stop
        string, a client gone)."""
        return TextStream(self.start(prompt, **request), self.decode)
