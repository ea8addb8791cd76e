"""Export an EAGLE-3 head checkpoint (eagle3.py) beside its target: `OUT/drafts/eagle3`, with
the graphs of eagle3_graph.py, `target_ids.npy` (d2t applied) and `head.json`
(runtime/ort/head_config.py), validated against the PyTorch reference (eagle3_reference.py)
before it is listed in the target manifest's `draft_head`.

Validation runs the written directory through the runtime's own `OrtDraftHead`, against the
reference forward on the same inputs, entry by entry:

- a first call of several entries from the target's hidden states (its exported graph run on a
  random prompt, entry j pairing token j + 1 with the states after token j; fc, then the
  layer);
- single-entry steps fed by the head's own hidden output, each drafting the reference's
  argmax (mapped to a target id) as the next token, as a chain draft does;
- a truncate back to the first call and the same steps re-fed in one call.

Every logit must lie within `HEAD_TOLERANCE` of the reference (relative to the largest
reference logit), and every hidden output likewise; the deviations go into head.json.

`add_draft_head(model_dir, head_path)` adds a head to an existing export whose graph already
returns the head's hidden states (`--hidden-states` with the head's layer ids); `export_model
(..., draft_head=PATH)` does both at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ortspec.runtime.check.tolerances import Bound
from ortspec.runtime.errors import ExportError
from ortspec.runtime.ort import head_config as hc
from ortspec.runtime.ort import manifest as mf

from .drafts import DRAFTS_DIR, read_target_manifest, rewrite_manifest
from .eagle3 import Eagle3Head, Eagle3Target, check_fits, read_eagle3_head
from .eagle3_graph import FC_GRAPH, HEAD_GRAPH, build_head_graphs, check_buildable, \
    embeds_quantized
from .errors import ExportOptionError
from .graph_spec import HEAD_QUANTS, WeightQuant
from .quantize import quantize_blockwise

HEAD_NAME = "eagle3"
HEAD_DIR = f"{DRAFTS_DIR}/{HEAD_NAME}"  # relative to the target directory: manifest.draft_head
# float32 graph against float32 PyTorch: GQA's and MatMul's summation orders only
HEAD_TOLERANCE = Bound(absolute=1e-4, relative=2e-4)
# an int8 head against PyTorch on its dequantized weights: the MatMulNBits kernels round the
# activations to int8 (accuracy level 4), a share of the logit scale as for int4 drafts
HEAD_QUANT_TOLERANCE = Bound(absolute=1e-3, relative=0.05)
LINEAR_FIELDS = ("fc", "q", "k", "v", "o", "gate", "up", "down")
FIRST_ROWS, OWN_STEPS = 5, 3  # entries of the first call; steps fed by the head's own output
HEAD_REVISION = 1


def target_of(manifest: mf.Manifest) -> Eagle3Target:
    a = manifest.architecture
    return Eagle3Target(hidden_size=a.hidden_size, vocab_size=a.vocab_size,
                        num_layers=a.num_layers)


def hf_target(source_dir: Path) -> Eagle3Target | None:
    """The target's sizes from a Hugging Face directory's config.json (None when not there)."""
    try:
        config = json.loads((source_dir / "config.json").read_text(encoding="utf-8"))
        config = config.get("text_config", config)
        return Eagle3Target(int(config["hidden_size"]), int(config["vocab_size"]),
                            int(config["num_hidden_layers"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_head_for(head_path: str | os.PathLike, target: Eagle3Target | None) -> Eagle3Head:
    """The head at `head_path`, checked against `target` when known (ExportError naming the
    key); the caller checks the fit later (check_fits) when the target is not known yet."""
    path = Path(head_path).expanduser()
    if not path.is_dir():
        raise ExportError(f"draft head {str(path)!r} is not a directory (an EAGLE-3 head is "
                          f"config.json and safetensors weights)")
    head = read_eagle3_head(path, target=target)
    check_buildable(head)
    return head


def check_head_quant(quant: str | None) -> WeightQuant | None:
    """The HEAD_QUANTS preset named `quant` (None: float32); ExportOptionError otherwise."""
    if quant is None:
        return None
    if quant not in HEAD_QUANTS:
        raise ExportOptionError(f"draft_head_quant must be one of {', '.join(HEAD_QUANTS)} or "
                                f"None, got {quant!r}")
    return HEAD_QUANTS[quant]


def dequantized_head(head: Eagle3Head, quant: WeightQuant | None) -> Eagle3Head:
    """The head with the weights a `quant` graph multiplies by (each quantized and
    dequantized again, as builder.py's MatMulNBits stores them): the reference it is
    validated against."""
    if quant is None:
        return head

    def back(w: np.ndarray, bits: int, scheme: str) -> np.ndarray:
        if w.shape[1] % quant.block_size:
            return w  # left float by the builder
        return quantize_blockwise(w, bits=bits, block_size=quant.block_size,
                                  scheme=scheme).dequantize()

    weights = {f: back(getattr(head, f), quant.bits, quant.scheme) for f in LINEAR_FIELDS}
    weights["lm_head"] = back(head.lm_head, quant.lm_head_bits, quant.lm_head_scheme)
    if head.embed is not None:
        weights["embed"] = dequantized_embedding(head.embed, quant)
    return dataclasses.replace(head, **weights)


def dequantized_embedding(table: np.ndarray | None, quant: WeightQuant | None) -> \
        np.ndarray | None:
    """The embedding rows a `quant` head gathers (eagle3_graph's 8-bit table), or `table`."""
    if table is None or not embeds_quantized(quant, table.shape[1]):
        return table
    return quantize_blockwise(table, bits=8, block_size=quant.block_size,
                              scheme="symmetric").dequantize()


def write_draft_head(dest: Path, head: Eagle3Head, *, target: Eagle3Target, capacity: int,
                     target_embed: np.ndarray | None, source: dict[str, Any],
                     quant: str | None = None, target_dir: Path | None = None) -> hc.HeadConfig:
    """Build, validate and describe the head in the (empty) directory `dest` (quant: a
    HEAD_QUANTS name, or None for float32; target_dir: validate_head's)."""
    config = write_head_files(dest, head, target=target, capacity=capacity,
                              target_embed=target_embed, source=source, quant=quant)
    report = validate_head(dest, head, target_embed=target_embed, quant=quant,
                           target_dir=target_dir)
    config = dataclasses.replace(config, extra={**config.extra, "validation": report})
    config.write(dest)
    return config


def write_head_files(dest: Path, head: Eagle3Head, *, target: Eagle3Target, capacity: int,
                     target_embed: np.ndarray | None, source: dict[str, Any],
                     quant: str | None = None) -> hc.HeadConfig:
    """The head's graphs, target_ids.npy and head.json in `dest`, not yet validated."""
    check_fits(head, target)
    q = check_head_quant(quant)
    dest.mkdir(parents=True, exist_ok=True)
    files = build_head_graphs(head, dest, capacity=capacity, embed=target_embed, quant=q)
    np.save(dest / hc.TARGET_IDS_FILE, head.target_ids().astype(np.int64))
    names = (*files.files, hc.TARGET_IDS_FILE)
    config = hc.HeadConfig(
        kind="eagle3", hidden_size=head.hidden_size, target_hidden_size=head.target_hidden_size,
        layer_ids=head.layers_for(target.num_layers), vocab_size=target.vocab_size,
        draft_vocab_size=head.draft_vocab_size, num_heads=head.num_heads,
        num_kv_heads=head.num_kv_heads, head_dim=head.head_dim, capacity=capacity,
        graphs={"fc": FC_GRAPH, "head": HEAD_GRAPH}, target_ids=hc.TARGET_IDS_FILE,
        files={n: mf.sha256_file(dest / n) for n in names},
        extra={"revision": HEAD_REVISION, "source": source,
               "source_format": head.source_format, "own_embedding": head.has_own_embedding,
               "weight_bytes": files.weight_bytes,
               "weights": {"format": "float", "dtype": "fp32"} if q is None else
               {"format": "MatMulNBits", "preset": quant, **dataclasses.asdict(q)}})
    config.write(dest)
    return config


def validate_head(head_dir: Path, head: Eagle3Head, *, target_embed: np.ndarray | None,
                  quant: str | None = None, target_dir: Path | None = None,
                  seed: int = 0) -> dict[str, Any]:
    """Compare the exported head with the PyTorch reference (see the module docstring);
    ExportError at the first entry beyond HEAD_TOLERANCE (a quantized head: against the
    reference on its dequantized weights, within HEAD_QUANT_TOLERANCE). Returns the largest
    deviations. target_dir: the export whose graph returns the head's hidden states, which
    then feed the first call (else random states)."""
    import torch

    from ortspec.runtime.ort.decoder import OrtDecoder
    from ortspec.runtime.ort.head import open_draft_head

    from .eagle3_reference import embed, head_forward, project_aux

    ort_head = open_draft_head(head_dir, threads=1)
    head = dequantized_head(head, check_head_quant(quant))
    target_embed = dequantized_embedding(target_embed, check_head_quant(quant))
    tolerance = HEAD_TOLERANCE if quant is None else HEAD_QUANT_TOLERANCE
    rng = np.random.default_rng(seed)
    if target_dir is None:  # random states of unit scale
        tokens = rng.integers(0, ort_head.vocab_size, FIRST_ROWS)  # [n] target ids
        aux = rng.normal(size=(FIRST_ROWS, head.fc.shape[1])).astype(np.float32)  # [n, K * Ht]
    else:  # the target's own: entry j pairs token j + 1 with the states after token j
        prompt = rng.integers(0, ort_head.vocab_size, FIRST_ROWS + 1)
        target = OrtDecoder(target_dir, providers=["CPUExecutionProvider"], threads=1)
        target.forward_batch(prompt)
        tokens, aux = prompt[1:], target.last_hidden_states()[:-1]  # [n], [n, K * Ht]
    worst = {"logits": 0.0, "hidden": 0.0}

    def compare(what: str, first: int, logits: np.ndarray, hidden: np.ndarray, ref) -> None:
        want = ref.logits.numpy()
        bound = tolerance.at(float(np.abs(want).max()))
        for name, got, exp in (("logits", logits, want), ("hidden", hidden, ref.hidden.numpy())):
            scale = bound if name == "logits" else tolerance.at(float(np.abs(exp).max()))
            dev = np.abs(got - exp).max(axis=-1)  # [n]
            worst[name] = max(worst[name], float(dev.max()))
            bad = np.flatnonzero(dev > scale)
            if bad.size:
                raise ExportError(
                    f"draft head validation: the ONNX head's {name} differ from the PyTorch "
                    f"reference at entry {first + int(bad[0])} ({what}): max |difference| "
                    f"{float(dev[bad[0]]):.3g} > {scale:.3g}")

    with torch.no_grad():
        first = head_forward(head, project_aux(head, aux), embed(head, tokens, target_embed),
                             np.arange(FIRST_ROWS))
    logits, hidden = ort_head.forward(tokens, aux, from_target=True)
    compare("first call, from the target's hidden states", 0, logits, hidden, first)
    kv, state, steps = first.kv, first.hidden[-1:], []
    token = int(head.target_ids()[int(first.logits[-1].argmax())])
    for k in range(OWN_STEPS):
        ref = head_forward(head, state, embed(head, [token], target_embed), [FIRST_ROWS + k], kv)
        logits, hidden = ort_head.forward([token], state.numpy(), from_target=False)
        compare("a step fed by the head's own hidden output", FIRST_ROWS + k, logits, hidden,
                ref)
        steps.append((token, state.numpy()[0], ref))
        kv, state = ref.kv, ref.hidden[-1:]
        token = int(head.target_ids()[int(ref.logits[-1].argmax())])
    ort_head.truncate(FIRST_ROWS)
    logits, hidden = ort_head.forward([t for t, _, _ in steps],
                                      np.stack([s for _, s, _ in steps]), from_target=False)
    refed = dataclasses.replace(steps[0][2], logits=torch.cat([r.logits for *_, r in steps]),
                                hidden=torch.cat([r.hidden for *_, r in steps]))
    compare("the steps re-fed in one call after truncate", FIRST_ROWS, logits, hidden, refed)
    return {"entries": FIRST_ROWS + 2 * OWN_STEPS,
            "first_call_from": "random states" if target_dir is None else
            "the target's hidden states",
            "max_logit_deviation": worst["logits"],
            "max_hidden_deviation": worst["hidden"],
            "tolerance": dataclasses.asdict(tolerance)}


def export_head_into(target_dir: Path, head: Eagle3Head, *, target: Eagle3Target,
                     capacity: int, target_embed: np.ndarray | None,
                     source: dict[str, Any], quant: str | None = None) -> Path:
    """Write the head into `target_dir/drafts/eagle3` (a temporary sibling renamed into place,
    replacing an older head) and return that path; the caller lists it in the manifest."""
    dest = target_dir / HEAD_DIR
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{HEAD_NAME}.tmp-", dir=dest.parent))
    try:
        write_draft_head(tmp, head, target=target, capacity=capacity,
                         target_embed=target_embed, source=source, quant=quant,
                         target_dir=target_dir)
        os.chmod(tmp, 0o755)
        if dest.exists():
            old = dest.with_name(f".{HEAD_NAME}.old-{os.getpid()}")
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def head_source(head_path: str | os.PathLike) -> dict[str, Any]:
    """What head.json records of the checkpoint: its path and the sha256 of its files."""
    path = Path(head_path).expanduser().absolute()
    return {"path": str(path), "files": {p.name: mf.sha256_file(p) for p in sorted(
        path.glob("*")) if p.is_file() and p.suffix in (".json", ".safetensors")}}


def add_draft_head(model_dir: str | os.PathLike, head_path: str | os.PathLike, *,
                   source: str | os.PathLike | None = None, overwrite: bool = False,
                   quant: str | None = None, progress: bool = False) -> Path:
    """Add the EAGLE-3 head at `head_path` to the existing export `model_dir`, into
    `model_dir/drafts/eagle3`, and set its manifest's draft_head; returns the head's path.

    The export must already return the head's hidden states (its manifest's
    hidden_state_layers are the head's layer ids). A head without its own embedding embeds
    with the target's table, read from the target's checkpoint (`source`, default the one its
    manifest records). ExportError, with the directory unchanged, for a head that does not
    fit (naming the key) or an export that does not return its states. quant: a HEAD_QUANTS
    name (the head's weights as MatMulNBits), or None for float32."""
    check_head_quant(quant)
    target_dir = Path(model_dir).expanduser().absolute()
    manifest = read_target_manifest(target_dir, adding="a draft head")
    target = target_of(manifest)
    head = read_head_for(head_path, target)
    layers = head.layers_for(target.num_layers)
    if manifest.hidden_state_layers != layers:
        raise ExportError(f"{target_dir} returns hidden states of layers "
                          f"{list(manifest.hidden_state_layers or ())}, the head reads "
                          f"eagle_aux_hidden_state_layer_ids {list(layers)}; re-export the "
                          f"target with --draft-head (or --hidden-states "
                          f"{','.join(map(str, layers))})")
    if (target_dir / HEAD_DIR).exists() and not overwrite:
        raise ExportError(f"{target_dir / HEAD_DIR} already exists; pass overwrite=True "
                          f"(--overwrite) to replace it")
    embed = None
    if not head.has_own_embedding:
        embed = _target_embedding(manifest, target_dir, source, progress=progress)
    dest = export_head_into(target_dir, head, target=target, capacity=manifest.capacity,
                            target_embed=embed, source=head_source(head_path), quant=quant)
    set_draft_head(target_dir, HEAD_DIR)
    return dest


def set_draft_head(target_dir: Path, relative: str) -> None:
    """Set target_dir's manifest draft_head atomically (the manifest is not in `files`)."""
    data = json.loads((target_dir / mf.MANIFEST_FILE).read_text(encoding="utf-8"))
    data["draft_head"] = relative
    rewrite_manifest(target_dir, data)


def _target_embedding(manifest: mf.Manifest, target_dir: Path,
                      source: str | os.PathLike | None, *, progress: bool) -> np.ndarray:
    from .checkpoint import load_checkpoint
    from .sources import identify_source, materialize, recorded_source

    src = identify_source(source) if source is not None else recorded_source(manifest)
    src = materialize(src, progress=progress)
    if src.record()["sha256"] != manifest.source.get("sha256"):
        raise ExportError(f"{src.path} is not the checkpoint {target_dir.name} was exported "
                          f"from (its sha256 differs from the manifest's)")
    ckpt = load_checkpoint(src, capacity=manifest.capacity, progress=False)
    return np.asarray(ckpt.weight("embed"), np.float32)
