"""vLLM's CPU attention backend with the OSCAR INT2 cache (imported by vLLM through the plugin).

With no oscarkv entry in the server's additional_config every method defers to vLLM's own CPU
backend, so installing oscarkv changes nothing for other servers. With one:
- `customize_spec` makes each (token, KV head) cell of vLLM's pages `CellFormat.cell_bytes` bytes
  instead of 2·head_dim model-dtype values, so vLLM's block pool holds that many more tokens;
- the metadata builder gives every live request a window lane (`LaneMap`);
- `forward` writes the chunk (keys centered and rotated after RoPE, then INT2 cells into the
  pages through vLLM's slot mapping, full precision into the windows) and attends each request
  with `attend_chunk`, the torch read path. With key shifts (key_centering="rope") a cell holds
  its key minus the shift of its position's block, and reading adds it back, as the reference
  cache does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from .. import rope
from ..cache.mixed import LayerSpec
from ..calibration.rotations import rotate_heads
from ..errors import OscarError
from .transformers import layer_specs, with_key_shifts
from .vllm_format import CellFormat, LaneMap, RequestWindows, attend_chunk
from .vllm_plugin import PluginSettings, active_settings


class OscarCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN, or OSCAR INT2 when the server asks for it (see the module docstring)."""

    forward_includes_kv_cache_update: bool = True  # the OSCAR write needs the step's metadata

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        settings = active_settings()
        if settings is None or spec.state_content_bytes is not None:
            return spec
        cell = settings.cell_bytes(spec.head_size)
        if cell % spec.dtype.itemsize:
            raise OscarError(f"a {cell}-byte cell cannot be viewed as {spec.dtype}.")
        return replace(spec, state_content_bytes=cell)

    @staticmethod
    def get_impl_cls():
        return OscarCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return OscarCPUMetadataBuilder


@dataclass
class OscarCPUMetadata(CPUAttentionMetadata):
    """CPU_ATTN's metadata plus what the OSCAR path reads on the host."""

    lanes: list[int] = field(default_factory=list)
    query_starts: list[int] = field(default_factory=list)  # num_reqs + 1
    lengths: list[int] = field(default_factory=list)  # tokens of each request after this step


class OscarCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.oscar = active_settings()
        if self.oscar is None:
            return
        if vllm_config.cache_config.enable_prefix_caching:
            raise OscarError("the oscarkv KV cache keeps per-request full-precision windows that prefix caching "
                             "cannot share; start vLLM with --no-enable-prefix-caching.")
        self.lane_map = LaneMap(window_lanes(self.oscar, vllm_config))

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.oscar is None:
            return base
        m = common_attn_metadata
        starts = m.query_start_loc_cpu[: m.num_reqs + 1].tolist()
        lengths = m.seq_lens[: m.num_reqs].cpu().tolist()
        contexts = [length - (b - a) for length, a, b in zip(lengths, starts, starts[1:])]
        first_blocks = m.block_table_tensor[: m.num_reqs, 0].cpu().tolist()
        lanes = self.lane_map.assign(first_blocks, contexts)
        values = {f.name: getattr(base, f.name) for f in fields(base)}
        return OscarCPUMetadata(**values, lanes=lanes, query_starts=starts, lengths=lengths)


def window_lanes(settings: PluginSettings, vllm_config) -> int:
    return settings.window_lanes or vllm_config.scheduler_config.max_num_seqs


@dataclass
class _LayerState:
    spec: LayerSpec
    cells: CellFormat
    windows: RequestWindows
    k_rotation: torch.Tensor | None
    k_mean: torch.Tensor | None
    key_shifts: torch.Tensor | None = None  # key_centering="rope": [blocks, Hkv, D] (see LayerSpec)
    shift_block: int = 1024

    def shift(self, positions: torch.Tensor) -> torch.Tensor | None:
        """[n, Hkv, D] key shifts of history positions [n], or None without shifts."""
        return None if self.key_shifts is None else rope.shift_rows(self.key_shifts, positions, self.shift_block)


class OscarCPUAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.oscar = active_settings()
        self.state: _LayerState | None = None
        if self.oscar is None:
            return
        problems = [name for name, bad in (
            ("sliding-window attention", self.sliding_window != -1),
            ("attention logit soft-capping", bool(self.logits_soft_cap)),
            ("ALiBi", self.alibi_slopes is not None),
            ("attention sinks", self.sinks is not None),
            ("a quantized --kv-cache-dtype", self.kv_cache_dtype != "auto"),
        ) if bad]
        if problems:
            raise OscarError(f"the oscarkv vLLM plugin does not support {', '.join(problems)} in this version.")
        vllm_config = get_current_vllm_config()  # set while the model is built, not at forward time
        self.lanes = window_lanes(self.oscar, vllm_config)
        self.model_config = vllm_config.model_config

    def _layer_state(self, layer, device) -> _LayerState:
        if self.state is None:
            settings = self.oscar
            index = extract_layer_index(layer.layer_name)
            artifact = settings.artifact
            specs = layer_specs(artifact, settings.quant, ["full_attention"] * len(artifact.layers), None)
            # RoPE-turned key shifts from the config's plain RoPE frequencies (no rotary module here)
            spec = with_key_shifts([specs[index]], settings.cache.key_centering, artifact, ["full_attention"],
                                   self.model_config.max_model_len,
                                   lambda kind: rope.config_inverse_frequencies(self.model_config.hf_config,
                                                                                self.head_size))[0]
            cells = CellFormat(self.head_size, spec.quant.group_size, spec.key_bits, spec.value_bits,
                               cell_bytes=settings.cell_bytes(self.head_size), key_inner=spec.key_inner,
                               value_inner=spec.value_inner)
            cache = settings.cache
            windows = RequestWindows(self.lanes, self.num_kv_heads, self.head_size, cache.sink_tokens,
                                     cache.recent_tokens, cache.window_dtype, device)
            rotation = None if spec.k_rotation is None else spec.k_rotation.to(device, torch.float32)
            mean = None if spec.k_mean is None else spec.k_mean.to(device, torch.float32)
            shifts = None if spec.k_mean_shifts is None else spec.k_mean_shifts.to(device, torch.float32)
            self.state = _LayerState(spec, cells, windows, rotation, mean, shifts, spec.shift_block)
        return self.state

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if self.oscar is None:
            if attn_metadata is not None and key is not None and self.attn_type == AttentionType.DECODER \
                    and self.kv_sharing_target_layer_name is None:
                self.do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if attn_metadata is None:  # a warm-up run without a cache
            return output
        if output_scale is not None or output_block_scale is not None:
            raise OscarError("fused output quantization is not supported with the oscarkv KV cache.")
        self._forward_oscar(layer, query, key, value, kv_cache, attn_metadata, output)
        return output

    def _forward_oscar(self, layer, query, key, value, kv_cache, meta: OscarCPUMetadata, output) -> None:
        state = self._layer_state(layer, query.device)
        cache = self.oscar.cache
        tokens = meta.num_actual_tokens
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        q = query[:tokens].reshape(tokens, hq, d)
        k = key[:tokens].reshape(tokens, hkv, d)
        v = value[:tokens].reshape(tokens, hkv, d)
        keys = self._write_keys(k, state).to(cache.window_dtype)
        values = v.to(cache.window_dtype)
        q_rot = self._rotate(q.float(), state)

        # Write path: every token's INT2 cell into vLLM's page slot.
        pages = kv_cache.view(torch.uint8)  # [num_blocks, Hkv, block_size, cell_bytes]
        block_size = pages.shape[2]
        slots = meta.slot_mapping[:tokens].long()
        valid = slots >= 0
        quant = state.spec.quant
        stored_keys = keys
        if state.key_shifts is not None:  # each token's cell holds its key minus its block's shift
            positions = torch.cat([torch.arange(length - (end - start), length) for length, start, end in
                                   zip(meta.lengths, meta.query_starts, meta.query_starts[1:])]).to(keys.device)
            stored_keys = keys.float() - state.shift(positions)  # as the reference cache's history does
        cells = state.cells.encode(stored_keys[valid], values[valid], quant.clip_ratio_k, quant.clip_ratio_v)
        pages[slots[valid] // block_size, :, slots[valid] % block_size] = cells

        out = output[:tokens].view(tokens, hq, d)
        for row, lane in enumerate(meta.lanes):
            start, end = meta.query_starts[row], meta.query_starts[row + 1]
            length = meta.lengths[row]
            context = length - (end - start)
            positions, window_k, window_v = state.windows.read(lane, context)
            positions = torch.cat([positions, torch.arange(context, length, device=positions.device)])
            window_k = torch.cat([window_k, keys[start:end]])
            window_v = torch.cat([window_v, values[start:end]])
            history_k, history_v, history_start = self._read_history(pages, meta.block_table[row], length, state)
            attended = attend_chunk(q_rot[start:end], history_k, history_v, history_start, positions, window_k,
                                    window_v, context, cache.sink_tokens, cache.recent_tokens, self.scale)
            out[start:end] = attended.to(out.dtype)
            state.windows.write(lane, context, keys[start:end], values[start:end])

    @staticmethod
    def _write_keys(k: torch.Tensor, state: _LayerState) -> torch.Tensor:
        """(k - μ_K) R_K in float32, for every key alike (as `OscarLayer.write_keys`)."""
        k = k.float()
        if state.k_mean is not None:
            k = k - state.k_mean
        return OscarCPUAttentionImpl._rotate(k, state)

    @staticmethod
    def _rotate(x: torch.Tensor, state: _LayerState) -> torch.Tensor:
        """x: [n, H, D] (queries, or keys after centering)."""
        return x if state.k_rotation is None else rotate_heads(x, state.k_rotation, head_axis=1)

    def _read_history(self, pages: torch.Tensor, block_row: torch.Tensor, length: int, state: _LayerState):
        """Dequantized keys/values of the positions some query of the chunk reads from INT2:
        [sink, length - recent)."""
        cache = self.oscar.cache
        start = cache.sink_tokens
        stop = max(start, length - cache.recent_tokens)
        block_size = pages.shape[2]
        if stop == start:
            empty = pages.new_zeros((0, self.num_kv_heads, self.head_size), dtype=torch.float32)
            return empty, empty, start
        first, last = start // block_size, (stop - 1) // block_size + 1
        blocks = block_row[first:last].long()
        cells = pages[blocks].permute(0, 2, 1, 3).reshape(-1, self.num_kv_heads, pages.shape[3])
        cells = cells[start - first * block_size: stop - first * block_size]
        keys, values = state.cells.decode(cells, torch.float32)
        if state.key_shifts is not None:
            keys = keys + state.shift(torch.arange(start, stop, device=keys.device))
        return keys, values, start
