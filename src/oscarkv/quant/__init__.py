"""The low-bit KV format (INT2, INT4 fallback) and the bits-per-element accounting."""

from .accounting import cache_bits_per_element, layers_bits_per_element
from .format import (
    Int2Tensor,
    QuantizedTensor,
    bits_per_element,
    clip_rows,
    dequantize,
    dequantize_int2,
    int2_bits_per_element,
    pack_codes,
    pack_int2,
    quantize,
    quantize_int2,
    unpack_codes,
    unpack_int2,
)

__all__ = [
    "Int2Tensor",
    "QuantizedTensor",
    "bits_per_element",
    "cache_bits_per_element",
    "clip_rows",
    "dequantize",
    "dequantize_int2",
    "int2_bits_per_element",
    "layers_bits_per_element",
    "pack_codes",
    "pack_int2",
    "quantize",
    "quantize_int2",
    "unpack_codes",
    "unpack_int2",
]
