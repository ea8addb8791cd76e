"""`head.json`: what a trained draft head's directory holds (`OUT/drafts/eagle3`, written by
`ortspec export --draft-head`, listed by the target manifest's `draft_head`).

    {
      "format": "ortspec-draft-head", "format_version": 1, "kind": "eagle3",
      "hidden_size": H, "target_hidden_size": Ht, "layer_ids": [2, 15, 27],
      "vocab_size": V, "draft_vocab_size": Vd,
      "num_heads": .., "num_kv_heads": .., "head_dim": .., "capacity": C,
      "graphs": {"fc": "fc.onnx", "head": "head.onnx"},
      "target_ids": "target_ids.npy",
      "files": {"fc.onnx": sha256, ...},   every file the head reads, checksummed
      "extra": {...}                       the source checkpoint, the export's validation
    }

The `fc` graph maps the target's hidden states [rows, K * Ht] (K = len(layer_ids), the target
manifest's hidden_state_layers) to [rows, H]; the `head` graph is one decoder layer over a KV
cache of C entries, with logits over the Vd draft ids; target_ids.npy ([Vd] int64) is the target
token id of each draft id. The graphs' I/O names are in export/eagle3_graph.py's docstring.
Reading checks every field, that each named file lies inside the directory and matches its
sha256, and that the graphs open nothing outside it (onnx_guard).
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ManifestError
from .graph_io import ATTENTION_MASK, INPUT_IDS, LOGITS, past_key_name, past_value_name, \
    present_key_name, present_value_name
from .manifest import safe_member, sha256_file
from .onnx_guard import check_reference, read_graph_summary

HEAD_FILE = "head.json"
FORMAT_NAME = "ortspec-draft-head"
FORMAT_VERSION = 1
KINDS = ("eagle3",)
TARGET_IDS_FILE = "target_ids.npy"
# the graphs' I/O beside graph_io's names (export/eagle3_graph.py writes them)
AUX, HIDDEN, HIDDEN_OUT = "aux", "hidden", "hidden_out"
FC_IO = ({AUX}, {HIDDEN})
HEAD_IO = ({INPUT_IDS, ATTENTION_MASK, HIDDEN, past_key_name(0), past_value_name(0)},
           {LOGITS, HIDDEN_OUT, present_key_name(0), present_value_name(0)})

_SIZES = ("hidden_size", "target_hidden_size", "vocab_size", "draft_vocab_size", "num_heads",
          "num_kv_heads", "head_dim", "capacity")


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    kind: str
    hidden_size: int  # H: the head's width, of hidden and hidden_out
    target_hidden_size: int  # Ht: each of the K target states fc reads
    layer_ids: tuple[int, ...]  # the target layers whose entering states fc reads, in order
    vocab_size: int  # the target's vocabulary: the token ids the head embeds
    draft_vocab_size: int  # Vd: rows of logits
    num_heads: int
    num_kv_heads: int
    head_dim: int
    capacity: int  # entries the KV buffers hold
    graphs: dict[str, str]  # "fc", "head" -> file name
    target_ids: str  # the .npy file
    files: dict[str, str]  # file name -> sha256
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def aux_width(self) -> int:
        """Columns of fc's input: K * Ht."""
        return len(self.layer_ids) * self.target_hidden_size

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["layer_ids"] = list(self.layer_ids)
        return json.dumps({"format": FORMAT_NAME, **d}, indent=2) + "\n"

    def write(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / HEAD_FILE
        path.write_text(self.to_json(), encoding="utf-8")
        return path


def read_head_config(directory: str | os.PathLike, *,
                     verify_checksums: bool = True) -> HeadConfig:
    """Read and check `directory/head.json` and the files it names (ManifestError naming what
    is wrong)."""
    d = Path(directory)
    path = d / HEAD_FILE
    if not path.is_file():
        raise ManifestError(f"{str(d)!r} has no {HEAD_FILE}; is it a draft head written by "
                            f"`ortspec export --draft-head`?")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from None
    config = parse_head_config(data, where=str(path))
    for name, digest in config.files.items():
        p = safe_member(d, name, what=f"{HEAD_FILE} files")
        if not p.is_file():
            raise ManifestError(f"{HEAD_FILE} names {name!r}, which is missing from {str(d)!r}")
        if verify_checksums and sha256_file(p) != digest:
            raise ManifestError(f"{name!r} does not match its sha256 in {HEAD_FILE} (corrupted?)")
    listed = {posixpath.normpath(k.replace("\\", "/")) for k in config.files}
    for role, (inputs, outputs) in (("fc", FC_IO), ("head", HEAD_IO)):
        _check_graph(d, config.graphs[role], listed, inputs, outputs)
    return config


def parse_head_config(data: Any, *, where: str = HEAD_FILE) -> HeadConfig:
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise ManifestError(f"{where}: not an ortspec draft head (format {FORMAT_NAME!r})")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise ManifestError(f"{where}: format_version {version!r}; this ortspec reads "
                            f"{FORMAT_VERSION}")
    if data.get("kind") not in KINDS:
        raise ManifestError(f"{where}: kind must be one of {', '.join(KINDS)}, got "
                            f"{data.get('kind')!r}")
    sizes = {}
    for key in _SIZES:
        value = data.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ManifestError(f"{where}: {key} must be a positive integer, got {value!r}")
        sizes[key] = value
    if sizes["draft_vocab_size"] > sizes["vocab_size"]:
        raise ManifestError(f"{where}: draft_vocab_size {sizes['draft_vocab_size']} exceeds "
                            f"vocab_size {sizes['vocab_size']}")
    if sizes["num_heads"] % sizes["num_kv_heads"]:
        raise ManifestError(f"{where}: num_heads is not a multiple of num_kv_heads")
    ids = data.get("layer_ids")
    if not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in ids):
        raise ManifestError(f"{where}: layer_ids must be a list of positive layer ids, got "
                            f"{ids!r}")
    graphs = data.get("graphs")
    if not isinstance(graphs, dict) or set(graphs) != {"fc", "head"} or not all(
            isinstance(v, str) for v in graphs.values()):
        raise ManifestError(f"{where}: graphs must name the 'fc' and 'head' files, got "
                            f"{graphs!r}")
    files = data.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in files.items()):
        raise ManifestError(f"{where}: files must map file names to sha256 hex digests")
    target_ids = data.get("target_ids")
    for name in (*graphs.values(), target_ids):
        if name not in files:
            raise ManifestError(f"{where}: files has no sha256 for {name!r}")
    extra = data.get("extra", {})
    if not isinstance(extra, dict):
        raise ManifestError(f"{where}: extra must be an object")
    return HeadConfig(kind=data["kind"], layer_ids=tuple(ids), graphs=dict(graphs),
                      target_ids=target_ids, files=dict(files), extra=extra, **sizes)


def read_target_ids(directory: str | os.PathLike, config: HeadConfig) -> np.ndarray:
    """target_ids.npy: [draft_vocab_size] int64, distinct ids inside the target vocabulary."""
    path = safe_member(Path(directory), config.target_ids, what=f"{HEAD_FILE} target_ids")
    ids = _read_npy_int64(path, config.target_ids)
    if ids.shape != (config.draft_vocab_size,):
        raise ManifestError(f"{config.target_ids!r}: expected int64 [{config.draft_vocab_size}], "
                            f"got {ids.dtype} {list(ids.shape)}")
    if ids.min() < 0 or ids.max() >= config.vocab_size or np.unique(ids).size != ids.size:
        raise ManifestError(f"{config.target_ids!r}: target ids must be distinct and inside "
                            f"0..{config.vocab_size - 1}")
    return ids


def _read_npy_int64(path: Path, name: str) -> np.ndarray:
    """A 1-D little-endian int64 .npy file, its header parsed by numpy.lib.format (never
    np.load: nothing in a model directory is unpickled)."""
    from numpy.lib import format as npy

    try:
        with open(path, "rb") as f:
            version = npy.read_magic(f)
            read_header = npy.read_array_header_1_0 if version == (1, 0) else \
                npy.read_array_header_2_0
            shape, fortran, dtype = read_header(f)
            if dtype != np.dtype("<i8") or len(shape) != 1 or fortran:
                raise ValueError(f"{dtype} {list(shape)}, not a 1-D int64 array")
            ids = np.fromfile(f, dtype=dtype, count=shape[0])
    except (OSError, ValueError) as e:
        raise ManifestError(f"{name!r}: not a 1-D int64 NumPy array file ({e})") from None
    if ids.size != shape[0]:
        raise ManifestError(f"{name!r}: truncated ({ids.size} of {shape[0]} ids)")
    return ids


def _check_graph(d: Path, name: str, listed: set[str], inputs: set[str],
                 outputs: set[str]) -> None:
    safe_member(d, name, what=f"{HEAD_FILE} graphs")
    summary = read_graph_summary(d / name)
    for ref in summary.references:
        check_reference(d, name, ref, listed)
    if set(summary.inputs) != inputs or not outputs <= set(summary.outputs):
        raise ManifestError(f"{name!r}: graph I/O is not a draft head's (inputs "
                            f"{sorted(summary.inputs)}, expected {sorted(inputs)}; outputs "
                            f"{sorted(summary.outputs)}, expected {sorted(outputs)})")
