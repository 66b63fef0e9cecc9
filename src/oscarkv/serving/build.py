"""Load a model, patch it for a method and put an engine over the matching slot cache."""

from __future__ import annotations

import socket
from dataclasses import replace

from ..config import CacheConfig, QuantConfig
from ..errors import OscarError
from ..methods import SERVE_METHODS
from .engine import Engine, EngineConfig
from ..integrations.slots import DenseSlotCache, PagedSlotCache



def check_address(host: str, port: int) -> None:
    """Refuse a --host / --port this machine cannot listen on, before the model loads: uvicorn would say so only
    after the loading and the warm-up. The port is bound and let go at once, as uvicorn binds it (SO_REUSEADDR)."""
    if not 0 <= port <= 65535:
        raise OscarError(f"--port {port}: a TCP port is a number from 0 to 65535.")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise OscarError(f"--host {host}: not a host name or address this machine knows ({exc.strerror}); use "
                         "127.0.0.1, or 0.0.0.0 for every interface.") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise OscarError(f"cannot listen on {host}:{port} ({exc.strerror}); pass another --port (or --host), or "
                             "stop what holds it.") from None


def check_max_context(config: EngineConfig, model_config) -> None:
    """Refuse a max_context longer than the model's positions (`model_config`: a transformers config, so that
    `serve` can check before the weights load)."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit and config.max_context > limit:
        raise OscarError(f"--max-context {config.max_context} is longer than the model's {limit} positions.")


def build_engine(model, tokenizer, method: str = "oscar", rotations=None, config: EngineConfig | None = None,
                 kv_memory_bytes: int | None = None, quant: QuantConfig | None = None,
                 cache: CacheConfig | None = None, backend: str = "auto") -> Engine:
    """Patch `model` (loaded, on its device) for `method` and return an engine over its cache.

    INT2/INT4 methods run on the paged cache (Triton kernels on CUDA, their torch references on
    the CPU); `bf16` on the dense BF16 slot cache. kv_memory_bytes: the KV budget (default: every
    slot can hold max_context tokens). backend: for the paged cache, "auto" (Triton on CUDA, the
    torch references elsewhere), "triton" or "torch".
    """
    import oscarkv

    if method not in SERVE_METHODS:
        raise OscarError(f"method {method!r} cannot be served; choose from {', '.join(SERVE_METHODS)}.")
    config = config or EngineConfig()
    check_max_context(config, model.config)
    cache = replace(cache or CacheConfig(), kernel="paged" if method != "bf16" else "reference",
                    max_context=config.max_context)
    oscarkv.patch(model, rotations, method=method, quant=quant, cache=cache)
    state = model.oscar
    device = next(model.parameters()).device
    if method == "bf16":
        slot_cache = DenseSlotCache(len(state.specs), config.max_seqs, config.max_context, state.cache.window_dtype,
                                    state.kv_heads, state.head_dim, device)
        if kv_memory_bytes is not None and slot_cache.usage().bytes_total > kv_memory_bytes:
            fit = kv_memory_bytes // (config.max_context * slot_cache.bytes_per_token)
            raise OscarError(f"the BF16 cache of {config.max_seqs} slots x {config.max_context} tokens needs "
                             f"{slot_cache.usage().bytes_total / 2**30:.2f} GiB, more than --kv-memory; "
                             f"use --max-seqs {max(1, fit)} or a shorter --max-context.")
        return Engine(model, tokenizer, slot_cache, config)
    state.uses_paged(device)  # raises, naming the reason, if the paged cache cannot take this model
    pages = PagedSlotCache.pages_for_budget(state, config.max_seqs, config.max_context, kv_memory_bytes)
    slot_cache = PagedSlotCache(state, config.max_seqs, pages, config.max_context, device, backend)
    return Engine(model, tokenizer, slot_cache, config)
