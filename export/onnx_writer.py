"""Small ONNX building blocks: a node list with unique names, and a streaming external-data file.

Weights go straight from NumPy to the `.data` file as they are added, so a multi-gigabyte model
never exists twice in memory and never passes through protobuf (whose messages stop at 2 GB).
Large tensors start at 64 KiB boundaries, the granularity onnx's own writer uses, so that ONNX
Runtime may memory-map them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ALIGNMENT = 65536  # offsets of tensors >= ALIGN_THRESHOLD are multiples of this (mmap-able)
ALIGN_THRESHOLD = 1 << 20
SMALL_ALIGNMENT = 64  # everything else: cache-line aligned

_ONNX_TYPES = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.uint8): TensorProto.UINT8,  # MatMulNBits' packed weights and zero points
}


class ExternalDataWriter:
    """Appends initializers to one external data file; `add` returns the TensorProto that points
    at them. Use as a context manager so the file is closed on failure too."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.location = self.path.name  # stored relative to the .onnx file, which sits next to it
        self._file: BinaryIO = open(self.path, "wb")
        self._offset = 0
        self.names: set[str] = set()
        self.bytes_written = 0  # payload bytes, excluding alignment padding

    def __enter__(self) -> ExternalDataWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def add(self, name: str, array: np.ndarray) -> TensorProto:
        if name in self.names:
            raise ValueError(f"initializer {name!r} added twice")  # internal invariant
        self.names.add(name)
        arr = np.ascontiguousarray(array)
        if arr.dtype not in _ONNX_TYPES:
            raise TypeError(f"initializer {name!r}: unsupported dtype {arr.dtype}")
        align = ALIGNMENT if arr.nbytes >= ALIGN_THRESHOLD else SMALL_ALIGNMENT
        pad = -self._offset % align
        if pad:
            self._file.write(b"\0" * pad)
            self._offset += pad
        tensor = TensorProto()
        tensor.name = name
        tensor.data_type = _ONNX_TYPES[arr.dtype]
        tensor.dims.extend(arr.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(self._offset)),
                           ("length", str(arr.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self._file.write(arr.tobytes())  # little-endian on every platform ORT runs on
        self._offset += arr.nbytes
        self.bytes_written += arr.nbytes
        return tensor


def alias(tensor: TensorProto, name: str, *, dims: list[int] | None = None) -> TensorProto:
    """A second initializer over the same bytes of the external data file (stored once).

    ONNX Runtime pre-packs a MatMul/Gemm weight into its own buffer and releases the
    initializer; one that a Gather also reads would then be resident twice (the packed copy
    and the original). Two names over one file region let the Gemm's copy be packed and
    released while the Gather's stays memory-mapped, paging in only the rows it reads.
    `dims` reshapes the view (the same number of elements, row-major).
    """
    twin = TensorProto()
    twin.CopyFrom(tensor)
    twin.name = name
    if dims is not None:
        if int(np.prod(dims)) != int(np.prod(tensor.dims)):
            raise ValueError(f"alias {name!r}: dims {dims} do not hold the {list(tensor.dims)} "
                             f"elements of {tensor.name!r}")  # internal invariant
        del twin.dims[:]
        twin.dims.extend(dims)
    return twin


class NodeList:
    """Nodes in topological order, each with a unique name; `op` returns the output names."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []  # small constants kept inside the .onnx file
        self._count = 0
        self._const_names: set[str] = set()

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, *, name: str | None = None,
           domain: str = "", outputs: list[str] | None = None, **attrs) -> list[str]:
        """Append a node; its outputs are `outputs` or generated names, returned either way."""
        self._count += 1
        base = name or f"{op_type}_{self._count}"
        outputs = outputs or [f"{base}/out{k}" for k in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=base, domain=domain,
                                           **attrs))
        return outputs

    def op1(self, op_type: str, inputs: list[str], **kw) -> str:
        return self.op(op_type, inputs, 1, **kw)[0]

    def const(self, name: str, array: np.ndarray) -> str:
        """A small constant stored in the .onnx file; adding a name again reuses the first."""
        if name not in self._const_names:
            self._const_names.add(name)
            self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name
