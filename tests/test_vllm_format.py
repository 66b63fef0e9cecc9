"""The vLLM plugin's storage and read path (plain torch) against the reference cache.

The same keys, values and queries go through oscarkv's reference cache (`OscarCache` +
`oscar_attention_reference`) and through the plugin's path (INT2 cells in a paged tensor
addressed by a block table, `RequestWindows`, `attend_chunk`), chunk by chunk as vLLM would send
them. The outputs must agree to float32 rounding.
"""

import pytest
import torch

from oscarkv import CacheConfig, QuantConfig
from oscarkv.attention import oscar_attention_reference
from oscarkv.cache.mixed import LayerSpec, OscarCache
from oscarkv.errors import OscarError
from oscarkv.integrations.vllm_format import CellFormat, LaneMap, RequestWindows, attend_chunk, shared_cell_bytes


def _rotation(d: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q.float()


class PluginPath:
    """The plugin's per-layer storage for one request, driven as vLLM's forward does."""

    def __init__(self, spec: LayerSpec, cache: CacheConfig, hkv: int, d: int, block_size: int, blocks: int):
        self.spec, self.cache = spec, cache
        self.cells = CellFormat(d, spec.quant.group_size, spec.key_bits, spec.value_bits, key_inner=spec.key_inner,
                                value_inner=spec.value_inner)
        self.pages = torch.zeros(blocks, hkv, block_size, self.cells.cell_bytes, dtype=torch.uint8)
        self.block_table = torch.randperm(blocks)  # vLLM's blocks are scattered
        self.windows = RequestWindows(2, hkv, d, cache.sink_tokens, cache.recent_tokens, cache.window_dtype)
        self.length = 0

    def step(self, q, k, v, scale):
        """q [n, Hq, D], k/v [n, Hkv, D] of the next n positions -> [n, Hq, D]."""
        n = k.shape[0]
        keys = k.float()
        if self.spec.k_mean is not None:
            keys = keys - self.spec.k_mean
        keys = (keys @ self.spec.k_rotation).to(self.cache.window_dtype)
        values = v.to(self.cache.window_dtype)
        context, end = self.length, self.length + n
        positions = torch.arange(context, end)
        bs = self.pages.shape[2]
        blocks, offsets = self.block_table[positions // bs], positions % bs
        q_cfg = self.spec.quant
        self.pages[blocks, :, offsets] = self.cells.encode(keys, values, q_cfg.clip_ratio_k, q_cfg.clip_ratio_v)
        start = self.cache.sink_tokens
        stop = max(start, end - self.cache.recent_tokens)
        cells = self.pages[self.block_table].permute(0, 2, 1, 3).reshape(-1, k.shape[1], self.cells.cell_bytes)
        hist_k, hist_v = self.cells.decode(cells[start:stop], torch.float32)
        held, win_k, win_v = self.windows.read(1, context)
        out = attend_chunk((q.float() @ self.spec.k_rotation), hist_k, hist_v, start,
                           torch.cat([held, positions]), torch.cat([win_k, keys]), torch.cat([win_v, values]),
                           context, self.cache.sink_tokens, self.cache.recent_tokens, scale)
        self.windows.write(1, context, keys, values)
        self.length = end
        return out


@pytest.mark.parametrize("chunks", [[1] * 40, [37, 1, 1, 5, 1, 1], [90, 1, 1], [12, 12, 12, 12, 1, 1]])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 3)])
@pytest.mark.parametrize("sink,recent", [(4, 8), (0, 1), (16, 32)])
def test_plugin_path_matches_the_reference_cache(chunks, hq, hkv, sink, recent):
    torch.manual_seed(0)
    d, group = 32, 16
    mean = torch.randn(hkv, d) * 0.5
    spec = LayerSpec(k_rotation=_rotation(d, 1), quant=QuantConfig(group, 0.96, 0.92), k_mean=mean)
    cache_cfg = CacheConfig(sink_tokens=sink, recent_tokens=recent, kernel="reference")
    reference = OscarCache([spec], cache_cfg)
    plugin = PluginPath(spec, cache_cfg, hkv, d, block_size=8, blocks=16)
    scale = d ** -0.5
    for n in chunks:
        q = torch.randn(n, hq, d)
        k = torch.randn(n, hkv, d) + 1.0
        v = torch.randn(n, hkv, d)
        layer, _ = reference.update(k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], 0)
        expected = oscar_attention_reference(layer, layer.rotate(q.permute(1, 0, 2)[None]), scale)[0]  # [n, Hq, D]
        got = plugin.step(q, k, v, scale)
        torch.testing.assert_close(got, expected.float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("key_inner,value_inner", [(0.37, 0.40), (None, 0.36)])
def test_plugin_path_reads_lloyd_max_levels_as_the_reference_cache(key_inner, value_inner):
    torch.manual_seed(2)
    d, group, hq, hkv = 32, 16, 4, 2
    spec = LayerSpec(k_rotation=_rotation(d, 3), quant=QuantConfig(group, 0.96, 0.92), key_inner=key_inner,
                     value_inner=value_inner)
    cache_cfg = CacheConfig(sink_tokens=4, recent_tokens=8, kernel="reference")
    reference = OscarCache([spec], cache_cfg)
    plugin = PluginPath(spec, cache_cfg, hkv, d, block_size=8, blocks=16)
    for n in (37, 1, 5, 1):
        q, k, v = torch.randn(n, hq, d), torch.randn(n, hkv, d) + 1.0, torch.randn(n, hkv, d)
        layer, _ = reference.update(k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], 0)
        expected = oscar_attention_reference(layer, layer.rotate(q.permute(1, 0, 2)[None]), d ** -0.5)[0]
        torch.testing.assert_close(plugin.step(q, k, v, d ** -0.5), expected.float(), atol=2e-5, rtol=1e-4)


def test_the_int2_part_is_really_read():
    """With a 1-token window, outputs differ from full-precision attention by the INT2 error."""
    torch.manual_seed(1)
    d, hkv = 32, 2
    spec = LayerSpec(k_rotation=_rotation(d, 2), quant=QuantConfig(16, 0.0, 0.0))
    plugin = PluginPath(spec, CacheConfig(sink_tokens=0, recent_tokens=1), hkv, d, block_size=8, blocks=8)
    q, k, v = torch.randn(40, hkv, d), torch.randn(40, hkv, d), torch.randn(40, hkv, d)
    got = plugin.step(q, k, v, d ** -0.5)
    exact = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                             is_causal=True).transpose(0, 1)
    error = (got - exact).abs().max().item()
    assert 1e-2 < error < 1.5


@pytest.mark.parametrize("key_bits,value_bits", [(2, 2), (4, 4), (4, 2), (2, 4)])
def test_cells_roundtrip_like_the_quantizer(key_bits, value_bits):
    from oscarkv.quant.format import dequantize, quantize

    x, y = torch.randn(5, 3, 64), torch.randn(5, 3, 64)
    fmt = CellFormat(64, 32, key_bits, value_bits, cell_bytes=shared_cell_bytes(64, 32, [(2, 2), (4, 4)]))
    cells = fmt.encode(x, y, 0.9, 0.0)
    assert cells.dtype == torch.uint8 and cells.shape == (5, 3, fmt.cell_bytes) and fmt.cell_bytes % 8 == 0
    k, v = fmt.decode(cells, torch.float32)
    torch.testing.assert_close(k, dequantize(quantize(x, key_bits, 32, 0.9), torch.float32))
    torch.testing.assert_close(v, dequantize(quantize(y, value_bits, 32, 0.0), torch.float32))
    if key_bits == 2:  # Lloyd–Max levels: the same cells' codes, read at the inner levels
        fmt = CellFormat(64, 32, key_bits, value_bits, key_inner=0.38)
        k, _ = fmt.decode(fmt.encode(x, y, 0.9, 0.0), torch.float32)
        torch.testing.assert_close(k, dequantize(quantize(x, 2, 32, 0.9, inner=0.38), torch.float32))


def test_cell_is_much_smaller_than_a_bf16_token():
    # SmolLM2 / Qwen3 shapes: 64 and 128 channels, group 64 / 128, fp16 scale and zero.
    assert CellFormat(64, 64).cell_bytes == 40  # BF16: 256 bytes per (token, head) for K and V
    assert CellFormat(128, 128).cell_bytes == 72  # BF16: 512
    assert CellFormat(64, 64, 4, 2).cell_bytes == 56  # INT4 keys: 32 + 16 code bytes, 8 of scales
    assert shared_cell_bytes(64, 64, [(2, 2), (4, 2)]) == 56


def test_lane_map_reuses_finished_lanes_and_keeps_live_ones():
    lanes = LaneMap(2)
    assert lanes.assign([10, 20], [0, 0]) == [0, 1]
    assert lanes.assign([10, 20], [5, 5]) == [0, 1]
    # Request 20 finished; a new request (first block 30) takes its lane, the live one keeps its own.
    assert lanes.assign([10, 30], [6, 0]) == [0, 1]
    # A new request whose first block was a finished request's reuses that lane.
    assert lanes.assign([10, 30, ], [7, 1]) == [0, 1]
    with pytest.raises(OscarError, match="evicted"):
        lanes.assign([20], [9])
    with pytest.raises(OscarError, match="more than 2"):
        lanes.assign([1, 2, 3], [0, 0, 0])
