"""Slow, plain-PyTorch references for the native kernels: GGUF block decoding and dequantization (bit-equal to
gguf-py's ``gguf.quants.dequantize``), the int8 activation quantizer, and the two numerics of the linear kernels
computed in float64; the RMSNorm of the native decoder layers (:func:`lane_rms_norm`).

Each quantized type decodes to integer codes ``u`` per element and float32 numbers ``a`` (and ``b``) per group of
``group`` elements; the weight is ``a * (u - offset)`` for the symmetric types and ``a * u + b`` for the others (the
products are exact in float32, so these are gguf-py's values bit for bit). See ``eagle/csrc/quant.h``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# The types this module decodes itself (:func:`dequantize` hands any other to gguf-py), with their elements and
# bytes per block from gguf-py. Which types the kernels handle is the extension's answer: eagle.kernels.quant_types().
BLOCKS = {name: GGML_QUANT_SIZES[GGMLQuantizationType[name]]
          for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}


@dataclass
class Codes:
    """Decoded blocks: ``u`` (blocks, block) int32 codes, ``a`` / ``b`` (blocks, block // group) float32,
    ``b`` None and ``offset`` an int for symmetric types."""

    u: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor | None
    offset: int | None
    group: int


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """(n,) float32 of the fp16 at byte ``start`` of each block."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16)[:, 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes -> (n, 32) codes: the low nibbles are elements 0..15, the high ones 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1).int()


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """(n, 4) bytes of a little-endian uint32 -> (n, count) of its bits 0..count-1."""
    word = qh.long()
    word = word[:, 0] | (word[:, 1] << 8) | (word[:, 2] << 16) | (word[:, 3] << 24)
    return ((word[:, None] >> torch.arange(count)) & 1).int()


def _k4_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: (n, 12) packed bytes -> 8 six-bit scales and 8 six-bit mins per block."""
    s = scales.int()
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 128) bytes -> (n, 256): bytes 32 i .. 32 i + 31 hold group 2 i (low nibbles) and 2 i + 1 (high)."""
    q = qs.reshape(-1, 4, 1, 32).int()
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(-1, 256)


def decode_blocks(type_name: str, blocks: torch.Tensor) -> Codes:
    """Codes of ``blocks`` (n, bytes per block) uint8 of a quantized type."""
    n = blocks.shape[0]
    if type_name in ("Q4_0", "Q4_1"):
        asym = type_name == "Q4_1"
        u = _nibbles(blocks[:, 4 if asym else 2:])
        return Codes(u, _f16(blocks, 0)[:, None], _f16(blocks, 2)[:, None] if asym else None, None if asym else 8, 32)
    if type_name in ("Q5_0", "Q5_1"):
        asym = type_name == "Q5_1"
        start = 4 if asym else 2
        u = _nibbles(blocks[:, start + 4:]) | (_high_bits(blocks[:, start:start + 4], 32) << 4)
        return Codes(u, _f16(blocks, 0)[:, None], _f16(blocks, 2)[:, None] if asym else None, None if asym else 16, 32)
    if type_name == "Q8_0":
        return Codes(blocks[:, 2:].contiguous().view(torch.int8).int() + 128, _f16(blocks, 0)[:, None], None, 128, 32)
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks, 0)[:, None], _f16(blocks, 2)[:, None]
        sc, mn = _k4_scales(blocks[:, 4:16])
        if type_name == "Q4_K":
            u = _k_nibbles(blocks[:, 16:])
        else:
            bits = (blocks[:, 16:48].int()[:, None, :] >> torch.arange(8)[None, :, None]) & 1  # (n, group, 32)
            u = _k_nibbles(blocks[:, 48:]) | (bits.reshape(n, 256) << 4)
        return Codes(u, d * sc.float(), -(dmin * mn.float()), None, 32)
    if type_name == "Q6_K":
        ql = blocks[:, 0:128].int().reshape(n, 2, 1, 64)
        ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 256)
        qh = blocks[:, 128:192].int().reshape(n, 2, 1, 32)
        qh = ((qh >> torch.tensor([0, 2, 4, 6]).reshape(1, 1, 4, 1)) & 3).reshape(n, 256)
        scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
        return Codes(ql | (qh << 4), _f16(blocks, 208)[:, None] * scales, None, 32, 16)
    raise ValueError(f"no reference decoder for GGUF type {type_name!r}")


def _groupwise(codes: Codes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(u, a, b) with u (n, groups, group) and a, b (n, groups, 1)."""
    n, block = codes.u.shape
    u = codes.u.reshape(n, block // codes.group, codes.group)
    return u, codes.a[:, :, None], None if codes.b is None else codes.b[:, :, None]


def dequantize(type_name: str, blocks: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor of ``shape`` stored in ``blocks`` (uint8, the file's bytes), as gguf-py computes it."""
    flat = blocks.reshape(-1)
    if type_name == "F32":
        return flat.view(torch.float32).reshape(shape).clone()
    if type_name == "F16":
        return flat.view(torch.float16).float().reshape(shape)
    if type_name == "BF16":
        return (flat.view(torch.int16).int() << 16).view(torch.float32).reshape(shape)
    if type_name not in BLOCKS:
        from gguf import quants

        values = quants.dequantize(flat.numpy().view(np.uint8), GGMLQuantizationType[type_name])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
    codes = decode_blocks(type_name, flat.reshape(-1, BLOCKS[type_name][1]))
    u, a, b = _groupwise(codes)
    if codes.offset is not None:
        w = a * (u - codes.offset).float()
    else:
        w = a * u.float() + b
    return w.reshape(shape)


# ------------------------------------------------------------------------------------------------ activations
@dataclass
class QuantizedActivations:
    """int8 activations: ``q`` (M, K) int8, per block of 32 ``d`` (M, K / 32) scale and ``s`` = d * sum(q), and
    ``sum16`` (M, K / 16) int32 sums of q."""

    q: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor
    sum16: torch.Tensor


def quantize_activations(x: torch.Tensor) -> QuantizedActivations:
    """Each row of x (M, K) float32 quantized per block of 32, as the kernels do: d = max|x| / 127,
    q = round-half-even(x / d) (x * (1 / d), clamped to [-127, 127]; q = 0 where d = 0)."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    d = blocks.abs().amax(dim=2) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((blocks * inv[:, :, None]).clamp(-127.0, 127.0)).to(torch.int8)
    sums = q.int().reshape(m, k // 16, 16).sum(dim=2).int()
    s = d * sums.reshape(m, k // 32, 2).sum(dim=2).float()
    return QuantizedActivations(q.reshape(m, k), d, s, sums)


# ------------------------------------------------------------------------------------------------ linears
def linear_float32_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) times float32 weight (N, K), accumulated in float64: (M, N) float64."""
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def linear_int8_reference(x: torch.Tensor, type_name: str, blocks: torch.Tensor, shape: tuple[int, int],
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The int8 numerics in float64: x quantized by :func:`quantize_activations`, exact integer dot products per
    group, sum over groups of a * d_x * isum (+ b * s_x for asymmetric types): (M, N) float64."""
    n, k = shape
    codes = decode_blocks(type_name, blocks.reshape(-1, BLOCKS[type_name][1]))
    group = codes.group
    u = codes.u.reshape(n, k // group, group).double()
    a = codes.a.reshape(n, k // group).double()
    xq = quantize_activations(x)
    m = x.shape[0]
    q = xq.q.reshape(m, k // group, group).double()
    if codes.offset is not None:
        u = u - codes.offset
    isum = torch.einsum("mgi,ngi->mng", q, u)  # exact: integers below 2^53
    dx = xq.d.double().repeat_interleave(32 // group, dim=1)  # (M, groups)
    out = (isum * a[None, :, :] * dx[:, None, :]).sum(dim=2)
    if codes.b is not None:
        out = out + xq.s.double() @ codes.b.reshape(n, k // group).double().T
    return out if bias is None else out + bias.double()


def lane_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm of ``eagle::decoder_layers`` (``eagle/csrc/decoder.cpp``) bit for bit, for float32 ``x`` (..., n):
    ``weight * (x * (1 / sqrt(sum(x^2) / n + eps)))`` per row, the sum of squares over 16 lanes (lane j adds
    ``x[16 i + j]^2``, i ascending), then lanes 0..15 added in order; the square root and the division correctly
    rounded (numpy's square root: torch's may not be, depending on the vector library it was built with)."""
    squares, n = x * x, x.shape[-1]
    lanes = torch.zeros(*x.shape[:-1], 16, dtype=x.dtype)
    for start in range(0, n - n % 16, 16):
        lanes = lanes + squares[..., start:start + 16]
    tail = squares[..., n - n % 16:]
    lanes[..., :tail.shape[-1]] = lanes[..., :tail.shape[-1]] + tail
    total = torch.zeros(*x.shape[:-1], 1, dtype=x.dtype)
    for lane in range(16):
        total = total + lanes[..., lane:lane + 1]
    root = torch.from_numpy(np.sqrt((total / n + eps).detach().numpy()))
    return weight * (x * (torch.ones_like(root) / root))
