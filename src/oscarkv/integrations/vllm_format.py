"""What the vLLM plugin stores and computes, in plain torch (no vLLM import, so the CPU tests
check it against the reference cache directly).

Paged storage, in vLLM's own KV-cache tensor of each layer ([num_blocks, kv_heads, block_size,
C] bytes, addressed by vLLM's block tables): every (token, KV head) cell holds the packed codes
of its rotated key and of its value, then the fp16 scale and zero of each group of both
(`CellFormat`). A token is quantized when it is written; SPEC §2 quantizes each token on its
own, so this equals quantizing it when it leaves the recent window.

Full-precision windows (`RequestWindows`, one per layer, outside vLLM's block pool): for each
live request, its first `sink_tokens` keys and values and a ring of its last `recent_tokens`,
in the window dtype. `LaneMap` gives each live request its lane.

Read path (`attend_chunk`), for a request with `context` cached tokens and a chunk of new tokens
at positions [context, context + n): the query at position t reads key j at full precision when
j < sink or t - j < recent, else dequantized from the pages: the semantics of the reference
cache (`oscarkv.attention.precision_masks`), so greedy outputs agree with oscarkv's own path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import OscarError
from ..quant.format import CodeSizes, QuantizedTensor, dequantize, quantize

CELL_ALIGN = 8  # bytes; vLLM views the page in the model dtype, so C must divide into it


@dataclass(frozen=True)
class CellFormat(CodeSizes):
    """Bytes of one (token, KV head) cell: K codes | V codes | K scale, K zero | V scale, V zero.
    key_inner, value_inner: Lloyd–Max inner levels of INT2 codes (`quant.format`); None: uniform."""

    head_dim: int
    group_size: int
    key_bits: int = 2
    value_bits: int = 2
    scale_dtype: torch.dtype = torch.float16
    cell_bytes: int = 0  # the page's C (>= used_bytes, shared by all layers); 0: used_bytes aligned
    key_inner: float | None = None
    value_inner: float | None = None

    def __post_init__(self) -> None:
        if self.cell_bytes == 0:
            object.__setattr__(self, "cell_bytes", aligned(self.used_bytes))
        if self.cell_bytes < self.used_bytes:
            raise OscarError(f"a cell of {self.cell_bytes} bytes cannot hold {self.used_bytes} bytes of codes.")

    @property
    def scale_bytes(self) -> int:
        return self.groups * self.scale_dtype.itemsize

    @property
    def used_bytes(self) -> int:
        return self.key_code_bytes + self.value_code_bytes + 4 * self.scale_bytes

    def encode(self, keys: torch.Tensor, values: torch.Tensor, clip_k: float, clip_v: float) -> torch.Tensor:
        """keys, values: [..., D] -> uint8 cells [..., cell_bytes]."""
        parts = []
        quantized = [quantize(x, bits, self.group_size, clip, self.scale_dtype, inner)
                     for x, bits, clip, inner in ((keys, self.key_bits, clip_k, self.key_inner),
                                                  (values, self.value_bits, clip_v, self.value_inner))]
        parts += [q.packed for q in quantized]
        for q in quantized:
            parts += [q.scale.contiguous().view(torch.uint8), q.zero.contiguous().view(torch.uint8)]
        cells = torch.cat(parts, dim=-1)
        pad = self.cell_bytes - cells.shape[-1]
        if pad:
            cells = torch.nn.functional.pad(cells, (0, pad))
        return cells

    def decode(self, cells: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 cells [..., cell_bytes] -> (keys, values) [..., D] in `dtype`."""
        c, s = self.key_code_bytes + self.value_code_bytes, self.scale_bytes
        offsets = [0, self.key_code_bytes, c, c + s, c + 2 * s, c + 3 * s, c + 4 * s]
        pieces = [cells[..., a:b] for a, b in zip(offsets, offsets[1:])]

        def scales(raw: torch.Tensor) -> torch.Tensor:
            return raw.contiguous().view(self.scale_dtype)

        k = QuantizedTensor(pieces[0], scales(pieces[2]), scales(pieces[3]), self.group_size, dtype, self.key_bits,
                            self.key_inner)
        v = QuantizedTensor(pieces[1], scales(pieces[4]), scales(pieces[5]), self.group_size, dtype, self.value_bits,
                            self.value_inner)
        return dequantize(k, dtype), dequantize(v, dtype)


def aligned(n: int) -> int:
    return -(-n // CELL_ALIGN) * CELL_ALIGN


def shared_cell_bytes(head_dim: int, group_size: int, bits: list[tuple[int, int]], scale_dtype=torch.float16) -> int:
    """The cell size every layer's pages use (vLLM gives all layers of a group one page size):
    that of the widest layer. bits: (key bits, value bits) per layer; one 4-bit stream makes
    every cell wider."""
    return max(CellFormat(head_dim, group_size, k, v, scale_dtype).cell_bytes for k, v in set(bits))


class LaneMap:
    """Which window lane each live request uses.

    A request is known by the first block of its block table: without prefix caching no two live
    requests share a block. A request whose first chunk starts at position 0 takes a lane (a
    finished request's lane is reused, least recently used first); a later chunk finds its lane.
    """

    def __init__(self, lanes: int) -> None:
        self.capacity = lanes
        self.lane_of: dict[int, int] = {}
        self.last_use = [-1] * lanes
        self.step = 0

    def assign(self, first_blocks: list[int], contexts: list[int]) -> list[int]:
        self.step += 1
        lanes = []
        in_batch = set()
        for block, context in zip(first_blocks, contexts):
            if context == 0:
                lane = self.lane_of.pop(block, None)
                if lane is None:
                    lane = self._free_lane(in_batch)
                self.lane_of[block] = lane
            elif block in self.lane_of:
                lane = self.lane_of[block]
            else:
                raise OscarError(
                    f"the full-precision windows of a request that started at block {block} were evicted "
                    f"(more than {self.capacity} requests alive at once). Raise the lane count: "
                    "additional_config oscarkv.window_lanes, or lower --max-num-seqs."
                )
            self.last_use[lane] = self.step
            in_batch.add(lane)
            lanes.append(lane)
        return lanes

    def _free_lane(self, in_batch: set[int]) -> int:
        candidates = [lane for lane in range(self.capacity) if lane not in in_batch]
        if not candidates:
            raise OscarError(f"a batch holds more than {self.capacity} requests; raise oscarkv.window_lanes.")
        lane = min(candidates, key=lambda i: self.last_use[i])
        for block, owner in list(self.lane_of.items()):
            if owner == lane:
                del self.lane_of[block]
        return lane


class RequestWindows:
    """The sink and recent windows of one layer: per lane, [2 (k, v), sink + recent, H, D].

    Position p < sink lives at index p; a later position at sink + p % recent (a ring). Lanes are
    allocated on first use, so memory follows the number of live requests.
    """

    def __init__(self, lanes: int, kv_heads: int, head_dim: int, sink: int, recent: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.sink, self.recent = sink, recent
        self.shape = (2, sink + recent, kv_heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.lanes: list[torch.Tensor | None] = [None] * lanes

    def _lane(self, lane: int) -> torch.Tensor:
        if self.lanes[lane] is None:
            self.lanes[lane] = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self.lanes[lane]

    def _index(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.where(positions < self.sink, positions, self.sink + positions % self.recent)

    def held(self, context: int) -> torch.Tensor:
        """Positions before `context` held in full precision: the sink and the last `recent`."""
        sink = torch.arange(min(self.sink, context))
        ring = torch.arange(max(self.sink, context - self.recent), max(self.sink, context))
        return torch.cat([sink, ring]).to(self.device)

    def read(self, lane: int, context: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        positions = self.held(context)
        stored = self._lane(lane)[:, self._index(positions)]
        return positions, stored[0], stored[1]

    def write(self, lane: int, context: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values: [n, H, D] of positions [context, context + n)."""
        end = context + keys.shape[0]
        positions = torch.arange(context, end, device=self.device)
        keep = (positions < self.sink) | (positions >= end - self.recent)
        index = self._index(positions[keep])
        lane = self._lane(lane)
        lane[0, index] = keys[keep].to(self.dtype)
        lane[1, index] = values[keep].to(self.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.lanes if t is not None)


def attend_chunk(query: torch.Tensor, history_k: torch.Tensor, history_v: torch.Tensor, history_start: int,
                 window_positions: torch.Tensor, window_k: torch.Tensor, window_v: torch.Tensor, context: int,
                 sink: int, recent: int, scale: float) -> torch.Tensor:
    """Attention of one request's chunk over its mixed-precision cache.

    query: [n, Hq, D] (rotated by R_K), the queries at positions [context, context + n).
    history_k, history_v: [h, Hkv, D], dequantized keys/values of positions
        [history_start, history_start + h) (the ones some query may read from INT2).
    window_positions [m], window_k, window_v [m, Hkv, D]: the full-precision entries (sink, ring and
        the chunk itself).
    Returns [n, Hq, D] in float32 (values in the rotated basis).
    """
    n, hq, d = query.shape
    hkv = window_k.shape[1]
    group = hq // hkv
    t = torch.arange(context, context + n, device=query.device)[:, None]
    j_lo = torch.arange(history_start, history_start + history_k.shape[0], device=query.device)[None, :]
    j_hi = window_positions[None, :]
    allowed = torch.cat([(j_lo >= sink) & (j_lo <= t - recent),
                         (j_hi <= t) & ((j_hi < sink) | (j_hi > t - recent))], dim=1)  # [n, E]
    keys = torch.cat([history_k, window_k], dim=0).float().transpose(0, 1)  # [Hkv, E, D]
    values = torch.cat([history_v, window_v], dim=0).float().transpose(0, 1)
    q = query.float().reshape(n, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * n, d)
    mask = allowed.repeat(group, 1)[None]  # [1, g·n, E]
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)
