"""Block-wise weight quantization for onnxruntime's `com.microsoft::MatMulNBits` (NumPy only).

MatMulNBits (onnxruntime 1.32 contrib schema) multiplies A [..., K] by a weight stored as
blocks of `block_size` consecutive input features per output feature:

    B            uint8 [N, n_blocks, block_size * bits / 8]   q, low nibble first (4 bits)
    scales       A's type [N * n_blocks]
    zero_points  uint8 [N * ceil(n_blocks * bits / 8)]        optional, packed like B;
                                                              default 2 ** (bits - 1)
    w[n, k] = (q[n, k] - zero_point[n, k // block_size]) * scale[n, k // block_size]

Three schemes, all `quantize_blockwise(w, ...)`:

- "block-min" (the default for 4 bits): per block, scale = (max - min) / (2**bits - 1) and
  q = round((w - min) / scale), so w = q * scale + min: llama.cpp's Q4_1 (w = d * q + m).
  MatMulNBits takes an integer zero point zp = round(-min / scale) (centring (q - zp) * scale
  on the block, which matters when the kernel rounds activations to int8), and the rest,
  offset = min + zp * scale, is added back by a second, small product in the graph:
  y += blocksum(x) @ offsets.T, blocksum(x) [.., n_blocks] the sums of x over each block.
  The weights of a Q4_1 GGUF, which transformers dequantises to exactly d * q + m, come back
  as the file's own q, d and m (llama.cpp's quantizer maps each block's min to q = 0 and its
  max to 15, so min/max recover d and m): the draft then multiplies by the target's very
  weights. Measured on SmolLM2-135M's Q4_1 file: all 3,317,760 blocks of the 210 linear
  weights dequantize bit for bit to the target's float32 weights (and its Q8_0 embedding
  through "symmetric" at 8 bits likewise), where "zero-point" misses by a quarter step on
  average. The extra product is [n_blocks, N] floats, 1/K of the
  weight's elements, but it is one more graph node per product (a Gemm whose C is
  MatMulNBits' output, so the sum is part of it: 0.91x the step time of a MatMul and an Add on
  SmolLM2-135M's int4 draft) and one per input (the block sums, a MatMul with a 0/1 block
  indicator; measured 4% faster a step than Reshape + ReduceSum there).
- "zero-point": the range widened to include 0 and an integer zero point round(-min / scale),
  onnxruntime's own quantizer's choice: no extra product, but the grid is shifted by up to
  half a step against the block's values, which for Q4_1 weights re-rounds every element
  (|error| <= scale / 2, scale itself larger when the block does not straddle 0).
- "symmetric": no zero point input (the default 2 ** (bits - 1)) and
  scale = max |w| / (2 ** (bits - 1) - 1). At 8 bits this is llama.cpp's Q8_0 (w = d * q,
  q in -127..127) exactly.

Why not MatMulNBits' float zero points (the schema allows zero_points of A's type, which
would express Q4_1's non-integer -m/d directly): onnxruntime 1.32's CPU kernel then leaves its
packed fast path; a 576 x 1536 product took 1.0 ms instead of 0.07 ms (measured here).
"""

from __future__ import annotations

import dataclasses

import numpy as np

SCHEMES = ("block-min", "zero-point", "symmetric")
BITS = (4, 8)


@dataclasses.dataclass(frozen=True)
class BlockQuantized:
    """A weight [N, K] in MatMulNBits' layout; `dequantize()` gives back what the op computes
    with (times the block-min correction for "block-min")."""

    packed: np.ndarray  # uint8 [N, n_blocks, block_size * bits // 8]
    scales: np.ndarray  # float32 [N, n_blocks]
    zero_points: np.ndarray | None  # uint8 [N, ceil(n_blocks * bits / 8)], packed; None: default
    mins: np.ndarray | None  # float32 [N, n_blocks], the per-block offset ("block-min" only)
    bits: int
    block_size: int
    scheme: str

    @property
    def shape(self) -> tuple[int, int]:  # (N, K)
        n, blocks, _ = self.packed.shape
        return n, blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.packed, self.scales, self.zero_points, self.mins)
                   if a is not None)

    def levels(self) -> np.ndarray:
        """q: uint8 [N, n_blocks, block_size], unpacked."""
        if self.bits == 8:
            return self.packed
        q = np.empty(self.packed.shape[:2] + (self.block_size,), np.uint8)
        q[..., 0::2] = self.packed & 0x0F
        q[..., 1::2] = self.packed >> 4
        return q

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: the weight the graph multiplies by."""
        q = self.levels().astype(np.float32)
        n, blocks, _ = q.shape
        if self.zero_points is None:
            zp = np.float32(2 ** (self.bits - 1) if self.scheme == "symmetric" else 0)
        else:
            zp = _unpack(self.zero_points, self.bits, blocks).astype(np.float32)[..., None]
        w = (q - zp) * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(n, blocks * self.block_size).astype(np.float32)


def quantize_blockwise(w: np.ndarray, *, bits: int = 4, block_size: int = 32,
                       scheme: str = "block-min") -> BlockQuantized:
    """w: [N, K] float, K a multiple of block_size (the graph builder leaves other matrices in
    float). Raises ValueError for a bad option."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size!r}")
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % block_size:
        raise ValueError(f"expected a [N, K] weight with K a multiple of {block_size}, got "
                         f"shape {w.shape}")
    n, k = w.shape
    blocks = w.reshape(n, k // block_size, block_size)  # [N, n_blocks, block_size]
    top = 2 ** bits - 1
    zero_points = mins = None
    if scheme == "symmetric":
        half = 2 ** (bits - 1)
        scales = np.abs(blocks).max(-1) / (half - 1)  # [N, n_blocks]
        q = np.round(blocks / _nonzero(scales)[..., None]) + half
    else:
        lo, hi = blocks.min(-1), blocks.max(-1)  # [N, n_blocks]
        scales = (hi - lo) / top
        if scheme == "block-min":
            # q spans [lo, hi] exactly; the integer zero point nearest -lo / scale centres
            # (q - zp) * scale on the block, and the offset adds back what it misses
            q = np.round((blocks - lo[..., None]) / _nonzero(scales)[..., None])
            zp = np.clip(np.round(-lo / _nonzero(scales)), 0, top)
            mins = lo + zp * scales  # |offset| <= scale / 2 unless zp clipped
            zero_points = _pack(zp.astype(np.uint8), bits)
        else:
            # the range includes 0, so the zero point is a level and nothing clips
            lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
            scales = (hi - lo) / top
            zp = np.round(-lo / _nonzero(scales))
            q = np.round(blocks / scales[..., None]) + zp[..., None]
            zero_points = _pack(zp.astype(np.uint8), bits)  # [N, ceil(n_blocks * bits / 8)]
    q = np.clip(q, 0, top).astype(np.uint8)
    return BlockQuantized(packed=_pack(q, bits), scales=scales.astype(np.float32),
                          zero_points=zero_points,
                          mins=None if mins is None else mins.astype(np.float32),
                          bits=bits, block_size=block_size, scheme=scheme)


def _nonzero(scales: np.ndarray) -> np.ndarray:
    """Scales with zeros replaced by 1 for dividing (a constant block quantizes to q = 0 and
    keeps scale 0, so it dequantizes to its min, or 0, exactly)."""
    return np.where(scales > 0, scales, 1.0).astype(np.float32)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 levels [..., m] -> [..., ceil(m * bits / 8)], first value in the low bits."""
    if bits == 8:
        return np.ascontiguousarray(q, np.uint8)
    if q.shape[-1] % 2:
        q = np.concatenate([q, np.zeros(q.shape[:-1] + (1,), np.uint8)], axis=-1)
    return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4), np.uint8)


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    if bits == 8:
        return packed[..., :count]
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out[..., :count]


Q4GEMM_TILE = 16  # outputs a tile of ortspec.Q4Gemm's packed weight


@dataclasses.dataclass(frozen=True)
class Q4GemmWeight:
    """A weight [N, K] as Q4_1 blocks of 32 in ortspec.Q4Gemm's layout (runtime/ort/_q4kernel.c):
    w[n, k] = d * q + m per block, d and m float16 (a GGUF's own Q4_1 fields)."""

    packed: np.ndarray  # uint8 [N / 16, K / 32, 4, 64]
    d: np.ndarray  # float16 [N / 16, K / 32, 16]
    m: np.ndarray  # float16 [N / 16, K / 32, 16]

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: the weight the op multiplies by."""
        tiles, blocks = self.packed.shape[:2]
        rows = self.packed.reshape(tiles, blocks, 4, 16, 4)  # tile, block, j, output, u
        q = np.concatenate([rows & 0x0F, rows >> 4], axis=2)  # groups 0-3 low, 4-7 high
        q = q.transpose(0, 3, 1, 2, 4).reshape(tiles * 16, blocks, 32).astype(np.float32)
        d = self.d.transpose(0, 2, 1).reshape(tiles * 16, blocks, 1).astype(np.float32)
        m = self.m.transpose(0, 2, 1).reshape(tiles * 16, blocks, 1).astype(np.float32)
        return (q * d + m).reshape(tiles * 16, blocks * 32)


def quantize_q4gemm(w: np.ndarray) -> Q4GemmWeight:
    """w [N, K] (N a multiple of 16, K of 32) as Q4_1 blocks: per block d = (max - min) / 15 and
    m = min, both rounded to float16, q = round((w - m) / d). A Q4_1 GGUF's weights come back
    as its own q, d and m (the block's min is m at q = 0 and its max d * 15 + m)."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    if n % Q4GEMM_TILE or k % 32:
        raise ValueError(f"expected a [N, K] weight with N a multiple of {Q4GEMM_TILE} and K "
                         f"of 32, got shape {w.shape}")
    blocks = w.reshape(n, k // 32, 32)
    m = blocks.min(-1).astype(np.float16)
    d = ((blocks.max(-1) - blocks.min(-1)) / 15).astype(np.float16)
    d32, m32 = d.astype(np.float32), m.astype(np.float32)
    q = np.round((blocks - m32[..., None]) / _nonzero(d32)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8)  # [N, n_blocks, 32]
    tiles = q.reshape(n // 16, 16, k // 32, 8, 4).transpose(0, 2, 3, 1, 4)  # tile, block, g, out, u
    packed = (tiles[:, :, :4] | (tiles[:, :, 4:] << 4)).reshape(n // 16, k // 32, 4, 64)

    def by_tile(a: np.ndarray) -> np.ndarray:  # [N, n_blocks] -> [N / 16, n_blocks, 16]
        return np.ascontiguousarray(a.reshape(n // 16, 16, k // 32).transpose(0, 2, 1))

    return Q4GemmWeight(packed=np.ascontiguousarray(packed), d=by_tile(d), m=by_tile(m))
