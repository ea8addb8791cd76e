"""Tokenizer facts for the manifest, derived at export time so the runtime never runs Jinja.

`derive_chat_format` renders the checkpoint's chat template through transformers with sentinel
messages and reads the pieces off the result: the text around one message, the prefix, the
generation prompt, and a default system prompt the template inserts when there is none. The
derived `ChatFormat` is then checked against the template on several conversations; a template
it cannot reproduce exactly (role-dependent layouts, trimming, strict alternation rules) yields
None and the manifest keeps only the Jinja text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ortspec.runtime.ort.manifest import ChatFormat

_SYS, _USER, _ASSISTANT, _USER2 = "SYSq7XsentinelA", "USRq7XsentinelB", "ASTq7XsentinelC", \
    "USRq7XsentinelD"

_CHECKS = [  # conversations the derived format must render exactly as the template does
    [{"role": "user", "content": "Hello, world! {braces} stay {content}"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b\nc"},
     {"role": "user", "content": "d"}],
]


def _fill(message: str, role: str, content: str) -> str:
    return message.replace("{role}", role).replace("{content}", content)


def _render(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation)


def derive_chat_format(tokenizer: Any) -> ChatFormat | None:
    """The template as plain string pieces, or None when it cannot be expressed that way."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        fmt = _derive(tokenizer)
        if fmt is None:
            return None
        for conv in _CHECKS:
            for generation in (False, True):
                if fmt.render(conv, add_generation_prompt=generation) != _render(
                        tokenizer, conv, generation):
                    return None
        return fmt
    except Exception:  # noqa: BLE001 - any template error means "not expressible"
        return None


def _derive(tokenizer: Any) -> ChatFormat | None:
    s = {"role": "system", "content": _SYS}
    u = {"role": "user", "content": _USER}
    a = {"role": "assistant", "content": _ASSISTANT}
    u2 = {"role": "user", "content": _USER2}
    r_s = _render(tokenizer, [s], False)
    r_su = _render(tokenizer, [s, u], False)
    if not r_su.startswith(r_s):
        return None
    message = r_su[len(r_s):].replace(_USER, "{content}").replace("user", "{role}")
    if message.count("{content}") != 1:
        return None
    sys_msg = _fill(message, "system", _SYS)
    if not r_s.endswith(sys_msg):
        return None
    prefix = r_s[: len(r_s) - len(sys_msg)]
    r_sua = _render(tokenizer, [s, u, a, u2], False)
    if r_sua != r_su + _fill(message, "assistant", _ASSISTANT) + _fill(message, "user", _USER2):
        return None
    r_su_gen = _render(tokenizer, [s, u], True)
    if not r_su_gen.startswith(r_su):
        return None
    generation_prompt = r_su_gen[len(r_su):]
    # a system message the template inserts on its own when the conversation has none
    r_u = _render(tokenizer, [u], False)
    user_msg = _fill(message, "user", _USER)
    if not (r_u.startswith(prefix) and r_u.endswith(user_msg)):
        return None
    middle = r_u[len(prefix): len(r_u) - len(user_msg)]
    default_system = ""
    if middle:
        before, after = _fill(message, "system", "\0").split("\0")
        if not (middle.startswith(before) and middle.endswith(after)):
            return None
        default_system = middle[len(before): len(middle) - len(after)]
        if not default_system:
            return None  # an empty system message inserted: not expressible
    return ChatFormat(message=message, generation_prompt=generation_prompt, prefix=prefix,
                      default_system=default_system)


def stop_token_ids(tokenizer: Any, model_config: Any, generation_config: Any,
                   chat_format: ChatFormat | None, vocab_size: int) -> tuple[int, ...]:
    """EOS ids (tokenizer, config, generation config) plus the special token that closes a chat
    turn, when the template has one distinct from EOS (`<|im_end|>`, `<|eot_id|>`, ...)."""
    ids: set[int] = set()
    for holder in (tokenizer, model_config, generation_config):
        value = getattr(holder, "eos_token_id", None) if holder is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    if chat_format is not None:
        after = chat_format.message.split("{content}", 1)[1]
        specials = set(tokenizer.all_special_tokens) | set(
            getattr(tokenizer, "added_tokens_encoder", {}) or {})
        found = [(after.find(t), t) for t in specials if t and t in after]
        if found:
            ids.add(tokenizer.convert_tokens_to_ids(min(found)[1]))
    return tuple(sorted(i for i in ids if 0 <= i < vocab_size))


def bos_token_id(tokenizer: Any) -> int | None:
    """The BOS id when encoding adds one on its own (tokenizer.json then adds it too)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == bos else None


def save_tokenizer(tokenizer: Any, path: Path) -> None:
    """tokenizer.json in the `tokenizers` library's own format."""
    tokenizer.backend_tokenizer.save(str(path))
