"""The INT2 format and the bits-per-element accounting."""

from .accounting import cache_bits_per_element
from .int2 import (
    Int2Tensor,
    clip_rows,
    dequantize_int2,
    int2_bits_per_element,
    pack_int2,
    quantize_int2,
    unpack_int2,
)

__all__ = [
    "Int2Tensor",
    "cache_bits_per_element",
    "clip_rows",
    "dequantize_int2",
    "int2_bits_per_element",
    "pack_int2",
    "quantize_int2",
    "unpack_int2",
]
