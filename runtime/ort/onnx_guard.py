"""What an `.onnx` file would make ONNX Runtime open, read before ONNX Runtime sees it.

A graph stores large tensors outside itself: a TensorProto whose `external_data` entry
`location` names a file, relative to the graph's folder, that ONNX Runtime opens and maps at
session creation. A model directory from someone else could point that at `/etc/shadow`,
`../../secret.bin`, or a symlink leading out of the directory. `check_graph` walks the file's
protobuf itself (the runtime does not depend on the `onnx` package) and refuses, as
`ManifestError`, every location that is absolute, climbs with `..`, resolves outside the model
directory, or is not listed with a sha256 in the manifest's `files` (so its bytes were checked).
It also compares the graph's inputs and outputs with the names the manifest implies.

Where tensors can hide, with field numbers from onnx.proto (onnx 1.17-1.20):

    ModelProto      graph = 7, training_info = 20, functions = 25
    GraphProto      node = 1, initializer = 5, input = 11, output = 12, sparse_initializer = 15
    NodeProto       op_type = 4, attribute = 5
    AttributeProto  name = 1, s = 4, t = 5, g = 6, tensors = 10, graphs = 11,
                    sparse_tensor = 22, sparse_tensors = 23
    TensorProto     name = 8, external_data = 13 (StringStringEntryProto), data_location = 14
    SparseTensorProto  values = 1, indices = 2 (TensorProtos)
    StringStringEntryProto  key = 1, value = 2
    ValueInfoProto  name = 1
    FunctionProto   node = 7
    TrainingInfoProto  initialization = 1, algorithm = 2 (GraphProtos)

The location `*/_ORT_MEM_ADDR_/*` is onnxruntime's marker for "the bytes are at the memory address
in `offset`": refused whatever the directory holds.

An `EPContext` node (a precompiled engine, TensorRT/QNN) with `embed_mode` 0 names its engine
file in the `ep_cache_context` attribute: the same rules apply to that path.

The protobuf wire format: each field is a varint key (field number << 3 | wire type) and a value:
wire type 0 a varint, 1 eight bytes, 2 a varint length and that many bytes (strings and nested
messages), 5 four bytes. Groups (3, 4) are not used by ONNX and are refused.
"""

from __future__ import annotations

import dataclasses
import mmap
import posixpath
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Iterable, Iterator

from ..errors import ManifestError
from .graph_io import decoder_io

# onnxruntime reads a tensor whose location is this marker from the memory address in its
# `offset` (meant for models built in memory): from a file it would read arbitrary memory
ORT_MEMORY_ADDRESS_TAG = "*/_ORT_MEM_ADDR_/*"
MAX_NESTING = 64  # subgraphs inside subgraphs: real models use a handful; deeper is an attack

# field numbers (see the module docstring)
_MODEL_GRAPH, _MODEL_TRAINING_INFO, _MODEL_FUNCTIONS = 7, 20, 25
_GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_INPUT, _GRAPH_OUTPUT, _GRAPH_SPARSE_INITIALIZER = \
    1, 5, 11, 12, 15
_NODE_OP_TYPE, _NODE_ATTRIBUTE = 4, 5
_ATTR_NAME, _ATTR_I, _ATTR_S, _ATTR_T, _ATTR_G, _ATTR_TENSORS, _ATTR_GRAPHS = 1, 3, 4, 5, 6, 10, 11
_ATTR_SPARSE_TENSOR, _ATTR_SPARSE_TENSORS = 22, 23
_TENSOR_NAME, _TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION = 8, 13, 14
_SPARSE_VALUES, _SPARSE_INDICES = 1, 2
_ENTRY_KEY, _ENTRY_VALUE = 1, 2
_VALUE_INFO_NAME = 1
_FUNCTION_NODE = 7
_TRAINING_INITIALIZATION, _TRAINING_ALGORITHM = 1, 2
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


class _Malformed(Exception):
    """The bytes are not a well-formed protobuf message."""


@dataclasses.dataclass(frozen=True)
class FileReference:
    """A file a graph makes ONNX Runtime open, relative to the graph's folder."""

    kind: str  # "external data" or "EPContext engine"
    owner: str  # the tensor or node that names it
    location: str


@dataclasses.dataclass(frozen=True)
class GraphSummary:
    references: tuple[FileReference, ...]
    inputs: tuple[str, ...]  # the main graph's inputs, initializer-backed ones excluded
    outputs: tuple[str, ...]


# -- the wire format ----------------------------------------------------------------------------


def _varint(buf: mmap.mmap | bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end:
            raise _Malformed("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise _Malformed("varint longer than 10 bytes")


def _fields(buf: mmap.mmap | bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, a, b) per field of the message in buf[start:end]:
    a varint's value is a (b = 0); a length-delimited value is buf[a:b]; fixed ones are skipped."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise _Malformed(f"field number 0 at byte {pos}")
        if wire == _VARINT:
            value, pos = _varint(buf, pos, end)
            yield field, wire, value, 0
        elif wire == _LEN:
            n, pos = _varint(buf, pos, end)
            if pos + n > end:
                raise _Malformed(f"field {field} runs past the end of its message")
            yield field, wire, pos, pos + n
            pos += n
        elif wire in (_FIXED64, _FIXED32):
            pos += 8 if wire == _FIXED64 else 4
            if pos > end:
                raise _Malformed(f"field {field} runs past the end of its message")
        else:
            raise _Malformed(f"wire type {wire} (field {field}) is not used by ONNX")


def _string(buf: mmap.mmap | bytes, a: int, b: int) -> str:
    try:
        return bytes(buf[a:b]).decode("utf-8")
    except UnicodeDecodeError:
        raise _Malformed("a string field is not UTF-8") from None


def _submessages(buf, start: int, end: int,
                 wanted: dict[int, str]) -> Iterator[tuple[str, int, int]]:
    """(kind, a, b) for each length-delimited field whose number is in `wanted`."""
    for field, wire, a, b in _fields(buf, start, end):
        if field in wanted:
            if wire != _LEN:
                raise _Malformed(f"field {field} should be a message, has wire type {wire}")
            yield wanted[field], a, b


# -- the walk -----------------------------------------------------------------------------------


class _Walker:
    def __init__(self, buf: mmap.mmap | bytes) -> None:
        self.buf = buf
        self.refs: list[FileReference] = []

    def model(self, start: int, end: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        io: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        wanted = {_MODEL_GRAPH: "graph", _MODEL_TRAINING_INFO: "training",
                  _MODEL_FUNCTIONS: "function"}
        for kind, a, b in _submessages(self.buf, start, end, wanted):
            if kind == "graph":
                io = self.graph(a, b, 1)
            elif kind == "training":
                for _, c, d in _submessages(self.buf, a, b, {_TRAINING_INITIALIZATION: "g",
                                                             _TRAINING_ALGORITHM: "g"}):
                    self.graph(c, d, 1)
            else:
                for _, c, d in _submessages(self.buf, a, b, {_FUNCTION_NODE: "node"}):
                    self.node(c, d, 1)
        if io is None:
            raise _Malformed("no graph (ModelProto field 7)")
        return io

    def graph(self, start: int, end: int, depth: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        if depth > MAX_NESTING:
            raise _Malformed(f"subgraphs nested more than {MAX_NESTING} deep")
        inputs: list[str] = []
        outputs: list[str] = []
        initializers: set[str] = set()
        wanted = {_GRAPH_NODE: "node", _GRAPH_INITIALIZER: "tensor", _GRAPH_INPUT: "input",
                  _GRAPH_OUTPUT: "output", _GRAPH_SPARSE_INITIALIZER: "sparse"}
        for kind, a, b in _submessages(self.buf, start, end, wanted):
            if kind == "node":
                self.node(a, b, depth)
            elif kind == "tensor":
                initializers.add(self.tensor(a, b))
            elif kind == "sparse":
                initializers.add(self.sparse(a, b))
            else:
                name = ""
                for _, c, d in _submessages(self.buf, a, b, {_VALUE_INFO_NAME: "name"}):
                    name = _string(self.buf, c, d)
                (inputs if kind == "input" else outputs).append(name)
        return tuple(n for n in inputs if n not in initializers), tuple(outputs)

    def node(self, start: int, end: int, depth: int) -> None:
        op_type = ""
        attributes: dict[str, tuple[int, str]] = {}  # name -> (i, s) for EPContext
        for field, wire, a, b in _fields(self.buf, start, end):
            if field == _NODE_OP_TYPE and wire == _LEN:
                op_type = _string(self.buf, a, b)
            elif field == _NODE_ATTRIBUTE:
                if wire != _LEN:
                    raise _Malformed(f"NodeProto.attribute has wire type {wire}")
                name, i, s = self.attribute(a, b, depth)
                attributes[name] = (i, s)
        if op_type == "EPContext" and attributes.get("embed_mode", (1, ""))[0] == 0:
            self.refs.append(FileReference("EPContext engine", "EPContext node",
                                           attributes.get("ep_cache_context", (0, ""))[1]))

    def attribute(self, start: int, end: int, depth: int) -> tuple[str, int, str]:
        name, i, s = "", 0, ""
        for field, wire, a, b in _fields(self.buf, start, end):
            if field == _ATTR_NAME and wire == _LEN:
                name = _string(self.buf, a, b)
            elif field == _ATTR_I and wire == _VARINT:
                i = a
            elif field == _ATTR_S and wire == _LEN:
                s = bytes(self.buf[a:b]).decode("utf-8", "replace")
            elif field in (_ATTR_T, _ATTR_TENSORS, _ATTR_G, _ATTR_GRAPHS, _ATTR_SPARSE_TENSOR,
                           _ATTR_SPARSE_TENSORS):
                if wire != _LEN:
                    raise _Malformed(f"AttributeProto field {field} has wire type {wire}")
                if field in (_ATTR_T, _ATTR_TENSORS):
                    self.tensor(a, b)
                elif field in (_ATTR_G, _ATTR_GRAPHS):
                    self.graph(a, b, depth + 1)
                else:
                    self.sparse(a, b)
        return name, i, s

    def sparse(self, start: int, end: int) -> str:
        name = ""
        for kind, a, b in _submessages(self.buf, start, end, {_SPARSE_VALUES: "values",
                                                              _SPARSE_INDICES: "indices"}):
            n = self.tensor(a, b)
            if kind == "values":
                name = n
        return name

    def tensor(self, start: int, end: int) -> str:
        name = ""
        locations: list[str] = []
        external = False
        for field, wire, a, b in _fields(self.buf, start, end):
            if field == _TENSOR_NAME and wire == _LEN:
                name = _string(self.buf, a, b)
            elif field == _TENSOR_DATA_LOCATION and wire == _VARINT:
                external = a == _EXTERNAL
            elif field == _TENSOR_EXTERNAL_DATA:
                if wire != _LEN:
                    raise _Malformed(f"TensorProto.external_data has wire type {wire}")
                key = value = ""
                for f2, w2, c, d in _fields(self.buf, a, b):
                    if w2 == _LEN and f2 == _ENTRY_KEY:
                        key = _string(self.buf, c, d)
                    elif w2 == _LEN and f2 == _ENTRY_VALUE:
                        value = _string(self.buf, c, d)
                if key == "location":
                    locations.append(value)
        if external and not locations:
            locations.append("")  # external data with no location: refused below
        for loc in locations:
            self.refs.append(FileReference("external data", f"tensor {name!r}", loc))
        return name


def read_graph_summary(path: str | Path) -> GraphSummary:
    """The files `path` references and its main graph's I/O names; ManifestError if the file
    is not a well-formed ONNX model."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise ManifestError(f"{path.name!r} is empty, not an ONNX model")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                walker = _Walker(buf)
                inputs, outputs = walker.model(0, size)
    except _Malformed as e:
        raise ManifestError(f"{path.name!r} is not a well-formed ONNX model ({e})") from None
    except OSError as e:
        raise ManifestError(f"cannot read {path.name!r}: {e}") from None
    return GraphSummary(tuple(walker.refs), inputs, outputs)


# -- the rules ----------------------------------------------------------------------------------


def check_reference(directory: Path, graph_name: str, ref: FileReference,
                    listed: set[str]) -> str:
    """The manifest-relative name of `ref`'s file, or ManifestError: absolute, `..`, outside the
    directory once symlinks are followed, or not in the manifest's `files`."""
    where = f"{graph_name!r}: {ref.kind} of {ref.owner} at {ref.location!r}"
    loc = ref.location
    if not loc or "\x00" in loc:
        raise ManifestError(f"{where}: the location is empty or not a file name")
    if ORT_MEMORY_ADDRESS_TAG in loc or "_ORT_MEM_ADDR_" in loc:
        raise ManifestError(f"{where}: onnxruntime's in-memory marker, which makes it read the "
                            f"process memory at `offset`; a model file must never use it")
    unix = loc.replace("\\", "/")
    win = PureWindowsPath(loc)
    if unix.startswith("/") or win.drive or win.root or PurePosixPath(unix).is_absolute():
        raise ManifestError(f"{where}: an absolute path; it must be relative to the model "
                            f"directory")
    if ".." in PurePosixPath(unix).parts:
        raise ManifestError(f"{where}: '..' leaves the model directory")
    rel = posixpath.normpath(posixpath.join(posixpath.dirname(graph_name.replace("\\", "/")), unix))
    root = directory.resolve()
    resolved = (directory / rel).resolve()
    if resolved != root and root not in resolved.parents:
        raise ManifestError(f"{where}: resolves outside the model directory ({resolved}); "
                            f"a symlink leading out?")
    if rel not in listed:
        raise ManifestError(f"{where}: {rel!r} is not listed with a sha256 in manifest.files, "
                            f"so its contents are unchecked")
    return rel


def check_graph(directory: str | Path, graph_name: str, *, files: Iterable[str],
                num_layers: int, hidden_states: bool = False) -> GraphSummary:
    """Refuse a graph file whose external data leaves the directory or is not among `files`
    (the manifest's checksummed names), or whose inputs and outputs are not those of a decoder
    of `num_layers` layers (with the `hidden_states` output when `hidden_states`).
    `graph_name` is relative to `directory` and has already passed `manifest.safe_member`."""
    directory = Path(directory)
    summary = read_graph_summary(directory / graph_name)
    listed = {posixpath.normpath(k.replace("\\", "/")) for k in files}
    for ref in summary.references:
        check_reference(directory, graph_name, ref, listed)
    required_in, optional_in, required_out = decoder_io(num_layers, hidden_states=hidden_states)
    inputs, outputs = set(summary.inputs), set(summary.outputs)
    missing = sorted((required_in - inputs) | (required_out - outputs))
    unexpected = sorted(inputs - required_in - optional_in)
    if missing or unexpected:
        shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        raise ManifestError(
            f"{graph_name!r}: graph I/O does not match the manifest "
            f"({num_layers} layers): missing [{shown}], "
            f"unexpected inputs {unexpected[:6]}"
        )
    return summary
