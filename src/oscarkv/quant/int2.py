"""The INT2 storage format (SPEC §2), torch reference.

Per token and per group of `group_size` channels, asymmetric 2-bit codes:

    scale = max(max - min, 1e-8) / 3      zero = -min / scale
    q     = clamp(floor(x / scale + zero + 0.5), 0, 3)
    x_hat = (q - zero) * scale

scale and zero are rounded to their storage dtype *before* the codes are chosen, so
that `dequantize_int2` reproduces exactly what the codes were chosen against. For a
(near-)constant group the 1e-8 floor of the range would make `zero` overflow a float16
(and a float16 scale of 1e-8/3 is 0), so the scale is also floored at |x|max / 2^15 and at
the dtype's smallest normal: zero then stays within ±2^15 and the group reads back to
within float16 rounding. Groups with a range above 1e-4·|x|max are unaffected.

Packing ("quarter-planar"): byte j of a row holds the codes of channels
j, j + D/4, j + D/2 and j + 3D/4 in bits 0-1, 2-3, 4-5 and 6-7. A kernel unpacks a row
into four contiguous quarter vectors with one shift and mask each, which keeps every
load and every dot product contiguous; no interleave shuffle is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import OscarError

LEVELS = 3  # 2 bits: codes 0..3
MIN_RANGE = 1e-8
ZERO_LIMIT_INV = 2.0**-15  # keeps |zero| <= 2^15, finite in float16


@dataclass
class Int2Tensor:
    """A tensor stored in 2 bits per element.

    packed: uint8 [..., D/4]; scale, zero: [..., D/group_size] in the scale dtype.
    dtype: dtype that `dequantize_int2` returns.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    dtype: torch.dtype

    @property
    def head_dim(self) -> int:
        return self.packed.shape[-1] * 4

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.head_dim))

    def nbytes(self) -> int:
        """Bytes actually stored (codes + scales + zeros)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))


def _check_shape(head_dim: int, group_size: int) -> None:
    if head_dim % 4:
        raise OscarError(f"head_dim={head_dim} must be a multiple of 4 to pack 2-bit codes.")
    if group_size <= 0 or head_dim % group_size:
        raise OscarError(
            f"group_size={group_size} does not divide head_dim={head_dim}; "
            f"choose a divisor of {head_dim} (e.g. {min(head_dim, 64)})."
        )


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


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """codes: uint8 [..., D] with values 0..3 -> uint8 [..., D/4] (quarter-planar)."""
    d = codes.shape[-1]
    quarters = codes.reshape(*codes.shape[:-1], 4, d // 4)
    packed = quarters[..., 0, :] | (quarters[..., 1, :] << 2) | (quarters[..., 2, :] << 4) | (quarters[..., 3, :] << 6)
    return packed.contiguous()


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D/4] -> uint8 codes [..., D] (inverse of `pack_int2`)."""
    quarters = [(packed >> shift) & 3 for shift in (0, 2, 4, 6)]
    return torch.cat(quarters, dim=-1)


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
    if not x.is_floating_point():
        raise OscarError(f"quantize_int2 expects a floating-point tensor, got {x.dtype}.")
    d = x.shape[-1]
    _check_shape(d, group_size)
    xf = clip_rows(x.float(), clip_ratio)
    groups = xf.reshape(*xf.shape[:-1], d // group_size, group_size)
    lo = groups.amin(dim=-1)
    hi = groups.amax(dim=-1)
    floor = torch.maximum(torch.maximum(lo.abs(), hi.abs()) * ZERO_LIMIT_INV, torch.tensor(
        torch.finfo(scale_dtype).tiny, device=x.device))
    scale = torch.maximum((hi - lo).clamp(min=MIN_RANGE) / LEVELS, floor).to(scale_dtype)
    zero = (-lo / scale.float()).to(scale_dtype)
    codes = torch.floor(groups / scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1) + 0.5)
    codes = codes.clamp(0, LEVELS).to(torch.uint8).reshape(*xf.shape[:-1], d)
    return Int2Tensor(pack_int2(codes), scale, zero, group_size, x.dtype)


def dequantize_int2(q: Int2Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Int2Tensor -> tensor [..., D] in `dtype` (default: the dtype that was quantized)."""
    codes = unpack_int2(q.packed).float()
    d = codes.shape[-1]
    groups = codes.reshape(*codes.shape[:-1], d // q.group_size, q.group_size)
    x = (groups - q.zero.float().unsqueeze(-1)) * q.scale.float().unsqueeze(-1)
    return x.reshape(*codes.shape[:-1], d).to(dtype or q.dtype)


def int2_bits_per_element(group_size: int, scale_dtype: torch.dtype = torch.float16) -> float:
    """Bits stored per history element: 2 for the code plus scale and zero shared by a group."""
    scale_bits = torch.finfo(scale_dtype).bits
    return 2.0 + 2.0 * scale_bits / group_size
