"""Perplexity with the history in INT2.

The text is cut into non-overlapping windows of `context` tokens. Each window is run
through a fresh cache in one forward, which by construction equals decoding it token by
token (see `oscarkv.attention`). Only predictions made at positions >= sink + recent
are scored: before that no token has reached the INT2 history and every method is BF16.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from ..calibration.calibrate import token_chunks
from ..config import CacheConfig, QuantConfig
from ..errors import InputTooLongError, OscarError
from ..integrations.transformers import cache_keyword, patch_model
from ..methods import method_setups
from ..models import attention_shape


@dataclass
class PplResult:
    method: str
    ppl: float
    tokens: int  # predictions scored
    bits_per_element: float  # measured from the cache after one full window
    kv_bytes: int  # bytes of K/V stored for one window of `context` tokens
    context: int
    group_size: int

    def as_dict(self) -> dict:
        return asdict(self)


def check_context(model, context: int, fix: str | None = None) -> None:
    """Refuse `context` tokens where the model (or its config) has fewer positions. `fix` says what to change
    (default: perplexity's --context)."""
    limit = attention_shape(model).max_positions
    if limit and context > limit:
        raise InputTooLongError(f"context {context} exceeds the model's maximum of {limit} positions; "
                                f"{fix or f'pass --context {limit} or less'}.")


def check_windows(context: int, cache: CacheConfig) -> None:
    """Refuse a `context` too short for any scored position to read history beyond the cache's BF16 windows."""
    if context <= cache.sink_tokens + cache.recent_tokens + 1:
        raise OscarError(
            f"context {context} leaves no position whose history reaches the INT2 region "
            f"(sink {cache.sink_tokens} + recent {cache.recent_tokens}); use a longer --context."
        )


def window_nll(model, window: torch.Tensor, scored_from: int) -> tuple[float, int, int]:
    """(sum of NLL, predictions scored, KV bytes) for one window through a fresh oscarkv cache."""
    device = next(model.parameters()).device
    cache = model.oscar.new_cache()
    with torch.no_grad():
        # Logits only where they are scored: the LM head is a large share of a small model's forward.
        logits = model(window[None].to(device), **{cache_keyword(model): cache}, use_cache=True,
                       logits_to_keep=window.numel() - scored_from).logits[0]
    targets = window[scored_from + 1 :].to(device)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), targets, reduction="sum")
    return float(nll), targets.numel(), cache.nbytes()


def perplexity(model, token_ids: torch.Tensor, context: int, max_tokens: int | None = None,
               desc: str = "ppl", bos_id: int | None = None) -> tuple[float, int, int]:
    """(perplexity, tokens scored, KV bytes of one window) of a patched model on `token_ids`."""
    check_context(model, context)
    cache_config = model.oscar.cache
    check_windows(context, cache_config)
    scored_from = cache_config.sink_tokens + cache_config.recent_tokens
    chunks = token_chunks(token_ids.reshape(-1), context, bos_id)
    if not chunks:
        raise OscarError(f"the evaluation text has {token_ids.numel()} tokens, fewer than one window of {context}.")
    total, count, kv_bytes = 0.0, 0, 0
    per_window = context - scored_from - 1
    needed = len(chunks) if max_tokens is None else min(len(chunks), max(1, math.ceil(max_tokens / per_window)))
    for window in tqdm(chunks[:needed], desc=desc, unit="window", leave=False):
        nll, n, kv_bytes = window_nll(model, window, scored_from)
        total += nll
        count += n
    return math.exp(total / count), count, kv_bytes


def evaluate_methods(model, token_ids: torch.Tensor, methods: list[str], quant: QuantConfig, cache: CacheConfig,
                     context: int, max_tokens: int | None, artifact=None, bos_id: int | None = None) -> list[PplResult]:
    """Perplexity of each method on the same windows and positions of `token_ids`."""
    shape = attention_shape(model)
    elements = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * context
    results = []
    for setup in method_setups(methods, model, quant, cache, artifact):
        name = setup.name
        patch_model(model, setup.artifact, setup.quant, setup.cache)
        ppl, tokens, kv_bytes = perplexity(model, token_ids, context, max_tokens, desc=name, bos_id=bos_id)
        results.append(PplResult(name, ppl, tokens, 8 * kv_bytes / elements, kv_bytes, context, quant.group_size))
    return results
