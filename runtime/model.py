"""`load_model`: a model directory -> decoder + tokenizer + chat format, ready to generate.

    model = load_model("models/exported/smollm2-135m-instruct-fp32")
    result = model.generate("Summarise: ...", chat=True, options=SpeculativeOptions(128))
    print(result.text, result.counters.mean_tokens_per_call)
    for piece in model.stream("Rewrite this function ...", chat=True):
        print(piece, end="", flush=True)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

from . import manifest as mf
from .decode import (
    DecodeStream,
    SpeculativeDecodeResult,
    SpeculativeOptions,
    plain_decode_steps,
    speculative_decode_steps,
)
from .draft_length import AdaptiveDraftLength
from .drafters.prompt_lookup import PromptLookupSpeculator
from .errors import InvalidOptionError, InvalidPromptError
from .ort_decoder import OrtDecoder
from .protocols import Drafter

DRAFTER_NAMES = ("prompt-lookup", "none", "draft-model", "prompt-lookup+draft-model")


@dataclasses.dataclass
class Model:
    decoder: OrtDecoder
    tokenizer: Any  # tokenizers.Tokenizer
    manifest: mf.Manifest
    path: Path
    draft: OrtDecoder | None = None  # a self-speculative draft exported beside the target
    _policy: Any = dataclasses.field(default=None, repr=False)  # draft_length_policy()'s, once made

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

    def make_drafter(self, name: str = "prompt-lookup", *, ngram_size: int = 3, max_draft_len: int = 8) -> Drafter | None:
        """A drafter by name: one of DRAFTER_NAMES ("none" gives None: plain decoding)."""
        if name == "none":
            return None
        if name == "prompt-lookup":
            return PromptLookupSpeculator(ngram_size=ngram_size, max_draft_len=max_draft_len)
        if name in ("draft-model", "prompt-lookup+draft-model"):
            from .drafters.composite import FallbackDrafter
            from .drafters.draft_model import DraftModelDrafter

            if self.draft is None:
                raise InvalidOptionError(
                    f"drafter {name!r} needs a draft model: export one with "
                    f"`ortspec export --draft-quant int4` or `--draft-layers N`, then load_model(path, draft=...)"
                )
            model_drafter = DraftModelDrafter(self.draft, max_draft_len=max_draft_len, target=self.decoder)
            if name == "draft-model":
                return model_drafter
            lookup = PromptLookupSpeculator(ngram_size=ngram_size, max_draft_len=max_draft_len)
            return FallbackDrafter([lookup, model_drafter])
        raise InvalidOptionError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTER_NAMES)}")

    def _prepare(self, prompt: str | Sequence[int], options: SpeculativeOptions | None, chat: bool,
                 system: str | None) -> tuple[list[int], SpeculativeOptions]:
        ids = self.encode(prompt, chat=chat, system=system) if isinstance(prompt, str) else list(prompt)
        if options is None:
            options = SpeculativeOptions(max_new_tokens=128)
        if not options.stop_token_ids:
            options = dataclasses.replace(options, stop_token_ids=self.manifest.stop_token_ids)
        return ids, options

    def draft_length_policy(self, *, refresh: bool = False) -> AdaptiveDraftLength:
        """The cost-model draft-length policy that `generate` and `stream` use by default.

        Made on first use (the cost curve is read from the calibration cache, or measured in a
        few seconds) and shared by this model's requests, so what it learns about acceptance and
        call costs carries over, as in a server. `refresh` re-measures the curve."""
        if self._policy is None or refresh:
            self._policy = AdaptiveDraftLength.for_model(self, refresh=refresh)
        return self._policy

    def _steps(self, ids: list[int], drafter: Drafter | str | None, options: SpeculativeOptions,
               draft_length: Any):
        if isinstance(drafter, str):
            drafter = self.make_drafter(drafter)
        if isinstance(draft_length, str):
            if draft_length != "auto":
                raise InvalidOptionError(
                    f"draft_length must be 'auto' (the cost model), None (always verify the whole "
                    f"draft) or a policy object; got {draft_length!r}")
            draft_length = self.draft_length_policy() if drafter is not None else None
            if draft_length is not None and options.seed is not None and options.temperature > 0:
                draft_length = draft_length.for_seeded_request()  # the seed fixes the output
        if drafter is None:
            return plain_decode_steps(self.decoder, ids, options)
        return speculative_decode_steps(self.decoder, ids, drafter, options, draft_length=draft_length)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        drafter: Drafter | str | None = "prompt-lookup",
        options: SpeculativeOptions | None = None,
        chat: bool = False,
        system: str | None = None,
        draft_length: Any = "auto",
    ) -> SpeculativeDecodeResult:
        """Decode `prompt` (text, or token ids) with `drafter` (None: plain decoding).

        `options.stop_token_ids` defaults to the model's; `result.text` holds the decoded text.
        `draft_length`: "auto" (default) lets the model's cost-model policy pick how many drafted
        tokens to verify each step (`draft_length_policy()`); None verifies every draft whole;
        or any object with the `DraftLengthPolicy` methods. The model's policy learns across
        requests and from timed calls; a request with a seed above temperature 0 gets a copy
        that learns from that request alone and times nothing, so the same seed gives the same
        output (the distribution is exact either way).
        """
        ids, options = self._prepare(prompt, options, chat, system)
        result = DecodeStream(self._steps(ids, drafter, options, draft_length)).run()
        result.text = self.decode(result.tokens)
        return result

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        drafter: Drafter | str | None = "prompt-lookup",
        options: SpeculativeOptions | None = None,
        chat: bool = False,
        system: str | None = None,
        draft_length: Any = "auto",
    ) -> "TextStream":
        """Like `generate`, yielding text as tokens are accepted; `.result` when done."""
        ids, options = self._prepare(prompt, options, chat, system)
        return TextStream(self, DecodeStream(self._steps(ids, drafter, options, draft_length)))


class TextStream:
    """Yields decoded text pieces; holds back an incomplete UTF-8 sequence until it completes."""

    def __init__(self, model: Model, stream: DecodeStream) -> None:
        self._model, self._stream = model, stream
        self.result: SpeculativeDecodeResult | None = None

    def __iter__(self) -> Iterator[str]:
        # incremental detokenisation: decode only the tokens since the last piece (plus the one
        # before, for tokenizers whose pieces depend on their left neighbour), not the whole text
        tokens: list[int] = []
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


def _no_spin():
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_mem_pattern = False  # as OrtDecoder's default options
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def _check_pairing(target: mf.Manifest, draft: mf.Manifest, draft_dir: Path) -> None:
    """A draft must speak the target's tokens: same vocabulary, same tokenizer file."""
    if draft.architecture.vocab_size != target.architecture.vocab_size:
        raise InvalidOptionError(
            f"draft {draft_dir} has a vocabulary of {draft.architecture.vocab_size}, "
            f"the target {target.architecture.vocab_size}: they must share a tokenizer"
        )
    if draft.files.get(draft.tokenizer) != target.files.get(target.tokenizer):
        raise InvalidOptionError(f"draft {draft_dir} has a different tokenizer from the target's")


def load_model(
    path: str | os.PathLike,
    *,
    providers: Any = None,
    threads: int | None = None,
    draft: str | os.PathLike | bool | None = None,
) -> Model:
    """Read and check `path/manifest.json`, open its entry points, load its tokenizer.

    `draft`: a draft model directory to pair with the target, or True to take the one the
    target's manifest lists (`extra["drafts"]`, first entry).
    """
    from tokenizers import Tokenizer

    root = Path(path)
    manifest = mf.read_manifest(root)
    tok_path = mf.safe_member(root, manifest.tokenizer, what="manifest.tokenizer")
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
        raise mf.ManifestError(f"{manifest.tokenizer!r} is not a tokenizers file: {e}") from None
    draft_dir = draft_manifest = None
    if draft:
        if draft is True:
            drafts = manifest.extra.get("drafts") or []
            if not drafts:
                raise InvalidOptionError(f"{root} lists no draft model in its manifest")
            draft_dir = mf.safe_member(root, drafts[0], what="manifest.extra.drafts")
        else:
            draft_dir = Path(draft)
        draft_manifest = mf.read_manifest(draft_dir)
        _check_pairing(manifest, draft_manifest, draft_dir)
    # Two sessions in one process: intra-op threads that spin while idle would fight for the
    # cores (measured: the int4 draft pair ran at 0.87x plain decoding spinning, 1.15x not)
    decoder = OrtDecoder(root, manifest=manifest, providers=providers, threads=threads,
                         session_options=_no_spin() if draft else None)
    draft_decoder = None
    if draft_dir is not None:
        draft_decoder = OrtDecoder(draft_dir, manifest=draft_manifest, providers=providers,
                                   threads=threads, session_options=_no_spin())
    return Model(decoder=decoder, tokenizer=tokenizer, manifest=manifest, path=root, draft=draft_decoder)
