"""Drafters: prompt lookup, a draft model, and their composition.

`DRAFTER_NAMES` is the one table of the names `Model.make_drafter`, the CLI and the benchmark
accept; "none" is plain decoding.
"""

DRAFTER_NAMES = ("prompt-lookup", "none", "draft-model", "prompt-lookup+draft-model")
NEEDS_DRAFT_MODEL = frozenset({"draft-model", "prompt-lookup+draft-model"})
