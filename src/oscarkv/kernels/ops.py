"""The one switch point between the Triton kernels and their torch references.

`write_step` and `attend_step` take the same arguments whatever runs them; `backend`
"auto" picks Triton for CUDA tensors when Triton is installed (or when TRITON_INTERPRET=1
asks for the interpreter, as the CPU tests do) and the torch reference otherwise.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ..cache.paged import PagedLayer, StepBatch
from ..config import EXTEND_PATHS, ExtendPath
from ..errors import OscarError
from . import gluon_history, reference
from .extend import extend_attention, takes_dequantized_extend
from .gluon_history import HISTORY_KERNELS, HistoryKernel
from .hardware import multiprocessors as _multiprocessors
from .hardware import register_cap_supported

BACKENDS = ("auto", "triton", "torch")
WINDOW_DTYPES = (torch.bfloat16, torch.float16)
ROTATED_QUERY_DTYPES = WINDOW_DTYPES + (torch.float32,)  # what `rotate_queries`' kernel reads and stores


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """"triton" or "torch" for tensors on `device`; explains what is missing when Triton cannot run."""
    if backend not in BACKENDS:
        raise OscarError(f"backend={backend!r} is not one of {BACKENDS}.")
    can_run = triton_available() and (device.type == "cuda" or interpreting())
    if backend == "auto":
        return "triton" if can_run else "torch"
    if backend == "triton" and not can_run:
        why = "Triton is not installed (pip install triton)" if not triton_available() else \
            f"the tensors are on {device}, not a CUDA GPU (set TRITON_INTERPRET=1 to run the kernels on the CPU)"
        raise OscarError(f"the Triton backend cannot run: {why}; use backend='torch' for the reference.")
    return backend


def _check_inputs(layer: PagedLayer, batch: StepBatch, *named: tuple[str, torch.Tensor, int | None]) -> None:
    lay = layer.layout
    if layer.ring_k.dtype not in WINDOW_DTYPES:
        raise OscarError(f"window dtype {layer.ring_k.dtype} is not supported by the kernels; use bfloat16.")
    for name, x, heads in named:
        if x.dim() != 3 or x.shape[2] != lay.head_dim or (heads is not None and x.shape[1] != heads):
            raise OscarError(f"{name} must be [tokens, {heads or 'heads'}, {lay.head_dim}], got {tuple(x.shape)}.")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise OscarError(f"{name} has dtype {x.dtype}; the kernels take bfloat16, float16 or float32.")
        if not x.is_contiguous():
            raise OscarError(f"{name} must be contiguous.")
        if x.device != layer.k_codes.device:
            raise OscarError(f"{name} is on {x.device} but the cache is on {layer.k_codes.device}.")
    for name, t in (("slots", batch.slots), ("cu_new", batch.cu_new), ("lengths", batch.lengths),
                    ("block_table", batch.block_table)):
        if t.dtype != torch.int32:
            raise OscarError(f"StepBatch.{name} must be int32, got {t.dtype}.")


def check_block_table(layer: PagedLayer, batch: StepBatch) -> None:
    """Every page a step may touch exists (synchronises with the device: eager mode only)."""
    lay = layer.layout
    cu = batch.cu_new.tolist()
    table = batch.block_table
    for b, (slot, old) in enumerate(zip(batch.slots.tolist(), batch.lengths.tolist())):
        if not 0 <= slot < table.shape[0]:
            raise OscarError(f"slot {slot} is outside the block table ({table.shape[0]} slots).")
        pages = lay.pages_needed(old + cu[b + 1] - cu[b])
        if pages > table.shape[1]:
            raise OscarError(f"slot {slot} needs {pages} pages but the block table has {table.shape[1]} columns.")
        used = table[slot, :pages]
        if pages and (int(used.min()) < 0 or int(used.max()) >= layer.num_pages):
            raise OscarError(
                f"the block table of slot {slot} points outside the {layer.num_pages} pages of the cache "
                f"(ids {int(used.min())}..{int(used.max())}); reserve pages through PagedKVCache.step."
            )


@dataclass(frozen=True)
class RotationPieces:
    """R_K prepared for the write kernel's bfloat16 path: k·R_K - μ_K·R_K with three bfloat16 dots.

    pieces: [H, 3, D, D] bfloat16 (H = 1 for one R_K per layer, Hkv for one per KV head), largest
    first; their sum is R_K to float32 accuracy. mean_rotated: [Hkv, D] float32 μ_K·R_K, or None.
    Both have their columns interleaved: column 4j + i holds column i·D/4 + j, so that one dot's
    output splits into the four quarters (code planes) the quantizer packs.
    """

    pieces: torch.Tensor
    mean_rotated: torch.Tensor | None

    @property
    def head_stride(self) -> int:
        """Elements between two KV heads' pieces: 0 when one R_K serves every head."""
        return 0 if self.pieces.shape[0] == 1 else self.pieces[0].numel()


def rotation_pieces(rotation: torch.Tensor, mean: torch.Tensor | None) -> RotationPieces:
    """rotation: [D, D] or [Hkv, D, D] R_K; mean: [Hkv, D] μ_K or None (float32, computed in float64)."""
    r = rotation.double()
    heads = r if r.dim() == 3 else r[None]
    d = heads.shape[-1]
    pieces, rest = [], heads
    for _ in range(3):
        piece = rest.to(torch.bfloat16)
        pieces.append(piece)
        rest = rest - piece.double()
    order = torch.arange(d, device=rotation.device).view(4, d // 4).t().reshape(-1)
    interleaved = torch.stack(pieces, dim=1)[..., order].contiguous()
    mean_rotated = None
    if mean is not None:
        mu = mean.double()
        rotated = torch.einsum("hd,hde->he", mu, heads.expand(mu.shape[0], d, d))
        mean_rotated = rotated[:, order].float().contiguous()
    return RotationPieces(interleaved, mean_rotated)


def uses_rotation_pieces(k: torch.Tensor, rotation: torch.Tensor | None) -> bool:
    """Whether the write kernel rotates these keys by bfloat16 pieces (bfloat16 keys, D <= 128)."""
    return rotation is not None and k.dtype == torch.bfloat16 and k.shape[-1] <= 128


def write_step(layer: PagedLayer, batch: StepBatch, k: torch.Tensor, v: torch.Tensor,
               rotation: torch.Tensor | None = None, mean: torch.Tensor | None = None, clip_k: float = 0.0,
               clip_v: float = 0.0, backend: str = "auto", validate: bool = True,
               pieces: RotationPieces | None = None) -> torch.Tensor:
    """Store a step's new keys/values ([T, Hkv, D], after RoPE) in the paged cache.

    rotation: [D, D] R_K, [Hkv, D, D] (one per KV head) or None; mean: [Hkv, D] μ_K or None.
    pieces: `rotation_pieces(rotation, mean)`, prepared once per layer; without it the Triton path
    prepares them at every call (bfloat16 keys only). Returns the rotated keys
    [T, Hkv, D] in the window dtype, which `attend_step` reads for the step's own tokens.
    validate=False skips the checks that synchronise with the device (CUDA-graph capture).
    """
    lay = layer.layout
    _check_inputs(layer, batch, ("k", k, lay.kv_heads), ("v", v, lay.kv_heads))
    if validate:
        check_block_table(layer, batch)
        if int(batch.cu_new[-1]) != k.shape[0]:
            raise OscarError(f"cu_new says {int(batch.cu_new[-1])} new tokens but k has {k.shape[0]}.")
    if rotation is not None:
        shapes = ((lay.head_dim, lay.head_dim), (lay.kv_heads, lay.head_dim, lay.head_dim))
        if tuple(rotation.shape) not in shapes:
            raise OscarError(f"the key rotation has shape {tuple(rotation.shape)}; this layer needs "
                             f"{shapes[0]} or, one per KV head, {shapes[1]}.")
        rotation = rotation.to(device=k.device, dtype=torch.float32).contiguous()
    if mean is not None:
        mean = mean.to(device=k.device, dtype=torch.float32).contiguous()
    if resolve_backend(backend, k.device) == "torch":
        return reference.write_reference(layer, batch, k, v, rotation, mean, clip_k, clip_v)
    from .triton_write import launch_write

    pieces = (pieces or rotation_pieces(rotation, mean)) if uses_rotation_pieces(k, rotation) else None
    k_rot = torch.empty(k.shape, dtype=layer.ring_k.dtype, device=k.device)
    launch_write(layer, batch, k, v, k_rot, rotation, mean, clip_k, clip_v, pieces)
    return k_rot


def _multiprocessor_count(device: torch.device) -> int:
    """The GPU's multiprocessors; 4 off CUDA (the interpreter runs the same split logic)."""
    return _multiprocessors(device.index or 0) if device.type == "cuda" else 4


def split_count(programs: int, tokens: int, device: torch.device) -> int:
    """Splits of the key positions per program for flash-decoding: enough programs to fill the GPU
    about 4 times over, and at least ~512 positions per split. 1 (no merge) when `programs` alone
    fill it."""
    sms = _multiprocessor_count(device)
    if programs >= 2 * sms:
        return 1
    wanted = -(-4 * sms // programs)
    by_length = max(1, tokens // 512)
    return max(2, min(wanted, by_length) + 1)


# A bound on the decode workspace. Batch 1 from 64K takes one history split per multiprocessor and KV head (132 on
# an H100): every multiprocessor then holds 8 history programs instead of 100 holding 8 and 32 holding 7 with
# the bound of 128 before. The whole Qwen3-4B step at 1x100K went from 4.41-4.43 to 4.36 ms on the H100
# (docs/data/history-splits-h100.txt).
MAX_HISTORY_SPLITS = 256
MIN_PAGES_PER_SPLIT = 8  # decode history splits shorter than this are merged, down to half a wave
PROGRAMS_PER_MULTIPROCESSOR = 8  # decode history programs per multiprocessor (`choose_splits`)
SMALL_BATCH_WINDOW_SPLITS = 4
SMALL_BATCH_WINDOW_PROGRAMS = 24
SMALL_BATCH_PROGRAMS = 32  # (sequence, KV head) pairs up to which a decode step takes 4-8 window splits
MID_BATCH_WINDOW_SPLITS = 2  # beyond, up to 2 pairs per multiprocessor (`_window_splits`)
# Keys per block of one-warp window programs (`window_plan`; None: never one-warp), and the channels each
# combine program merges (`launch_attention`'s combine_d_block).
ONE_WARP_WINDOW_BLOCK: int | None = 16
COMBINE_CHANNELS = 32
# Decode history programs per multiprocessor from which they take one warp each (`history_warps`), and the
# one-warp window programs per (sequence, KV head) where they take four (`_few_history_windows`).
ONE_WARP_HISTORY_PROGRAMS_PER_MULTIPROCESSOR = 1
FEW_HISTORY_WINDOW_SPLITS = 16


@dataclass(frozen=True)
class WindowPlan:
    """The programs of a decode step that read the BF16 windows (sink, ring, the step's own tokens): how
    many per (sequence, KV head), their warps, and their keys per block (None: 64)."""
    splits: int
    warps: int = 4
    block_n: int | None = None


# The window program per (sequence, KV head) of decode steps beyond 2·sms pairs (`_two_warp_windows`).
LARGE_BATCH_WINDOW_PLAN = WindowPlan(1, warps=2, block_n=32)


def _decode_programs(layer: PagedLayer, batch_size: int, max_new: int, query_heads: int,
                     block_m: int | None = None) -> tuple[int, int]:
    lay = layer.layout
    group = query_heads // lay.kv_heads
    m_blocks = -(-max_new * group // (block_m or choose_block_m(max_new, group)))
    return m_blocks, batch_size * lay.kv_heads * m_blocks


EXTEND_BLOCK_M = 32  # query rows per program of the fused kernel's extend steps (decode: 16)


def choose_block_m(max_new: int, group: int) -> int:
    """Query rows per program of the fused attention kernel: 16 where a sequence's step fits one such block
    (decode), else EXTEND_BLOCK_M. Every program of an extend step decodes every history page it reads, so
    fewer, larger blocks read the history fewer times: H100, Qwen3 shapes (GQA 4), batch 1, 16 -> 32 rows took
    8K + 8 new tokens from 38.7 to 32.4 µs, 8K + 64 from 180 to 114 µs, 32K + 128 from 1099 to 628 µs
    (docs/kernels-log.md)."""
    return 16 if max_new * group <= 16 else EXTEND_BLOCK_M


def _small_batch_window_splits(programs: int) -> int:
    """At least SMALL_BATCH_WINDOW_SPLITS (4) per (sequence, KV head), up to 8 so that there are about
    24 window programs: with 3 KV heads (SmolLM2) 8 splits took 1x1K from 11.2 to 9.6 µs and 1x8K from
    16.8 to 15.4 µs on the H100, while 8 KV heads (Qwen3) were fastest at 4 (1x32K 18.7 against 19.1 µs;
    data/window-splits-h100.txt)."""
    return max(SMALL_BATCH_WINDOW_SPLITS, min(8, -(-SMALL_BATCH_WINDOW_PROGRAMS // max(programs, 1))))


def _one_warp_windows(layer: PagedLayer, programs: int, history_splits: int, max_context: int, sms: int) -> bool:
    """Whether a decode step's windows are read by one one-warp program per (sequence, KV head) (`_decode_plan` also
    takes that plan for Gluon steps of more (sequence, KV head) pairs than multiprocessors, see there): for
    SMALL_BATCH_PROGRAMS to 2·sms (sequence, KV head) pairs (where MID_BATCH_WINDOW_SPLITS applies otherwise),
    with head_dim 128, where the history splits read ROW_GROUP_MIN_PAGES pages or more. A one-warp program
    reading 16-key blocks takes about 167 registers and fits beside the one-warp history programs, so it
    runs while they do; a four-warp one (168 registers a thread) does not fit, and runs when they end. H100, Qwen3 shapes, one layer (data/window-programs-h100.txt): 32x32K 263.0 ->
    258.5 µs and whole Qwen3-4B steps at 32x32K 14.01 -> 13.92 ms; with shorter splits it loses (32x8K
    94.0 -> 96.3-113.9 µs, batch 1 at 32K-128K by 3-10 µs: the one-warp chain of 16-key blocks outlasts
    the history there)."""
    lay = layer.layout
    pages = -(-max(max_context - lay.sink_tokens, 0) // lay.page_size)
    return (ONE_WARP_WINDOW_BLOCK is not None and SMALL_BATCH_PROGRAMS < programs <= 2 * sms
            and lay.head_dim == 128 and -(-pages // max(history_splits, 1)) >= ROW_GROUP_MIN_PAGES)


def history_warps(history_programs: int, device: torch.device) -> int:
    """Warps of each decode history program: one where there are at least as many history programs as
    multiprocessors (off CUDA always one), else four. H200, one layer, four -> one warp: SmolLM2 shapes (9 query
    / 3 KV heads, D 64) 1x4K 15.6 -> 10.2 µs, 1x8K 15.3 -> 10.4, 2x2K 18.6 -> 11.5, 8x1K 18.8 -> 12.8; Qwen3
    shapes 1x2K 17.2 -> 10.5, 1x4K 22.7 -> 11.2, 2x1K 16.8 -> 10.4. With fewer history programs four warps are
    as fast or faster (SmolLM2 1x1K 8.9 against 9.3 µs, 0.3 programs per multiprocessor; Qwen3 1x1K 10.4
    against 10.8, 0.85). Until the forty-sixth session the rule counted four programs per multiprocessor,
    window programs included (docs/data/history-warps-h200.txt)."""
    if device.type != "cuda":
        return 1
    return 1 if _one_warp_history(history_programs, _multiprocessor_count(device)) else 4


def _one_warp_history(history_programs: int, sms: int) -> bool:
    """The rule of `history_warps` (and of `_few_history_windows`, its complement) on `sms` multiprocessors."""
    return history_programs >= ONE_WARP_HISTORY_PROGRAMS_PER_MULTIPROCESSOR * sms


def _few_history_windows(programs: int, history_splits: int, sms: int) -> bool:
    """Whether a decode step reads its windows with FEW_HISTORY_WINDOW_SPLITS one-warp programs of 16-key blocks:
    where its history programs take four warps (`history_warps`) and the window programs are at most one per
    multiprocessor (the measured range: up to 8 (sequence, KV head) pairs; at 24 pairs, 8x500 SmolLM2 shapes, 4-8
    four-warp programs were faster: 12.5 against 13.1 µs). H200, one layer, 4-8 four-warp window programs
    of 64-key blocks -> 16 one-warp ones: SmolLM2 shapes 1x1K 8.9 -> 7.0 µs, 1x2K 9.7 -> 8.7, 2x1K 11.0 -> 8.4;
    Qwen3 shapes 1x1K 10.4 -> 8.7. Below 8 history splits (short contexts) the rule before took one four-warp
    window program, which walked the sink and ring alone: SmolLM2 1x500 19.1 -> 6.4 µs, Qwen3 1x500 14.9 -> 8.3,
    Qwen3 1x300 13.2 -> 6.6 (docs/data/history-warps-h200.txt). Beside one-warp history programs they lose (1x4K
    SmolLM2 10.2 -> 13.7 µs)."""
    return (ONE_WARP_WINDOW_BLOCK is not None and programs * FEW_HISTORY_WINDOW_SPLITS <= sms
            and not _one_warp_history(programs * history_splits, sms))


def _two_warp_windows(layer: PagedLayer, programs: int, sms: int) -> bool:
    """Whether a decode step reads its windows with LARGE_BATCH_WINDOW_PLAN (one program of two warps and
    32-key blocks per pair): head_dim up to 128 beyond 2·sms (sequence, KV head) pairs, where it took one
    four-warp program of 64-key blocks. Those take 168 registers a thread and wait for history programs to end;
    the two-warp ones run beside them. H200, one layer (docs/data/quarter-slices-h200.txt,
    two-warp-windows-h200.txt): SmolLM2 shapes (9 query / 3 KV heads, head_dim 64) 128x4K 86.3 -> 59.6 µs,
    256x4K 153.8 -> 115.4; Qwen3 shapes (32 / 8, head_dim 128) 128x4K 194.7 -> 189.5, 256x4K 389.3 -> 370.3,
    96x32K 757.8 -> 749.3; whole random models, SmolLM2 256x4K 6.03 -> 4.81 ms, Qwen3-4B 128x4K 11.25 -> 11.19,
    64x8K 9.70 -> 9.61. With fewer pairs the four-warp programs were as fast or faster (history before the
    quarter slices: 64x4K 58.4 against 62.3 µs, 16x2K 17.4 against 21.2). Head_dim 256 was not measured."""
    return layer.layout.head_dim <= 128 and programs > 2 * sms


def _window_splits(programs: int, sms: int) -> int:
    """Window splits per (sequence, KV head) of a decode step with `programs` of them:
    - up to SMALL_BATCH_PROGRAMS (batch 1-4 with 8 KV heads): `_small_batch_window_splits`, since the window
      programs alone would leave most of the GPU idle. Until the forty-sixth session only at 8 or more history
      splits, else one; at short contexts the windows are most of the tokens (H200, one layer, 1 -> 4 window
      splits: SmolLM2 shapes 8x500 19.7 -> 12.5 µs, Qwen3 shapes 4x500 15.5 -> 12.1).
      One window program walks ~6 blocks of the sink and ring one after another: 11 µs on the H100,
      as long as the whole history at 8K;
    - more, up to 2 per multiprocessor: MID_BATCH_WINDOW_SPLITS (2). H100, Qwen3 shapes, one layer, 1 / 4 /
      2 window splits (data/window-splits-batch-h100.txt): 8x32K 81.6 / 78.8 / 77.1 µs, 32x8K 98.0 / 95.2 /
      94.4, 32x32K 263.9 / 265.7 / 260.7, 16x4K 43.1 / - / 39.9; 16x32K 138.0 / 145.2 / 140.3 (1 is best
      there; the rule before took 4). With 4 pairs per multiprocessor (64x4K, 64x8K) 1 is 1-2% faster;
    - otherwise 1."""
    if programs <= SMALL_BATCH_PROGRAMS:
        return _small_batch_window_splits(programs)
    return MID_BATCH_WINDOW_SPLITS if programs <= 2 * sms else 1


def choose_splits(layer: PagedLayer, batch_size: int, max_new: int, query_heads: int, max_context: int,
                  device: torch.device, block_m: int | None = None, gluon: bool = False) -> int:
    """Splits of the INT2 kernel's grid (history splits + window splits; see the kernel).

    Decode: the history of each (sequence, KV head) is split into as many parts as keep the one-warp
    programs at about 8 per multiprocessor, one resident wave (9 fit), with at most MAX_HISTORY_SPLITS splits
    and at least one page each. A single one-warp program reads only about one page per 3 µs (a serial
    chain of loads and dots), so short splits are what makes batch 1 fast; a second, partial wave
    costs more than the longer splits save (32x32K on the H100: 4 history splits 291 µs, 5 splits
    366 µs, 7 splits 326 µs). When one wave would be less than 6 programs per multiprocessor
    (large batches), the history takes about two waves instead (81x32K: 1 split 1070 µs, 4 splits
    738 µs; scripts/tune_attention.py). Batch 1 below 64K takes fewer splits of at least 8 pages,
    down to half the wave (see below). gluon: the step's history runs the Gluon kernel (`gluon_history.takes`),
    whose long splits are split further (`_gluon_history_splits`). Prefill and extend keep `split_count` over their
    programs of `block_m` query rows (None: `choose_block_m`)."""
    m_blocks, programs = _decode_programs(layer, batch_size, max_new, query_heads, block_m)
    if m_blocks > 1:
        return split_count(programs, max_context - layer.layout.sink_tokens, device)
    history, windows = _decode_plan(layer, programs, max_context, _multiprocessor_count(device), gluon)
    return history + windows.splits


def _decode_plan(layer: PagedLayer, programs: int, max_context: int, sms: int,
                 gluon: bool = False) -> tuple[int, WindowPlan]:
    """History splits and window programs per (sequence, KV head) of a decode step (`choose_splits`).

    Gluon steps of more (sequence, KV head) pairs than multiprocessors read the windows with one one-warp program
    of 16-key blocks per pair, which also merges the splits (`triton_attention.merges_in_windows`). H200, one layer,
    Qwen3 shapes, merged in the window programs, against the plan before (two-warp programs of 32-key blocks beyond
    2·sms pairs, else two four-warp ones of 64-key blocks): 64x8K 122.4 -> 112.1 µs, 32x8K 67.1 -> 63.7 (one two-warp
    program: 60.1), 128x4K 134.8 -> 134.3; 32x32K kept its plan (200.0 µs; one two-warp program 197.5, two one-warp
    ones 200.8, four 202.7; docs/data/window-merge-h200-s54.txt)."""
    tokens = max_context - layer.layout.sink_tokens
    history = PROGRAMS_PER_MULTIPROCESSOR * sms // programs  # one resident wave
    if 0 < history and history * programs < 6 * sms:  # that wave would leave a quarter idle: take two
        history = -(-2 * PROGRAMS_PER_MULTIPROCESSOR * sms // programs)
    # Splits of fewer than MIN_PAGES_PER_SPLIT pages cost their programs' fixed start and end for little
    # reading; down to half a wave, fewer and longer splits are faster (1x8K 14.5 -> 11.3 µs with 63
    # splits instead of 127; fewer still is slower: 31 splits 22.2 µs). With the history's registers capped
    # (`history_registers`), a full wave at 1x30K was faster alone (16.7 against 18.5 µs) but not in a whole
    # Qwen3-4B step (3.94-3.95 against 3.91-3.92 ms), so the rule stays.
    history = min(history, max(tokens // layer.layout.page_size // MIN_PAGES_PER_SPLIT, history // 2))
    history = max(1, min(history, tokens // 64, MAX_HISTORY_SPLITS))
    if gluon:
        history = _gluon_history_splits(history, -(-max(tokens, 0) // layer.layout.page_size), programs, sms)
    if _one_warp_windows(layer, programs, history, max_context, sms) or (gluon and programs > sms):
        return history, WindowPlan(1, warps=1, block_n=ONE_WARP_WINDOW_BLOCK)
    if _few_history_windows(programs, history, sms):
        return history, WindowPlan(FEW_HISTORY_WINDOW_SPLITS, warps=1, block_n=ONE_WARP_WINDOW_BLOCK)
    if _two_warp_windows(layer, programs, sms):
        return history, LARGE_BATCH_WINDOW_PLAN
    return history, WindowPlan(_window_splits(programs, sms))


def _gluon_history_splits(history: int, pages: int, programs: int, sms: int) -> int:
    """History splits of a Gluon decode step that `_decode_plan` would give `history`: up to one wave of
    `gluon_history.PROGRAMS_PER_MULTIPROCESSOR` (16) programs, the Triton kernel's wave being 8-9, as long as each
    split keeps `gluon_history.MIN_SPLIT_PAGES` (64) pages; never fewer than `history`. So only long splits change:
    at 32x32K (Qwen3 shapes: 256 (sequence, KV head) pairs, 507 pages) 4 splits of 127 pages become 8 of 64. H200,
    whole random Qwen3-4B steps at 32x32K, in turn in one process: 10.930 / 10.951 ms with 4, 10.720 with 6,
    10.718 / 10.732 with 8 (-2.0%; docs/data/gluon-splits-h200-s53.txt); one layer, 5 / 7 / 9 splits in all:
    214.7 / 210.8 / 209.2 µs (208.4 / 203.8 with 5 / 7 in the fifty-second session). Where the splits are shorter,
    more were as fast or slower (one layer: 16x32K 9 / 13 / 17 splits 111.8 / 111.6 / 110.6 µs, 8x32K 18 / 26 / 34
    58.4 / 59.1 / 59.9, 128x4K 2 / 3 / 4 159.0 / 166.6 / 166.7, 1x128K 136 / 264 32.4 / 34.8), and this rule leaves
    them. Not measured: the other shapes it changes (on 132 multiprocessors 64x32K 2 -> 4 splits, 32x64K and 32x128K
    4 -> 8, 16x64K 8 -> 16, 8x128K 16 -> 32, 4x256K 33 -> 64, batch 1 beyond about 540K tokens: 1x1M 132 -> 256),
    which reach 32x32K's 8-split counts of programs and pages or come near them."""
    longer = min(gluon_history.PROGRAMS_PER_MULTIPROCESSOR * sms // max(programs, 1), MAX_HISTORY_SPLITS)
    while longer > history and -(-pages // longer) < gluon_history.MIN_SPLIT_PAGES:
        longer -= 1
    return max(history, longer)


def window_plan(layer: PagedLayer, batch_size: int, max_new: int, query_heads: int, num_splits: int,
                max_context: int, device: torch.device, block_m: int | None = None,
                gluon: bool = False) -> WindowPlan:
    """The window programs among `num_splits`: `choose_splits`' plan for `max_context` (gluon as there) where
    `num_splits` is its count, else its rules for that count (one four-warp split where `num_splits` leaves no
    history split beside them)."""
    m_blocks, programs = _decode_programs(layer, batch_size, max_new, query_heads, block_m)
    if m_blocks > 1 or num_splits < 2:
        return WindowPlan(1)
    sms = _multiprocessor_count(device)
    history, chosen = _decode_plan(layer, programs, max_context, sms, gluon)
    if history + chosen.splits == num_splits:
        return chosen
    # a split count chosen elsewhere: one-warp windows or the batch rule, as `choose_splits` would take them
    if _one_warp_windows(layer, programs, num_splits - 1, max_context, sms):
        return WindowPlan(1, warps=1, block_n=ONE_WARP_WINDOW_BLOCK)
    windows = _window_splits(programs, sms)
    return WindowPlan(windows if num_splits > windows else 1)


# A decode step's query/key launch prefetches into L2 the first keys of each history split at batches up to this
# size (`prefetched_splits`).
PREFETCH_MAX_BATCH = 1


def prefetched_splits(layer: PagedLayer, batch_size: int, query_heads: int, max_context: int,
                      device: torch.device) -> int:
    """The history splits per (sequence, KV head) of the decode step that `attend_step` plans for `max_context`,
    at batches up to PREFETCH_MAX_BATCH (else 0). The query/key launch (`decode_query_key_write`) then prefetches
    into L2 the keys of each split's first page. H100, random Qwen3-4B INT2 steps in one process, alternating:
    1×100K 4.313–4.317 → 4.281–4.289 ms, 1×30K 3.770–3.771 → 3.760–3.762, 1×60K 4.014 → 3.978, 1×8K 3.651 →
    3.642. Larger batches gave no clear gain: 4×32K 5.703 → 5.690 and 5.704 → 5.859 ms, 32×32K 13.31 → 13.32 and
    13.36 → 13.50 (docs/data/qk-prefetch-h100.txt). The plan is that of a layer without a sliding window (the
    query/key launch does not know the window), Gluon's where the layer takes it (`gluon_history.takes_steps`)."""
    if batch_size > PREFETCH_MAX_BATCH:
        return 0
    gluon = gluon_history.takes_steps(layer, 1, query_heads, 0, device)
    num_splits = choose_splits(layer, batch_size, 1, query_heads, max_context, device, gluon=gluon)
    if num_splits < 2:
        return 0
    return num_splits - window_plan(layer, batch_size, 1, query_heads, num_splits, max_context, device,
                                    gluon=gluon).splits


def window_split_count(layer: PagedLayer, batch_size: int, max_new: int, query_heads: int, num_splits: int,
                       max_context: int, device: torch.device) -> int:
    """The window splits among `num_splits` (`window_plan`)."""
    return window_plan(layer, batch_size, max_new, query_heads, num_splits, max_context, device).splits


MAX_ROW_GROUPS = 2  # four: 255 registers with spills, slower on every benchmark shape
ROW_GROUP_MIN_PAGES = 64


def choose_row_groups(layer: PagedLayer, max_new: int, query_heads: int, num_splits: int, window_splits: int,
                      max_context: int) -> int:
    """History pages per softmax step of the decode kernel's history splits (ROW_GROUPS in
    `triton_attention`): as many copies of a KV head's query heads as fit 16 rows, at most MAX_ROW_GROUPS,
    where a split reads at least ROW_GROUP_MIN_PAGES pages; else 1. The grouped loop has a longer
    start and end (a merge of the copies), which only long splits repay. H100, Qwen3 shapes (32 query /
    8 KV heads, D 128): 32x32K (128 pages per split) 287.8 -> 265.6 µs; 32x8K and 8x32K (32 pages) within
    2%; 1x128K (16 pages) 44.4 -> 46.5 µs."""
    lay = layer.layout
    group = query_heads // lay.kv_heads
    history_splits = num_splits - window_splits if num_splits > 1 else 1
    pages = -(-max(max_context - lay.sink_tokens, 0) // lay.page_size)
    if max_new != 1 or lay.head_dim < 128 or -(-pages // history_splits) < ROW_GROUP_MIN_PAGES:
        return 1
    return max(1, min(16 // group, MAX_ROW_GROUPS))


# Registers per thread of decode history programs that leave room for a four-warp window program beside them
# on each multiprocessor (`history_registers`): 8 x 168 x 32 + 4 x 32 x 168 = 64,512 of the 65,536.
HISTORY_REGISTERS_BESIDE_WINDOWS = 168
UNCAPPED_HISTORY_PROGRAMS_BESIDE_WINDOWS = 6  # uncapped (about 206 registers), at most this many leave room


def history_registers(layer: PagedLayer, batch_size: int, max_new: int, query_heads: int, num_splits: int,
                      plan: WindowPlan, row_groups: int, device: torch.device,
                      block_m: int | None = None) -> int | None:
    """Register cap of a decode step's history launch (None: the compiler's choice, about 206 a thread).

    The four-warp window programs (`window_plan`) need 4 x 32 x 168 registers. Next to more than
    UNCAPPED_HISTORY_PROGRAMS_BESIDE_WINDOWS uncapped one-warp history programs per multiprocessor they do not
    fit, and run only as history programs end, in the step's tail. Capped at HISTORY_REGISTERS_BESIDE_WINDOWS,
    the one resident wave of `choose_splits` (PROGRAMS_PER_MULTIPROCESSOR) leaves room for one. One page per
    softmax step only (the two-page loop takes 211 registers); one-warp window programs fit anyway; None
    where this Triton takes no register cap. H100, Qwen3 shapes, one layer, uncapped -> capped, same process
    (data/history-registers-h100.txt): 1x64K 30.9 -> 27.4 µs, 1x100K 39.0 -> 36.1, 1x128K 42.9 -> 41.6,
    4x32K 44.9 -> 43.2, 8x32K 75.1 -> 73.5, 32x8K 90.2 -> 88.7, 64x4K 111.4 -> 107.1; a whole Qwen3-4B step
    at 1x100K 4.70 -> 4.50 ms. With half a wave (1x8K, 1x32K: 4 programs per multiprocessor) the cap was
    0.5-4% slower (H200) and is not taken."""
    m_blocks, programs = _decode_programs(layer, batch_size, max_new, query_heads, block_m)
    if m_blocks > 1 or row_groups > 1 or plan.warps != 4 or not 0 < plan.splits < num_splits:
        return None
    per_multiprocessor = -(-programs * (num_splits - plan.splits) // _multiprocessor_count(device))
    if (UNCAPPED_HISTORY_PROGRAMS_BESIDE_WINDOWS < per_multiprocessor <= PROGRAMS_PER_MULTIPROCESSOR
            and register_cap_supported()):
        return HISTORY_REGISTERS_BESIDE_WINDOWS
    return None


def _check_rotation(rotation: torch.Tensor | None, query_heads: int, d: int) -> None:
    if rotation is None:
        return
    if rotation.shape[-2:] != (d, d) or rotation.dim() not in (2, 3):
        raise OscarError(f"R_K must be [{d}, {d}] or [kv_heads, {d}, {d}], got {tuple(rotation.shape)}.")
    if rotation.dim() == 3 and query_heads % rotation.shape[0]:
        raise OscarError(f"{query_heads} query heads cannot share {rotation.shape[0]} per-KV-head rotations evenly.")


def rotate_queries(query: torch.Tensor, rotation: torch.Tensor | None, backend: str = "auto",
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """query [B, Hq, n, D] (after RoPE) -> query·R_K as [B·n, Hq, D] in `dtype` (None: query.dtype), rounded once
    from float32: the q of `attend_step`. rotation: float32 [D, D], [Hkv, D, D] (one per KV head), or None (no
    rotation). One Triton launch on CUDA instead of a cast, a float32 matmul, a cast back and a transpose."""
    if query.dim() != 4:
        raise OscarError(f"queries must be [batch, heads, tokens, head_dim], got {tuple(query.shape)}.")
    b, hq, n, d = query.shape
    _check_rotation(rotation, hq, d)
    dtype = dtype or query.dtype
    if rotation is None or resolve_backend(backend, query.device) == "torch" or b * n == 0 \
            or query.dtype not in ROTATED_QUERY_DTYPES or dtype not in ROTATED_QUERY_DTYPES or d & (d - 1) \
            or d < 16:
        return reference.rotate_queries_reference(query, rotation, dtype)
    from .triton_rotate import launch_rotate_queries

    if query.stride(3) != 1:
        query = query.contiguous()
    out = torch.empty(b * n, hq, d, dtype=dtype, device=query.device)
    launch_rotate_queries(query, rotation.float().contiguous(), out)
    return out


def decode_query_key(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     rotation: torch.Tensor | None, q_norm: tuple[torch.Tensor, float] | None = None,
                     k_norm: tuple[torch.Tensor, float] | None = None, backend: str = "auto",
                     rotate_keys: bool = False, key_mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's queries and keys, one token per row, from the projections to what the cache takes.

    q [B, Hq, D] and k [B, Hkv, D] (heads contiguous, unit stride on D), cos/sin [B, D] of the rows'
    positions, all in one half-precision dtype; q_norm/k_norm: an RMSNorm's (weight [D], eps), or None.
    Returns (the queries normalized, RoPE'd and times R_K, [B, Hq, D]: `attend_step`'s q; the keys
    normalized and RoPE'd, [B, Hkv, D]: what `write_step` takes). With rotate_keys, the keys come out as
    the cache stores them: (key - key_mean)·R_K in float32, rounded (key_mean [Hkv, D] or None), for
    `write_step` without a rotation. One Triton launch on CUDA (`triton_decode_qk`) instead of five; the
    torch reference elsewhere."""
    _check_decode_qk(q, k, cos, sin, rotation, q_norm, k_norm, key_mean)
    rotate_keys = rotate_keys and rotation is not None
    key_mean = key_mean if rotate_keys else None
    if not _decode_qk_on_triton(q, k, cos, sin, q_norm, k_norm, backend):
        query, key = reference.decode_query_key_reference(q, k, cos, sin, rotation, q_norm, k_norm)
        return query, reference.rotate_keys_reference(key, rotation, key_mean, key.dtype) if rotate_keys else key
    return _launch_decode_qk(q, k, cos, sin, rotation, q_norm, k_norm, rotate_keys, key_mean)


def _check_decode_qk(q, k, cos, sin, rotation, q_norm, k_norm, key_mean) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise OscarError(f"queries and keys must be [batch, heads, head_dim] with equal batch and head_dim, "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}.")
    b, hq, d = q.shape
    if hq % k.shape[1]:
        raise OscarError(f"{hq} query heads are not a multiple of {k.shape[1]} KV heads.")
    if cos.shape != (b, d) or sin.shape != (b, d):
        raise OscarError(f"cos and sin must be [{b}, {d}], got {tuple(cos.shape)} and {tuple(sin.shape)}.")
    _check_rotation(rotation, hq, d)
    for name, norm in (("q", q_norm), ("k", k_norm)):
        if norm is not None and norm[0].shape != (d,):
            raise OscarError(f"the {name} norm's weight must be [{d}], got {tuple(norm[0].shape)}.")
    if key_mean is not None and key_mean.shape != (k.shape[1], d):
        raise OscarError(f"the key mean must be [{k.shape[1]}, {d}], got {tuple(key_mean.shape)}.")


def _decode_qk_on_triton(q, k, cos, sin, q_norm, k_norm, backend: str) -> bool:
    """Whether `decode_query_key` runs the Triton launch (else the torch reference)."""
    d = q.shape[2]
    same_dtype = all(x.dtype == q.dtype for x in (k, cos, sin) + tuple(n[0] for n in (q_norm, k_norm) if n))
    return resolve_backend(backend, q.device) == "triton" and q.shape[0] > 0 and q.dtype in WINDOW_DTYPES \
        and same_dtype and not d & (d - 1) and d >= 16


def _launch_decode_qk(q, k, cos, sin, rotation, q_norm, k_norm, rotate_keys: bool, key_mean,
                      write=None) -> tuple[torch.Tensor, torch.Tensor]:
    from .hardware import overlaps_launches
    from .triton_decode_qk import launch_decode_qk

    b, hq, d = q.shape
    q, k = (x if x.stride(2) == 1 and x.stride(1) == d else x.contiguous() for x in (q, k))
    cos, sin = (x if x.stride(1) == 1 else x.contiguous() for x in (cos, sin))
    norms = [None if n is None else (n[0].contiguous(), n[1]) for n in (q_norm, k_norm)]
    q_out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(b, k.shape[1], d, dtype=q.dtype, device=q.device)
    launch_decode_qk(q, k, cos, sin, None if rotation is None else rotation.float().contiguous(),
                     *norms, q_out, k_out, overlap=overlaps_launches(q), rotate_keys=rotate_keys,
                     key_mean=None if key_mean is None else key_mean.float().contiguous(), write=write)
    return q_out, k_out


def decode_query_key_write(layer: PagedLayer, batch: StepBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, rotation: torch.Tensor,
                           q_norm: tuple[torch.Tensor, float] | None = None,
                           k_norm: tuple[torch.Tensor, float] | None = None, key_mean: torch.Tensor | None = None,
                           clip_k: float = 0.0, clip_v: float = 0.0,
                           backend: str = "auto", history_splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_query_key` with rotate_keys, then `write_step` of its keys and the values v [B, Hkv, D] into
    `layer` (validate=False): (the queries for `attend_step`, the rotated keys it reads for the step's own tokens).

    On the Triton path a step of one new token per sequence (the batch's row b is sequence b) whose windows hold
    q's dtype runs both in one launch: the query/key launch's key programs also store the token in the sink or
    ring, and more programs of that launch move the tokens that age out of the ring into the history, as
    `triton_write.launch_write` does in its merged decode launch. That saves one launch per layer in a decode
    step. Any other step makes the two calls. history_splits (`prefetched_splits`; 0: none): that launch also
    prefetches into L2 the keys of the first page of each of that many history splits (`triton_decode_qk`)."""
    if rotation is None:
        raise OscarError("decode_query_key_write stores rotated keys: it needs the layer's key rotation.")
    _check_decode_qk(q, k, cos, sin, rotation, q_norm, k_norm, key_mean)
    lay = layer.layout
    one_token_rows = batch.max_new == 1 and batch.batch == q.shape[0] == k.shape[0] == v.shape[0]
    fits = v.shape == k.shape == (q.shape[0], lay.kv_heads, lay.head_dim) and v.dtype == q.dtype == layer.ring_k.dtype
    if one_token_rows and fits and _decode_qk_on_triton(q, k, cos, sin, q_norm, k_norm, backend):
        from .triton_decode_qk import StepWrite

        _check_inputs(layer, batch)  # the window dtype and the step's index dtypes
        v = v if v.stride(2) == 1 and v.stride(1) == lay.head_dim else v.contiguous()
        return _launch_decode_qk(q, k, cos, sin, rotation, q_norm, k_norm, True, key_mean,
                                 StepWrite(layer, batch, v, clip_k, clip_v, history_splits))
    query, key = decode_query_key(q, k, cos, sin, rotation, q_norm, k_norm, backend, rotate_keys=True,
                                  key_mean=key_mean)
    return query, write_step(layer, batch, key, v, None, None, clip_k, clip_v, backend=backend, validate=False)


def attend_step(layer: PagedLayer, batch: StepBatch, q: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor,
                scale: float, window: int = 0, backend: str = "auto", num_splits: int | None = None,
                max_context: int | None = None, out: torch.Tensor | None = None,
                workspace: tuple[torch.Tensor, torch.Tensor] | None = None, validate: bool = True,
                window_splits: int | WindowPlan | None = None, row_groups: int | None = None,
                extend: ExtendPath = "auto", block_m: int | None = None,
                history: HistoryKernel = "auto") -> torch.Tensor:
    """Attention of a step's queries q [T, Hq, D] (rotated by R_K) over the cache and the step itself.

    k_rot, v: [T, Hkv, D] from `write_step` (call it first). Returns [T, Hq, D] in q.dtype.
    num_splits / out / workspace: fix them (with validate=False) for a CUDA-graph-captured step.
    window_splits: how many of the splits share the BF16 windows, as four-warp programs, or a `WindowPlan`
    (None: `window_plan`).
    row_groups: history pages per softmax step in decode (None: `choose_row_groups`). The history launch's
    register cap follows from the plan (`history_registers`).
    extend: how the Triton backend runs a step of several new tokens per sequence: "fused" (the attention
    kernel), "dequantize" (`extend.extend_attention`: the history dequantized once, then SDPA), or "auto"
    (`takes_dequantized_extend`). Decode steps (one new token per sequence at most) always run the kernel.
    block_m: query rows per program of the kernel (None: `choose_block_m`). history: the kernel of a decode step's
    history launch, "auto", "triton" or "gluon" (`gluon_history`; see `triton_attention.launch_attention`).
    """
    lay = layer.layout
    _check_inputs(layer, batch, ("q", q, None), ("k_rot", k_rot, lay.kv_heads), ("v", v, lay.kv_heads))
    if q.shape[1] % lay.kv_heads:
        raise OscarError(f"{q.shape[1]} query heads are not a multiple of {lay.kv_heads} KV heads.")
    if extend not in EXTEND_PATHS:
        raise OscarError(f"extend={extend!r}; use one of {EXTEND_PATHS}.")
    if history not in HISTORY_KERNELS:
        raise OscarError(f"history={history!r}; use one of {HISTORY_KERNELS}.")
    if validate:
        check_block_table(layer, batch)
    if resolve_backend(backend, q.device) == "torch":
        return reference.attention_reference(layer, batch, q, k_rot, v, scale, window).to(q.dtype)
    if dequantizes_extend(layer, batch, q.device, backend, extend):
        result = extend_attention(layer, batch, q, k_rot, v, scale, window)
        return result if out is None else out.copy_(result)
    from .triton_attention import launch_attention

    context = max_context if max_context is not None else batch.block_table.shape[1] * lay.page_size
    block_m = block_m or choose_block_m(batch.max_new, q.shape[1] // lay.kv_heads)
    gluon = history != "triton" and gluon_history.takes(layer, batch, q.shape[1], window, q.device)
    if num_splits is None:
        num_splits = choose_splits(layer, batch.batch, batch.max_new, q.shape[1], context, q.device, block_m, gluon)
    out = torch.empty_like(q) if out is None else out
    if num_splits > 1 and workspace is None:
        workspace = (torch.empty(q.shape[0], q.shape[1], num_splits, q.shape[2], dtype=torch.float32, device=q.device),
                     torch.empty(q.shape[0], q.shape[1], num_splits, dtype=torch.float32, device=q.device))
    if window_splits is None:
        plan = window_plan(layer, batch.batch, batch.max_new, q.shape[1], num_splits, context, q.device, block_m,
                           gluon)
    else:
        plan = window_splits if isinstance(window_splits, WindowPlan) else WindowPlan(window_splits)
    if row_groups is None:
        row_groups = choose_row_groups(layer, batch.max_new, q.shape[1], num_splits, plan.splits, context)
    registers = history_registers(layer, batch.batch, batch.max_new, q.shape[1], num_splits, plan, row_groups,
                                  q.device, block_m)
    launch_attention(layer, batch, q, k_rot, v, out, scale, window, num_splits, workspace, window_splits=plan.splits,
                     row_groups=row_groups, window_warps=plan.warps, window_block_n=plan.block_n, maxnreg=registers,
                     combine_d_block=min(COMBINE_CHANNELS, lay.head_dim), block_m=block_m, history=history)
    return out


def dequantizes_extend(layer: PagedLayer, batch: StepBatch, device: torch.device, backend: str = "auto",
                       extend: ExtendPath = "auto") -> bool:
    """Whether `attend_step` runs this step by `extend.extend_attention` (the history dequantized, then SDPA in
    `extend.COMPUTE_DTYPE`, the dtype its queries are best rotated into): a step of several new tokens per
    sequence on the Triton backend, with extend "dequantize", or "auto" and `takes_dequantized_extend`."""
    return (resolve_backend(backend, device) != "torch" and batch.max_new > 1
            and (extend == "dequantize" or (extend == "auto" and takes_dequantized_extend(layer, batch, device))))


def attend_dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                 lengths: torch.Tensor, scale: float, window: int = 0, backend: str = "auto",
                 max_context: int | None = None) -> torch.Tensor:
    """Decode attention over a dense cache (the BF16 baseline), one query token per sequence.

    q: [B, Hq, D]; keys, values: [slots, Hkv, max_context, D]; slots, lengths: [B] integer device
    tensors (lengths counts the positions each query sees, its own included). Returns [B, Hq, D]
    in q.dtype. Nothing here synchronises with the device, so it can be captured in a CUDA graph.
    """
    if q.dim() != 3 or keys.dim() != 4 or keys.shape != values.shape or q.shape[2] != keys.shape[3]:
        raise OscarError(f"attend_dense takes q [B, Hq, D] and keys/values [slots, Hkv, L, D]; got "
                         f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}.")
    if q.shape[1] % keys.shape[1]:
        raise OscarError(f"{q.shape[1]} query heads are not a multiple of {keys.shape[1]} KV heads.")
    if keys.stride()[2:] != (keys.shape[3], 1) or values.stride() != keys.stride():
        raise OscarError("keys and values must have contiguous [max_context, D] rows per (slot, KV head).")
    if resolve_backend(backend, q.device) == "torch":
        return reference.dense_decode_reference(q, keys, values, slots, lengths, scale, window).to(q.dtype)
    from .triton_dense import launch_dense_decode

    q = q.contiguous()
    b, hq, d = q.shape
    splits = split_count(b * keys.shape[1], max_context or keys.shape[2], q.device)
    out = torch.empty_like(q)
    workspace = None
    if splits > 1:
        workspace = (torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device),
                     torch.empty(b, hq, splits, dtype=torch.float32, device=q.device))
    launch_dense_decode(q, keys, values, slots, lengths, out, scale, window, splits, workspace)
    return out
