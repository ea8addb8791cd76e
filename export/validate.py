"""The export's last gate: run the written graph through `OrtDecoder` and compare logits.

Two comparisons on a fixed prompt, both as max |difference| over every position and token:
verify vs step (the verify entry point in blocks of max_verify_len against the step entry point
token by token) and verify vs PyTorch (the same logits against one forward pass of the
checkpoint in float32). The bounds, and the reasons for them, are `ortspec.runtime.check.tolerances`
(`TOLERANCES`): `ortspec check` applies the same verify-vs-step bound.

An export with hidden states (hidden_states.py) has its `hidden_states` output compared the
same two ways, per position, with the states PyTorch computes (transformers'
`output_hidden_states`), under `HIDDEN_STATE_TOLERANCES`: `validate_hidden_states`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ortspec.runtime.ort import manifest as mf
from ortspec.runtime.errors import ExportError
from ortspec.runtime.ort.decoder import OrtDecoder
from ortspec.runtime.check.tolerances import HIDDEN_STATE_TOLERANCES, TOLERANCES, Tolerances, \
    comparison_length

if TYPE_CHECKING:  # torch is imported only when an export really runs
    from .checkpoint import Checkpoint

VALIDATION_TEXT = ("The quick brown fox jumps over the lazy dog. Speculative decoding drafts "
                   "several tokens and verifies them in one forward pass.")


@dataclasses.dataclass(frozen=True)
class ValidationReport:
    prompt_tokens: int
    step_vs_verify: float  # max |logits(verify) - logits(step)|
    verify_vs_pytorch: float  # max |logits(verify) - logits(PyTorch)|
    step_vs_pytorch: float
    max_abs_logit: float  # of the PyTorch reference, the scale of the differences above
    bound_step_vs_verify: float  # the absolute bounds applied
    bound_vs_pytorch: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def validation_prompt(checkpoint: Checkpoint, *, capacity: int, max_verify_len: int) -> np.ndarray:
    """Token ids [n] of a fixed text, repeated or cut so that n = min(capacity,
    max(48, 2 * max_verify_len + 5)): at least two full verify blocks and a partial one."""
    n = comparison_length(capacity, max_verify_len)
    ids = list(checkpoint.tokenizer(VALIDATION_TEXT, add_special_tokens=True)["input_ids"])
    if not ids:
        ids = [0]
    while len(ids) < n:
        ids += ids
    arr = np.asarray(ids[:n], np.int64) % checkpoint.spec.vocab_size
    return arr


def validate_export(model_dir: Path, manifest: mf.Manifest, checkpoint: Checkpoint, *,
                    reference_weights: dict[str, np.ndarray] | None = None,
                    tolerances: Tolerances | None = None) -> ValidationReport:
    """Raise ExportError when the graph's logits are outside the dtype's tolerances.

    reference_weights: canonical name -> the weight the graph computes with, swapped into the
    PyTorch reference (a quantized graph's dequantized weights); tolerances: instead of the
    dtype's."""
    ids = validation_prompt(checkpoint, capacity=manifest.capacity,
                            max_verify_len=manifest.max_verify_len)
    verify, step = run_graph(model_dir, manifest, ids)
    reference = checkpoint.torch_logits(ids, replace=reference_weights or None)  # [n, vocab]
    return check_logits(verify, step, reference, tolerances or TOLERANCES[manifest.dtype],
                        manifest.dtype)


def run_graph(model_dir: Path, manifest: mf.Manifest, ids: np.ndarray) -> \
        tuple[np.ndarray, np.ndarray]:
    """The graph's logits on ids [n] through the verify entry point (in blocks) and through the
    step entry point token by token: ([n, vocab], [n, vocab])."""
    verify, step, _ = run_graph_outputs(model_dir, manifest, ids)
    return verify, step


def run_graph_outputs(model_dir: Path, manifest: mf.Manifest, ids: np.ndarray) -> \
        tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """run_graph's logits, and for a graph with hidden states the same calls' hidden states
    (verify [n, width], step [n, width]); None without."""
    hidden = None
    try:
        decoder = OrtDecoder(model_dir, manifest=manifest, providers=["CPUExecutionProvider"])
        verify = decoder.forward_batch(ids)  # [n, vocab]
        if manifest.hidden_state_layers is not None:
            verify_hidden = decoder.last_hidden_states()  # [n, width]
            step_hidden = []
        decoder.reset()
        step = []
        for t in ids:
            step.append(decoder.forward_token(int(t)))
            if manifest.hidden_state_layers is not None:
                step_hidden.append(decoder.last_hidden_states()[0])  # [width]
        step = np.stack(step)  # [n, vocab]
        if manifest.hidden_state_layers is not None:
            hidden = verify_hidden, np.stack(step_hidden)
    except ExportError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to run the graph fails the export
        raise ExportError(f"the exported graph does not run: {type(e).__name__}: {e}") from e
    return verify, step, hidden


@dataclasses.dataclass(frozen=True)
class Deviations:
    """How far the verify and the step entry points are from each other and from PyTorch, and
    the bounds they were held to (scaled by the reference's largest magnitude)."""

    step_vs_verify: float
    verify_vs_pytorch: float
    step_vs_pytorch: float
    scale: float  # max |reference|
    bound_step_vs_verify: float
    bound_vs_pytorch: float


def deviations(verify: np.ndarray, step: np.ndarray, reference: np.ndarray, tol: Tolerances, *,
               noun: str, subject: str, suffix: str = "") -> Deviations:
    """verify, step, reference: [n, width]. ExportError outside the bounds: "verify and step
    {noun} differ by ..." or "{subject} differ from PyTorch by ...{suffix}"."""
    scale = float(np.abs(reference).max())
    d = Deviations(step_vs_verify=float(np.abs(verify - step).max()),
                   verify_vs_pytorch=float(np.abs(verify - reference).max()),
                   step_vs_pytorch=float(np.abs(step - reference).max()), scale=scale,
                   bound_step_vs_verify=tol.step_vs_verify.at(scale),
                   bound_vs_pytorch=tol.vs_pytorch.at(scale))
    if not d.step_vs_verify <= d.bound_step_vs_verify:
        raise ExportError(f"validation failed: verify and step {noun} differ by "
                          f"{d.step_vs_verify:.3g} > {d.bound_step_vs_verify:.3g}")
    worst = max(d.verify_vs_pytorch, d.step_vs_pytorch)
    if not worst <= d.bound_vs_pytorch:
        raise ExportError(f"validation failed: {subject} differ from PyTorch by {worst:.3g} > "
                          f"{d.bound_vs_pytorch:.3g}{suffix}")
    return d


def check_logits(verify: np.ndarray, step: np.ndarray, reference: np.ndarray, tol: Tolerances,
                 what: str) -> ValidationReport:
    """Compare the entry points with each other and with the reference; ExportError outside
    the bounds (`what` names the comparison in the message)."""
    d = deviations(verify, step, reference, tol, noun="logits", subject="logits",
                   suffix=f" ({what})")
    return ValidationReport(
        prompt_tokens=int(verify.shape[0]), step_vs_verify=d.step_vs_verify,
        verify_vs_pytorch=d.verify_vs_pytorch, step_vs_pytorch=d.step_vs_pytorch,
        max_abs_logit=d.scale, bound_step_vs_verify=d.bound_step_vs_verify,
        bound_vs_pytorch=d.bound_vs_pytorch)


@dataclasses.dataclass(frozen=True)
class HiddenStateReport:
    layers: list[int]  # the manifest's hidden_state_layers
    step_vs_verify: float  # max |hidden(verify) - hidden(step)| over every position and column
    verify_vs_pytorch: float
    step_vs_pytorch: float
    max_abs_state: float  # of the PyTorch reference: the scale of the differences above
    bound_step_vs_verify: float
    bound_vs_pytorch: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def torch_hidden_states(checkpoint: Checkpoint, ids: np.ndarray, layers: tuple[int, ...], *,
                        replace: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """PyTorch's residual streams entering `layers` on ids [n], one forward pass:
    [n, len(layers) * hidden] float32, transformers' `hidden_states[k]` for each k in order
    (index 0 the embeddings, k the output of layer k - 1). replace: as torch_logits'."""
    import torch  # the export's dependency, imported only when an export runs

    with torch.no_grad(), checkpoint.replaced(replace or {}):
        out = checkpoint.model(torch.as_tensor(ids, dtype=torch.int64)[None], use_cache=False,
                               output_hidden_states=True)
    return np.concatenate([out.hidden_states[k][0].float().numpy() for k in layers], axis=-1)


def validate_hidden_states(model_dir: Path, manifest: mf.Manifest, checkpoint: Checkpoint, *,
                           reference_weights: dict[str, np.ndarray] | None = None,
                           tolerances: Tolerances | None = None) -> HiddenStateReport:
    """Raise ExportError when the `hidden_states` output of the verify or the step entry point
    strays from PyTorch's states (or the two from each other) beyond HIDDEN_STATE_TOLERANCES
    (`tolerances` instead, with `reference_weights` swapped into PyTorch, for a quantized
    graph, as validate_export). The logits of the same graph are validate_export's, under the
    logits' own bounds."""
    layers = manifest.hidden_state_layers
    assert layers is not None  # internal: called for exports with hidden states only
    ids = validation_prompt(checkpoint, capacity=manifest.capacity,
                            max_verify_len=manifest.max_verify_len)
    _, _, hidden = run_graph_outputs(model_dir, manifest, ids)
    assert hidden is not None
    reference = torch_hidden_states(checkpoint, ids, layers, replace=reference_weights)
    verify_h, step_h = hidden
    d = deviations(verify_h, step_h, reference,
                   tolerances or HIDDEN_STATE_TOLERANCES[manifest.dtype],
                   noun="hidden states", subject=f"hidden states of layers {list(layers)}")
    report = HiddenStateReport(
        layers=list(layers), step_vs_verify=d.step_vs_verify,
        verify_vs_pytorch=d.verify_vs_pytorch, step_vs_pytorch=d.step_vs_pytorch,
        max_abs_state=d.scale, bound_step_vs_verify=d.bound_step_vs_verify,
        bound_vs_pytorch=d.bound_vs_pytorch)
    return report
