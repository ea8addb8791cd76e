"""`load_model`: a model directory -> a `Model` (sessions, tokenizer, an optional draft).

Everything is checked before a session opens: the manifest, the tokenizer file, the draft's
pairing with the target (vocabulary and tokenizer), the prefix cache size.

    model = load_model("models/exported/smollm2-135m-instruct-fp32")
    print(model.generate("Name a planet.", chat=True).text)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .ort import manifest as mf
from .errors import InvalidOptionError
from .model import DEFAULT_MAX_CONCURRENT, Model
from .batching.prefix_cache import DEFAULT_PREFIX_CACHE_MIB, prefix_cache_bytes
from .ort.sessions import OrtSessions
from .slots import WhenBusy


def load_model(
    path: str | os.PathLike,
    *,
    providers: Any = None,
    threads: int | None = None,
    draft: str | os.PathLike | bool | None = None,
    max_concurrent: int = DEFAULT_MAX_CONCURRENT,
    when_busy: WhenBusy = "wait",
    busy_timeout: float | None = None,
    batch: bool | None = None,
    prefix_cache_mib: float = DEFAULT_PREFIX_CACHE_MIB,
) -> Model:
    """Read and check `path/manifest.json`, open its entry points, load its tokenizer.

    `draft`: a draft model directory to pair with the target, or True to take the one the
    target's manifest lists (`extra["drafts"]`, first entry).
    `max_concurrent`: how many requests decode at once (each holds a slot of KV state, made on
    first need: `Model.slot_bytes` each, about 114 MiB for the default model in fp32 at
    capacity 2048). A request beyond that waits for a slot (`when_busy="wait"`, for at most
    `busy_timeout` seconds if given) or fails at once with ModelBusyError (`"error"`).
    `batch`: decode concurrent requests in shared calls (`ortspec.runtime.batching.runner`); None
    (default) does when the graph takes several rows (manifest `max_batch` > 1: an export with
    `--attention window`) and `max_concurrent` > 1. The rows are then at most `max_batch`.
    `prefix_cache_mib`: a batching model keeps the keys and values of recent prompts, up to
    this many MiB (and as many again for a batched draft), and copies them into a new request
    that starts with the same tokens (a shared system prompt, a conversation's earlier turns)
    instead of computing them (`ortspec.runtime.batching.prefix_cache`); 0 turns it off.
    """
    from tokenizers import Tokenizer

    cache_bytes = prefix_cache_bytes(prefix_cache_mib)  # checked before anything is opened
    root = Path(path)
    manifest = mf.read_manifest(root)
    tok_path = mf.safe_member(root, manifest.tokenizer, what="manifest.tokenizer")
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
        raise mf.ManifestError(f"{manifest.tokenizer!r} is not a tokenizers file: {e}") from None
    draft_dir = draft_manifest = None
    if draft:
        if draft is True:
            drafts = manifest.extra.get("drafts") or []
            if not drafts:
                raise InvalidOptionError(f"{root} lists no draft model in its manifest")
            draft_dir = mf.safe_member(root, drafts[0], what="manifest.extra.drafts")
        else:
            draft_dir = Path(draft)
        draft_manifest = mf.read_manifest(draft_dir)
        _check_pairing(manifest, draft_manifest, draft_dir)
    # two models in one process: their intra-op threads must not spin against each other
    sessions = OrtSessions(root, manifest=manifest, providers=providers, threads=threads,
                           allow_spinning=draft_dir is None)
    draft_sessions = None
    if draft_dir is not None:
        draft_sessions = OrtSessions(draft_dir, manifest=draft_manifest, providers=providers,
                                     threads=threads, allow_spinning=False)
    return Model(sessions=sessions, tokenizer=tokenizer, manifest=manifest, path=root,
                 draft_sessions=draft_sessions, max_concurrent=max_concurrent, when_busy=when_busy,
                 busy_timeout=busy_timeout, batch=batch, prefix_cache_bytes=cache_bytes)


def _check_pairing(target: mf.Manifest, draft: mf.Manifest, draft_dir: Path) -> None:
    """A draft must speak the target's tokens: same vocabulary, same tokenizer file."""
    if draft.architecture.vocab_size != target.architecture.vocab_size:
        raise InvalidOptionError(
            f"draft {draft_dir} has a vocabulary of {draft.architecture.vocab_size}, "
            f"the target {target.architecture.vocab_size}: they must share a tokenizer"
        )
    if draft.files.get(draft.tokenizer) != target.files.get(target.tokenizer):
        raise InvalidOptionError(f"draft {draft_dir} has a different tokenizer from the target's")
