"""A request to a loaded model, checked once: `check_request`.

What a request can get wrong (the prompt's token ids, the options, the drafter, the draft-length
choice) is checked by this one function, up front: by `Model.start` (so by `generate` and
`stream`) when the request is made, by the server when it turns a request body into a request
(`serve/protocol.py`), and by the command line before the model loads (`facts=None`: what can
be checked without a model). The decode loop itself checks nothing more on this path.

    ids = check_request(prompt_ids, options, drafter="prompt-lookup", facts=model.facts())
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .decoding.options import check_options, check_prompt
from .decoding.protocols import check_drafter
from .drafters import DRAFTER_NAMES, NEEDS_DRAFT_HEAD, NEEDS_DRAFT_MODEL
from .drafters.draft_model import DEFAULT_DRAFT_CONTEXT, check_draft_context
from .drafters.prompt_lookup import check_lookup_sizes
from .errors import InvalidOptionError
from .validation import check_int


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """A drafter by name with its options, made afresh for each request on the request's own
    slot by `Model.generate` and `stream` (as a bare name is): what to pass for a draft model
    drafter with options other than the defaults, since its draft decoder belongs to the slot."""

    name: str
    ngram_size: int = 3
    max_draft_len: int = 8
    draft_context: int | None = DEFAULT_DRAFT_CONTEXT


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the request checks need to know about a model (`Model.facts()`): its vocabulary and
    KV capacity; whether it has a draft model (loaded, or listed in its manifest and loaded by
    the first request that needs it); the draft's capacity and whether it runs on the target's
    KV buffers, once it is loaded (None before)."""

    vocab_size: int
    capacity: int
    path: str = "the model"  # named in messages
    has_draft: bool = False
    draft_capacity: int | None = None
    draft_follows: bool = False
    has_draft_head: bool = False  # the manifest lists a trained draft head (draft_head)


def check_request(prompt: Sequence[int] | None, options: object | None, *,
                  drafter: object = "prompt-lookup", draft_length: object = "auto",
                  facts: ModelFacts | None = None) -> list[int] | None:
    """Check one request before any decoding; the prompt as a list of ints (None if none).

    - `options`: a SpeculativeOptions (InvalidOptionError; its fields checked themselves when
      it was made); None to leave for later (the server sizes max_new_tokens by the prompt);
    - `prompt`: token ids in the model's vocabulary that fit its capacity (InvalidPromptError;
      not checked without `facts`);
    - `drafter`: None (plain decoding), a name from DRAFTER_NAMES or a `DrafterSpec` (name, sizes,
      and against `facts` the draft model it needs; InvalidOptionError), or a drafter object
      (its methods; DrafterError);
    - `draft_length`: "auto", None or a policy object (InvalidOptionError).
    """
    if options is not None:
        check_options(options)
    ids = None
    if prompt is not None and facts is not None:
        ids = check_prompt(prompt, vocab_size=facts.vocab_size, capacity=facts.capacity)
    spec = drafter_spec(drafter)
    if spec is not None:
        check_drafter_spec(spec, facts)
    elif drafter is not None and not isinstance(drafter, str):
        check_drafter(drafter)
    if isinstance(draft_length, str) and draft_length != "auto":
        raise InvalidOptionError(
            f"draft_length must be 'auto' (the cost model), None (always verify the whole "
            f"draft) or a policy object; got {draft_length!r}")
    return ids


def drafter_spec(drafter: object) -> DrafterSpec | None:
    """A name or a `DrafterSpec` as a spec (a bare name with the default options); None for
    anything else (no drafter, a drafter object)."""
    if isinstance(drafter, str):
        return DrafterSpec(drafter)
    return drafter if isinstance(drafter, DrafterSpec) else None


def check_draft_head(name: str, *, has_draft_head: bool, path: str) -> None:
    """InvalidOptionError where drafter `name` drafts with a trained draft head (eagle3) and the
    model at `path` lists none; the command-line tools call it before loading anything."""
    if name in NEEDS_DRAFT_HEAD and not has_draft_head:
        raise InvalidOptionError(
            f"drafter {name!r} needs a trained draft head and {path} lists none: "
            f"export the model with `ortspec export SOURCE --draft-head HEAD_DIR`, or choose "
            f"another drafter (auto picks one the model has)")


def check_drafter_spec(spec: DrafterSpec, facts: ModelFacts | None = None) -> None:
    """InvalidOptionError unless `spec` names a drafter with valid options that the model of
    `facts` (if given) can make: a draft-model drafter needs a draft, and its `draft_context`
    must suit the draft once it is loaded (`check_draft_context`)."""
    if spec.name not in DRAFTER_NAMES:
        raise InvalidOptionError(f"unknown drafter {spec.name!r}; choose one of {', '.join(DRAFTER_NAMES)}")
    check_lookup_sizes(spec.ngram_size, 1, spec.max_draft_len)
    if facts is not None:
        check_draft_head(spec.name, has_draft_head=facts.has_draft_head, path=facts.path)
    if spec.name not in NEEDS_DRAFT_MODEL:
        return
    if facts is None:
        check_int("draft_context", spec.draft_context, minimum=1, allow_none=True)
        return
    if not facts.has_draft:
        raise InvalidOptionError(
            f"drafter {spec.name!r} needs a draft model and {facts.path} lists none: export one "
            f"with `ortspec export --draft-quant int4` or `--draft-layers N`, then "
            f"load_model(path, draft=...)")
    if facts.draft_capacity is None:
        check_int("draft_context", spec.draft_context, minimum=1, allow_none=True)
    else:
        check_draft_context(spec.draft_context, capacity=facts.draft_capacity,
                            follows=facts.draft_follows, name="draft_context")
