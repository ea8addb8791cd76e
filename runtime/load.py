"""`load_model`: a model directory -> a `Model` (sessions, tokenizer, an optional draft).

Everything is checked before a session opens: the manifest, the tokenizer file, the draft's
pairing with the target (vocabulary and tokenizer), the prefix cache size, the execution
providers (chosen once, for the target and its draft alike).

    model = load_model("models/exported/smollm2-135m-instruct-fp32", calibrate=True)
    print(model.generate("Name a planet.", chat=True).text)
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from .ort import manifest as mf
from .errors import InvalidOptionError
from .model import DEFAULT_MAX_CONCURRENT, ListedDraft, Model
from .batching.prefix_cache import DEFAULT_PREFIX_CACHE_MIB, prefix_cache_bytes
from .ort.providers import ProviderChoice, choose_providers
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
    calibrate: bool = False,
) -> Model:
    """Read and check `path/manifest.json`, open its entry points, load its tokenizer.

    `providers`: onnxruntime's convention (names or (name, options) pairs; see
    `ort.providers`), or a `ProviderChoice` made earlier; chosen once for the target and its
    draft. `draft`: a draft model directory to pair with the target, or True to take the one
    the target's manifest lists (`extra["drafts"]`, first entry), opened now; None (default)
    checks the listed one now and opens it on the first request that needs a draft model
    (`Model.load_draft`); False: no draft model.
    `max_concurrent`: how many requests decode at once (each holds a slot of KV state, made on
    first need: `Model.slot_bytes` each, about 114 MiB for the default model in fp32 at
    capacity 2048). A request beyond that waits for a slot (`when_busy="wait"`, for at most
    `busy_timeout` seconds if given) or fails at once with ModelBusyError (`"error"`).
    `batch`: decode concurrent requests in shared calls (`ortspec.runtime.batching.runner`); None
    (default) does when the graph takes several rows (manifest `max_batch` > 1: an export with
    `--attention window`) and `max_concurrent` > 1. The rows are then at most `max_batch`.
    `prefix_cache_mib`: the model keeps the keys and values of recent prompts, up to this many
    MiB (and as many again for a batched draft), and copies them into a new request that
    starts with the same tokens (a shared system prompt, a conversation's earlier turns)
    instead of computing them (`ortspec.runtime.batching.prefix_cache`); 0 turns it off. A
    model that decodes each request on calls of its own keeps them only where its graph
    computes a position alike in any call (`Manifest.rows_exact`: the int4 exports).
    `calibrate`: make the cost model now (`Model.prepare`: read or measure the cost curve), not
    on the first request that needs it.
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
    choice = choose_providers(providers)  # once: the target's and the draft's sessions
    listed = _listed_draft(root, manifest) if draft is None or draft is True else None
    if draft is True and listed is None:
        raise InvalidOptionError(f"{root} lists no draft model in its manifest; add one with "
                                 f"`ortspec export [SOURCE] --draft-only --draft-quant int4 "
                                 f"--out {root}` (or name a draft model directory)")
    draft_dir = listed if draft is True else Path(draft) if draft not in (None, False) else None
    draft_manifest = None
    if draft_dir is not None:
        draft_manifest = mf.read_manifest(draft_dir)
        _check_pairing(manifest, draft_manifest, draft_dir)
    # two models in one process (a listed draft may join later): their intra-op threads must
    # not spin against each other
    sessions = OrtSessions(root, manifest=manifest, providers=choice, threads=threads,
                           allow_spinning=draft_dir is None and listed is None)
    draft_sessions = listed_draft = None
    if draft_dir is not None:
        draft_sessions = OrtSessions(draft_dir, manifest=draft_manifest, providers=choice,
                                     threads=threads, allow_spinning=False)
    elif listed is not None:
        listed_draft = ListedDraft(listed, _max_batch(listed), functools.partial(
            _open_listed_draft, manifest, listed, choice, threads))
    model = Model(sessions=sessions, tokenizer=tokenizer, manifest=manifest, path=root,
                  draft_sessions=draft_sessions, listed_draft=listed_draft,
                  max_concurrent=max_concurrent, when_busy=when_busy, busy_timeout=busy_timeout,
                  batch=batch, prefix_cache_bytes=cache_bytes)
    if calibrate:
        model.prepare()
    return model


def _open_listed_draft(target: mf.Manifest, directory: Path, providers: ProviderChoice,
                       threads: int | None) -> OrtSessions:
    """A listed draft's sessions, checked as `load_model(path, draft=True)` checks it."""
    draft_manifest = mf.read_manifest(directory)
    _check_pairing(target, draft_manifest, directory)
    return OrtSessions(directory, manifest=draft_manifest, providers=providers, threads=threads,
                       allow_spinning=False)


def _max_batch(directory: Path) -> int:
    """The rows a listed draft's graph takes (1 if its manifest cannot be read now: loading it
    will say why)."""
    try:
        return mf.read_manifest(directory, verify_checksums=False).max_batch
    except mf.ManifestError:
        return 1


def _listed_draft(root: Path, manifest: mf.Manifest) -> Path | None:
    """The first draft model the manifest lists (`extra["drafts"]`), if any."""
    drafts = manifest.extra.get("drafts") or []
    return mf.safe_member(root, drafts[0], what="manifest.extra.drafts") if drafts else None


def _check_pairing(target: mf.Manifest, draft: mf.Manifest, draft_dir: Path) -> None:
    """A draft must speak the target's tokens: same vocabulary, same tokenizer file."""
    if draft.architecture.vocab_size != target.architecture.vocab_size:
        raise InvalidOptionError(
            f"draft {draft_dir} has a vocabulary of {draft.architecture.vocab_size}, "
            f"the target {target.architecture.vocab_size}: they must share a tokenizer"
        )
    if draft.files.get(draft.tokenizer) != target.files.get(target.tokenizer):
        raise InvalidOptionError(f"draft {draft_dir} has a different tokenizer from the target's")
