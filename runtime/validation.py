"""One helper for checking integer options, `check_int`; one for a decoder call's tokens,
`check_token_block`; one for a cache's rollback, `check_truncate_length`; and one for the logits a
model returned, `check_logits` (`non_finite_logits` where the error is handed on, not raised).

Python's `bool` is an `int`, and NumPy integers are not, so the test a user-facing option needs
("a real integer, not True, in this range") is longer than it looks. Every tier calls this one
instead of writing it again, with the exception class its caller documents.

    check_int("max_new_tokens", n, minimum=1)                 # -> int(n), or InvalidOptionError
    check_int("seed", seed, minimum=0, allow_none=True)        # None passes through
    check_int("capacity", c, minimum=16, maximum=32768, error=ExportOptionError)
"""

from __future__ import annotations

import numpy as np

from .errors import CapacityError, InvalidOptionError, InvalidPromptError, NonFiniteLogitsError


def is_int(value: object) -> bool:
    """An integer (Python or NumPy), and not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None,
              allow_none: bool = False, error: type[Exception] = InvalidOptionError,
              what: str = "") -> int | None:
    """`value` as an int if it is an integer within [minimum, maximum], else `error` naming
    `name`, the value and what is allowed. `what` (e.g. " (0 = onnxruntime's default)") is
    appended to the allowed range in the message."""
    if value is None and allow_none:
        return None
    ok = is_int(value)
    if ok and minimum is not None and value < minimum:  # type: ignore[operator]
        ok = False
    if ok and maximum is not None and value > maximum:  # type: ignore[operator]
        ok = False
    if ok:
        return int(value)  # type: ignore[arg-type]
    if minimum is not None and maximum is not None:
        allowed = f"an integer in {minimum}..{maximum}"
    elif minimum is not None:
        allowed = f"an integer >= {minimum}"
    elif maximum is not None:
        allowed = f"an integer <= {maximum}"
    else:
        allowed = "an integer"
    if allow_none:
        allowed = f"None or {allowed}"
    message = f"{name} must be {allowed}{what}, got {value!r}"
    if issubclass(error, InvalidOptionError):
        raise error(message, option=name)
    raise error(message)


def check_token_block(tokens: object, *, vocab_size: int, length: int, capacity: int
                      ) -> np.ndarray:
    """The tokens a decoder call appends, as int64 [n]: a non-empty 1-D sequence of ids in
    0..vocab_size-1 that fits after `length` cached tokens in `capacity`."""
    ids = np.asarray(tokens)
    if ids.ndim != 1 or ids.size == 0:
        raise InvalidPromptError(f"expected a non-empty 1-D sequence of token ids, got shape "
                                 f"{ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InvalidPromptError(f"token ids must be integers, got dtype {ids.dtype}")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        raise InvalidPromptError(f"token id {int(ids[bad][0])} is outside the vocabulary "
                                 f"0..{vocab_size - 1}")
    if length + ids.size > capacity:
        raise CapacityError(f"{ids.size} more tokens would make {length + ids.size}, over the "
                            f"KV capacity of {capacity} (export with a larger --capacity, or "
                            f"truncate/reset first)")
    return ids.astype(np.int64, copy=False)



def check_truncate_length(length: object, held: int) -> int:
    """`length` as an int if a cache holding `held` tokens can be truncated to it (an integer
    in 0..held), else InvalidOptionError."""
    if not is_int(length):
        raise InvalidOptionError(f"truncate length must be an integer, got {length!r}")
    if not 0 <= length <= held:  # type: ignore[operator]
        raise InvalidOptionError(f"cannot truncate to {length}: the cache holds "
                                 f"{held} tokens (allowed 0..{held})")
    return int(length)  # type: ignore[arg-type]


def non_finite_logits(logits: np.ndarray, *, first_position: int | None = None,
                      source: str = "the graph") -> NonFiniteLogitsError | None:
    """None when every logit is finite, else the error that says where: with `first_position`,
    `logits` are the rows [n, vocab] `source` computed at positions first_position.. and the
    error names their range; without, it counts the bad logits and names the first one's flat
    index."""
    if np.isfinite(logits).all():
        return None
    if first_position is not None:
        last = first_position + logits.shape[0] - 1
        return NonFiniteLogitsError(f"{source} returned NaN or infinite logits at positions "
                                    f"{first_position}..{last}")
    bad = np.flatnonzero(~np.isfinite(logits.reshape(-1)))
    return NonFiniteLogitsError(
        f"the model returned {bad.size} non-finite logits (first at flat index {bad[0]}: "
        f"{logits.reshape(-1)[bad[0]]}); logits must be finite"
    )


def check_logits(logits: np.ndarray, *, first_position: int | None = None,
                 source: str = "the graph") -> None:
    """Raise `non_finite_logits`'s error, if there is one."""
    error = non_finite_logits(logits, first_position=first_position, source=source)
    if error is not None:
        raise error
