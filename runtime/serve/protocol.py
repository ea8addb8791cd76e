"""The OpenAI wire format: request bodies checked into a `GenerationRequest`, and the response
bodies and stream chunks built from what a decode did. Plain functions, no web framework.

Every check runs before any decoding and raises `ApiError` naming the field (`param`), the
value and what is allowed; `ApiError.body()` is OpenAI's `{"error": {...}}` shape. What the
model itself would refuse is checked by the runtime's own validators, in OpenAI's words here:
the prompt's token ids by `request.check_request`, the sampling options by `SpeculativeOptions`.

    info = ModelInfo.of(model, name="smollm2")
    request = parse_chat(json_body, info)     # or parse_completion
    request.prompt_ids, request.options, request.stop, request.stream
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from typing import Any, Callable, Literal

from ..decoding.counters import DecodeCounters
from ..decoding.options import SpeculativeOptions
from ..errors import InvalidOptionError, InvalidPromptError
from ..model import Model
from ..ort.manifest import ChatFormat
from ..request import ModelFacts, check_request
from ..validation import is_int

Kind = Literal["chat", "completion"]
CHAT_ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 16
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: what fits
MAX_TEMPERATURE = 2.0  # OpenAI's range of temperature is [0, 2]
# OpenAI fields this server cannot honour; a request that sets one to a non-default value is
# refused rather than silently answered differently (name -> the values that mean "unused").
# In /v1/completions `logprobs` is a count, and 0 still asks for the chosen tokens' logprobs.
_EXTENSIONS = {"ignore_eos": (False,), "min_tokens": (0,), "min_p": (0,),
               "repetition_penalty": (1,)}  # vLLM's and llama.cpp's, which load tools send
UNSUPPORTED: dict[Kind, dict[str, tuple[Any, ...]]] = {
    "chat": {"logprobs": (False,), "top_logprobs": (0,), "presence_penalty": (0,),
             "frequency_penalty": (0,), "logit_bias": ({},), "tools": ([],), "functions": ([],),
             "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
             "response_format": ({"type": "text"},), "modalities": (["text"],),
             "verbosity": ("medium",), "audio": (), "prediction": (), "reasoning_effort": (),
             "web_search_options": (), "chat_template_kwargs": ({},), **_EXTENSIONS},
    "completion": {"logprobs": (), "echo": (False,), "best_of": (1,), "suffix": (),
                   "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
                   **_EXTENSIONS},
}
# the fields each route honours (besides UNSUPPORTED's at their unused values), and OpenAI's
# fields that change nothing in the answer; any other field is refused, as OpenAI's API does
HONOURED: dict[Kind, frozenset[str]] = {
    "chat": frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature",
                       "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n"}),
    "completion": frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "top_k",
                             "seed", "stop", "stream", "stream_options", "n"}),
}
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                       "prompt_cache_key", "prompt_cache_retention", "safety_identifier"})


class ApiError(Exception):
    """An error answered to the client in OpenAI's shape, with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=param)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What request checks need to know about the served model."""

    name: str
    capacity: int  # KV capacity; a decode may reach capacity + 1 tokens (the last is never fed)
    vocab_size: int
    chat_format: ChatFormat | None
    encode: Callable[[str], list[int]]  # text -> token ids, BOS as the model wants it

    @classmethod
    def of(cls, model: Model, *, name: str) -> "ModelInfo":
        return cls(name=name, capacity=model.capacity,
                   vocab_size=model.manifest.architecture.vocab_size,
                   chat_format=model.manifest.chat_format, encode=model.encode)

    @property
    def facts(self) -> ModelFacts:
        """What `check_request` checks a prompt against."""
        return ModelFacts(vocab_size=self.vocab_size, capacity=self.capacity, path=self.name)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    kind: Kind
    prompt_ids: list[int]
    options: SpeculativeOptions  # stop_token_ids left empty: the model adds its own
    stop: tuple[str, ...]  # stop strings, matched on the text and not returned
    stream: bool
    include_usage: bool


# -- field checks ---------------------------------------------------------------------------------

def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float | None) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v) or not math.isfinite(v):
        raise invalid(name, f"{name} must be a finite number, got {_show(v)}")
    return float(v)


def _integer(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not is_int(v):
        raise invalid(name, f"{name} must be an integer, got {_show(v)}")
    return int(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"{name} must be true or false, got {_show(v)}")
    return v


def _check_model(body: dict, info: ModelInfo) -> None:
    name = body.get("model")
    if name is None:
        raise invalid("model", f"model is required; this server serves {_show(info.name)}")
    if not isinstance(name, str):
        raise invalid("model", f"model must be a string, got {_show(name)}")
    if name != info.name:
        raise ApiError(404, f"the model {_show(name)} does not exist; this server serves "
                            f"{_show(info.name)}", param="model", code="model_not_found")


def _check_fields(body: dict, kind: Kind) -> None:
    """Refuse a field this route does not know, and one it cannot honour set to a value that
    would change the answer."""
    unsupported = UNSUPPORTED[kind]
    for name in body:
        if name in HONOURED[kind] or name in unsupported or name in NO_EFFECT:
            continue
        if name == "speculative":
            raise invalid(name, "speculative is a field of the response, not of a request: the "
                                "drafter is the server's (ortspec serve --drafter)")
        raise invalid(name, f"unrecognized request field {_show(name)}; this route takes "
                            f"{', '.join(sorted(HONOURED[kind]))}")
    for name, defaults in unsupported.items():
        v = body.get(name)
        # as JSON compares: false is not 0
        if v is not None and not any(v == d and isinstance(v, bool) == isinstance(d, bool)
                                     for d in defaults):
            raise invalid(name, f"{name} is not supported by this server (got {_show(v)})")


def _sampling(body: dict) -> tuple[float, int | None, float | None, int | None]:
    """The sampling fields in OpenAI's meaning (temperature 1 by default, top_k -1 and top_p 1
    for no limit): temperature's range (OpenAI's) and top_k's -1 checked here, the rest by
    SpeculativeOptions (`_options`)."""
    temperature = _number(body, "temperature", 1.0)
    assert temperature is not None
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise invalid("temperature", f"temperature must be between 0 and {MAX_TEMPERATURE:g}, "
                                     f"got {_show(body['temperature'])}")
    top_p = _number(body, "top_p", None)
    top_k = _integer(body, "top_k")
    if top_k is not None and top_k != -1 and top_k < 1:
        raise invalid("top_k", f"top_k must be -1 (no limit) or an integer >= 1, got {top_k}")
    seed = _integer(body, "seed")
    return (temperature, None if top_k in (None, -1) else top_k,
            None if top_p == 1.0 else top_p, seed)


OPTION_FIELDS = ("temperature", "top_k", "top_p", "seed")  # body fields named as the options


def _options(sampling: tuple[float, int | None, float | None, int | None], max_new: int
             ) -> SpeculativeOptions:
    """SpeculativeOptions from `_sampling`'s fields; its own check's error as a 400 naming the
    field (the error's `option`, where it is one of the body's fields)."""
    temperature, top_k, top_p, seed = sampling
    try:
        return SpeculativeOptions(max_new, temperature=temperature, top_k=top_k, top_p=top_p,
                                  seed=seed)
    except InvalidOptionError as e:
        raise invalid(e.option if e.option in OPTION_FIELDS else None, str(e)) from None


def _check_prompt(body: dict, ids: list[int], info: ModelInfo) -> list[int]:
    """`check_request` on the prompt's token ids, its refusal in OpenAI's words."""
    param = "messages" if "messages" in body else "prompt"
    try:
        checked = check_request(ids, None, drafter=None, facts=info.facts)
    except InvalidPromptError as e:
        if e.token_index is not None:
            raise invalid(param, f"prompt token id {e.token} is outside the vocabulary "
                                 f"(0..{info.vocab_size - 1})") from None
        if e.length is not None:
            raise invalid(param, f"the prompt has {e.length} tokens; this model's context holds "
                                 f"at most {info.capacity}") from None
        raise invalid(param, str(e)) from None
    assert checked is not None
    return checked


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid("stop", f"stop must be a string or a list of strings, got {_show(v)}")
    if len(items) > MAX_STOP_STRINGS:
        raise invalid("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(items)}")
    if any(s == "" for s in items):
        raise invalid("stop", "stop strings must not be empty")
    return tuple(items)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise invalid("stream_options", f"stream_options must be an object, got {_show(opts)}")
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    return stream, _bool(opts, "include_usage")


def _max_tokens(body: dict, prompt_len: int, info: ModelInfo, default: int | None) -> int:
    room = info.capacity + 1 - prompt_len  # the loop: prompt + new tokens <= capacity + 1
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    n = _integer(body, name)
    if n is None:
        return room if default is None else min(default, room)
    if n < 1:
        raise invalid(name, f"{name} must be an integer >= 1, got {n}")
    if n > room:
        raise invalid(name, f"{name} is {n}, but at most {room} new tokens fit after this "
                             f"{prompt_len}-token prompt (context {info.capacity})")
    return n


def _common(body: Any, info: ModelInfo, kind: Kind) -> None:
    if not isinstance(body, dict):
        kind_of = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
        raise invalid(None, f"the request body must be a JSON object, got "
                            f"{kind_of.get(type(body), 'a number')}")
    _check_model(body, info)
    n = body.get("n")
    if n is not None and (not is_int(n) or n != 1):
        raise invalid("n", f"n must be 1 (this server returns one choice per request), got "
                           f"{_show(n)}")
    _check_fields(body, kind)


def _request(kind: Kind, body: dict, ids: list[int], info: ModelInfo,
             default_max_tokens: int | None) -> GenerationRequest:
    sampling = _sampling(body)
    stop = _stop(body)
    stream, include_usage = _stream(body)
    ids = _check_prompt(body, ids, info)
    options = _options(sampling, _max_tokens(body, len(ids), info, default_max_tokens))
    return GenerationRequest(kind, ids, options, stop, stream, include_usage)


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise invalid(f"messages[{i}].content[{j}]",
                              f'only text content parts ({{"type": "text", "text": ...}}) are '
                              f"supported, got {_show(part)}")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"messages[{i}].content",
                  f"messages[{i}].content must be a string or a list of text parts, got "
                  f"{_show(content)}")


def parse_chat(body: Any, info: ModelInfo) -> GenerationRequest:
    """A /v1/chat/completions body -> a request, the messages rendered with the chat format."""
    _common(body, info, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", f"messages must be a non-empty list, got {_show(messages)}")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", f"messages[{i}] must be an object, got {_show(m)}")
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role", f"messages[{i}].role must be one of "
                                                  f"{', '.join(CHAT_ROLES)} or developer (as "
                                                  f"system), got {_show(m.get('role'))}")
        turns.append({"role": role, "content": _message_text(i, m.get("content"))})
    if info.chat_format is None:
        raise invalid("messages", f"the model {_show(info.name)} has no chat format; use /v1/completions")
    ids = info.encode(info.chat_format.render(turns))
    return _request("chat", body, ids, info, None)


def parse_completion(body: Any, info: ModelInfo) -> GenerationRequest:
    """A /v1/completions body -> a request; the prompt is a string or a list of token ids."""
    _common(body, info, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "prompt must not be empty")
        ids = info.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        ids = prompt  # in the vocabulary: check_request's (_request)
    else:
        raise invalid("prompt", f"prompt must be a string or a non-empty list of token ids (one "
                                f"prompt per request), got {_show(prompt)}")
    return _request("completion", body, ids, info, COMPLETION_DEFAULT_MAX_TOKENS)


def _show(v: Any) -> str:
    """A request's value as the client wrote it (JSON), cut to 80 characters."""
    try:
        r = json.dumps(v, ensure_ascii=False, allow_nan=True)
    except (TypeError, ValueError):
        r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


# -- responses ------------------------------------------------------------------------------------

def finish_reason(reason: str) -> str:
    """ortspec's finish reasons in OpenAI's words: the KV capacity is a length limit."""
    return "length" if reason == "capacity" else reason


def speculative_section(counters: DecodeCounters, drafter: str) -> dict[str, Any]:
    """The per-request speculative-decoding figures: what the decode did up to where it ended.
    After a stop string `emitted_tokens` may exceed `completion_tokens`: the last step's tokens
    past the stop were decoded (and counted here) but are not part of the answer."""
    return {
        "drafter": drafter,
        "emitted_tokens": counters.emitted,
        "drafted_tokens": counters.drafted,
        "accepted_tokens": counters.accepted,
        "acceptance_rate": round(counters.acceptance_rate, 4),
        "target_calls": counters.target_calls,
        "verify_calls": counters.verify_calls,
        "mean_tokens_per_target_call": round(counters.mean_tokens_per_call, 4),
        "acceptance_by_position": [round(a, 4) for a in counters.acceptance_by_position],
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclasses.dataclass(frozen=True)
class ResponseIds:
    """The id, creation time and model name every body and chunk of one response repeats."""

    kind: Kind
    model: str
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def head(self, obj: str) -> dict[str, Any]:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}


def response_body(ids: ResponseIds, text: str, reason: str, prompt_tokens: int,
                  completion_tokens: int, speculative: dict[str, Any]) -> dict[str, Any]:
    if ids.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": reason}
        body = ids.head("chat.completion")
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        body = ids.head("text_completion")
    return {**body, "choices": [choice], "usage": usage(prompt_tokens, completion_tokens),
            "speculative": speculative}


def chunk(ids: ResponseIds, *, text: str | None = None, role: bool = False,
          reason: str | None = None, include_usage: bool = False,
          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One stream chunk: a piece of text (chat: the first one carries the role), or the last
    one with `reason`. With `include_usage` every chunk has "usage": null (the usage chunk,
    `usage_chunk`, comes after the last)."""
    if ids.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        body = ids.head("chat.completion.chunk")
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        body = ids.head("text_completion")
    body["choices"] = [choice]
    if include_usage:
        body["usage"] = None
    if extra:
        body.update(extra)
    return body


def usage_chunk(ids: ResponseIds, prompt_tokens: int, completion_tokens: int,
                speculative: dict[str, Any]) -> dict[str, Any]:
    obj = "chat.completion.chunk" if ids.kind == "chat" else "text_completion"
    return {**ids.head(obj), "choices": [], "usage": usage(prompt_tokens, completion_tokens),
            "speculative": speculative}

