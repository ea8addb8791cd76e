"""One helper for checking integer options, `check_int`, and one for a decoder call's tokens,
`check_token_block`.

Python's `bool` is an `int`, and NumPy integers are not, so the test a user-facing option needs
("a real integer, not True, in this range") is longer than it looks. Every tier calls this one
instead of writing it again, with the exception class its caller documents.

    check_int("max_new_tokens", n, minimum=1)                 # -> int(n), or InvalidOptionError
    check_int("seed", seed, minimum=0, allow_none=True)        # None passes through
    check_int("capacity", c, minimum=16, maximum=32768, error=ExportOptionError)
"""

from __future__ import annotations

import numpy as np

from .errors import CapacityError, InvalidOptionError, InvalidPromptError


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
    raise error(f"{name} must be {allowed}{what}, got {value!r}")


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

