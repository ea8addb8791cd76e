"""Drafters: prompt lookup, a draft model, their composition, and two that sample from a q:
continuation counts (`ngram-counts`) and the target's own cached distributions (`target-cache`).

`DRAFTER_NAMES` is the one table of the names `Model.make_drafter`, the CLI and the benchmark
accept; "none" is plain decoding.
"""

DRAFTER_NAMES = ("prompt-lookup", "none", "draft-model", "prompt-lookup+draft-model",
                 "ngram-counts", "target-cache")
NEEDS_DRAFT_MODEL = frozenset({"draft-model", "prompt-lookup+draft-model"})
