"""Drive the paged cache through a sequence of steps with one backend (kernel tests, GPU bench)."""

from __future__ import annotations

import torch

from oscarkv.cache.paged import PagedKVCache, PagedLayout
from oscarkv.kernels.ops import attend_step, write_step


def random_rotation(d: int, generator: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    return q.float()


class PagedRun:
    """One layer's paged cache plus the rotation and mean that its write path applies."""

    def __init__(self, layout: PagedLayout, slots: int, max_context: int, query_heads: int, backend: str,
                 seed: int = 0, device="cpu", center: bool = True, rotate: bool = True,
                 clip_k: float = 0.96, clip_v: float = 0.92, window_dtype=torch.bfloat16,
                 shift_block: int = 0, per_head_rotation: bool = False, mean_offset: float = 0.0) -> None:
        """shift_block > 0: random key shifts (key_centering="rope") over blocks of that many positions;
        per_head_rotation: one random R_K per KV head ([Hkv, D, D]) instead of one for the layer;
        mean_offset: added to μ_K (large means, as in Qwen's key channels)."""
        g = torch.Generator().manual_seed(seed)
        self.layout, self.backend, self.device = layout, backend, torch.device(device)
        pages = slots * (layout.pages_needed(max_context) + 1)
        self.cache = PagedKVCache([layout], pages, slots, max_context, device, window_dtype)
        self.layer = self.cache.layers[0]
        self.query_heads = query_heads
        self.rotation = None
        if rotate:
            heads = layout.kv_heads if per_head_rotation else 1
            rotations = torch.stack([random_rotation(layout.head_dim, g) for _ in range(heads)])
            self.rotation = (rotations if per_head_rotation else rotations[0]).to(device)
        mean = torch.randn(layout.kv_heads, layout.head_dim, generator=g) * 0.5 + mean_offset
        self.mean = mean.to(device) if center else None
        self.clip_k, self.clip_v = clip_k, clip_v
        if shift_block:
            blocks = -(-max_context // shift_block)
            shifts = torch.randn(blocks, layout.kv_heads, layout.head_dim, generator=g) * 2
            self.layer.key_shifts, self.layer.shift_block = shifts.to(device), shift_block
        self.slots = [self.cache.open_slot() for _ in range(slots)]

    def step(self, new_tokens: list[int], q, k, v, window: int = 0, num_splits: int | None = None,
             window_splits: int | None = None, row_groups: int | None = None, extend: str = "auto",
             block_m: int | None = None, history: str = "auto"):
        """history: the decode history kernel of the Triton backend (`attend_step`), for steps of at most one
        new token per sequence (prompts take "auto")."""
        batch = self.cache.step(self.slots, new_tokens)
        k_rot = write_step(self.layer, batch, k, v, self.rotation, self.mean, self.clip_k, self.clip_v,
                           backend=self.backend)
        scale = self.layout.head_dim ** -0.5
        out = attend_step(self.layer, batch, q, k_rot, v, scale, window, backend=self.backend, num_splits=num_splits,
                          window_splits=window_splits if self.backend == "triton" else None,
                          row_groups=row_groups if self.backend == "triton" else None, extend=extend, block_m=block_m,
                          history=history if self.backend == "triton" and max(new_tokens) <= 1 else "auto")
        return out, k_rot


def random_step(layout: PagedLayout, query_heads: int, new_tokens: list[int], generator: torch.Generator,
                dtype=torch.bfloat16, device="cpu"):
    t = sum(new_tokens)
    d = layout.head_dim
    q = torch.randn(t, query_heads, d, generator=generator).to(device=device, dtype=dtype)
    k = (torch.randn(t, layout.kv_heads, d, generator=generator) * 2 + 0.5).to(device=device, dtype=dtype)
    v = torch.randn(t, layout.kv_heads, d, generator=generator).to(device=device, dtype=dtype)
    return q, k, v
