"""The paged cache behind transformers' Cache interface: the GPU kernels' path for `generate`.

`PagedOscarCache` holds one `PagedKVCache` (all layers, one page pool) for a batch of
sequences. Each forward is one step: the first layer's `update` reserves the pages the
step needs and builds its `StepBatch`; every layer then writes its new keys and values
with `write_step` and hands itself to the "oscar" attention function, which calls
`attend_step`. Both run the Triton kernels on CUDA and their torch references elsewhere
(`oscarkv.kernels.ops` decides).

Semantics (see `oscarkv.cache.paged`): the recent window holds between R and R + P - 1
tokens (tokens move to INT2 a page at a time), and a prompt's own tokens attend to each
other at full precision. The reference cache (`OscarCache`) instead keeps exactly R
recent tokens and quantizes prompt tokens as decoding would; both keep at least what
the method asks for in full precision.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from ..cache.mixed import LayerSpec, left_padding
from ..cache.paged import PagedKVCache, PagedLayer, PagedLayout, StepBatch
from ..config import CacheConfig
from ..errors import OscarError
from ..kernels.extend import COMPUTE_DTYPE as EXTEND_COMPUTE_DTYPE
from ..kernels.ops import (attend_step, decode_query_key, decode_query_key_write, dequantizes_extend,
                           prefetched_splits, rotate_queries, rotation_pieces, uses_rotation_pieces, write_step)


def paged_layouts(specs: list[LayerSpec], config: CacheConfig, kv_heads: int, head_dim: int) -> list[PagedLayout]:
    """One layout per layer; raises OscarError when a layer's shape is not one the kernels take."""
    return [PagedLayout(kv_heads=kv_heads, head_dim=head_dim, group_size=spec.quant.group_size,
                        key_bits=spec.key_bits, value_bits=spec.value_bits,
                        key_inner=spec.key_inner, value_inner=spec.value_inner,
                        page_size=config.page_size, sink_tokens=config.sink_tokens,
                        recent_tokens=config.recent_tokens) for spec in specs]


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                     pad: torch.Tensor | None = None) -> torch.Tensor:
    """Causal SDPA of a prompt chunk over itself: query [B, Hq, n, D], keys/values [B, Hkv, n, D]
    -> [B, n, Hq, D] in query.dtype (flash attention on the GPU). pad: long [B], each row's left
    padding; no token reads a padding key, and the padding rows' outputs are zero."""
    mask = None
    if pad is not None:
        n = query.shape[2]
        i = torch.arange(n, device=query.device)
        real = i[None, :] >= pad[:, None]  # [B, n]
        # A padding query sees only itself (a row with no key would give NaN), and is zeroed below.
        mask = (i[None, :, None] >= i[None, None, :]) & (real[:, None, :] | (i[:, None] == i[None, :])[None])
        mask = mask[:, None]  # [B, 1, n, n]
    out = F.scaled_dot_product_attention(query, keys.to(query.dtype), values.to(query.dtype), attn_mask=mask,
                                         is_causal=mask is None, scale=scaling,
                                         enable_gqa=keys.shape[1] != query.shape[1])
    if pad is not None:
        out = out * real[:, None, :, None].to(out.dtype)
    return out.transpose(1, 2)


class AttendingLayer(DynamicLayer):
    """A cache layer that computes attention itself: the "oscar" attention function hands it the
    queries (`attend`) instead of reading keys and values out of it."""

    @abstractmethod
    def attend(self, query: torch.Tensor, scaling: float, sliding_window: int | None) -> torch.Tensor:
        """query: [B, Hq, n, D] (not rotated) -> attention output [B, n, Hq, D] in query.dtype."""

    @property
    def query_rotation(self) -> torch.Tensor | None:
        """What a decode step's queries are multiplied by before `attend_decode` (None: nothing)."""
        return None

    @property
    def takes_rotated_keys(self) -> bool:
        """Whether `update(keys, values, keys_rotated=True)` takes a decode step's keys as they are stored:
        (k - key_mean)·query_rotation, rounded to the cache's dtype."""
        return False

    @property
    def key_mean(self) -> torch.Tensor | None:
        return None

    def attend_decode(self, query: torch.Tensor, scaling: float, sliding_window: int | None) -> torch.Tensor:
        """query: [B, Hq, D], one token per row, already times `query_rotation` -> [B, Hq, D]."""
        b, hq, d = query.shape
        return self.attend(query.view(b, hq, 1, d), scaling, sliding_window).reshape(b, hq, d)

    def prepare_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       norms: tuple, backend: str) -> torch.Tensor:
        """A decode step's queries and cache write, from the projections: q [B, Hq, D], k and v [B, Hkv, D],
        cos/sin [B, D], norms the (q, k) RMSNorms' (weight, eps) or None. Stores the step's key and value and
        returns the queries for `attend_decode` (`ops.decode_query_key`, then `update`)."""
        rotated = self.takes_rotated_keys
        query, key = decode_query_key(q, k, cos, sin, self.query_rotation, *norms, backend=backend,
                                      rotate_keys=rotated, key_mean=self.key_mean if rotated else None)
        b, hkv, d = k.shape
        self.update(key.view(b, hkv, 1, d), v.view(b, hkv, 1, d), keys_rotated=rotated)
        return query


class PagedOscarLayer(AttendingLayer):
    """One layer: its write spec, and the step's rotated keys and values for the attention."""

    def __init__(self, index: int, spec: LayerSpec, owner: PagedOscarCache) -> None:
        super().__init__()
        self.index = index
        self.spec = spec
        self.owner = owner
        self.length = 0
        self.fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        # On the device once, not copied from the host at every step of every layer.
        as_float = lambda x: None if x is None else x.to(device=self.device, dtype=torch.float32).contiguous()  # noqa: E731
        self.k_rotation = as_float(self.spec.k_rotation)
        self.k_mean = as_float(self.spec.k_mean)
        # The write kernel's form of R_K for bfloat16 keys, prepared once (not at every step).
        self.rotation_pieces = (rotation_pieces(self.k_rotation, self.k_mean)
                                if uses_rotation_pieces(key_states, self.k_rotation) else None)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, keys_rotated: bool = False, **kwargs):
        """key/value_states: [B, Hkv, n, D] after RoPE. Returns (self, self) as handles.
        keys_rotated: the keys are already centered and rotated (`takes_rotated_keys`)."""
        if keys_rotated and not (self.is_initialized and self.takes_rotated_keys):
            raise OscarError("this layer cannot take rotated keys before its first step, or without a key rotation.")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, _, n, _ = key_states.shape
        self._store(self.owner.begin_step(self.index, b, n, key_states.device), key_states, value_states,
                    keys_rotated)
        return self, self

    def _store(self, step: StepBatch, key_states: torch.Tensor, value_states: torch.Tensor, keys_rotated: bool) -> None:
        """Write a step's keys and values ([B, Hkv, n, D]) with `write_step` and keep what its attention reads."""
        b, hkv, n, d = key_states.shape
        k = key_states.transpose(1, 2).reshape(b * n, hkv, d)
        v = value_states.transpose(1, 2).reshape(b * n, hkv, d)
        rows = self.owner.real_rows  # a left-padded first step stores its real tokens only
        k, v = (k.contiguous(), v.contiguous()) if rows is None else (k[rows], v[rows])
        quant = self.spec.quant
        self.step = step
        self.new_values = v
        # A prompt's first chunk attends only to itself, at full precision: plain causal SDPA on the
        # unrotated keys (qRᵀ(kR) = qkᵀ) instead of the paged kernel.
        self.fresh_kv = (key_states, value_states) if step.fresh and n > 1 else None
        rotation, mean, pieces = (None, None, None) if keys_rotated else \
            (self.k_rotation, self.k_mean, self.rotation_pieces)
        # validate=False: the step comes from this cache's own PagedKVCache (pages from its allocator, token
        # counts from these shapes), so the block-table checks, which wait for the device, are skipped; the
        # shape, dtype and device checks still run.
        self.new_keys = write_step(self.pages, step, k, v, rotation, mean,
                                   quant.clip_ratio_k, quant.clip_ratio_v, backend=self.owner.backend,
                                   validate=False, pieces=pieces)
        self.length += n

    def attend(self, query: torch.Tensor, scaling: float, sliding_window: int | None) -> torch.Tensor:
        """query: [B, Hq, n, D] (not rotated) -> attention output [B, n, Hq, D] in query.dtype."""
        b, hq, n, d = query.shape
        if self.fresh_kv is not None and not (sliding_window and sliding_window < n):
            return causal_attention(query, *self.fresh_kv, scaling, self.owner.step_padding)
        # Where the step dequantizes the history and runs SDPA in float16, the rotation rounds the queries straight
        # into float16 (once, not to the queries' dtype first, and with no cast launch), and the output is cast back.
        dequantizes = dequantizes_extend(self.pages, self.step, query.device,
                                         self.owner.backend, self.owner.cache_config.extend_attention)
        q = rotate_queries(query, self.k_rotation, backend=self.owner.backend,
                           dtype=EXTEND_COMPUTE_DTYPE if dequantizes else None)
        rows = self.owner.real_rows
        if rows is None:
            return self._attend_rotated(q, scaling, sliding_window).reshape(b, n, hq, d).to(query.dtype)
        out = query.new_zeros(b * n, hq, d)  # padding rows stay zero
        out[rows] = self._attend_rotated(q[rows], scaling, sliding_window).to(query.dtype)
        return out.reshape(b, n, hq, d)

    @property
    def pages(self) -> PagedLayer:
        """This layer's part of the cache's storage (its pages and windows): what the write and attention kernels
        take."""
        return self.owner.storage.layers[self.index]

    @property
    def query_rotation(self) -> torch.Tensor | None:
        return self.k_rotation

    @property
    def takes_rotated_keys(self) -> bool:
        return self.k_rotation is not None and self.owner.cache_config.window_dtype == self.dtype

    @property
    def key_mean(self) -> torch.Tensor | None:
        return self.k_mean

    def attend_decode(self, query: torch.Tensor, scaling: float, sliding_window: int | None) -> torch.Tensor:
        return self._attend_rotated(query, scaling, sliding_window)

    def prepare_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       norms: tuple, backend: str) -> torch.Tensor:
        """As `AttendingLayer.prepare_decode`, with the queries, keys and cache write in one launch where the
        kernels allow (`ops.decode_query_key_write`)."""
        if not (self.is_initialized and self.takes_rotated_keys):
            return super().prepare_decode(q, k, v, cos, sin, norms, backend)
        b, hkv, d = k.shape
        step = self.owner.begin_step(self.index, b, 1, k.device)
        if self.owner.real_rows is not None:  # a left-padded first step: only its real rows are stored
            query, key = decode_query_key(q, k, cos, sin, self.k_rotation, *norms, backend=backend, rotate_keys=True,
                                          key_mean=self.k_mean)
            self._store(step, key.view(b, hkv, 1, d), v.view(b, hkv, 1, d), keys_rotated=True)
            return query
        v = v if v.is_contiguous() else v.contiguous()  # what `update` stores for the attention
        quant = self.spec.quant
        layer = self.pages
        splits = prefetched_splits(layer, b, q.shape[1], self.owner.max_context, q.device)
        query, self.new_keys = decode_query_key_write(
            layer, step, q, k, v, cos, sin, self.k_rotation, *norms,
            key_mean=self.k_mean, clip_k=quant.clip_ratio_k, clip_v=quant.clip_ratio_v, backend=backend,
            history_splits=splits)
        self.step, self.new_values, self.fresh_kv = step, v, None
        self.length += 1
        return query

    def _attend_rotated(self, q: torch.Tensor, scaling: float, sliding_window: int | None) -> torch.Tensor:
        """q: [B·n, Hq, D] times R_K -> [B·n, Hq, D], over the cache and the step's own tokens."""
        return attend_step(self.pages, self.step, q, self.new_keys, self.new_values,
                           scaling, sliding_window or 0, backend=self.owner.backend,
                           max_context=self.owner.max_context, validate=False,
                           extend=self.owner.cache_config.extend_attention)

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self.is_initialized = False
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise OscarError("the paged INT2 cache cannot be cropped (history cannot be un-written); "
                         "use CacheConfig(kernel='reference') for assisted generation.")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise OscarError("the paged INT2 cache does not support beam search or num_return_sequences > 1 yet; "
                             "use CacheConfig(kernel='reference').")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise OscarError("the paged INT2 cache does not support beam search yet; use CacheConfig(kernel='reference').")


class PagedOscarCache(DynamicCache):
    """A transformers cache over one `PagedKVCache`; see the module docstring."""

    def __init__(self, specs: list[LayerSpec], config: CacheConfig, kv_heads: int, head_dim: int,
                 max_context: int, backend: str = "auto") -> None:
        self.cache_config = config
        self.specs = specs
        self.layouts = paged_layouts(specs, config, kv_heads, head_dim)
        self.max_context = max_context
        self.backend = backend
        self.storage: PagedKVCache | None = None
        self.slots: list[int] = []
        self._step: StepBatch | None = None
        self._pad: torch.Tensor | None = None  # left padding of the first step's rows (set_padding)
        self.step_padding: torch.Tensor | None = None  # the current step's left padding, on its device
        self.real_rows: torch.Tensor | None = None  # its rows of real tokens in the flattened [B·n] step
        self.frozen: StepBatch | None = None  # the one StepBatch of every step of a static decode
        Cache.__init__(self, layers=[PagedOscarLayer(i, spec, self) for i, spec in enumerate(specs)])

    def new_storage(self, num_pages: int, max_slots: int, device: torch.device) -> PagedKVCache:
        """The page pool and windows of every layer, with the layers' key shifts (key_centering="rope"): the rows of
        the blocks below max_context, not of every position the model takes (18 MiB for Qwen3-4B's 131072 in
        1024-position blocks)."""
        storage = PagedKVCache(self.layouts, num_pages, max_slots, self.max_context, device,
                               self.cache_config.window_dtype)
        for layer, spec in zip(storage.layers, self.specs):
            if spec.k_mean_shifts is not None:
                rows = max(1, -(-self.max_context // spec.shift_block))
                layer.key_shifts = spec.k_mean_shifts[:rows].to(device=device, dtype=torch.float32).contiguous()
                layer.shift_block = spec.shift_block
        return storage

    def set_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Record each row's left padding from a 2-D mask [B, T] before the first step. The padding is
        not stored: each sequence's slot holds its real tokens from position 0 (the positions
        `generate` gives them), and the padding rows' attention outputs are zero."""
        self._pad = None
        if attention_mask is None or attention_mask.dim() != 2 or bool(attention_mask.bool().all()):
            return
        pad = left_padding(attention_mask)
        if bool((pad >= attention_mask.shape[1]).any()):
            raise OscarError("a row of the batch is all padding; give every row at least one token.")
        self._pad = pad

    def begin_step(self, layer_index: int, batch: int, new_tokens: int, device: torch.device) -> StepBatch:
        """The step of the current forward: made by layer 0, reused by the others."""
        if layer_index == 0:
            self._step = self.frozen if self.frozen is not None else self.reserve_step(batch, new_tokens, device)
        if self._step is None:
            raise OscarError("layer 0 must run before the others in a step.")
        return self._step

    def reserve_step(self, batch: int, new_tokens: int, device: torch.device) -> StepBatch:
        """Pages and metadata for a step of `batch` rows (one slot per row, opened at the first step)."""
        if self.storage is None:
            pages = batch * max(1, self.layouts[0].pages_needed(self.max_context))
            self.storage = self.new_storage(pages, batch, device)
            self.slots = [self.storage.open_slot() for _ in range(batch)]
        if batch != len(self.slots):
            raise OscarError(f"this cache holds {len(self.slots)} sequences but the step has {batch}.")
        pad, self._pad = self._pad, None  # the padding belongs to the first step only
        self.step_padding = self.real_rows = None
        if pad is None:
            return self.storage.step(self.slots, [new_tokens] * batch)
        if pad.shape[0] != batch or int(pad.max()) >= new_tokens:
            raise OscarError(f"the attention mask ({pad.shape[0]} rows) does not fit the first step's {batch} rows "
                             f"of {new_tokens} tokens.")
        self.step_padding = pad.to(device)
        real = torch.arange(new_tokens, device=device)[None, :] >= self.step_padding[:, None]
        self.real_rows = real.flatten().nonzero().flatten()
        return self.storage.step(self.slots, [new_tokens - p for p in pad.tolist()])

    def nbytes(self) -> int:
        """Bytes of the pages in use and the windows of the open sequences, over all layers."""
        return 0 if self.storage is None else self.storage.used_bytes()
