"""The paged mixed-precision KV cache the GPU kernels run on (SPEC §3, paged).

Per sequence ("slot") and layer, every position p lives in exactly one region:

    sink     p < S                       window dtype, [slots, Hkv, S, D]
    history  S <= p < hist_end(L)        INT2/INT4 pages, addressed through the block table
    recent   hist_end(L) <= p < L        window dtype ring [slots, Hkv, R + P, D], row (p - S) % (R + P)

with L the sequence length and hist_end(L) = S + P·floor(max(0, L - S - R) / P): tokens move
from the recent ring to the history a whole page at a time, once R + P of them are waiting,
so the recent region always holds between R and R + P - 1 tokens (at least the R the
method asks for) and the ring never overwrites a token that has not been flushed.
Everything about the layout follows from L, so kernels need only the lengths and the
block table: no per-token index lists.

Page layout, per layer: codes [pages, Hkv, P, D·bits/8] uint8 and scale/zero
[pages, Hkv, P, D/G] float16 for keys and for values (keys and values each have their width,
2 or 4 bits). One (page, KV head) is one contiguous run of P·D·bits/8 bytes (2 KiB for P = 64,
D = 128, INT2), so the decode kernel, which walks the pages of one KV head, reads whole cache
lines with consecutive threads on consecutive bytes, and each page is read once for all query
heads of its GQA group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import OscarError
from ..quant.format import CodeSizes, check_inner
from ..transfer import to_device

KERNEL_HEAD_DIMS = (64, 128, 256)


class CacheFullError(OscarError):
    """The paged cache has no free page left for a sequence."""


@dataclass(frozen=True)
class PagedLayout(CodeSizes):
    """Shapes of one layer's paged cache. group_size, key_bits and value_bits describe the history codes,
    key_inner and value_inner their levels (Lloyd–Max inner levels of INT2 codes, `quant.format`;
    None: the uniform grid)."""

    kv_heads: int
    head_dim: int
    group_size: int = 128
    key_bits: int = 2
    value_bits: int = 2
    page_size: int = 64
    sink_tokens: int = 64
    recent_tokens: int = 256
    key_inner: float | None = None
    value_inner: float | None = None

    def __post_init__(self) -> None:
        d, g = self.head_dim, self.group_size
        check_inner(self.key_inner, self.key_bits)
        check_inner(self.value_inner, self.value_bits)
        if d not in KERNEL_HEAD_DIMS:
            raise OscarError(f"head_dim={d} is not supported by the paged cache; supported: {KERNEL_HEAD_DIMS}.")
        for name in ("key_bits", "value_bits"):
            if getattr(self, name) not in (2, 4):
                raise OscarError(f"{name}={getattr(self, name)} is not supported; use 2 (INT2) or 4 (INT4, where "
                                 "calibration moved a stream).")
        if g > d or d % g or g < d // 4:
            raise OscarError(
                f"group_size={g} with head_dim={d}: the kernels need group_size in "
                f"{{{d // 4}, {d // 2}, {d}}} (a quarter, half or all of head_dim)."
            )
        if self.page_size < 16 or self.page_size & (self.page_size - 1):
            raise OscarError(f"page_size={self.page_size} must be a power of two >= 16.")
        if self.sink_tokens < 0 or self.recent_tokens < 1:
            raise OscarError("sink_tokens must be >= 0 and recent_tokens >= 1.")

    @property
    def ring_capacity(self) -> int:
        return self.recent_tokens + self.page_size

    def history_end(self, length: int) -> int:
        """First position after the history for a sequence of `length` tokens."""
        full = max(0, length - self.sink_tokens - self.recent_tokens) // self.page_size
        return self.sink_tokens + full * self.page_size

    def ages_out(self, stored: int, new: int) -> bool:
        """Whether a step of `new` tokens after `stored` moves a token from the ring into the history: whether
        [history_end(stored), stored) and [sink, history_end(stored + new)) meet (the flush then has work)."""
        return min(stored, self.history_end(stored + new)) > self.history_end(stored)

    def pages_needed(self, length: int) -> int:
        return (self.history_end(length) - self.sink_tokens) // self.page_size

    def history_bytes_per_token(self) -> int:
        """Bytes one history token occupies per KV head, keys and values together."""
        return self.key_code_bytes + self.value_code_bytes + 2 * (2 * self.groups * 2)


@dataclass
class PagedLayer:
    """The tensors of one layer (see the module docstring for the shapes)."""

    layout: PagedLayout
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    ring_k: torch.Tensor
    ring_v: torch.Tensor
    # CacheConfig(key_centering="rope"): [blocks, Hkv, D] float32 shifts (R(o)·μ_K - μ_K)·R_K, and the
    # block of positions each covers (`oscarkv.rope`). A history page is stored minus the shift of
    # the block of its first position and read plus it; None: no shifts.
    key_shifts: torch.Tensor | None = None
    shift_block: int = 0

    def shift_index(self, positions: torch.Tensor) -> torch.Tensor:
        """Row of `key_shifts` for history positions: the block of their page's first position."""
        lay = self.layout
        first = lay.sink_tokens + (positions - lay.sink_tokens).div(lay.page_size, rounding_mode="floor") * lay.page_size
        return first.div(self.shift_block, rounding_mode="floor").clamp(max=self.key_shifts.shape[0] - 1)

    @classmethod
    def allocate(cls, layout: PagedLayout, num_pages: int, max_slots: int, device, window_dtype=torch.bfloat16):
        h, p, d = layout.kv_heads, layout.page_size, layout.head_dim
        key_codes = (num_pages, h, p, layout.key_code_bytes)
        value_codes = (num_pages, h, p, layout.value_code_bytes)
        scales = (num_pages, h, p, layout.groups)

        def window(n: int) -> torch.Tensor:
            return torch.zeros(max_slots, h, n, d, dtype=window_dtype, device=device)

        return cls(
            layout,
            torch.zeros(key_codes, dtype=torch.uint8, device=device),
            torch.zeros(scales, dtype=torch.float16, device=device),
            torch.zeros(scales, dtype=torch.float16, device=device),
            torch.zeros(value_codes, dtype=torch.uint8, device=device),
            torch.zeros(scales, dtype=torch.float16, device=device),
            torch.zeros(scales, dtype=torch.float16, device=device),
            window(layout.sink_tokens), window(layout.sink_tokens),
            window(layout.ring_capacity), window(layout.ring_capacity),
        )

    @property
    def num_pages(self) -> int:
        return self.k_codes.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero,
                self.sink_k, self.sink_v, self.ring_k, self.ring_v)


class PageAllocator:
    """Free list of page ids shared by all layers (a page id addresses the same page in each).

    A page may be held by several sequences (`share`: a prompt's history pages, read by every
    sequence forked from it); it goes back to the free list when its last holder releases it."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._holders: dict[int, int] = {}  # pages held by more than one sequence: how many hold them

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(
                f"the KV cache needs {n} more pages but only {len(self._free)} of {self.num_pages} are free; "
                "finish or evict a sequence, or build the cache with more pages."
            )
        return [self._free.pop() for _ in range(n)]

    def share(self, pages: list[int]) -> None:
        """One more sequence holds `pages` (pages in use)."""
        for page in pages:
            self._holders[page] = self._holders.get(page, 1) + 1

    def release(self, pages: list[int]) -> None:
        """A sequence lets go of `pages`; those no other sequence holds become free."""
        freed = []
        for page in pages:
            left = self._holders.pop(page, 1) - 1
            if left > 1:
                self._holders[page] = left
            elif left == 0:
                freed.append(page)
        self._free.extend(reversed(freed))


@dataclass
class StepBatch:
    """Device metadata of one forward step over a batch of sequences (varlen).

    slots: int32 [B] cache slot of each sequence; cu_new: int32 [B+1] offsets of each
    sequence's new tokens in the flattened [T, H, D] inputs; lengths: int32 [B] tokens
    already stored before this step; max_new: host int, the largest count of new tokens;
    fresh: host bool, every sequence of the step starts empty (no history to read);
    host_rows: (slot, stored, new) per sequence as the host knew them when the step was made (None
    where the device advances the lengths itself: a frozen static decode);
    ages_out: host bool, some sequence's step moves a token from the ring into the history
    (`PagedLayout.ages_out`; True where the host does not know).
    """

    slots: torch.Tensor
    cu_new: torch.Tensor
    lengths: torch.Tensor
    max_new: int
    block_table: torch.Tensor  # int32 [max_slots, max_pages_per_slot]
    fresh: bool = False
    host_rows: tuple[tuple[int, int, int], ...] | None = None
    ages_out: bool = True

    @property
    def batch(self) -> int:
        return self.slots.shape[0]


class PagedKVCache:
    """All layers' paged storage, the page allocator and the block table of every slot.

    The host keeps each slot's length (it knows them without a device sync: every step adds
    a known number of tokens), reserves pages before a step writes, and frees them at the end.
    """

    def __init__(self, layouts: list[PagedLayout], num_pages: int, max_slots: int, max_context: int,
                 device, window_dtype=torch.bfloat16) -> None:
        if not layouts:
            raise OscarError("a paged cache needs at least one layer.")
        if len({(lay.page_size, lay.sink_tokens, lay.recent_tokens) for lay in layouts}) != 1:
            raise OscarError("all layers of a paged cache must share page size, sink and recent sizes.")
        self.layout = layouts[0]
        self.layers = [PagedLayer.allocate(lay, num_pages, max_slots, device, window_dtype) for lay in layouts]
        self.allocator = PageAllocator(num_pages)
        self.max_context = max_context
        self.max_pages_per_slot = max(1, self.layout.pages_needed(max_context))
        self.block_table = torch.zeros(max_slots, self.max_pages_per_slot, dtype=torch.int32, device=device)
        self.lengths = [0] * max_slots
        self.pages: list[list[int]] = [[] for _ in range(max_slots)]
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self.device = torch.device(device)

    @property
    def max_slots(self) -> int:
        return len(self.lengths)

    def open_slot(self) -> int:
        if not self._free_slots:
            raise CacheFullError(f"all {self.max_slots} sequence slots are in use; finish a sequence first.")
        return self._free_slots.pop()

    def close_slot(self, slot: int) -> None:
        self.allocator.release(self.pages[slot])
        self.pages[slot] = []
        self.lengths[slot] = 0
        self._free_slots.append(slot)
        self._free_slots.sort(reverse=True)  # lowest slot first, so full batches stay slots 0..B-1

    def fork(self, source: int, into: int) -> None:
        """Give the open, empty slot `into` what `source` holds now: its full history pages shared (no copy;
        a page of a slot's history is never written again) and its BF16 sink and recent windows copied.
        The two sequences then go on apart. Pages `source` reserved beyond its history stay its own."""
        if self.lengths[into] or self.pages[into] or into in self._free_slots:
            raise OscarError(f"slot {into} must be open and empty to take a fork of slot {source}.")
        length = self.lengths[source]
        shared = self.pages[source][:self.layout.pages_needed(length)]
        self.allocator.share(shared)
        self.pages[into] = list(shared)
        self.block_table[into, :len(shared)] = self.block_table[source, :len(shared)]
        for layer in self.layers:
            for window in (layer.sink_k, layer.sink_v, layer.ring_k, layer.ring_v):
                window[into] = window[source]
        self.lengths[into] = length

    def reserve(self, slot: int, new_length: int) -> None:
        """Make sure `slot` has the pages a length of `new_length` needs (all or nothing)."""
        if new_length > self.max_context:
            raise CacheFullError(
                f"a sequence of {new_length} tokens exceeds the cache's max_context={self.max_context}; "
                "build the cache with a larger max_context."
            )
        missing = self.layout.pages_needed(new_length) - len(self.pages[slot])
        if missing > 0:
            new = self.allocator.allocate(missing)
            first = len(self.pages[slot])
            self.pages[slot].extend(new)
            self.block_table[slot, first:first + missing] = to_device(new, torch.int32, self.device)

    def step(self, slots: list[int], new_tokens: list[int]) -> StepBatch:
        """Reserve pages for a step that appends new_tokens[i] tokens to slots[i]; returns its metadata.

        Host-side lengths advance here; call once per forward step, before the layers run.
        """
        for slot, n in zip(slots, new_tokens):
            self.reserve(slot, self.lengths[slot] + n)
        batch = self.metadata(slots, new_tokens)
        self.advance(slots, new_tokens)
        return batch

    def metadata(self, slots: list[int], new_tokens: list[int]) -> StepBatch:
        """The StepBatch of a step at the current lengths (nothing reserved, nothing advanced)."""
        cu = [0]
        for n in new_tokens:
            cu.append(cu[-1] + n)
        lengths = [self.lengths[s] for s in slots]
        # One copy without a synchronisation; each part starts on a 16-byte boundary, as a tensor of its
        # own would (the kernels' pointer alignment, and so their compiled variants, stay the same).
        parts = [list(slots), cu, lengths]
        padded = [-(-len(p) // 4) * 4 for p in parts]
        packed = to_device([x for p, n in zip(parts, padded) for x in p + [0] * (n - len(p))], torch.int32,
                           self.device)
        starts = [0, padded[0], padded[0] + padded[1]]
        slots_d, cu_d, lengths_d = (packed[s:s + len(p)] for s, p in zip(starts, parts))
        return StepBatch(slots_d, cu_d, lengths_d, max(new_tokens, default=0),
                         self.block_table, fresh=not any(lengths),
                         host_rows=tuple(zip(slots, lengths, new_tokens)),
                         ages_out=any(self.layout.ages_out(old, n) for old, n in zip(lengths, new_tokens)))

    def advance(self, slots: list[int], new_tokens: list[int]) -> None:
        """Host-side lengths after a step (or, for a static decode, after all its steps) has written."""
        for slot, n in zip(slots, new_tokens):
            self.lengths[slot] += n

    def nbytes(self) -> int:
        """Bytes the cache tensors occupy (all pages, used or not, and all window slots)."""
        return sum(layer.nbytes() for layer in self.layers)

    def used_bytes(self) -> int:
        """Bytes of the pages in use plus the windows of the open slots, over all layers."""
        open_slots = self.max_slots - len(self._free_slots)
        total = 0
        for layer in self.layers:
            lay = layer.layout
            per_page = lay.kv_heads * lay.page_size * lay.history_bytes_per_token()
            window = 2 * lay.kv_heads * (lay.sink_tokens + lay.ring_capacity) * lay.head_dim * layer.sink_k.element_size()
            total += self.allocator.used_pages * per_page + open_slots * window
        return total
