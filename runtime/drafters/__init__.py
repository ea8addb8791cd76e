"""Drafters: prompt lookup, a draft model, a trained EAGLE-3 head (`eagle3`), their
composition, and two that sample from a q: continuation counts (`ngram-counts`) and the
target's own cached distributions (`target-cache`).

`DRAFTER_NAMES` is the one table of the names `Model.make_drafter`, the CLI and the benchmark
accept; "none" is plain decoding, "auto" the model's default (`Model.default_drafter`: eagle3
where the model lists a draft head, prompt lookup otherwise).
"""

DRAFTER_NAMES = ("auto", "prompt-lookup", "none", "draft-model", "prompt-lookup+draft-model",
                 "eagle3", "prompt-lookup+eagle3", "ngram-counts", "target-cache")
NEEDS_DRAFT_MODEL = frozenset({"draft-model", "prompt-lookup+draft-model"})
NEEDS_DRAFT_HEAD = frozenset({"eagle3", "prompt-lookup+eagle3"})
