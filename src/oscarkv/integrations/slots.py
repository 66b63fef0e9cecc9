"""KV caches for continuous batching: a fixed pool of sequence slots that requests come and go from.

The serving engine runs a patched model one step at a time over whichever sequences are
active; before each forward it names them with `set_batch(slots, new_tokens)`. Two caches
plug into the same attention function ("oscar", which calls the handle's `attend`):

- `PagedSlotCache`: the paged INT2 cache of the GPU kernels (sink and recent windows in
  BF16, history in INT2 pages from one shared pool). Pages are promised to a request when it
  is admitted (for its prompt plus its max_tokens), so a running request never finds the
  pool empty mid-stream.
- `DenseSlotCache`: the BF16 baseline, every slot a contiguous [Hkv, max_context, D] buffer
  for K and for V; decode steps on the GPU attend with the dense Triton kernel
  (`attend_dense`), prompts with torch SDPA. Same engine, same model, same scheduler: only the
  cache differs.

Both also take static steps (`reserve_ahead`, `bind_step`, `advance_slots`, and `freeze` /
`thaw` on top of them), whose metadata lives on the device so that a CUDA graph can replay
them (`oscarkv.integrations.static_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache

from ..cache.paged import StepBatch
from ..errors import OscarError
from ..kernels.extend import causal_gqa_attention, gqa_attention
from ..kernels.ops import attend_dense
from ..transfer import to_device
from .paged import AttendingLayer, PagedOscarCache, causal_attention, paged_layouts
from .transformers import OscarState


class SlotError(OscarError):
    """A request the cache cannot hold (now or ever)."""


@dataclass(frozen=True)
class CacheUsage:
    """What /metrics reports. Pages exist only in the paged cache (0 for the dense one)."""

    slots_total: int
    slots_used: int
    pages_total: int
    pages_used: int
    pages_promised: int
    bytes_total: int
    bytes_used: int


class _SlotBook:
    """Which slots are open and how many pages each was promised; shared by both caches.

    Slots opened together for the choices of one prompt (`open_group`) each count its pages, but
    the prompt's history pages are held once (`fork`): the book subtracts them for every member of
    the group but one, as long as two or more members are open."""

    def __init__(self, max_slots: int) -> None:
        self.max_slots = max_slots
        self.promised: dict[int, int] = {}
        self.groups: list[tuple[int, set[int]]] = []  # (shared units, open member slots)

    def free_count(self) -> int:
        return self.max_slots - len(self.promised)

    def lowest_free(self) -> int:
        return min(set(range(self.max_slots)) - self.promised.keys())

    def take(self, slot: int, units: int) -> int:
        self.promised[slot] = units
        return slot

    def group(self, slots: list[int], shared_units: int) -> None:
        if len(slots) > 1 and shared_units > 0:
            self.groups.append((shared_units, set(slots)))

    def give_back(self, slot: int) -> None:
        if slot not in self.promised:
            raise SlotError(f"slot {slot} is not open.")
        del self.promised[slot]
        for _, members in self.groups:
            members.discard(slot)
        self.groups = [g for g in self.groups if len(g[1]) > 1]

    @property
    def promised_total(self) -> int:
        return self.promised_without(None)

    def promised_without(self, slot: int | None) -> int:
        """The pages promised if `slot` were given back."""
        members = [(units, group - {slot}) for units, group in self.groups]
        return (sum(units for s, units in self.promised.items() if s != slot)
                - sum((len(group) - 1) * units for units, group in members if len(group) > 1))

    def free_count_with(self, slot: int | None) -> int:
        """Slots free, with `slot` (an open one to be reused) counted as free."""
        return self.free_count() + (slot is not None)


def group_units(units_for, tokens: list[int], shared_tokens: int) -> int:
    """Pages that sequences of `tokens` tokens need together when all share the history pages of their first
    `shared_tokens` (one prompt read once, `fork`)."""
    return sum(units_for(t) for t in tokens) - (len(tokens) - 1) * units_for(shared_tokens) if tokens else 0


class _OneSlot:
    """A request's slot: a group of one (`can_open_group`, `open_group` of the cache)."""

    def can_open(self, tokens: int) -> bool:
        return self.can_open_group([tokens], 0)

    def open(self, tokens: int) -> int:
        return self.open_group([tokens], 0)[0]


class PagedSlotCache(_OneSlot, PagedOscarCache):
    """The paged INT2 cache with slots opened and closed per request (see the module docstring)."""

    def __init__(self, state: OscarState, max_slots: int, num_pages: int, max_context: int,
                 device: torch.device, backend: str = "auto") -> None:
        super().__init__(state.specs, state.cache, state.kv_heads, state.head_dim, max_context, backend)
        self.storage = self.new_storage(num_pages, max_slots, device)
        self.book = _SlotBook(max_slots)
        self.batch_slots: list[int] = []

    @staticmethod
    def slot_bytes(state: OscarState) -> tuple[int, int]:
        """(bytes of one page over all layers, bytes of one slot's sink and ring windows over all layers)."""
        layouts = paged_layouts(state.specs, state.cache, state.kv_heads, state.head_dim)
        per_page = sum(x.kv_heads * x.page_size * x.history_bytes_per_token() for x in layouts)
        window_bytes = state.cache.window_dtype.itemsize
        windows = sum(2 * x.kv_heads * (x.sink_tokens + x.ring_capacity) * x.head_dim * window_bytes for x in layouts)
        return per_page, windows

    @staticmethod
    def pages_for_budget(state: OscarState, max_slots: int, max_context: int, budget_bytes: int | None) -> int:
        """Pages that fit in `budget_bytes` after the slots' windows; all slots at full length if None."""
        if budget_bytes is None:
            layout = paged_layouts(state.specs, state.cache, state.kv_heads, state.head_dim)[0]
            return max(1, max_slots * layout.pages_needed(max_context))
        per_page, windows = PagedSlotCache.slot_bytes(state)
        windows *= max_slots
        pages = (budget_bytes - windows) // per_page
        if pages < 1:
            raise SlotError(f"a KV budget of {budget_bytes / 2**20:.0f} MiB does not cover the BF16 windows of "
                            f"{max_slots} slots ({windows / 2**20:.0f} MiB); raise the budget or lower --max-seqs.")
        return int(pages)

    def units_for(self, tokens: int) -> int:
        return self.layouts[0].pages_needed(tokens)

    def capacity_units(self) -> int:
        return self.storage.allocator.num_pages

    def can_open_group(self, tokens: list[int], shared_tokens: int, adopt: int | None = None) -> bool:
        """Room now for sequences of `tokens` tokens that will share their first `shared_tokens` (`fork`); the
        first in the open slot `adopt`, if given (it goes on from what that slot holds)."""
        need = group_units(self.units_for, tokens, shared_tokens)
        return (self.book.free_count_with(adopt) >= len(tokens)
                and self.book.promised_without(adopt) + need <= self.capacity_units())

    def open_group(self, tokens: list[int], shared_tokens: int, adopt: int | None = None) -> list[int]:
        """Open one slot per entry of `tokens` (the first: `adopt`, if given, promised anew); the first reads the
        shared prompt, the others take it by `fork` once it is read (their pages promised without the prompt's
        history pages)."""
        if not self.can_open_group(tokens, shared_tokens, adopt):
            raise SlotError(f"no room for {len(tokens)} sequence(s) of up to {max(tokens)} tokens now.")
        if adopt is not None:
            self.book.give_back(adopt)
        first = adopt if adopt is not None else self.storage.open_slot()
        slots = [self.book.take(slot, self.units_for(t))
                 for slot, t in zip([first] + [self.storage.open_slot() for _ in tokens[1:]], tokens)]
        self.book.group(slots, self.units_for(shared_tokens))
        return slots

    def fork(self, source: int, into: int) -> None:
        """The open, empty slot `into` takes what `source` holds: its history pages shared, its windows copied."""
        self.storage.fork(source, into)

    def held_units(self, slots: list[int]) -> int:
        """Distinct pages that `slots` hold (a shared page once)."""
        return len({page for slot in slots for page in self.storage.pages[slot]})

    def close(self, slot: int) -> None:
        self.book.give_back(slot)
        self.storage.close_slot(slot)

    def length(self, slot: int) -> int:
        return self.storage.lengths[slot]

    def set_batch(self, slots: list[int]) -> None:
        """The slots of the next forward, in the order of its batch rows."""
        if self.frozen is not None:
            raise OscarError("the batch of a static decode cannot change before thaw().")
        self.batch_slots = list(slots)
        longest = max((self.storage.lengths[s] for s in slots), default=0)
        for layer in self.layers:
            layer.length = longest  # what transformers sizes its (unused) mask by

    def reserve_step(self, batch: int, new_tokens: int, device: torch.device):
        """The rows of a forward are the slots `set_batch` named, in its order."""
        if batch != len(self.batch_slots):
            raise OscarError(f"set_batch named {len(self.batch_slots)} slots but the forward has {batch} rows.")
        return self.storage.step(self.batch_slots, [new_tokens] * batch)

    def advance(self, new_tokens: int) -> None:
        """Nothing to do: the paged cache advances its lengths when layer 0 reserves the step."""

    # ---- static steps (CUDA graphs; see oscarkv.integrations.static_decode) -------------------
    def reserve_ahead(self, slots: list[int], steps: int) -> None:
        """Reserve now the pages that `steps` more tokens of each slot will need."""
        for slot in slots:
            self.storage.reserve(slot, self.storage.lengths[slot] + steps)

    def bind_step(self, slots: torch.Tensor, lengths: torch.Tensor, cu_new: torch.Tensor) -> None:
        """Until `unbind_step`, every forward is one token per slot with this device metadata (int32
        slots, stored lengths and [0..B] offsets), read by the kernels without host work."""
        self.frozen = StepBatch(slots, cu_new, lengths, 1, self.storage.block_table)

    def unbind_step(self) -> None:
        self.frozen = None

    def advance_slots(self, slots: list[int], tokens: int) -> None:
        """Host-side lengths after static steps wrote `tokens` tokens to each slot."""
        self.storage.advance(slots, [tokens] * len(slots))

    def freeze(self, steps: int) -> None:
        """Fix the next `steps` one-token steps of the current batch so they can be captured in one
        CUDA graph: their pages are reserved now, and every step reuses one StepBatch whose device
        lengths `advance_on_device` moves. `thaw(steps)` afterwards brings the host lengths up to date."""
        self.reserve_ahead(self.batch_slots, steps)
        step = self.storage.metadata(self.batch_slots, [1] * len(self.batch_slots))
        self.bind_step(step.slots, step.lengths, step.cu_new)

    def advance_on_device(self) -> None:
        """End of a frozen step: every sequence of the batch holds one more token (no host work)."""
        self.frozen.lengths.add_(1)

    def thaw(self, steps_done: int) -> None:
        self.unbind_step()
        self.advance_slots(self.batch_slots, steps_done)
        self.set_batch(self.batch_slots)

    def usage(self) -> CacheUsage:
        alloc = self.storage.allocator
        return CacheUsage(self.storage.max_slots, len(self.book.promised), alloc.num_pages, alloc.used_pages,
                          self.book.promised_total, self.storage.nbytes(), self.storage.used_bytes())


class DenseSlotLayer(AttendingLayer):
    """One layer of the BF16 baseline: K and V [slots, Hkv, max_context, D]; a handle for "oscar"."""

    def __init__(self, owner: DenseSlotCache) -> None:
        super().__init__()
        self.owner = owner
        self.keys_store: torch.Tensor | None = None
        self.values_store: torch.Tensor | None = None
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        o = self.owner
        shape = (o.max_slots, key_states.shape[1], o.max_context, key_states.shape[3])
        self.keys_store = torch.zeros(shape, dtype=o.dtype, device=key_states.device)
        self.values_store = torch.zeros(shape, dtype=o.dtype, device=key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states: [B, Hkv, n, D] after RoPE, one row per slot of the batch."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        o = self.owner
        positions = o.starts_on_device[:, None] + torch.arange(n, device=key_states.device)[None]  # [B, n]
        rows = o.slots_on_device[:, None]
        # One scatter per tensor: [B, n] index pairs select [B, n, Hkv, D] slices.
        self.keys_store[rows, :, positions] = key_states.transpose(1, 2).to(o.dtype)
        self.values_store[rows, :, positions] = value_states.transpose(1, 2).to(o.dtype)
        self.length += n
        return self, self

    def attend(self, query: torch.Tensor, scaling: float, sliding_window: int | None) -> torch.Tensor:
        """query: [B, Hq, n, D] -> [B, n, Hq, D] over each row's stored positions (causal).

        Decode on the GPU or in a static decode (n = 1): the dense decode kernel, which reads each
        row's length on the device (so a CUDA graph can replay it). A prompt's first chunk: causal
        SDPA over itself. One sequence without a sliding window: SDPA with a lower-right causal bias
        (`causal_gqa_attention`). Otherwise (batched steps, sliding windows): SDPA with a mask."""
        o = self.owner
        b, hq, n, d = query.shape
        if n == 1 and (o.frozen or query.device.type == "cuda" or o.backend == "triton"):
            out = attend_dense(query[:, :, 0].to(o.dtype), self.keys_store, self.values_store, o.slots_on_device,
                               o.starts_on_device + 1, scaling, sliding_window or 0, backend=o.backend)
            return out[:, None].to(query.dtype)
        if not any(o.batch_starts) and not (sliding_window and sliding_window < n):
            rows = o.slots_on_device
            return causal_attention(query.to(o.dtype), self.keys_store[rows, :, :n], self.values_store[rows, :, :n],
                                    scaling).to(query.dtype)
        if b == 1 and not sliding_window:  # one sequence (the engine's prefill chunks): no mask tensor
            slot, end = o.batch_slots[0], o.batch_starts[0] + n
            out = causal_gqa_attention(query.to(o.dtype), self.keys_store[slot:slot + 1, :, :end],
                                       self.values_store[slot:slot + 1, :, :end], scaling)
            return out.transpose(1, 2).to(query.dtype)
        starts = o.starts_on_device
        # Keys up to a multiple of 256 (masked beyond each row's length): the attention backend
        # then sees a new shape only every 256 steps instead of at every step.
        end = min(o.max_context, -(-(max(o.batch_starts) + n) // 256) * 256)
        lo, hi = min(o.batch_slots), max(o.batch_slots) + 1
        if hi - lo == b and o.batch_slots == list(range(lo, hi)):
            keys, values = self.keys_store[lo:hi, :, :end], self.values_store[lo:hi, :, :end]  # views, no copy
        else:
            keys, values = self.keys_store[o.slots_on_device, :, :end], self.values_store[o.slots_on_device, :, :end]
        query_pos = starts[:, None] + torch.arange(n, device=query.device)[None]  # [B, n]
        out = gqa_attention(query.to(o.dtype), keys, values, query_pos, scaling, sliding_window or 0)
        return out.transpose(1, 2).to(query.dtype)

    def get_seq_length(self) -> int:
        return self.length


class DenseSlotCache(_OneSlot, DynamicCache):
    """The BF16 baseline for the serving engine (see the module docstring)."""

    def __init__(self, num_layers: int, max_slots: int, max_context: int, dtype: torch.dtype = torch.bfloat16,
                 kv_heads: int = 1, head_dim: int = 1, device: torch.device | str = "cpu",
                 backend: str = "auto") -> None:
        self.max_slots, self.max_context, self.dtype = max_slots, max_context, dtype
        self.backend = backend
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.frozen = False
        self.device = torch.device(device)
        self.bytes_per_token = 2 * num_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        self.book = _SlotBook(max_slots)
        self.lengths = [0] * max_slots
        self.batch_slots: list[int] = []
        self.batch_starts: list[int] = []
        Cache.__init__(self, layers=[DenseSlotLayer(self) for _ in range(num_layers)])

    def set_padding(self, attention_mask) -> None:  # called by the patched model's pre-hook
        pass

    def units_for(self, tokens: int) -> int:
        return 0

    def capacity_units(self) -> int:
        return 0

    def can_open_group(self, tokens: list[int], shared_tokens: int, adopt: int | None = None) -> bool:
        return self.book.free_count_with(adopt) >= len(tokens) and max(tokens) <= self.max_context

    def open_group(self, tokens: list[int], shared_tokens: int, adopt: int | None = None) -> list[int]:
        """As `PagedSlotCache.open_group`; every slot owns its positions, so a fork copies the prompt's K and V."""
        if not self.can_open_group(tokens, shared_tokens, adopt):
            raise SlotError(f"no room for {len(tokens)} sequence(s) of up to {max(tokens)} tokens now.")
        slots = [] if adopt is None else [adopt]
        while len(slots) < len(tokens):
            slots.append(self.book.take(self.book.lowest_free(), 0))
            self.lengths[slots[-1]] = 0
        return slots

    def held_units(self, slots: list[int]) -> int:
        return 0

    def fork(self, source: int, into: int) -> None:
        """The empty slot `into` takes a copy of the K and V that `source` holds."""
        if self.lengths[into] or into not in self.book.promised:
            raise OscarError(f"slot {into} must be open and empty to take a fork of slot {source}.")
        n = self.lengths[source]
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys_store[into, :, :n] = layer.keys_store[source, :, :n]
                layer.values_store[into, :, :n] = layer.values_store[source, :, :n]
        self.lengths[into] = n

    def close(self, slot: int) -> None:
        self.book.give_back(slot)
        self.lengths[slot] = 0

    def length(self, slot: int) -> int:
        return self.lengths[slot]

    def set_batch(self, slots: list[int]) -> None:
        if self.frozen:
            raise OscarError("the batch of a static decode cannot change before thaw().")
        self.batch_slots = list(slots)
        self.batch_starts = [self.lengths[s] for s in slots]
        self.slots_on_device = to_device(self.batch_slots, torch.long, self.device)
        self.starts_on_device = to_device(self.batch_starts, torch.long, self.device)
        longest = max(self.batch_starts, default=0)
        for layer in self.layers:
            layer.length = longest

    def advance(self, new_tokens: int) -> None:
        """After a forward: every slot of the batch holds `new_tokens` more."""
        self.advance_slots(self.batch_slots, new_tokens)

    # ---- static steps: as PagedSlotCache's; every slot owns max_context positions ---------------
    def reserve_ahead(self, slots: list[int], steps: int) -> None:
        for slot in slots:
            if self.lengths[slot] + steps > self.max_context:
                raise SlotError(f"slot {slot} holds {self.lengths[slot]} tokens; {steps} more exceed its "
                                f"max_context={self.max_context}.")

    def bind_step(self, slots: torch.Tensor, lengths: torch.Tensor, cu_new: torch.Tensor | None = None) -> None:
        self.frozen = True
        self.slots_on_device, self.starts_on_device = slots.long(), lengths.long()  # no copy when already int64

    def unbind_step(self) -> None:
        self.frozen = False

    def advance_slots(self, slots: list[int], tokens: int) -> None:
        for slot in slots:
            self.lengths[slot] += tokens

    def freeze(self, steps: int) -> None:
        self.reserve_ahead(self.batch_slots, steps)
        self.bind_step(self.slots_on_device, self.starts_on_device)

    def advance_on_device(self) -> None:
        self.starts_on_device.add_(1)

    def thaw(self, steps_done: int) -> None:
        self.unbind_step()
        self.advance_slots(self.batch_slots, steps_done)
        self.set_batch(self.batch_slots)

    def usage(self) -> CacheUsage:
        used = sum(self.lengths[s] for s in self.book.promised) * self.bytes_per_token
        return CacheUsage(self.max_slots, len(self.book.promised), 0, 0, 0,
                          self.max_slots * self.max_context * self.bytes_per_token, used)
