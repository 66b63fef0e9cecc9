"""The mixed-precision KV cache for transformers (SPEC §3): BF16 sink, INT2 history, BF16 recent.

Storage per layer, along a slot axis shared by the batch (left padding occupies the first
slots of shorter rows):

    sink   [0, a)            window dtype, a = sink_tokens + largest left padding
    history [a + dropped, …)  INT2 (HistoryStore)
    tail    last slots        window dtype: the recent window plus the tokens of the step in flight

Write path (`update`): rotate keys by R_K, append, and hand the layer itself to the
attention function as the key/value "handle". Tokens that have aged out of the recent
window are moved to the history at the start of the next `update` (`flush`), so the
attention of the current step still sees them at full precision where the decode
semantics say so (see `oscarkv.attention.precision_masks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from .. import rope
from ..config import CacheConfig, QuantConfig
from ..calibration.rotations import rotate_heads
from ..errors import OscarError
from .history import ChannelGroupedHistory, HistoryStore, TurboQuantHistory


@dataclass
class LayerSpec:
    """What the write path of one layer needs."""

    k_rotation: torch.Tensor | None  # [d, d] float32, or [Hkv, d, d] one per KV head; None = identity
    quant: QuantConfig  # group size, this layer's clip ratios, scale dtype
    sliding_window: int | None = None
    k_mean: torch.Tensor | None = None  # [Hkv, d]: subtracted from every key before R_K (SPEC §6)
    key_bits: int = 2  # history code widths: 2, or 4 where calibration moved the stream to INT4
    value_bits: int = 2
    key_inner: float | None = None  # Lloyd–Max inner levels of INT2 streams (`quant.format`); None: uniform
    value_inner: float | None = None
    plain_history: bool = False  # history kept in the window dtype (TurboQuant's boundary layers)
    # key_centering="rope": [blocks, Hkv, d] (R(o)·μ_K - μ_K)·R_K for o = block·i, subtracted from the
    # history keys of positions [o, o + block) before quantization and added back on reading
    # (`oscarkv.rope`); None = every key centered by μ_K alone.
    k_mean_shifts: torch.Tensor | None = None
    shift_block: int = 1024


class OscarLayer(DynamicLayer):
    """One layer of the mixed-precision cache; see the module docstring for the layout."""

    def __init__(self, spec: LayerSpec, config: CacheConfig, owner: OscarCache) -> None:
        super().__init__()
        self.spec = spec
        self.config = config
        self.owner = owner
        self.sink_tokens = config.sink_tokens
        self.is_sliding = False  # keep every slot addressable; the attention applies the window

    # -- transformers interface -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        store_dtype = self.config.window_dtype
        history_dtype = self.config.history_dtype or store_dtype
        quant = self.spec.quant
        quantized = self.config.quantize_history and not self.spec.plain_history
        if quantized and self.config.history_format == "turboquant3":
            self.history_k = TurboQuantHistory("keys", history_dtype)
            self.history_v = TurboQuantHistory("values", history_dtype)
        else:
            if self.config.key_grouping == "channel" and quantized:
                self.history_k = ChannelGroupedHistory(quant.group_size, quant.clip_ratio_k, quant.scale_dtype,
                                                       history_dtype, self.spec.key_bits)
            else:
                self.history_k = HistoryStore(quantized, quant.group_size, quant.clip_ratio_k, quant.scale_dtype,
                                              history_dtype, self.spec.key_bits, self.spec.key_inner)
            self.history_v = HistoryStore(quantized, quant.group_size, quant.clip_ratio_v, quant.scale_dtype,
                                          history_dtype, self.spec.value_bits, self.spec.value_inner)
        empty = key_states[:, :, :0].to(store_dtype)
        self.sink_k, self.sink_v = empty, empty.clone()
        self.tail_k, self.tail_v = empty.clone(), empty.clone()
        self.dropped = 0  # history slots dropped from the front (sliding-window layers)
        self.length = 0
        self.pad = self.owner.padding(key_states.shape[0], key_states.device)
        self.sink_capacity = self.sink_tokens + int(self.pad.max().item()) if self.pad.numel() else self.sink_tokens
        if self.spec.k_rotation is not None:
            self.k_rotation = self.spec.k_rotation.to(device=self.device, dtype=torch.float32)
        else:
            self.k_rotation = None
        if self.spec.k_mean is not None:
            self.k_mean = self.spec.k_mean.to(device=self.device, dtype=torch.float32)[None, :, None, :]
        else:
            self.k_mean = None
        if self.spec.k_mean_shifts is not None:
            self.k_mean_shifts = self.spec.k_mean_shifts.to(device=self.device, dtype=torch.float32)
        else:
            self.k_mean_shifts = None
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states: [B, H_kv, n, D] after RoPE. Returns (self, self) as handles."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.flush()
        keys = self.write_keys(key_states).to(self.config.window_dtype)
        values = value_states.to(self.config.window_dtype)
        room = max(0, self.sink_capacity - self.sink_k.shape[2])
        if room:
            self.sink_k = torch.cat([self.sink_k, keys[:, :, :room]], dim=2)
            self.sink_v = torch.cat([self.sink_v, values[:, :, :room]], dim=2)
            keys, values = keys[:, :, room:], values[:, :, room:]
        if keys.shape[2]:
            self.tail_k = torch.cat([self.tail_k, keys], dim=2)
            self.tail_v = torch.cat([self.tail_v, values], dim=2)
        self.length += key_states.shape[2]
        return self, self

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def reset(self) -> None:
        self.is_initialized = False
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            tokens_to_remove = self.length - tokens_to_remove
        n = abs(tokens_to_remove)
        if n == 0 or not self.is_initialized:
            return
        if n > self.tail_k.shape[2]:
            raise OscarError(
                f"cannot crop {n} tokens: only the {self.tail_k.shape[2]} most recent tokens are kept in full "
                "precision and INT2 history cannot be un-written. Crop at most the recent window."
            )
        self.tail_k, self.tail_v = self.tail_k[:, :, :-n], self.tail_v[:, :, :-n]
        self.length -= n

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda x: x[indices, ...])

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.sink_k, self.sink_v = fn(self.sink_k), fn(self.sink_v)
        self.tail_k, self.tail_v = fn(self.tail_k), fn(self.tail_v)
        self.history_k.map_batch(fn)
        self.history_v.map_batch(fn)
        self.pad = fn(self.pad)

    # -- write path -------------------------------------------------------------------------
    def write_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """(k - μ_K) @ R_K in at least float32 (keys: [B, H_kv, n, D]), for every key alike.

        Centering shifts each score of a query by the same q·μ_K, which softmax ignores.
        """
        if self.k_mean is not None:
            dtype = torch.promote_types(keys.dtype, torch.float32)
            keys = keys.to(dtype) - self.k_mean.to(dtype)
        return self.rotate(keys)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x @ R_K in at least float32 (queries: [B, H_q, n, D]; keys after centering); a query head
        takes the rotation of its KV head where R_K is one per KV head."""
        if self.k_rotation is None:
            return x
        dtype = torch.promote_types(x.dtype, torch.float32)
        return rotate_heads(x.to(dtype), self.k_rotation.to(dtype), head_axis=1)

    def key_shift(self, first_slot: int, n: int) -> torch.Tensor | None:
        """[B, Hkv, n, d] float32: the (R(o) - 1)·μ_K·R_K of slots first_slot.. of each row (their
        positions are slot - left padding), or None when keys are centered by μ_K alone."""
        if self.k_mean_shifts is None:
            return None
        slots = torch.arange(first_slot, first_slot + n, device=self.device)
        positions = slots[None, :] - self.pad[:, None]  # [B, n]
        return rope.shift_rows(self.k_mean_shifts, positions, self.spec.shift_block).transpose(1, 2)

    def keys_to_history(self, keys: torch.Tensor, first_slot: int) -> torch.Tensor:
        """Window keys of slots first_slot.. as the history stores them (block-shifted, see LayerSpec)."""
        shift = self.key_shift(first_slot, keys.shape[2])
        return keys if shift is None else keys.float() - shift

    def history_keys(self, dtype: torch.dtype) -> torch.Tensor:
        """The history keys read back in `dtype`, shifts added back."""
        keys = self.history_k.read(dtype)
        shift = self.key_shift(self.history_start, keys.shape[2])
        return keys if shift is None else keys + shift.to(dtype)

    def roundtrip_keys(self, keys: torch.Tensor, first_slot: int) -> torch.Tensor:
        """Window keys of slots first_slot.. as they would read back from the history."""
        shift = self.key_shift(first_slot, keys.shape[2])
        if shift is None:
            return self.history_k.roundtrip(keys)
        return self.history_k.roundtrip(keys.float() - shift) + shift

    def flush(self) -> None:
        """Move tokens that left the recent window into the INT2 history."""
        overflow = self.tail_k.shape[2] - self.config.recent_tokens
        overflow -= overflow % self.token_multiple  # KIVI keys move a whole token group at a time
        if overflow > 0:
            self.history_k.append(self.keys_to_history(self.tail_k[:, :, :overflow], self.tail_start))
            self.history_v.append(self.tail_v[:, :, :overflow])
            self.tail_k = self.tail_k[:, :, overflow:].contiguous()
            self.tail_v = self.tail_v[:, :, overflow:].contiguous()
        window = self.spec.sliding_window
        if window and self.history_k.length:
            # Slots older than length - window are invisible to every future query.
            first_visible = self.length - window + 1
            stale = min(self.history_k.length, first_visible - (self.sink_capacity + self.dropped))
            stale -= stale % self.token_multiple
            if stale > 0:
                self.history_k.drop_front(stale)
                self.history_v.drop_front(stale)
                self.dropped += stale

    # -- read-path views ----------------------------------------------------------------------
    @property
    def token_multiple(self) -> int:
        """Tokens enter and leave the history in multiples of this (1, or KIVI's key group)."""
        return getattr(self.history_k, "token_multiple", 1)

    @property
    def history_start(self) -> int:
        return self.sink_capacity + self.dropped

    @property
    def tail_start(self) -> int:
        return self.length - self.tail_k.shape[2]

    def nbytes(self) -> int:
        """Bytes the stored K/V of this layer occupy now (after moving aged tokens to history)."""
        if not self.is_initialized:
            return 0
        self.flush()
        windows = sum(t.numel() * t.element_size() for t in (self.sink_k, self.sink_v, self.tail_k, self.tail_v))
        return windows + self.history_k.nbytes() + self.history_v.nbytes()


def left_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """Leading padding of each row of a 2-D mask [B, T] (long [B]); OscarError if the mask is not left padding."""
    mask = attention_mask.bool()
    pad = (~mask).int().cumprod(dim=1).sum(dim=1)  # leading zeros per row
    expected = torch.arange(mask.shape[1], device=mask.device)[None, :] >= pad[:, None]
    if not torch.equal(mask, expected):
        raise OscarError(
            "the attention mask has holes or right padding; the oscarkv cache supports left padding only "
            "(tokenizer.padding_side = 'left')."
        )
    return pad.long()


class OscarCache(DynamicCache):
    """A DynamicCache whose layers are `OscarLayer`s (so `generate` treats it as dynamic)."""

    def __init__(self, specs: list[LayerSpec], config: CacheConfig) -> None:
        self.cache_config = config
        self._pad: torch.Tensor | None = None
        Cache.__init__(self, layers=[OscarLayer(spec, config, self) for spec in specs])

    def set_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Record each row's left padding from a 2-D mask [B, T] before the first token is written."""
        if attention_mask is None or attention_mask.dim() != 2:
            self._pad = None
            return
        pad = left_padding(attention_mask)
        if self.cache_config.key_grouping == "channel" and bool(pad.any()):
            raise OscarError("key_grouping='channel' (kivi2) groups keys over aligned token groups and does not "
                             "support left padding; evaluate one sequence at a time or pad to equal lengths.")
        self._pad = pad

    def padding(self, batch: int, device: torch.device) -> torch.Tensor:
        if self._pad is None or self._pad.shape[0] != batch:
            return torch.zeros(batch, dtype=torch.long, device=device)
        return self._pad.to(device=device, dtype=torch.long)

    def nbytes(self) -> int:
        """Bytes of K/V stored over all layers."""
        return sum(layer.nbytes() for layer in self.layers)
