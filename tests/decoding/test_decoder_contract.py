"""The `Decoder` contract is seven members: vocab_size, capacity, length, reset, forward_token,
forward_batch, truncate. A decoder with exactly those (a plain class, not a DecoderBase) decodes
through every entry point that takes a decoder, with DecoderBase's defaults for the optional
members (max_verify_len, prefill, ort_seconds) applied at the boundary (`as_decoder`); an
object lacking one of the seven is refused, naming it, before anything is called on it."""

from __future__ import annotations

import pytest

from ortspec.runtime import (
    DecoderContractError,
    DraftModelDrafter,
    OrtspecError,
    PromptLookupSpeculator,
    ReferenceConfig,
    ReferenceDecoder,
    SpeculativeOptions,
    as_decoder,
    plain_decode,
    speculative_decode,
    speculative_decode_with,
)
from ortspec.runtime.decoding.protocols import DECODER_MEMBERS, DecoderDefaults

CFG = ReferenceConfig(vocab_size=12, d_model=16, n_layers=2, n_heads=2, capacity=64, seed=7)
# repetitive, so prompt lookup finds drafts that are accepted and rejected
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 5, 6, 5, 6, 7, 5, 6], [3, 9, 3, 9, 2, 3, 9]]
OPTIONS = SpeculativeOptions(24)


class SevenMembers:
    """Exactly the seven members of `Decoder` over the reference decoder's computation: no
    max_verify_len, prefill or ort_seconds, and not a DecoderBase."""

    def __init__(self, config: ReferenceConfig = CFG) -> None:
        self._ref = ReferenceDecoder(config)
        self.vocab_size = config.vocab_size
        self.capacity = config.capacity

    @property
    def length(self) -> int:
        return self._ref.length

    def reset(self) -> None:
        self._ref.reset()

    def forward_token(self, token):
        return self._ref.forward_token(token)

    def forward_batch(self, tokens):
        return self._ref.forward_batch(tokens)

    def truncate(self, length: int) -> None:
        self._ref.truncate(length)


def _plain(prompt):
    return plain_decode(ReferenceDecoder(CFG), prompt, OPTIONS).tokens


def test_the_seven_members_are_the_contract_and_the_adapter_keeps_length_live():
    assert DECODER_MEMBERS == ("vocab_size", "capacity", "length", "reset", "forward_token",
                               "forward_batch", "truncate")
    inner = SevenMembers()
    dec = as_decoder(inner)
    assert isinstance(dec, DecoderDefaults)
    assert (dec.max_verify_len, dec.ort_seconds) == (None, 0.0)  # DecoderBase's defaults
    dec.prefill([1, 2, 3])  # the default prefill: forward_batch in chunks
    assert dec.length == inner.length == 3
    inner.truncate(1)  # read through, not copied
    assert dec.length == 1
    ref = ReferenceDecoder(CFG)
    assert as_decoder(ref) is ref  # a decoder with every optional member passes as itself


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_seven_member_decoder_decodes_greedy_identically_through_every_entry_point(prompt):
    want = _plain(prompt)
    assert plain_decode(SevenMembers(), prompt, OPTIONS).tokens == want
    spec = speculative_decode_with(SevenMembers(), prompt, PromptLookupSpeculator(2, 4), OPTIONS)
    assert spec.tokens == want
    assert spec.counters.ort_seconds == 0.0  # the default, not an AttributeError
    assert speculative_decode(SevenMembers(), prompt, OPTIONS.max_new_tokens, ngram_size=2).tokens == want


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_seven_member_decoder_drafts_for_the_draft_model_drafter(prompt):
    """As the draft of DraftModelDrafter: the draft is the target's own weights in a seven-member
    decoder (so its drafts are accepted), or a different model (so some are rejected)."""
    want = _plain(prompt)
    for draft_config in (CFG, ReferenceConfig(**{**CFG.__dict__, "seed": 8})):
        drafter = DraftModelDrafter(SevenMembers(draft_config), max_draft_len=3,
                                    target=ReferenceDecoder(CFG))
        spec = speculative_decode_with(ReferenceDecoder(CFG), prompt, drafter, OPTIONS)
        assert spec.tokens == want
        assert spec.counters.drafted > 0
        if draft_config is CFG:
            assert spec.counters.accepted == spec.counters.drafted  # self-draft: all accepted


class Recorder:
    """Every member of `Decoder`, each recording its use; subclasses drop one."""

    vocab_size = 12
    capacity = 64

    def __init__(self) -> None:
        self.calls: list[str] = []

    @property
    def length(self) -> int:
        self.calls.append("length")
        return 0

    def reset(self) -> None:
        self.calls.append("reset")

    def forward_token(self, token):
        self.calls.append("forward_token")

    def forward_batch(self, tokens):
        self.calls.append("forward_batch")

    def truncate(self, length):
        self.calls.append("truncate")


def _lacking(member: str) -> Recorder:
    """A Recorder without `member` (a class attribute set to nothing is no member)."""
    namespace = {name: getattr(Recorder, name) for name in DECODER_MEMBERS if name != member}
    cls = type(f"Without_{member}", (), {**namespace, "__init__": Recorder.__init__})
    obj = cls()
    assert not hasattr(type(obj), member)
    return obj


@pytest.mark.parametrize("member", DECODER_MEMBERS)
def test_an_object_lacking_one_member_is_refused_naming_it_before_any_call(member):
    entry_points = {
        "plain_decode": lambda d: plain_decode(d, [1, 2, 3], OPTIONS),
        "speculative_decode_with": lambda d: speculative_decode_with(
            d, [1, 2, 3], PromptLookupSpeculator(), OPTIONS),
        "speculative_decode": lambda d: speculative_decode(d, [1, 2, 3], 4),
        "DraftModelDrafter": lambda d: DraftModelDrafter(d),
    }
    for name, call in entry_points.items():
        obj = _lacking(member)
        with pytest.raises(DecoderContractError, match=rf"lacks {member}:") as e:
            call(obj)
        assert isinstance(e.value, TypeError) and isinstance(e.value, OrtspecError), name
        assert "forward_batch, truncate" in str(e.value)  # the whole contract is named too
        assert obj.calls == [], (name, obj.calls)  # nothing was called on it
