"""Static-shape greedy decoding over a slot cache, replayed from one CUDA graph.

A decode step of a fixed batch has the same shapes every time: one token per sequence.
What changes is data: the token ids, the positions, and each sequence's stored length.
`StaticDecoder` keeps all three in device buffers that the step itself advances, so the
whole step (embedding, every layer's write and attention, the LM head, the argmax, the
bookkeeping) is one CUDA graph, replayed with no host work and no host sync per token.

The caches make that possible with `freeze(steps)`: before the steps, the paged INT2 cache
reserves the pages they need and fixes one `StepBatch` whose device lengths
`advance_on_device` increments; the dense BF16 cache needs no pages, and its decode
attention (`attend_dense`) reads lengths from the device too. The BF16 baseline therefore
runs through exactly the same path as the INT2 cache: only the cache differs.

`generate_static` is greedy `generate` on top of it: prefill (eager: one forward over the
prompt, with the model's RMSNorms as oscarkv's Triton kernel where `compile_small_ops` asks for it and the prompt
is long), then the static decode. A patched model's `generate` routes to it on CUDA when
the call is plain greedy decoding (`static_generate_arguments` says when); everything else
goes to transformers' own loop.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

import torch
from transformers import GenerationConfig

from ..cache.mixed import left_padding
from ..errors import OscarError
from ..sampling import Sampling, repetition_penalized
from ..transfer import to_device
from .decode_attention import fused_decode_attention
from .fused_ops import compiled_small_ops
from .gemv import gemv_linears
from .norms import triton_norms
from .paged import paged_layouts
from .slots import DenseSlotCache, PagedSlotCache
from .transformers import cache_keyword

SlotCache = PagedSlotCache | DenseSlotCache

# Forwards of at least this many tokens (batch x length) run the model's RMSNorms as the Triton kernel
# (`forward_slots`). H200, random Qwen3-4B, whole prompts, eager norms -> Triton norms (docs/decode-log.md, "Prompts:
# the norms in one launch"): 8,192 tokens in one forward 1.21-1.22x faster, 32,768 1.12x, with either cache; 8,192 in
# chunks of 2048 1.12-1.13x faster on one machine and 0.91x (BF16) / 1.00x (INT2) on another, whose slower host paid
# more for the Triton launches than the GPU saved.
PROMPT_NORM_TOKENS = 4096

# Settings of a GenerationConfig that change what greedy decoding picks; generate() keeps
# transformers' loop when any of them differs from the default.
_GREEDY_CHANGERS = ("num_beams", "no_repeat_ngram_size", "bad_words_ids",
                    "min_length", "min_new_tokens", "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens",
                    "begin_suppress_tokens", "sequence_bias", "stop_strings",
                    "exponential_decay_length_penalty", "encoder_repetition_penalty", "guidance_scale",
                    "output_scores", "output_logits", "return_dict_in_generate", "output_attentions",
                    "output_hidden_states", "max_time", "renormalize_logits", "watermarking_config",
                    "prompt_lookup_num_tokens", "assistant_early_exit", "low_memory", "diversity_penalty")
# Keyword arguments of generate() that the static path handles itself.
_STATIC_KWARGS = {"input_ids", "attention_mask", "max_new_tokens", "do_sample", "eos_token_id", "pad_token_id",
                  "use_cache", "temperature", "top_k", "top_p", "num_return_sequences", "repetition_penalty"}
# Sampling settings the static path does not apply (it takes temperature, top_k and top_p): with any of them
# set, generate(do_sample=True) keeps transformers' loop.
_SAMPLING_CHANGERS = {"min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}
_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # transformers' own, where nothing sets them


def _cuda_step_option(model, name: str) -> bool:
    """CacheConfig.<name> of a patched model on CUDA; False elsewhere (the static steps' own operations)."""
    state = getattr(model, "oscar", None)
    device = next(model.parameters()).device
    return device.type == "cuda" and state is not None and getattr(state.cache, name)


def compiles_small_ops(model) -> bool:
    """Whether the static steps of this model run its small operations compiled (CUDA only)."""
    return _cuda_step_option(model, "compile_small_ops")


def uses_gemv(model) -> bool:
    """Whether the static steps of this model send their linear products (batch 1 to 32) to the Triton kernels
    (CUDA only)."""
    return _cuda_step_option(model, "decode_gemv")


@contextmanager
def fast_step_ops(model, enabled: bool = True) -> Iterator[None]:
    """The static steps' own operations: compiled small ops (`fused_ops`) with the Triton RMSNorm (`norms`) and
    the attention's queries and keys prepared in one launch (`decode_attention`), and the linear products of
    batches of 1 to 32 rows (`gemv`), each where the model's CacheConfig asks for it."""
    small_ops = enabled and compiles_small_ops(model)
    # inside the compiled ops: rows the kernels do not take keep the compiled norms and MLPs
    with compiled_small_ops(model, small_ops), triton_norms(model, small_ops), \
            fused_decode_attention(model, small_ops), gemv_linears(model, enabled and uses_gemv(model)):
        yield


def forward_slots(model, cache: SlotCache, slots: list[int], input_ids: torch.Tensor,
                  every_position: bool = False) -> torch.Tensor:
    """Append input_ids [B, n] (row i to slots[i]) through the model; last-position logits [B, V] (float32), or
    with every_position the logits of every position [B, n, V]. Where the model's CacheConfig compiles the small
    operations (CUDA) and the forward reads at least PROMPT_NORM_TOKENS tokens, its known RMSNorms and residual adds
    run as the Triton norm kernel (`triton_norms`, "Prompts"); the rest of the forward is eager."""
    n = input_ids.shape[1]
    starts = to_device([cache.length(s) for s in slots], torch.long, input_ids.device)
    positions = starts[:, None] + torch.arange(n, device=input_ids.device)[None]
    cache.set_batch(slots)
    with triton_norms(model, compiles_small_ops(model) and input_ids.numel() >= PROMPT_NORM_TOKENS):
        out = model(input_ids=input_ids, position_ids=positions, **{cache_keyword(model): cache}, use_cache=True,
                    logits_to_keep=0 if every_position else 1)
    cache.advance(n)
    return out.logits.float() if every_position else out.logits[:, -1].float()


class StaticDecoder:
    """Greedy decoding of a fixed batch of slots: eager warm-up steps, then one captured CUDA graph.

    graphs: capture and replay (default: on CUDA). Without it every step runs eagerly through the
    same static buffers, which is what the CPU tests check against the step-by-step path.
    """

    def __init__(self, model, cache: SlotCache, graphs: bool | None = None, warmup_steps: int = 2,
                 sampling: Sampling | None = None, repetition_penalty: float = 1.0) -> None:
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise OscarError(f"CUDA graphs need a CUDA model; this one is on {self.device} (use graphs=False).")
        self.warmup_steps = max(1, warmup_steps)
        self.pick = next_tokens(sampling)
        self.repetition_penalty = repetition_penalty
        self.replay_timing: tuple[int, float] | None = None  # (steps, seconds) of the last graph replays

    @torch.inference_mode()
    def decode(self, slots: list[int], last_tokens: torch.Tensor, steps: int,
               seen: torch.Tensor | None = None) -> torch.Tensor:
        """Feed last_tokens [B] (chosen, not yet in the cache) to `slots` and decode `steps` tokens
        greedily. Returns [B, steps]: column 0 is the prediction after last_tokens. seen [B, V] (bool):
        the tokens each row has so far, last_tokens included, where a repetition penalty applies."""
        b = len(slots)
        if last_tokens.shape != (b,):
            raise OscarError(f"last_tokens must be [{b}] (one per slot), got {tuple(last_tokens.shape)}.")
        if (seen is None) != (self.repetition_penalty == 1.0):
            raise OscarError("a repetition penalty needs the tokens each row has seen, and only it uses them.")
        buffers = _StepBuffers.create(self.cache, slots, last_tokens.to(self.device), steps, seen)
        if steps == 0:
            return buffers.tokens
        self.cache.set_batch(slots)
        self.cache.freeze(steps)
        done = 0
        try:
            with fast_step_ops(self.model):
                eager = steps if not self.graphs else min(steps, self.warmup_steps)
                for _ in range(eager):
                    self._step(buffers)
                    done += 1
                if done < steps:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        self._step(buffers)  # recorded, not run: the buffers stay as the eager steps left them
            if done < steps:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                replays = steps - done
                start.record()
                for _ in range(replays):
                    graph.replay()
                    done += 1
                end.record()
                end.synchronize()
                self.replay_timing = (replays, start.elapsed_time(end) / 1e3)
        finally:
            self.cache.thaw(done)
        return buffers.tokens

    def _step(self, buf: _StepBuffers) -> None:
        logits = self.model(input_ids=buf.ids, position_ids=buf.positions, **{cache_keyword(self.model): self.cache},
                            use_cache=True, logits_to_keep=1).logits
        scores = logits[:, -1]
        if buf.seen is not None:
            scores = repetition_penalized(scores, buf.seen, self.repetition_penalty)
        chosen = self.pick(scores)
        if buf.seen is not None:
            buf.seen.scatter_(1, chosen, True)
        buf.tokens.index_copy_(1, buf.counter, chosen)
        buf.ids.copy_(chosen)
        buf.positions.add_(1)
        buf.counter.add_(1)
        self.cache.advance_on_device()


class DecodeGraphs:
    """One captured decode forward per batch size, for a server whose batch changes every step.

    Before each step the host reserves the pages the step needs and writes its slots, stored
    lengths, token ids and positions into static device buffers; the graph of that batch size
    (captured at its first use) runs the forward and leaves the last-position logits in a static
    buffer. The first step of each batch size runs eagerly, which compiles its kernels (a
    compilation cannot happen inside a capture), and is then captured; the engine's `warm_up`
    does this for every batch size before serving. graphs=False runs every step eagerly through
    the same static buffers (the CPU tests check it against the plain forward).
    """

    def __init__(self, model, cache: SlotCache, max_batch: int, graphs: bool | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        as_int32 = dict(dtype=torch.int32, device=self.device)
        self.slots = torch.zeros(max_batch, **as_int32)
        self.lengths = torch.zeros(max_batch, **as_int32)
        self.cu_new = torch.arange(max_batch + 1, **as_int32)
        self.ids = torch.zeros(max_batch, 1, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(max_batch, 1, dtype=torch.long, device=self.device)
        self._captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # One memory pool for all batch sizes: their graphs never run at the same time, and each
        # graph's output is copied out right after its replay.
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None

    @torch.inference_mode()
    def logits(self, slots: list[int], last_tokens: list[int]) -> torch.Tensor:
        """Append last_tokens[i] to slots[i] (one token each); last-position logits [B, V] float32."""
        b = len(slots)
        if not 0 < b <= self.slots.shape[0] or len(last_tokens) != b:
            raise OscarError(f"a static decode step takes 1..{self.slots.shape[0]} slots with one token each; "
                             f"got {b} slots and {len(last_tokens)} tokens.")
        self.cache.reserve_ahead(slots, 1)
        lengths = [self.cache.length(s) for s in slots]
        step = to_device([slots, lengths, last_tokens], torch.long, self.device)  # one copy, no synchronisation
        self.slots[:b].copy_(step[0])
        self.lengths[:b].copy_(step[1])
        self.positions[:b, 0].copy_(step[1])  # the new token's position is the stored length
        self.ids[:b, 0].copy_(step[2])
        if b in self._captured:
            graph, out = self._captured[b]
            graph.replay()
            result = out.float()
        else:  # the first step of a batch size runs eagerly (compiling its kernels), then is captured
            result = self._forward(b).float()
            if self.graphs:
                self._captured[b] = self._capture(b)
        self.cache.advance_slots(slots, 1)
        return result

    def _forward(self, b: int) -> torch.Tensor:
        self.cache.bind_step(self.slots[:b], self.lengths[:b], self.cu_new[:b + 1])
        try:
            with fast_step_ops(self.model, self.graphs):
                return self.model(input_ids=self.ids[:b], position_ids=self.positions[:b],
                                  **{cache_keyword(self.model): self.cache},
                                  use_cache=True, logits_to_keep=1).logits[:, -1]
        finally:
            self.cache.unbind_step()

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(b)  # recorded, not run
        return graph, out


@dataclass
class _StepBuffers:
    """The device tensors a static step reads and advances."""

    ids: torch.Tensor  # [B, 1] the token each sequence appends this step
    positions: torch.Tensor  # [B, 1] its position
    tokens: torch.Tensor  # [B, steps] the chosen tokens
    counter: torch.Tensor  # [1] steps done
    seen: torch.Tensor | None = None  # [B, V] bool: the tokens of each row so far (repetition penalty)

    @classmethod
    def create(cls, cache: SlotCache, slots: list[int], last_tokens: torch.Tensor, steps: int,
               seen: torch.Tensor | None = None) -> _StepBuffers:
        device = last_tokens.device
        positions = torch.tensor([[cache.length(s)] for s in slots], dtype=torch.long, device=device)
        return cls(last_tokens.long().reshape(-1, 1).clone(), positions,
                   torch.zeros(len(slots), steps, dtype=torch.long, device=device),
                   torch.zeros(1, dtype=torch.long, device=device), None if seen is None else seen.clone())


def slot_cache_for(model, batch: int, max_context: int, backend: str = "auto", copies: int = 1,
                   shared_tokens: int = 0) -> SlotCache:
    """The slot cache of a patched model's method: paged INT2/INT4, or dense BF16 for `bf16`. Pages for `batch`
    sequences of max_context tokens, in groups of `copies` that share the history pages of their first
    `shared_tokens` (`generate_static`'s copies)."""
    state = model.oscar
    device = next(model.parameters()).device
    if not state.cache.quantize_history:
        if state.cache.history_dtype not in (None, state.cache.window_dtype):
            raise OscarError("the static decode path has no FP8 cache; use model.generate with "
                             "CacheConfig(static_decode=False).")
        return DenseSlotCache(len(state.specs), batch, max_context, state.cache.window_dtype, state.kv_heads,
                              state.head_dim, device, backend)
    replace(state, cache=replace(state.cache, kernel="paged")).uses_paged(device)  # raises, naming the reason,
    # where the paged cache cannot take the model
    pages = PagedSlotCache.pages_for_budget(state, batch, max_context, None)
    layout = paged_layouts(state.specs, state.cache, state.kv_heads, state.head_dim)[0]
    pages -= (batch - batch // copies) * layout.pages_needed(shared_tokens)
    return PagedSlotCache(state, batch, pages, max_context, device, backend)


@torch.inference_mode()
def next_tokens(sampling: Sampling | None):
    """logits [B, V] -> tokens [B, 1]: greedy (None), or drawn by `sampling` (on the device, no synchronisation)."""
    return (lambda logits: logits.argmax(dim=-1, keepdim=True)) if sampling is None else sampling.choose


def generate_static(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None,
                    pad_token_id: int | None = None, graphs: bool | None = None,
                    max_context: int | None = None, backend: str = "auto",
                    attention_mask: torch.Tensor | None = None, sampling: Sampling | None = None,
                    repetition_penalty: float = 1.0, copies: int = 1) -> torch.Tensor:
    """Greedy generation through the static decode path (or sampled, with `sampling`); returns
    [B, prompt + new] like `generate`. repetition_penalty: transformers' (over input_ids, padding
    included as transformers does, and the new tokens), applied before sampling.

    Rows stop at an EOS token (later positions become pad_token_id) and generation ends when every
    row has stopped, as transformers' greedy search does. max_context: the cache's length
    (default: prompt + max_new_tokens). backend: the cache's kernels ("auto": Triton on CUDA).
    attention_mask [B, prompt]: left padding only; each padded row's prompt is read without its padding
    (one forward per row), and the rows then decode together from their own lengths.
    copies: transformers' num_return_sequences; the output has `copies` rows per prompt, in order. Each prompt
    is read once, and its copies take its cache (`fork`: the INT2 history pages shared, the windows copied).
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise OscarError(f"input_ids must be [batch, prompt tokens] with a non-empty prompt, got "
                         f"{tuple(input_ids.shape)}.")
    if max_new_tokens < 1:
        raise OscarError(f"max_new_tokens={max_new_tokens} must be >= 1.")
    if copies < 1:
        raise OscarError(f"copies={copies} must be >= 1.")
    b, n = input_ids.shape
    context = max_context or n + max_new_tokens
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and n + max_new_tokens > limit:
        raise OscarError(f"prompt ({n}) + max_new_tokens ({max_new_tokens}) exceeds the model's {limit} positions; "
                         "shorten the prompt or ask for fewer tokens.")
    if attention_mask is not None and tuple(attention_mask.shape) != (b, n):
        raise OscarError(f"attention_mask must be [{b}, {n}] like input_ids, got {tuple(attention_mask.shape)}.")
    pad = [0] * b if attention_mask is None else left_padding(attention_mask).tolist()
    if max(pad) >= n:
        raise OscarError("a row of the batch is all padding; give every row at least one token.")
    cache = slot_cache_for(model, b * copies, context, backend, copies, n - max(pad))
    groups = [cache.open_group([n - p + max_new_tokens] * copies, n - p) for p in pad]
    readers = [group[0] for group in groups]
    if any(pad):
        logits = torch.cat([forward_slots(model, cache, [slot], input_ids[i:i + 1, p:])
                            for i, (slot, p) in enumerate(zip(readers, pad))])
    else:
        logits = forward_slots(model, cache, readers, input_ids)
    for reader, *others in groups:
        for slot in others:
            cache.fork(reader, slot)
    slots = [slot for group in groups for slot in group]
    if copies > 1:
        input_ids, logits = input_ids.repeat_interleave(copies, dim=0), logits.repeat_interleave(copies, dim=0)
    seen = None
    if repetition_penalty != 1.0:
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(
            1, input_ids.to(logits.device), True)
        logits = repetition_penalized(logits, seen, repetition_penalty)
    first = next_tokens(sampling)(logits)[:, 0]
    if seen is not None:
        seen.scatter_(1, first[:, None], True)
    rest = StaticDecoder(model, cache, graphs, sampling=sampling, repetition_penalty=repetition_penalty).decode(
        slots, first, max_new_tokens - 1, seen)
    new = torch.cat([first[:, None], rest], dim=1)
    return torch.cat([input_ids, stop_at_eos(new, eos_token_id, pad_token_id)], dim=1)


def stop_at_eos(new: torch.Tensor, eos_token_id, pad_token_id: int | None) -> torch.Tensor:
    """Greedy search's stopping on the tokens of a run that did not stop: positions after a row's
    first EOS become pad, and the columns after the last row's EOS are dropped."""
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not eos:
        return new
    is_eos = torch.isin(new, torch.tensor(eos, device=new.device))
    seen = is_eos.long().cumsum(dim=1)
    after = (seen - is_eos.long()) > 0  # strictly after the first EOS
    pad = eos[0] if pad_token_id is None else pad_token_id
    new = new.masked_fill(after, pad)
    stopped = seen > 0
    if bool(stopped[:, -1].all()):
        new = new[:, :int(stopped.all(dim=0).long().argmax()) + 1]
    return new


def _setting(name: str, config: GenerationConfig, kwargs: dict, default):
    """A generation setting: the call's, else the model's generation config, else transformers' default."""
    return next(value for value in (kwargs.get(name), getattr(config, name, None), default) if value is not None)


def _sampling(config: GenerationConfig, kwargs: dict) -> Sampling | None:
    """The `Sampling` of a generate(do_sample=True) call, or None where it sets what the static path does not
    apply (or values transformers refuses: its loop then says so)."""
    if any(getattr(config, name, None) not in (None, default) for name, default in _SAMPLING_CHANGERS.items()):
        return None
    settings = {name: _setting(name, config, kwargs, default) for name, default in _SAMPLING_DEFAULTS.items()}
    try:
        return Sampling(float(settings["temperature"]), int(settings["top_k"]), float(settings["top_p"]))
    except (OscarError, TypeError, ValueError):
        return None


def static_generate_arguments(model, args: tuple, kwargs: dict) -> dict | None:
    """The arguments of `generate_static` for a generate() call it can serve exactly, else None.

    It serves plain greedy decoding, or sampling with temperature, top_k and top_p only, of a batch (unpadded or
    left-padded) on CUDA with a cache the static path has
    (paged INT2/INT4, or BF16), when CacheConfig.static_decode is on."""
    state = getattr(model, "oscar", None)
    device = next(model.parameters()).device
    if state is None or not state.cache.static_decode or device.type != "cuda":
        return None
    if len(args) > 1 or set(kwargs) - _STATIC_KWARGS or kwargs.get("use_cache") is False:
        return None
    input_ids = args[0] if args else kwargs.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None:
        try:
            left_padding(mask)
        except OscarError:  # transformers' loop then, whose cache names the problem
            return None
    config = model.generation_config
    default = GenerationConfig()
    for name in _GREEDY_CHANGERS:
        value = getattr(config, name, None)
        if value not in (None, False, getattr(default, name, None)):
            return None
    sampling = None
    if kwargs.get("do_sample", config.do_sample):
        sampling = _sampling(config, kwargs)
        if sampling is None:
            return None
    penalty = _setting("repetition_penalty", config, kwargs, 1.0)
    if not penalty > 0:  # transformers' loop refuses it, with its message
        return None
    copies = _setting("num_return_sequences", config, kwargs, 1)
    if copies > 1 and sampling is None:  # transformers' loop refuses it for greedy search, with its message
        return None
    max_new = kwargs.get("max_new_tokens", config.max_new_tokens)
    if max_new is None:
        return None
    history = state.cache
    if history.kernel == "reference" or history.history_dtype not in (None, history.window_dtype):
        return None
    if history.quantize_history:
        try:
            if not state.uses_paged(device):
                return None
        except OscarError:
            return None
    return dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=int(max_new), sampling=sampling,
                repetition_penalty=float(penalty), copies=int(copies),
                eos_token_id=kwargs.get("eos_token_id", config.eos_token_id),
                pad_token_id=kwargs.get("pad_token_id", config.pad_token_id))
