"""Exact bits-per-element accounting of the mixed-precision cache."""

from __future__ import annotations

import torch

from ..config import CacheConfig, QuantConfig
from .format import bits_per_element


def layers_bits_per_element(history_tokens: list[int], window_tokens: list[int], code_bits: list[float],
                            cache: CacheConfig, quant: QuantConfig) -> float:
    """Average stored bits per K/V element over layers that hold the given history and window tokens.

    Layer i keeps window_tokens[i] tokens at the window dtype and history_tokens[i] tokens at
    code_bits[i] bits plus their share of scale and zero: 2 or 4, or 3 for a layer with INT4 keys
    and INT2 values (the mean of its two streams' widths).
    """
    window_bits = torch.finfo(cache.window_dtype).bits
    float_history_bits = torch.finfo(cache.history_dtype or cache.window_dtype).bits
    total = 0.0
    for history, window, bits in zip(history_tokens, window_tokens, code_bits):
        history_bits = bits_per_element(bits, quant.group_size, quant.scale_dtype) if cache.quantize_history \
            else float_history_bits
        total += history * history_bits + window * window_bits
    elements = sum(history_tokens) + sum(window_tokens)
    return total / elements if elements else 0.0


def cache_bits_per_element(context: int, cache: CacheConfig, quant: QuantConfig) -> float:
    """Average stored bits per K/V element of one sequence of `context` tokens, all INT2.

    Counts the sink and recent windows at their storage dtype and every history token
    at 2 bits plus its share of scale and zero. Example (SPEC §2): context 131072,
    group 128, fp16 scales, BF16 windows of 64 + 256 tokens -> 2.2836.
    """
    if context <= 0:
        return 0.0
    windows = min(context, cache.sink_tokens + cache.recent_tokens)
    return layers_bits_per_element([context - windows], [windows], [2], cache, quant)
