"""Exact bits-per-element accounting of the mixed-precision cache."""

from __future__ import annotations

import torch

from ..config import CacheConfig, QuantConfig
from .format import int2_bits_per_element


def cache_bits_per_element(context: int, cache: CacheConfig, quant: QuantConfig) -> float:
    """Average stored bits per K/V element of one sequence of `context` tokens.

    Counts the sink and recent windows at their storage dtype and every history token
    at 2 bits plus its share of scale and zero. Example (SPEC §2): context 131072,
    group 128, fp16 scales, BF16 windows of 64 + 256 tokens -> 2.2836.
    """
    if context <= 0:
        return 0.0
    window_bits = torch.finfo(cache.window_dtype).bits
    windows = min(context, cache.sink_tokens + cache.recent_tokens)
    history = context - windows
    history_bits = (
        int2_bits_per_element(quant.group_size, quant.scale_dtype) if cache.quantize_history else window_bits
    )
    return (windows * window_bits + history * history_bits) / context
