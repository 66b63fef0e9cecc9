"""`oscarkv bench attention`: the INT2 decode kernel against BF16 SDPA on the same cache contents.

One attention layer with the shapes of Qwen3-4B/8B (32 query heads, 8 KV heads,
head_dim 128), group 128, or of a named model (`layer_shape`: `--model`), INT2 history,
sink 64, recent 256, pages of 64 tokens. For
each (batch, context) the cache is filled with random codes, scales and windows; the
BF16 baseline attends over exactly those values, dequantized, with torch SDPA (flash
backend where it runs). Both are timed in the same process with CUDA graphs (launch
overhead excluded for both), and the achieved bandwidth is the bytes that must be read
divided by the time, against the measured device-to-device copy bandwidth.

With `inner` (`--lloyd-inner A`), each row also times the same kernels on the same codes read
at Lloyd–Max levels with inner level A for keys and values (`quant.format`; one more masked dot
per code tile), in the same run, so the cost of the levels is a ratio of two measured times.

With `key_shifts` (`--key-shifts`), each row and the write path are also timed with the key shifts of
`CacheConfig(key_centering="rope")`, the default of every calibrated, centered `oscar` artifact
(`oscarkv.rope`; blocks of 1024 positions, a random key mean turned by Qwen3's RoPE frequencies), on the
same contents: history keys are stored minus their block's shift and read plus it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from ..cache.paged import PagedKVCache, PagedLayer, PagedLayout, StepBatch
from ..errors import OscarError
from . import require_cuda, stream_read
from ..kernels import reference
from ..kernels import gluon_history
from ..kernels.ops import RotationPieces, attend_step, choose_splits, rotation_pieces, write_step
from .. import rope

DEFAULT_SHAPES = ((1, 8192), (1, 32768), (1, 65536), (1, 131072), (32, 8192), (32, 32768))
SHIFT_BLOCK = 1024  # positions a key shift covers: the calibration chunk of a centered artifact
ROPE_THETA = 1e6  # Qwen3's RoPE base, for the key shifts' frequencies


@dataclass(frozen=True)
class LayerShape:
    """The attention layer `bench attention` times: heads, head_dim, and the group of channels per scale."""
    query_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    group: int = 128

    def describe(self) -> str:
        return (f"{self.query_heads} query / {self.kv_heads} KV heads, head_dim {self.head_dim}, "
                f"group {self.group}")


QWEN3_LAYER = LayerShape()  # Qwen3-4B and Qwen3-8B


def layer_shape(model: str) -> LayerShape:
    """The attention layer of MODEL (its config only, no weights), with the default group size of its head_dim,
    checked against what the paged cache supports before any GPU work."""
    from ..config import QuantConfig
    from ..models import attention_shape, model_config

    shape = attention_shape(model_config(model))
    try:
        group = QuantConfig.for_head_dim(shape.head_dim).group_size
        PagedLayout(kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, group_size=group)  # refuses what it cannot hold
    except OscarError as exc:
        raise OscarError(f"{model}: {exc}") from None
    return LayerShape(shape.num_heads, shape.num_kv_heads, shape.head_dim, group)


@dataclass
class AttentionResult:
    batch: int
    context: int
    sdpa_us: float
    int2_us: float
    speedup: float
    sdpa_bytes: int
    int2_bytes: int
    sdpa_bandwidth_gbs: float
    int2_bandwidth_gbs: float
    int2_bandwidth_fraction: float  # of the measured copy bandwidth
    copy_bandwidth_gbs: float
    max_abs_error: float  # kernel vs torch reference of the same cache
    sdpa_gap: float  # kernel vs BF16 SDPA over the same (dequantized) contents
    splits: int
    sdpa_backend: str
    lloyd_us: float | None = None  # the same step with Lloyd–Max levels (`inner`), same codes
    lloyd_max_abs_error: float | None = None  # that kernel vs the torch reference at those levels
    # A device-to-device copy that moves int2_bytes (half read, half written), timed as the kernels are:
    # what the copy bandwidth becomes at this size, launch and ramp included.
    same_bytes_copy_us: float | None = None
    int2_fraction_of_same_bytes_copy: float | None = None  # same_bytes_copy_us / int2_us
    # torch SDPA over the same contents with its own backend choice (the baseline above keeps the flash backend,
    # as issue 4 defines it; at some shapes another backend is faster: H200, SmolLM2's GQA 3 / head_dim 64,
    # 256x4K, flash 366 µs against 191), and the INT2 kernel's speed-up over the faster of the two.
    sdpa_any_backend_us: float | None = None
    speedup_over_fastest_sdpa: float | None = None
    history_kernel: str | None = None  # the decode history launch's kernel: "gluon" (`gluon_history`) or "triton"
    shifts_us: float | None = None  # the same step with key shifts (`key_shifts`), same contents
    shifts_max_abs_error: float | None = None  # that step vs the torch reference with the same shifts
    # The fastest plain read of int2_bytes we could launch (`stream_read`), timed as the kernels are: about the best
    # any kernel that must read these bytes could do. Its share of the copy bandwidth bounds int2_bandwidth_fraction,
    # and sdpa_us over it bounds the speed-up over BF16 SDPA (speedup_ceiling).
    same_bytes_read_us: float | None = None
    same_bytes_read_fraction: float | None = None  # int2_bytes / same_bytes_read_us, against the copy bandwidth
    speedup_ceiling: float | None = None  # sdpa_us / same_bytes_read_us


@dataclass
class WriteResult:
    tokens: int
    microseconds: float
    tokens_per_s: float
    bytes_moved: int
    bandwidth_gbs: float
    bandwidth_fraction: float
    lloyd_microseconds: float | None = None  # the same write with Lloyd–Max levels (`inner`)
    # The same write launched from Python at every call (no CUDA graph), as an eager prefill runs it: where the
    # host's launches take longer than the GPU's work, this is the host's time.
    eager_microseconds: float | None = None
    shifts_microseconds: float | None = None  # the same write with key shifts (`key_shifts`)


def with_random_key_shifts(layer: PagedLayer, context: int, seed: int = 0) -> PagedLayer:
    """The layer with the key shifts of key_centering "rope" (`PagedLayer.key_shifts`) for contexts up to `context`:
    (R(o) - 1)·μ for a random key mean μ of norm ~4 per head and Qwen3's RoPE frequencies, blocks of SHIFT_BLOCK."""
    lay = layer.layout
    gen = torch.Generator().manual_seed(seed + 7)
    mean = 0.35 * torch.randn(lay.kv_heads, lay.head_dim, generator=gen, dtype=torch.float64)
    freqs = 1.0 / ROPE_THETA ** (torch.arange(0, lay.head_dim, 2, dtype=torch.float64) / lay.head_dim)
    shifts = rope.mean_shifts(mean, freqs, SHIFT_BLOCK, context)
    return replace(layer, key_shifts=shifts.float().to(layer.k_scale.device).contiguous(), shift_block=SHIFT_BLOCK)


def _time_us(fn, graph: bool = True) -> float:
    import triton.testing

    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=100) * 1e3


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth: (read + write bytes) / time of a large copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = _time_us(lambda: dst.copy_(src), graph=False)
    return 2 * nbytes / us / 1e3


def same_bytes_copy_us(nbytes: int, device: torch.device, timer=_time_us) -> float:
    """Time of a device-to-device copy that moves `nbytes` in all (nbytes / 2 read, nbytes / 2 written),
    measured with `timer` as the kernels are (CUDA graphs, back to back). At the sizes of one decode
    layer this is below the 2 GiB copy's bandwidth: a launch, the ramp and the tail weigh more."""
    src = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src))


def _layout(kv_heads: int, head_dim: int, group: int, key_bits: int = 2) -> PagedLayout:
    return PagedLayout(kv_heads=kv_heads, head_dim=head_dim, group_size=group, key_bits=key_bits, page_size=64,
                       sink_tokens=64, recent_tokens=256)


def _fill_random(cache: PagedKVCache, generator: torch.Generator) -> None:
    for layer in cache.layers:
        for codes in (layer.k_codes, layer.v_codes):
            codes.copy_(torch.randint(0, 256, codes.shape, dtype=torch.uint8, generator=generator))
        for scale in (layer.k_scale, layer.v_scale):
            scale.copy_(torch.rand(scale.shape, generator=generator).mul(0.5).add(0.2).half())
        for zero in (layer.k_zero, layer.v_zero):
            zero.copy_(torch.rand(zero.shape, generator=generator).mul(3).half())
        for window in (layer.sink_k, layer.sink_v, layer.ring_k, layer.ring_v):
            window.copy_(torch.randn(window.shape, generator=generator).bfloat16())


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


@dataclass
class DecodeCase:
    """One decode step over a randomly filled paged cache: every slot holds context - 1 tokens."""
    cache: PagedKVCache
    slots: list[int]
    step: object  # StepBatch
    q: torch.Tensor  # [B, Hq, D]
    k_new: torch.Tensor  # [B, Hkv, D]
    v_new: torch.Tensor

    @property
    def layer(self):
        return self.cache.layers[0]


def decode_case(batch: int, context: int, query_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                group: int = 128, seed: int = 0, device: str = "cuda", key_bits: int = 2) -> DecodeCase:
    """key_bits 4: a layer whose keys calibration moved to INT4 (values stay INT2)."""
    device = torch.device(device)
    layout = _layout(kv_heads, head_dim, group, key_bits)
    cache = PagedKVCache([layout], batch * layout.pages_needed(context), batch, context, device)
    gen = torch.Generator().manual_seed(seed)
    _fill_random(cache, gen)
    slots = [cache.open_slot() for _ in range(batch)]
    for slot in slots:  # every slot already holds context - 1 tokens; the step adds one
        cache.reserve(slot, context)
        cache.lengths[slot] = context - 1
    step = cache.step(slots, [1] * batch)
    q = torch.randn(batch, query_heads, head_dim, generator=gen).bfloat16().to(device)
    k_new = torch.randn(batch, kv_heads, head_dim, generator=gen).bfloat16().to(device)
    v_new = torch.randn(batch, kv_heads, head_dim, generator=gen).bfloat16().to(device)
    return DecodeCase(cache, slots, step, q, k_new, v_new)


def decode_bytes(case: DecodeCase, context: int) -> int:
    """Bytes one decode step must read: history codes, scales and zeros, BF16 sink and ring
    (the step's own key/value included), and the queries and outputs."""
    layout = case.layer.layout
    batch, kv_heads = case.k_new.shape[:2]
    history = layout.history_end(context) - layout.sink_tokens
    return (history * batch * kv_heads * layout.history_bytes_per_token()
            + batch * kv_heads * (context - history) * layout.head_dim * 2 * 2 + 2 * case.q.numel() * 2)


def bench_decode(batch: int, context: int, query_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                 group: int = 128, copy_gbs: float | None = None, seed: int = 0, device: str = "cuda",
                 timer=_time_us, key_bits: int = 2, inner: float | None = None,
                 key_shifts: bool = False) -> AttentionResult:
    """One decode step at `context` tokens per sequence. `timer(fn) -> microseconds`; key_bits 4:
    a layer with INT4 keys and INT2 values; inner: also time the step at Lloyd–Max levels; key_shifts: also
    time it with key shifts (`with_random_key_shifts`)."""
    case = decode_case(batch, context, query_heads, kv_heads, head_dim, group, seed, device, key_bits)
    device = torch.device(device)
    cache, layout, layer, slots, step = case.cache, case.layer.layout, case.layer, case.slots, case.step
    q, k_new, v_new = case.q, case.k_new, case.v_new
    scale = head_dim ** -0.5
    splits = choose_splits(layer, batch, 1, query_heads, context, device,
                           gluon=gluon_history.takes(layer, step, query_heads, 0, device))  # as `attend_step` plans
    out = torch.empty_like(q)
    workspace = (torch.empty(batch, query_heads, splits, head_dim, dtype=torch.float32, device=device),
                 torch.empty(batch, query_heads, splits, dtype=torch.float32, device=device))

    def int2():
        attend_step(layer, step, q, k_new, v_new, scale, num_splits=splits, out=out, workspace=workspace,
                    validate=False)

    int2()
    expected = reference.attention_reference(layer, step, q, k_new, v_new, scale)
    error = (out.float() - expected).abs().max().item()
    # The same contents as BF16 tensors in position order, for SDPA.
    end = layout.history_end(context)
    keys, values = [], []
    for b, slot in enumerate(slots):
        k_b, v_b = reference.stored_kv_reference(layer, cache.block_table, slot, context - 1, end)
        keys.append(torch.cat([k_b, k_new[b, :, None].float()], dim=1).bfloat16())
        values.append(torch.cat([v_b, v_new[b, :, None].float()], dim=1).bfloat16())
    del expected
    k_full, v_full = torch.stack(keys), torch.stack(values)  # [B, Hkv, context, D]
    del keys, values
    q4 = q[:, :, None]  # [B, Hq, 1, D]
    backend = "flash"
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            _sdpa(q4, k_full, v_full)
        sdpa_fn = lambda: _sdpa_flash(q4, k_full, v_full)  # noqa: E731
    except (RuntimeError, AssertionError):
        backend = "default"
        sdpa_fn = lambda: _sdpa(q4, k_full, v_full)  # noqa: E731
    reference_out = sdpa_fn()[:, :, 0]
    sdpa_gap = (reference_out.float() - out.float()).abs().max().item()
    sdpa_us = timer(sdpa_fn)
    sdpa_any_us = timer(lambda: _sdpa(q4, k_full, v_full)) if backend == "flash" else sdpa_us
    int2_us = timer(int2)
    int2_bytes = decode_bytes(case, context)
    sdpa_bytes = 2 * k_full.numel() * 2 + 2 * q.numel() * 2
    copy_gbs = copy_gbs or copy_bandwidth_gbs(device)
    int2_gbs = int2_bytes / int2_us / 1e3
    copy_us = same_bytes_copy_us(int2_bytes, device, timer)
    read_us = stream_read.same_bytes_read_us(int2_bytes, device, timer)

    def variant(lay: PagedLayer) -> tuple[float, float]:
        """(time, max abs error against the torch reference) of the same step over the layer `lay`."""

        def step_fn():
            attend_step(lay, step, q, k_new, v_new, scale, num_splits=splits, out=out, workspace=workspace,
                        validate=False)

        step_fn()
        error = (out.float() - reference.attention_reference(lay, step, q, k_new, v_new, scale)).abs().max().item()
        return timer(step_fn), error

    lloyd_us = lloyd_error = shifts_us = shifts_error = None
    if inner is not None:
        del k_full, v_full, reference_out
        lloyd_us, lloyd_error = variant(replace(layer, layout=replace(
            layout, key_inner=inner if layout.key_bits == 2 else None, value_inner=inner)))
    if key_shifts:
        shifts_us, shifts_error = variant(with_random_key_shifts(layer, context))
    return AttentionResult(batch, context, sdpa_us, int2_us, sdpa_us / int2_us, sdpa_bytes, int2_bytes,
                           sdpa_bytes / sdpa_us / 1e3, int2_gbs, int2_gbs / copy_gbs, copy_gbs, error, sdpa_gap,
                           splits, backend, lloyd_us, lloyd_error, copy_us, copy_us / int2_us, sdpa_any_us,
                           min(sdpa_us, sdpa_any_us) / int2_us,
                           "gluon" if gluon_history.takes(layer, step, query_heads, 0, device) else "triton",
                           shifts_us, shifts_error, read_us, int2_bytes / read_us / 1e3 / copy_gbs,
                           sdpa_us / read_us)


def _sdpa_flash(q, k, v):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return _sdpa(q, k, v)


@dataclass
class WriteCase:
    """A prompt into an empty paged cache: bfloat16 keys and values [T, Hkv, D], a random R_K and μ_K."""
    cache: PagedKVCache
    step: StepBatch
    k: torch.Tensor
    v: torch.Tensor
    rotation: torch.Tensor
    mean: torch.Tensor
    pieces: RotationPieces

    @property
    def layer(self) -> PagedLayer:
        return self.cache.layers[0]


def write_case(tokens: int = 32768, kv_heads: int = 8, head_dim: int = 128, group: int = 128,
               device: str = "cuda") -> WriteCase:
    device = torch.device(device)
    layout = _layout(kv_heads, head_dim, group)
    cache = PagedKVCache([layout], layout.pages_needed(tokens), 1, tokens, device)
    step = cache.step([cache.open_slot()], [tokens])
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).bfloat16().to(device)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).bfloat16().to(device)
    rotation, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
    rotation = rotation.float().to(device)
    mean = torch.randn(kv_heads, head_dim, generator=gen).to(device)
    pieces = rotation_pieces(rotation, mean)  # prepared once per layer, as PagedOscarCache does
    return WriteCase(cache, step, k, v, rotation, mean, pieces)


def bench_write(tokens: int = 32768, kv_heads: int = 8, head_dim: int = 128, group: int = 128,
                copy_gbs: float | None = None, inner: float | None = None, key_shifts: bool = False) -> WriteResult:
    """Write path of a prompt of `tokens` tokens into an empty cache (center, rotate, quantize, pack).

    Timed with CUDA graphs, as the decode rows are, so the time is the GPU's; `eager_microseconds` is the same
    write launched from Python at every call."""
    case = write_case(tokens, kv_heads, head_dim, group)
    device, layer, step, k, v = case.k.device, case.layer, case.step, case.k, case.v
    rotation, mean, pieces, layout = case.rotation, case.mean, case.pieces, case.layer.layout

    def write(lay: PagedLayer) -> torch.Tensor:
        return write_step(lay, step, k, v, rotation, mean, 0.96, 0.92, validate=False, pieces=pieces)

    us = _time_us(lambda: write(layer))
    eager_us = _time_us(lambda: write(layer), graph=False)
    lloyd_us = None
    if inner is not None:
        lloyd_layer = replace(layer, layout=replace(layout, key_inner=inner, value_inner=inner))
        lloyd_us = _time_us(lambda: write(lloyd_layer))
    shifts_us = None
    if key_shifts:
        shifted = with_random_key_shifts(layer, tokens)
        shifts_us = _time_us(lambda: write(shifted))
    hist = layout.history_end(tokens) - layout.sink_tokens
    window_tokens = tokens - hist
    moved = (2 * k.numel() * 2  # read K and V
             + k.numel() * 2  # write the rotated keys the step's attention reads
             + hist * kv_heads * layout.history_bytes_per_token()
             + 2 * window_tokens * kv_heads * head_dim * 2)
    copy_gbs = copy_gbs or copy_bandwidth_gbs(device)
    gbs = moved / us / 1e3
    return WriteResult(tokens, us, tokens / us * 1e6, moved, gbs, gbs / copy_gbs, lloyd_us, eager_us, shifts_us)


def run(shapes=DEFAULT_SHAPES, write_tokens: int = 32768, inner: float | None = None,
        layer: LayerShape = QWEN3_LAYER, key_shifts: bool = False) -> dict:
    require_cuda("bench attention")
    device = torch.device("cuda")
    copy_gbs = copy_bandwidth_gbs(device)
    rows = []
    for batch, context in shapes:
        rows.append(asdict(bench_decode(batch, context, layer.query_heads, layer.kv_heads, layer.head_dim, layer.group,
                                        copy_gbs=copy_gbs, inner=inner, key_shifts=key_shifts)))
        torch.cuda.empty_cache()
    write = asdict(bench_write(write_tokens, layer.kv_heads, layer.head_dim, layer.group, copy_gbs=copy_gbs,
                               inner=inner, key_shifts=key_shifts))
    return {"device": torch.cuda.get_device_name(device), "copy_bandwidth_gbs": copy_gbs, "layer": asdict(layer),
            "decode": rows, "write": write, "torch": torch.__version__}
