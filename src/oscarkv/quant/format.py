"""The low-bit storage format (SPEC §2), torch reference: INT2, and INT4 for the streams calibration moves there.

Per token and per group of `group_size` channels, asymmetric b-bit codes (L = 2^b - 1,
so L = 3 for INT2 and 15 for INT4):

    scale = max(max - min, 1e-8) / L      zero = -min / scale
    q     = clamp(floor(x / scale + zero + 0.5), 0, L)
    x_hat = (q - zero) * scale

scale and zero are rounded to their storage dtype *before* the codes are chosen, so
that `dequantize_int2` reproduces exactly what the codes were chosen against. For a
(near-)constant group the 1e-8 floor of the range would make `zero` overflow a float16
(and a float16 scale of 1e-8/3 is 0), so the scale is also floored at |x|max / 2^15 and at
the dtype's smallest subnormal: zero then stays within ±2^15 and the group reads back to
within float16 rounding. Groups with a range above 1e-4·|x|max are unaffected.

Packing ("planar"): a byte holds n = 8/b codes; byte j of a row holds the codes of
channels j + i·D/n for i = 0..n-1, in bits i·b .. i·b+b-1. For INT2 that is channels
j, j + D/4, j + D/2, j + 3D/4; for INT4, j (low nibble) and j + D/2 (high nibble). A kernel
unpacks a row into n contiguous vectors with one shift and mask each, which keeps every
load and every dot product contiguous; no interleave shuffle is needed.

Lloyd–Max levels (OSCAR+, INT2 only; `inner`). The uniform grid reads code c back at
t = c/3 of the group's range. A bell-shaped group is better served by levels t = 0, a,
1 - a, 1 with a > 1/3 (the two inner levels move outwards). Scale and zero are the same; in
code units u = x/scale + zero (0 at the minimum, 3 at the maximum) the levels are
0, 3a, 3 - 3a, 3 and each element takes the nearest:

    q     = [u >= 1.5a] + [u >= 1.5] + [u >= 3 - 1.5a]
    x_hat = (level(q) - zero) * scale,  level(q) = 3a·(q + kappa·b1),  kappa = (3 - 9a) / (3a)

with b1 the high bit of q: the levels are linear in the two bits of the code, which is what
lets the attention kernels keep reading raw codes (one more masked dot per slice). inner =
None is the uniform grid (a = 1/3 gives the same codes and values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import OscarError

SUPPORTED_BITS = (2, 4)
INNER_RANGE = (0.25, 0.45)  # Lloyd–Max inner level a accepted (1/3 is the uniform grid)
MIN_RANGE = 1e-8
ZERO_LIMIT_INV = 2.0**-15  # keeps |zero| <= 2^15, finite in float16


@dataclass
class QuantizedTensor:
    """A tensor stored in `bits` (2 or 4) bits per element.

    packed: uint8 [..., D·bits/8]; scale, zero: [..., D/group_size] in the scale dtype.
    dtype: dtype that `dequantize` returns.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    dtype: torch.dtype
    bits: int = 2
    inner: float | None = None  # Lloyd–Max inner level a (INT2); None: the uniform grid

    @property
    def head_dim(self) -> int:
        return self.packed.shape[-1] * 8 // self.bits

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.head_dim))

    def nbytes(self) -> int:
        """Bytes actually stored (codes + scales + zeros)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))


Int2Tensor = QuantizedTensor  # the name of the INT2 case in the public API


class CodeSizes:
    """The sizes that follow from a layout's head_dim, group_size, key_bits and value_bits (fields of the dataclass
    that takes this in: the paged cache's `PagedLayout`, the vLLM plugin's `CellFormat`)."""

    head_dim: int
    group_size: int
    key_bits: int
    value_bits: int

    @property
    def key_code_bytes(self) -> int:
        """Bytes of one token's packed key codes (one KV head)."""
        return self.head_dim * self.key_bits // 8

    @property
    def value_code_bytes(self) -> int:
        """Bytes of one token's packed value codes (one KV head)."""
        return self.head_dim * self.value_bits // 8

    @property
    def groups(self) -> int:
        """Quantization groups (one scale and zero each) per head vector."""
        return self.head_dim // self.group_size


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise OscarError(f"bits={bits} is not supported; use 2 (INT2) or 4 (INT4).")


def _check_shape(head_dim: int, group_size: int, bits: int = 2) -> None:
    _check_bits(bits)
    per_byte = 8 // bits
    if head_dim % per_byte:
        raise OscarError(f"head_dim={head_dim} must be a multiple of {per_byte} to pack {bits}-bit codes.")
    if group_size <= 0 or head_dim % group_size:
        raise OscarError(
            f"group_size={group_size} does not divide head_dim={head_dim}; "
            f"choose a divisor of {head_dim} (e.g. {min(head_dim, 64)})."
        )


def check_inner(inner: float | None, bits: int = 2) -> None:
    """Raises OscarError unless `inner` is None or a Lloyd–Max inner level the format supports."""
    if inner is None:
        return
    if bits != 2:
        raise OscarError(f"Lloyd–Max levels (inner={inner}) exist for INT2 codes only, not {bits}-bit ones.")
    lo, hi = INNER_RANGE
    if not lo <= float(inner) <= hi:
        raise OscarError(f"inner level {inner} is outside [{lo}, {hi}]; 1/3 is the uniform grid.")


def inner_thresholds(inner: float) -> tuple[float, float]:
    """The outer decision thresholds 1.5a and 3 - 1.5a (code units) as float32 numbers, so that the
    reference and the write kernel (which takes them as float32 arguments) compare against the
    same values; the middle one is 1.5."""
    t = torch.tensor([1.5 * inner, 3.0 - 1.5 * inner], dtype=torch.float32)
    return float(t[0]), float(t[1])


def inner_kappa(inner: float) -> float:
    """kappa of level(q) = 3a·(q + kappa·b1) (see the module doc): (3 - 9a) / (3a)."""
    return (3.0 - 9.0 * inner) / (3.0 * inner)


def inner_levels(inner: float | None) -> torch.Tensor:
    """The four INT2 levels in code units, float32: 0, 3a, 3 - 3a, 3 (uniform: 0, 1, 2, 3)."""
    if inner is None:
        return torch.arange(4, dtype=torch.float32)
    return torch.tensor([0.0, 3.0 * inner, 3.0 - 3.0 * inner, 3.0], dtype=torch.float32)


def clip_rows(x: torch.Tensor, clip_ratio: float) -> torch.Tensor:
    """Clamp each row (last dim) to ± the value of rank floor(c·D) of its sorted |x|.

    x: [..., D] float. clip_ratio <= 0 returns x unchanged.
    """
    if clip_ratio <= 0:
        return x
    d = x.shape[-1]
    rank = min(int(clip_ratio * d), d - 1)  # 0-based index into ascending |x|
    if x.numel() == 0:
        return x
    threshold = x.abs().kthvalue(rank + 1, dim=-1, keepdim=True).values
    return torch.maximum(torch.minimum(x, threshold), -threshold)


def pack_codes(codes: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """codes: uint8 [..., D] with values < 2^bits -> uint8 [..., D·bits/8] (planar, see module doc)."""
    _check_bits(bits)
    per_byte = 8 // bits
    d = codes.shape[-1]
    planes = codes.reshape(*codes.shape[:-1], per_byte, d // per_byte)
    packed = planes[..., 0, :].clone()
    for i in range(1, per_byte):
        packed |= planes[..., i, :] << (i * bits)
    return packed.contiguous()


def unpack_codes(packed: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """uint8 [..., D·bits/8] -> uint8 codes [..., D] (inverse of `pack_codes`)."""
    _check_bits(bits)
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (i * bits)) & mask for i in range(8 // bits)], dim=-1)


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """codes: uint8 [..., D] with values 0..3 -> uint8 [..., D/4] (quarter-planar)."""
    return pack_codes(codes, 2)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D/4] -> uint8 codes [..., D] (inverse of `pack_int2`)."""
    return unpack_codes(packed, 2)


def quantize(
    x: torch.Tensor,
    bits: int = 2,
    group_size: int = 128,
    clip_ratio: float = 0.0,
    scale_dtype: torch.dtype = torch.float16,
    inner: float | None = None,
) -> QuantizedTensor:
    """Quantize the last dimension of x to asymmetric `bits`-bit codes per group of channels.

    x: [..., D] floating point. Returns a `QuantizedTensor` with packed [..., D·bits/8] and
    scale/zero [..., D/group_size]. inner: Lloyd–Max inner level (INT2; see the module doc).
    """
    if not x.is_floating_point():
        raise OscarError(f"quantize expects a floating-point tensor, got {x.dtype}.")
    d = x.shape[-1]
    _check_shape(d, group_size, bits)
    check_inner(inner, bits)
    levels = (1 << bits) - 1
    xf = clip_rows(x.float(), clip_ratio)
    groups = xf.reshape(*xf.shape[:-1], d // group_size, group_size)
    lo = groups.amin(dim=-1)
    hi = groups.amax(dim=-1)
    finfo = torch.finfo(scale_dtype)
    smallest = torch.tensor(finfo.tiny * finfo.eps, device=x.device)  # smallest subnormal: never rounds to 0
    floor = torch.maximum(torch.maximum(lo.abs(), hi.abs()) * ZERO_LIMIT_INV, smallest)
    scale = torch.maximum((hi - lo).clamp(min=MIN_RANGE) / levels, floor).to(scale_dtype)
    zero = (-lo / scale.float()).to(scale_dtype)
    # x·(1/s), not x/s: one division per group, then a multiply per element (as the write kernel);
    # each operation rounds to float32 on its own (the kernel runs without fused multiply-adds).
    inverse = 1.0 / scale.float()
    units = groups * inverse.unsqueeze(-1) + zero.float().unsqueeze(-1)
    if inner is None:
        codes = torch.floor(units + 0.5).clamp(0, levels)
    else:
        low, high = inner_thresholds(inner)
        codes = (units >= low).to(torch.uint8) + (units >= 1.5).to(torch.uint8) + (units >= high).to(torch.uint8)
    codes = codes.to(torch.uint8).reshape(*xf.shape[:-1], d)
    return QuantizedTensor(pack_codes(codes, bits), scale, zero, group_size, x.dtype, bits, inner)


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """QuantizedTensor -> tensor [..., D] in `dtype` (default: the dtype that was quantized)."""
    codes = unpack_codes(q.packed, q.bits)
    codes = codes.float() if q.inner is None else inner_levels(q.inner).to(codes.device)[codes.long()]
    d = codes.shape[-1]
    groups = codes.reshape(*codes.shape[:-1], d // q.group_size, q.group_size)
    x = (groups - q.zero.float().unsqueeze(-1)) * q.scale.float().unsqueeze(-1)
    return x.reshape(*codes.shape[:-1], d).to(dtype or q.dtype)


def quantize_int2(
    x: torch.Tensor,
    group_size: int = 128,
    clip_ratio: float = 0.0,
    scale_dtype: torch.dtype = torch.float16,
) -> Int2Tensor:
    """Quantize the last dimension of x to asymmetric INT2 per group of channels.

    x: [..., D] floating point. Returns an `Int2Tensor` with packed [..., D/4] and
    scale/zero [..., D/group_size].
    """
    return quantize(x, 2, group_size, clip_ratio, scale_dtype)


def dequantize_int2(q: Int2Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Int2Tensor -> tensor [..., D] in `dtype` (default: the dtype that was quantized)."""
    return dequantize(q, dtype)


def bits_per_element(bits: int, group_size: int, scale_dtype: torch.dtype = torch.float16) -> float:
    """Bits stored per history element: the code plus scale and zero shared by a group."""
    return bits + 2.0 * torch.finfo(scale_dtype).bits / group_size


def int2_bits_per_element(group_size: int, scale_dtype: torch.dtype = torch.float16) -> float:
    """Bits stored per INT2 history element (2.25 at group 128 with fp16 scale and zero)."""
    return bits_per_element(2, group_size, scale_dtype)
