"""`oscarkv bench decode`: whole-model decode speed, BF16 cache vs INT2 cache, on one GPU.

Both caches run through the same static decode path (`StaticDecoder`: one CUDA graph per
step, the same model, the same argmax); only the cache differs:
- BF16: `DenseSlotCache`, contiguous K/V per slot, decode attention by `attend_dense`;
- INT2: `PagedSlotCache`, BF16 sink (64) and recent ring (256 + one page), INT2 history pages
  (group 128), the kernels of `oscarkv.kernels`. The model is patched with the `hadamard`
  method: OSCAR's kernels and bytes with every layer INT2. A calibrated OSCAR artifact adds
  the centering subtraction in the write and, with the default key centering, the per-page score
  term of its key shifts (fifty-eighth session: 0.2-10% of a decode layer on the H200, 1.8-3.5% of a
  whole Qwen3-4B step, docs/decode-log.md), and may keep a few layers INT4. `Settings.centered` measures that
  configuration instead: the `oscar` method with `centered_artifact` (every layer INT2).

Before decoding, each cache is filled to the context length: the INT2 cache through its
write kernel, the BF16 cache by writing its buffers, both with random keys and values
(decode time does not depend on the values). Prefill is timed separately, as a real
forward over a prompt.

Figures, per (batch, context):
- step_ms: mean time of one decode step over `steps` graph replays (CUDA events);
- tokens_per_s: batch / step time;
- roofline_ms: the bytes a step must read (the weights once, plus each sequence's KV cache
  at that length) divided by the device-to-device copy bandwidth measured in the same run;
  roofline_fraction = roofline_ms / step_ms (1.0 = at the byte limit).
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass

import torch

from ..calibration.artifact import RotationArtifact
from ..config import CacheConfig, QuantConfig
from ..integrations.slots import DenseSlotCache, PagedSlotCache
from ..integrations.static_decode import StaticDecoder, forward_slots, slot_cache_for
from ..kernels.ops import write_step
from . import require_cuda
from .attention import copy_bandwidth_gbs

METHODS = {"bf16": "bf16", "int2": "hadamard"}  # what the benchmark calls a cache -> the method patched
BATCH_CAP = 256


@dataclass
class DecodeRun:
    cache: str
    batch: int
    context: int
    steps: int
    step_ms: float
    tokens_per_s: float
    kv_bytes_per_step: int
    weight_bytes: int
    roofline_ms: float
    roofline_fraction: float
    kv_bytes_allocated: int


@dataclass
class PrefillRun:
    cache: str
    tokens: int
    ms: float
    tokens_per_s: float


@dataclass
class Settings:
    model: str = "random:qwen3-4b"
    contexts: tuple[int, ...] = (30000, 60000, 100000)
    batch: int = 32
    batch_contexts: tuple[int, ...] = (8192, 32768)
    largest_batch: bool = True
    prefill_tokens: int = 32768
    bits_context: int = 131072
    steps: int = 128
    memory_margin_gib: float = 6.0
    compile_small_ops: bool = True  # CacheConfig.compile_small_ops of both caches' static steps
    decode_gemv: bool = True  # CacheConfig.decode_gemv: linear products of batches 1-32 by the Triton kernels
    # The INT2 cache as a calibrated `oscar` artifact runs it: keys and values centered, the keys with RoPE-following
    # shifts (the default key centering), through `centered_artifact`; False: the hadamard method, no centering.
    centered: bool = False


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an input embedding
    that is not also the LM head (a step reads only its batch's rows of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight.data_ptr() != embed.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_read(cache, batch: int, length: int) -> int:
    """Bytes of KV cache a decode step reads for `batch` sequences of `length` tokens."""
    if isinstance(cache, DenseSlotCache):
        return batch * length * cache.bytes_per_token
    total = 0
    for lay in cache.layouts:
        history = lay.history_end(length) - lay.sink_tokens
        window = length - history
        total += lay.kv_heads * (history * lay.history_bytes_per_token() + window * 2 * lay.head_dim * 2)
    return batch * total


def kv_bytes_per_sequence(model, context: int) -> dict[str, int]:
    """Allocated KV bytes of one slot of `context` tokens, per cache (from the cache's tensors)."""
    state = model.oscar
    out = {}
    for name in METHODS:
        if name == "bf16":
            per_token = 2 * len(state.specs) * state.kv_heads * state.head_dim * state.cache.window_dtype.itemsize
            out[name] = context * per_token
        else:
            per_page, windows = PagedSlotCache.slot_bytes(state)
            out[name] = PagedSlotCache.pages_for_budget(state, 1, context, None) * per_page + windows
    return out


def fill(cache, slots: list[int], context: int, chunk_tokens: int = 65536, seed: int = 0) -> None:
    """Bring every slot to `context` tokens of random keys and values (see the module docstring);
    the INT2 cache is written `chunk_tokens` tokens (over all slots) at a time."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    if isinstance(cache, PagedSlotCache):
        chunk = max(64, chunk_tokens // len(slots))
        storage = cache.storage
        for start in range(0, context, chunk):
            n = min(chunk, context - start)
            step = storage.step(slots, [n] * len(slots))
            for layer in storage.layers:
                lay = layer.layout
                shape = (len(slots) * n, lay.kv_heads, lay.head_dim)
                k = torch.randn(shape, generator=generator, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(shape, generator=generator, device="cuda", dtype=torch.bfloat16)
                write_step(layer, step, k, v, validate=False)
        cache.set_batch(slots)
        return
    for layer in cache.layers:
        if not layer.is_initialized:
            probe = torch.zeros(1, cache.kv_heads, 1, cache.head_dim, dtype=cache.dtype, device="cuda")
            layer.lazy_initialization(probe, probe)
        for slot in slots:
            layer.keys_store[slot, :, :context].normal_(generator=generator)
            layer.values_store[slot, :, :context].normal_(generator=generator)
    for slot in slots:
        cache.lengths[slot] = context
    cache.set_batch(slots)


CENTERING_CHUNK = 1024  # `centered_artifact`'s calibration chunk: the key shifts' block of positions


def centered_artifact(model, seed: int = 0) -> RotationArtifact:
    """A data-free artifact that centers as a calibrated `oscar` one does: Hadamard rotations, random key and value
    means, calibrated at start positions in CENTERING_CHUNK-token chunks, so that the default key centering takes
    RoPE-following key shifts (`CacheConfig.key_centering`). Decode speed does not depend on the values."""
    from ..methods import data_free_artifact
    from ..models import attention_shape

    shape = attention_shape(model)
    artifact = data_free_artifact(model, "hadamard", QuantConfig.for_head_dim(shape.head_dim))
    gen = torch.Generator().manual_seed(seed)
    for layer in artifact.layers:
        layer.k_mean = torch.randn(shape.num_kv_heads, shape.head_dim, generator=gen)
        layer.v_mean = 0.1 * torch.randn(shape.num_kv_heads, shape.head_dim, generator=gen)
    artifact.method = "oscar"
    artifact.calibration = {"tokens": 0, "sources": [], "positions": "start", "chunk_tokens": CENTERING_CHUNK}
    return artifact


def _patch(model, name: str, compile_small_ops: bool = True, decode_gemv: bool = True, centered: bool = False) -> None:
    import oscarkv

    cache = CacheConfig(compile_small_ops=compile_small_ops, decode_gemv=decode_gemv)
    if centered and name == "int2":
        oscarkv.patch(model, centered_artifact(model), method="oscar", cache=cache)
    else:
        oscarkv.patch(model, method=METHODS[name], cache=cache)


def decode_run(model, name: str, batch: int, context: int, steps: int, weights: int, bandwidth_gbs: float,
               compile_small_ops: bool = True, decode_gemv: bool = True, centered: bool = False) -> DecodeRun:
    """Fill a fresh cache of `batch` slots to `context` tokens, then time `steps` graph-replayed steps
    (compile_small_ops: the static steps' norms, MLPs and rotary embedding compiled, the default;
    decode_gemv: the linear products of batches of 1 to 32 by the Triton kernels, the default; centered: the INT2
    cache as an `oscar` artifact runs it, `Settings.centered`)."""
    release_memory()  # the previous run's cache, now garbage
    _patch(model, name, compile_small_ops, decode_gemv, centered)
    warmup = 2
    total = context + warmup + steps + 1
    cache = slot_cache_for(model, batch, total)
    try:
        slots = [cache.open(total) for _ in range(batch)]
        fill(cache, slots, context)
        vocab = model.config.vocab_size
        first = torch.randint(0, vocab, (batch,), device="cuda")
        decoder = StaticDecoder(model, cache, graphs=True, warmup_steps=warmup)
        decoder.decode(slots, first, warmup + steps)
        replays, seconds = decoder.replay_timing
        step_ms = 1e3 * seconds / replays
        kv_bytes = kv_bytes_read(cache, batch, context + warmup + steps // 2)
        roofline_ms = (weights + kv_bytes) / (bandwidth_gbs * 1e9) * 1e3
        allocated = cache.usage().bytes_total
    finally:
        del cache
        release_memory()
    return DecodeRun(name, batch, context, replays, step_ms, batch / step_ms * 1e3, kv_bytes, weights, roofline_ms,
                     roofline_ms / step_ms, allocated)


def prefill_run(model, name: str, tokens: int, repeats: int = 2, centered: bool = False) -> PrefillRun:
    """Time a real forward over a `tokens`-token prompt into an empty cache (best of `repeats`, after one warm-up)."""
    release_memory()
    _patch(model, name, centered=centered)
    cache = slot_cache_for(model, 1, tokens + 1)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device="cuda")
    best = float("inf")
    try:
        for i in range(repeats + 1):
            slot = cache.open(tokens + 1)
            torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.inference_mode():
                forward_slots(model, cache, [slot], ids)
            torch.cuda.synchronize()
            if i:
                best = min(best, time.perf_counter() - started)
            cache.close(slot)
    finally:
        del cache
        release_memory()
    return PrefillRun(name, tokens, best * 1e3, tokens / best)


def bits_per_element(model, context: int, centered: bool = False) -> dict:
    """Bits per stored K/V element of one INT2 slot holding `context` tokens, from the allocator; also without the
    tables the cache holds once for all its sequences (`shared_bytes`: the key shifts of a centered artifact)."""
    release_memory()
    _patch(model, "int2", centered=centered)
    state = model.oscar
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    pages = PagedSlotCache.pages_for_budget(state, 1, context, None)
    cache = PagedSlotCache(state, 1, pages, context, torch.device("cuda"))
    allocated = torch.cuda.memory_allocated() - before
    # key_centering "rope": each layer's key-shift table, [blocks of the cache's positions, Hkv, D], one for the
    # whole cache however many sequences it holds
    shared = sum(layer.key_shifts.nbytes for layer in cache.storage.layers if layer.key_shifts is not None)
    elements = context * len(state.specs) * state.kv_heads * state.head_dim * 2
    del cache
    release_memory()
    return {"context": context, "allocated_bytes": allocated, "elements": elements,
            "bits_per_element": 8 * allocated / elements, "group_size": state.quant.group_size,
            "shared_bytes": shared, "bits_per_element_unshared": 8 * (allocated - shared) / elements}


def release_memory() -> None:
    """Give a deleted cache's memory back: its layers and the cache refer to each other (a cycle)."""
    gc.collect()
    torch.cuda.empty_cache()


def largest_batch(model, name: str, context: int, margin_gib: float) -> int:
    """Sequences of `context` tokens whose cache fits in the free GPU memory less a margin (capped)."""
    release_memory()
    free = torch.cuda.mem_get_info()[0] - int(margin_gib * 2**30)
    per_sequence = kv_bytes_per_sequence(model, context)[name]
    return max(0, min(BATCH_CAP, free // per_sequence))


FROM_JSON_HINT = "A result saved there with --save shows here with `oscarkv bench decode --from-json FILE`."


def run(settings: Settings, progress=None) -> dict:
    """All measurements for one model; `progress(message)` is told what runs next."""
    from ..models import load_model

    require_cuda("bench decode", FROM_JSON_HINT)
    say = progress or (lambda message: None)
    model, _ = load_model(settings.model, device="cuda", dtype=torch.bfloat16)
    limit = getattr(model.config, "max_position_embeddings", None) or max(settings.contexts)
    bandwidth = copy_bandwidth_gbs(torch.device("cuda"))
    weights = weight_bytes(model)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": settings.model,
              "copy_bandwidth_gbs": bandwidth, "weight_bytes": weights, "settings": asdict(settings),
              "single": [], "equal_memory": [], "largest": [], "skipped": []}

    def pair(batches: dict[str, int], context: int) -> dict:
        runs = {}
        for name, batch in batches.items():
            say(f"{name} batch {batch} x {context} tokens")
            try:
                runs[name] = asdict(decode_run(model, name, batch, context, settings.steps, weights, bandwidth,
                                               settings.compile_small_ops, settings.decode_gemv,
                                               settings.centered)) if batch else None
            except torch.OutOfMemoryError as exc:  # recorded, and the other runs go on
                release_memory()
                runs[name] = None
                result["skipped"].append(f"{name} batch {batch} x {context}: out of GPU memory ({exc})"[:300])
        if all(runs.values()):
            runs["throughput_ratio"] = runs["int2"]["tokens_per_s"] / runs["bf16"]["tokens_per_s"]
            runs["step_speedup"] = runs["bf16"]["step_ms"] / runs["int2"]["step_ms"]
        return runs

    for context in settings.contexts:
        if context + settings.steps + 3 > limit:
            result["skipped"].append(f"batch 1 x {context}: longer than the model's {limit} positions")
            continue
        result["single"].append({"context": context, **pair({"bf16": 1, "int2": 1}, context)})
    for context in settings.batch_contexts:
        if context + settings.steps + 3 > limit:
            result["skipped"].append(f"batch x {context}: longer than the model's {limit} positions")
            continue
        per_seq = kv_bytes_per_sequence(model, context + settings.steps + 3)
        budget = settings.batch * per_seq["int2"]
        bf16_batch = budget // per_seq["bf16"]
        entry = pair({"int2": settings.batch, "bf16": bf16_batch}, context)
        result["equal_memory"].append({"context": context, "kv_budget_bytes": budget, **entry})
        if settings.largest_batch:
            fits = {name: largest_batch(model, name, context + settings.steps + 3, settings.memory_margin_gib)
                    for name in ("int2", "bf16")}
            result["largest"].append({"context": context, **pair(fits, context)})
    if settings.prefill_tokens and settings.prefill_tokens < limit:
        say(f"prefill of {settings.prefill_tokens} tokens")
        result["prefill"] = {name: asdict(prefill_run(model, name, settings.prefill_tokens,
                                                      centered=settings.centered)) for name in METHODS}
        result["prefill"]["ratio"] = result["prefill"]["int2"]["ms"] / result["prefill"]["bf16"]["ms"]
    say("bits per element")
    result["bits"] = bits_per_element(model, min(settings.bits_context, limit), settings.centered)
    per_sequence = kv_bytes_per_sequence(model, result["bits"]["context"])
    result["kv_bytes_per_token"] = {name: b / result["bits"]["context"] for name, b in per_sequence.items()}
    return result
