"""Growable token-axis storage of the history region of one layer (keys or values).

Tensors are [batch, kv_heads, tokens, head_dim]. Capacity grows geometrically so that
appending one token per decode step costs amortised O(1) copies, not O(length).
"""

from __future__ import annotations

import torch

from ..quant import turboquant
from ..quant.format import QuantizedTensor, dequantize, quantize


class _Growable:
    """A [B, H, capacity, X] buffer with a filled prefix along dim 2."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self.length = 0

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[2]
        if self.data is None:
            self.data = torch.empty((*x.shape[:2], max(n, 16), x.shape[3]), dtype=x.dtype, device=x.device)
        elif self.length + n > self.data.shape[2]:
            grown = torch.empty(
                (*self.data.shape[:2], max(2 * self.data.shape[2], self.length + n), self.data.shape[3]),
                dtype=self.data.dtype,
                device=self.data.device,
            )
            grown[:, :, : self.length] = self.data[:, :, : self.length]
            self.data = grown
        self.data[:, :, self.length : self.length + n] = x
        self.length += n

    def view(self) -> torch.Tensor:
        assert self.data is not None
        return self.data[:, :, : self.length]

    def drop_front(self, n: int) -> None:
        if n <= 0 or self.data is None:
            return
        kept = self.data[:, :, n : self.length].clone()
        self.data, self.length = None, 0
        if kept.shape[2]:
            self.append(kept)

    def map_batch(self, fn) -> None:
        if self.data is not None:
            kept = fn(self.view())
            self.data, self.length = None, 0
            self.append(kept)

    def nbytes(self) -> int:
        """Bytes of the filled prefix (what the tokens occupy, not the spare capacity)."""
        if self.data is None:
            return 0
        return self.length * self.data.shape[0] * self.data.shape[1] * self.data.shape[3] * self.data.element_size()


class HistoryStore:
    """The history of one tensor stream (keys or values) of one layer.

    quantize=True stores `bits`-bit codes (2, or 4 for a stream moved to INT4) and scales; False
    stores `plain_dtype` tensors (the BF16 baseline and the no-quantization checks use this).
    inner: the Lloyd–Max inner level of INT2 codes (`quant.format`); None: the uniform grid.
    """

    def __init__(self, quantize: bool, group_size: int, clip_ratio: float, scale_dtype: torch.dtype,
                 plain_dtype: torch.dtype, bits: int = 2, inner: float | None = None) -> None:
        self.quantize = quantize
        self.bits = bits
        self.inner = inner
        self.group_size = group_size
        self.clip_ratio = clip_ratio
        self.scale_dtype = scale_dtype
        self.plain_dtype = plain_dtype
        self.parts = [_Growable()] if not quantize else [_Growable(), _Growable(), _Growable()]

    @property
    def length(self) -> int:
        return self.parts[0].length

    def encode(self, x: torch.Tensor) -> QuantizedTensor | torch.Tensor:
        if not self.quantize:
            if self.plain_dtype.itemsize == 1:  # FP8: saturate instead of overflowing to NaN
                limit = torch.finfo(self.plain_dtype).max
                return x.clamp(-limit, limit).to(self.plain_dtype)
            return x.to(self.plain_dtype)
        return quantize(x, self.bits, self.group_size, self.clip_ratio, self.scale_dtype, self.inner)

    def decode(self, stored: QuantizedTensor | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(stored, QuantizedTensor):
            return dequantize(stored, dtype)
        return stored.to(dtype)

    def roundtrip(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x as it would read back after being stored in the history."""
        return self.decode(self.encode(x), dtype)

    def append(self, x: torch.Tensor) -> None:
        """x: [B, H, n, D] -> stored at the end of the history."""
        stored = self.encode(x)
        if isinstance(stored, QuantizedTensor):
            for part, tensor in zip(self.parts, (stored.packed, stored.scale, stored.zero)):
                part.append(tensor)
        else:
            self.parts[0].append(stored)

    def stored(self) -> QuantizedTensor | torch.Tensor:
        if not self.quantize:
            return self.parts[0].view()
        packed, scale, zero = (part.view() for part in self.parts)
        return QuantizedTensor(packed, scale, zero, self.group_size, self.plain_dtype, self.bits, self.inner)

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole history dequantized to `dtype` (a temporary for the reference read path)."""
        return self.decode(self.stored(), dtype)

    def drop_front(self, n: int) -> None:
        for part in self.parts:
            part.drop_front(n)

    def map_batch(self, fn) -> None:
        for part in self.parts:
            part.map_batch(fn)

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in self.parts)


class ChannelGroupedHistory(HistoryStore):
    """Keys quantized per channel over groups of `group_size` consecutive tokens (KIVI).

    Tokens arrive and leave in whole groups (`token_multiple`). A group of G tokens is stored
    as [D, G] rows, each channel's G values one asymmetric group with its own scale and zero:
    the same codes-plus-scales format, transposed, so the bits per element equal those of
    per-token groups of the same size.
    """

    def __init__(self, group_size: int, clip_ratio: float, scale_dtype: torch.dtype, plain_dtype: torch.dtype,
                 bits: int = 2) -> None:
        super().__init__(True, group_size, clip_ratio, scale_dtype, plain_dtype, bits)
        self.token_multiple = group_size

    @property
    def length(self) -> int:
        return self.parts[0].length * self.group_size

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, n, D] -> [B, H, n/G, D, G]."""
        b, h, n, d = x.shape
        if n % self.group_size:
            raise ValueError(f"{n} tokens are not a whole number of {self.group_size}-token groups")
        return x.reshape(b, h, n // self.group_size, self.group_size, d).transpose(-1, -2)

    def encode(self, x: torch.Tensor) -> QuantizedTensor:
        return quantize(self._grouped(x), self.bits, self.group_size, self.clip_ratio, self.scale_dtype)

    def decode(self, stored: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
        x = dequantize(stored, dtype)  # [B, H, groups, D, G]
        b, h, groups, d, g = x.shape
        return x.transpose(-1, -2).reshape(b, h, groups * g, d)

    def append(self, x: torch.Tensor) -> None:
        stored = self.encode(x)
        for part, tensor in zip(self.parts, (stored.packed, stored.scale, stored.zero)):
            part.append(tensor.flatten(3))  # [B, H, groups, D·X]

    def stored(self) -> QuantizedTensor:
        packed, scale, zero = (part.view() for part in self.parts)
        b, h, groups, _ = packed.shape
        return QuantizedTensor(packed.reshape(b, h, groups, -1, self.group_size * self.bits // 8),
                               scale.reshape(b, h, groups, -1, 1), zero.reshape(b, h, groups, -1, 1),
                               self.group_size, self.plain_dtype, self.bits)

    def drop_front(self, n: int) -> None:
        super().drop_front(n // self.group_size)


class TurboQuantHistory(HistoryStore):
    """Keys or values in vLLM's TurboQuant 3-bit format (`oscarkv.quant.turboquant`): keys as
    Hadamard-rotated unit vectors on 8 Lloyd-Max centroids plus an fp16 norm, values as 3-bit
    per-token groups over all channels with fp16 scale and minimum. Stored packed, so `nbytes`
    is what vLLM stores."""

    def __init__(self, stream: str, plain_dtype: torch.dtype) -> None:
        if stream not in ("keys", "values"):
            raise ValueError(f"stream must be 'keys' or 'values', got {stream!r}")
        super().__init__(False, 0, 0.0, torch.float16, plain_dtype)
        self.stream = stream
        self.parts = [_Growable(), _Growable()] if stream == "keys" else [_Growable(), _Growable(), _Growable()]

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return turboquant.encode_keys(x) if self.stream == "keys" else turboquant.encode_values(x)

    def decode(self, stored: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return turboquant.decode_keys(*stored, dtype) if self.stream == "keys" else \
            turboquant.decode_values(*stored, dtype)

    def append(self, x: torch.Tensor) -> None:
        for part, tensor in zip(self.parts, self.encode(x)):
            part.append(tensor)

    def stored(self) -> tuple[torch.Tensor, ...]:
        return tuple(part.view() for part in self.parts)
