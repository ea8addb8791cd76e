"""One helper for checking integer options: `check_int`.

Python's `bool` is an `int`, and NumPy integers are not, so the test a user-facing option needs
("a real integer, not True, in this range") is longer than it looks. Every tier calls this one
instead of writing it again, with the exception class its caller documents.

    check_int("max_new_tokens", n, minimum=1)                 # -> int(n), or InvalidOptionError
    check_int("seed", seed, minimum=0, allow_none=True)        # None passes through
    check_int("capacity", c, minimum=16, maximum=32768, error=ExportOptionError)
"""

from __future__ import annotations

import numpy as np

from .errors import InvalidOptionError


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
