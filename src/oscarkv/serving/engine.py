"""Continuous batching over a slot cache: the scheduler behind `oscarkv serve`.

One thread owns the model and the cache and runs steps. Each step:
1. closes the slots of finished and cancelled requests;
2. admits waiting requests, oldest first, while a slot is free and the cache can promise
   the request's prompt plus max_tokens (so no running request ever meets a full cache);
3. runs one prefill chunk (at most `Engine.prefill_chunk` prompt tokens of the oldest request
   still reading its prompt), so a long prompt never stalls the streams already running; while no
   request is decoding, nothing waits on the chunk, and it may be longer (`Engine.solo_prefill_chunk`);
4. runs one decode step for every request that has read its prompt, as one batch.

Requests arrive from any thread through `submit`; what happens to them comes back through
the `emit` callback each one carries (a token's text, the end, or an error).

transformers' own continuous batching (`generate_batch` and `transformers serve`) was
checked first: it owns its cache (`PagedAttentionCache`, BF16 pages in a flat layout) and
its attention entry points, so an INT2 cache would mean replacing its internals, which
change from one transformers release to the next. This scheduler instead drives the
patched model through the public forward and the Cache interface that the rest of
oscarkv already uses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ..errors import OscarError
from ..integrations.slots import group_units
from ..integrations.static_decode import DecodeGraphs, forward_slots
from ..sampling import logit_adjustments, repetition_penalized, sample_tokens
from ..transfer import to_device

log = logging.getLogger("oscarkv.serving")


class RequestRejected(OscarError):
    """A request the server will not run; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class SamplingParams:
    """max_tokens: tokens to generate at most; temperature 0 is greedy; top_p in (0, 1];
    ignore_eos: run to max_tokens (for benchmarks); logprobs: None, or report each generated token's
    log-probability and those of the `logprobs` most likely tokens at its position (`TokenLogprob`);
    presence_penalty, frequency_penalty, logit_bias ((token, bias) pairs): OpenAI's, added to the logits
    before the token is chosen (the penalties count the tokens generated so far; logprobs stay the model's);
    prompt_logprobs: None, or the prompt tokens' log-probabilities too (every position's logits in prefill),
    with that many alternatives. max_tokens may be 0 then: the request ends once its prompt is read.
    repetition_penalty: transformers' and vLLM's, over the prompt and the generated tokens (a logit divided by
    it where positive, multiplied where negative), before the penalties and logit_bias.
    vLLM's extensions: top_k (0: all tokens) and min_p (0: none dropped) filter sampled tokens
    (`sampling.sample_tokens`); stop_token_ids end the sequence as EOS does (their text is not sent, and
    ignore_eos does not apply to them); min_tokens: no EOS (unless ignore_eos) nor stop token is chosen before
    that many tokens."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass(frozen=True)
class EngineConfig:
    """max_seqs: sequences decoded together; max_context: prompt + output tokens per request;
    prefill_chunk: prompt tokens per prefill forward (None: CUDA_PREFILL_CHUNK on CUDA, CPU_PREFILL_CHUNK
    elsewhere; a request that asks for prompt_logprobs reads at most PROMPT_LOGPROBS_CHUNK); solo_prefill_chunk:
    the same while no request is decoding (None: SOLO_PREFILL_FACTOR times prefill_chunk on CUDA, prefill_chunk
    elsewhere; never fewer than prefill_chunk); max_waiting: queued requests before
    new ones get HTTP 503; cuda_graphs: on CUDA, replay each decode step from a CUDA graph
    captured per batch size (`DecodeGraphs`); prefix_reuse: keep each finished sequence's cache in its
    slot until the slot or its pages are needed (oldest first), and let a request whose prompt begins with one of
    them go on in that slot (`Retained`: the next turn of a conversation reads only its new tokens); and where a
    new prompt starts with at least shared_prefix_min tokens that a running or retained sequence also starts
    with (a common system prompt), keep a copy of its cache at the end of that start, which later prompts
    with the same start take (`fork`) instead of reading it."""

    max_seqs: int = 32
    max_context: int = 4096
    prefill_chunk: int | None = None
    solo_prefill_chunk: int | None = None
    max_waiting: int = 256
    cuda_graphs: bool = True
    prefix_reuse: bool = True
    shared_prefix_min: int = 256

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_context", "prefill_chunk", "solo_prefill_chunk", "max_waiting",
                     "shared_prefix_min"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise OscarError(f"{name}={getattr(self, name)} must be >= 1.")



# Prompt tokens per prefill forward by default. On a GPU an eager forward of a few hundred tokens costs the host more
# than the GPU: one H200, random Qwen3-4B, one 8,192-token prompt took 615-988 ms (BF16) and 949-1542 ms (INT2) in
# chunks of 512 against 231-239 and 344-389 ms in chunks of 2048, and a forward of 2048 tokens took 0.9-1.6x as long
# as one of 512 (docs/decode-log.md, "Chunked prompts"), so the other requests' decode steps also wait less in all. On
# the CPU a forward's time grows with its tokens, and smaller chunks keep the others' steps short.
CUDA_PREFILL_CHUNK = 2048
CPU_PREFILL_CHUNK = 512
# While no request is decoding, no stream waits on a prefill forward, and on CUDA a prompt reads this many times
# prefill_chunk tokens a forward (8192 by default): fewer forwards, so less of the host's per-forward cost. One H200,
# random Qwen3-4B, a prompt alone in `serve`'s engine, first token after 235 -> 190 ms (BF16) and 241 -> 187 ms (INT2)
# at 8,192 tokens, 581 -> 526 and 598 -> 530 ms at 16,384 (scripts/probe_serve_prefill.py; docs/serving.md, "Prompts
# read alone"). The forward's memory grows with it: at its peak 620-1292 MiB beyond the memory before the prompt,
# against 171-299 MiB at 2048 tokens, in those runs. The warm-up runs such a forward, so a GPU without that room
# fails at start-up, not mid-request.
SOLO_PREFILL_FACTOR = 4
# A request with prompt_logprobs keeps the logits of every position of a chunk (chunk x vocabulary floats, 1.2 GB
# for 2048 tokens of a 152K vocabulary): its chunks stay at most this long.
PROMPT_LOGPROBS_CHUNK = 512
# Warm-up chunks: multiples of this (a page edge, and integer arguments divisible by 16 as a real prompt's are).
WARM_UP_ALIGN = 64

# The short last chunk of a warm-up prompt: more than 16 query rows per KV head at any GQA ratio (the fused
# kernel's 32-row blocks) and fewer new tokens than `kernels.extend.EXTEND_MIN_TOKENS` (not dequantized).
EXTEND_TAIL_TOKENS = 17

@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id, its text (decoded after the tokens before it), its log-probability
    under the model (log-softmax of the logits, before temperature and top_p, as OpenAI and vLLM report),
    and the `SamplingParams.logprobs` most likely (id, text, log-probability) at its position."""

    token: int
    text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass
class Event:
    """kind: "token" (text is the new text, maybe empty), "done" (finish_reason "stop" or "length"),
    or "error" (text is the message). logprobs: the generated tokens since the last event, where the
    request asked for them (`SamplingParams.logprobs`)."""

    kind: str
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the first event of a request that asked for them


@dataclass
class Sequence:
    """One request inside the engine."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    arrived: float = field(default_factory=time.monotonic)
    slot: int = -1
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    text: str = ""  # the text of `generated` up to read_offset (decoded incrementally)
    prefix_offset: int = 0  # tokens [prefix_offset, read_offset) give the context of the next decode
    read_offset: int = 0
    text_sent: int = 0
    cancelled: bool = False
    finished: bool = False
    failed: bool = False
    prompt_logprobs_sent: bool = False
    seen_marked: bool = False  # repetition_penalty: its slot's row of `Engine._seen` holds its prompt and tokens
    snapshot_at: int = 0  # a prompt start that others share: a chunk ends there and its cache is copied (`_snapshot`)
    prompt_started: bool = False  # its first prefill chunk has run (`Engine._start_prompt` before it)
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # generated since the last event
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # None for the first prompt token
    counts: dict[int, int] = field(default_factory=dict)  # how often each token was generated (penalties)
    # Choices of one prompt (`Engine.submit_choices`): the first reads the prompt; the others wait, as its
    # followers, and take its cache by `fork` once it is read.
    followers: list[Sequence] = field(default_factory=list)
    leader: Sequence | None = None

    @property
    def tokens_needed(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def reading_prompt(self) -> bool:
        return self.prefilled < len(self.prompt_ids)


@dataclass
class Retained:
    """A finished sequence's cache, or a copy of a prompt's common start, kept in its slot for reuse: `tokens`
    are the ones it holds, in order."""

    slot: int
    tokens: list[int]
    kept: float = field(default_factory=time.monotonic)
    shared: bool = False  # a common prompt start (`_snapshot`): requests fork it, and it stays


@dataclass
class EngineCounters:
    """Totals since start, for /metrics."""

    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens taken from a retained sequence's cache instead of read
    prefix_hits: int = 0
    generated_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0


class Engine:
    """Continuous batching of a patched model over a slot cache (see the module docstring)."""

    def __init__(self, model, tokenizer, cache, config: EngineConfig) -> None:
        self.model, self.tokenizer, self.cache, self.config = model, tokenizer, cache, config
        self.device = next(model.parameters()).device
        self.eos_ids = _eos_ids(model, tokenizer)
        self.counters = EngineCounters()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self.retained: list[Retained] = []  # engine thread only
        self._seen: torch.Tensor | None = None  # [slots, vocabulary] bool, the tokens each slot's sequence has seen
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_id = 0
        self.crashed: BaseException | None = None
        self.graphs = DecodeGraphs(model, cache, config.max_seqs) \
            if config.cuda_graphs and self.device.type == "cuda" else None
        self.prefill_chunk = config.prefill_chunk or (
            CUDA_PREFILL_CHUNK if self.device.type == "cuda" else CPU_PREFILL_CHUNK)  # prompt tokens per forward
        self.solo_prefill_chunk = max(self.prefill_chunk, config.solo_prefill_chunk or (  # ... while none decodes
            SOLO_PREFILL_FACTOR * self.prefill_chunk if self.device.type == "cuda" else self.prefill_chunk))

    # ---- from any thread -------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, emit: Callable[[Event], None]) -> Sequence:
        """Queue a request, or raise RequestRejected saying why it cannot run."""
        return self.submit_choices(prompt_ids, [(params, emit)])[0]

    def submit_choices(self, prompt_ids: list[int], choices: list[tuple[SamplingParams, Callable[[Event], None]]]
                       ) -> list[Sequence]:
        """Queue several sequences of one prompt (OpenAI's `n`), or raise RequestRejected for all of them. The
        prompt is read once per `max_seqs` of them (a group is admitted at once): when the group's first has
        read it, the others take its cache (`fork`: the INT2 history pages shared, the BF16 windows copied)
        and each draws its own tokens from there."""
        if not prompt_ids:
            raise RequestRejected("the prompt is empty.")
        limit = self.config.max_context
        longest = max(len(prompt_ids) + params.max_tokens for params, _ in choices)
        if longest > limit:
            self.counters.rejected += 1
            raise RequestRejected(
                f"the prompt has {len(prompt_ids)} tokens and max_tokens is {longest - len(prompt_ids)}: together "
                f"more than this server's context of {limit} tokens; shorten the prompt or lower max_tokens.",
                code="context_length_exceeded")
        size = self.config.max_seqs  # a group is admitted at once, so at most max_seqs choices read the prompt once
        units = group_units(self.cache.units_for, [len(prompt_ids) + p.max_tokens for p, _ in choices[:size]],
                            len(prompt_ids))
        if units > self.cache.capacity_units() > 0:
            self.counters.rejected += 1
            raise RequestRejected(
                f"the request needs {units} KV pages but the whole cache has {self.cache.capacity_units()}; "
                "lower max_tokens or the prompt, or start the server with a larger --kv-memory.",
                code="kv_cache_too_small")
        with self._lock:
            if self._waiting_count() >= self.config.max_waiting:
                self.counters.rejected += 1
                raise RequestRejected(f"{self._waiting_count()} requests are already waiting; retry later.",
                                      status=503, code="server_busy")
            seqs = []
            for params, emit in choices:
                seq = Sequence(self._next_id, list(prompt_ids), params, emit)
                self._next_id += 1
                if params.seed is not None and params.temperature > 0:
                    seq.generator = torch.Generator().manual_seed(params.seed)
                seqs.append(seq)
            for first in range(0, len(seqs), size):
                leader, *followers = seqs[first:first + size]
                leader.followers = followers
                for follower in followers:
                    follower.leader = leader
                self._waiting.append(leader)
        self._wake.set()
        return seqs

    def _waiting_count(self) -> int:
        return sum(1 + len(seq.followers) for seq in self._waiting)

    def cancel(self, seq: Sequence) -> None:
        """The client went away: free its slot at the next step; no more events are sent."""
        seq.cancelled = True
        self._wake.set()

    def load(self) -> dict[str, int]:
        with self._lock:
            return {"running": len(self._running), "waiting": self._waiting_count()}

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="oscarkv-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.crashed is None

    @torch.inference_mode()
    def warm_up(self, progress: Callable[[int, int], None] | None = None) -> bool:
        """Before serving: prefill chunks and one decode step at every batch size, on throw-away
        slots, so that the kernels compile now rather than stalling the first requests (Triton
        compiles one variant per split count, and the split count changes with the batch). The
        chunks are a prompt's first, a second over it and a short last one (the extend steps of
        longer prompts: the paged cache's dense-KV kernel and the fused kernel's 32-row blocks), the first two
        of `solo_prefill_chunk` tokens, the longest forward the engine runs (so its memory is taken now).
        Where max_context cannot hold them at that length, the first two are shortened to
        what fits (a multiple of WARM_UP_ALIGN), and only below WARM_UP_ALIGN tokens is a chunk left out.
        Returns False, doing nothing, if the cache cannot hold the throw-away sequences; raises OscarError, naming
        the settings to lower, where a prompt chunk does not fit the GPU's memory.
        progress(done, total) is called after each chunk and each batch size."""
        m = self.config.max_seqs
        steps = 2 if self.graphs else 1  # with graphs, each batch size also runs (and captures) a static step
        chunk = self.solo_prefill_chunk
        if 2 * chunk + EXTEND_TAIL_TOKENS + steps * m > self.config.max_context:
            fits = (self.config.max_context - EXTEND_TAIL_TOKENS - steps * m) // 2 // WARM_UP_ALIGN * WARM_UP_ALIGN
            chunk = fits if fits >= WARM_UP_ALIGN else chunk
        chunks = [chunk, chunk, EXTEND_TAIL_TOKENS]
        while sum(chunks) + steps * m > self.config.max_context and len(chunks) > 1:
            chunks.pop()
        need = [sum(chunks) + steps * m] + [steps * m] * (m - 1)
        pages = sum(self.cache.units_for(t) for t in need)
        if self._running or self._waiting or need[0] > self.config.max_context or (
                self.cache.capacity_units() and pages > self.cache.capacity_units()):
            return False
        slots = [self.cache.open(t) for t in need]
        told = progress or (lambda done, total: None)
        total = len(chunks) + m
        told(0, total)
        try:
            for i, n in enumerate(chunks):
                try:
                    self._forward(slots[:1], [[0] * n])
                except torch.OutOfMemoryError:
                    raise OscarError(
                        f"the warm-up's prompt forward of {n} tokens ran out of GPU memory beside the KV cache; "
                        f"pass a smaller --solo-prefill-chunk (now {self.solo_prefill_chunk}) or --prefill-chunk "
                        f"(now {self.prefill_chunk}), or a smaller --kv-memory.") from None
                told(i + 1, total)
            for b in range(1, m + 1):
                self._forward(slots[:b], [[0]] * b)
                if self.graphs:  # captured now, after the eager step compiled its kernels
                    self.graphs.logits(slots[:b], [0] * b)
                told(len(chunks) + b, total)
        finally:
            for slot in slots:
                self.cache.close(slot)
        return True

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.step():
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
        except BaseException as exc:  # the loop itself broke: fail everyone, say so on /health
            self.crashed = exc
            log.exception("the engine loop stopped")
            for seq in list(self._running) + list(self._waiting):
                self._fail(seq, f"the server's engine stopped: {exc}")
            raise

    @torch.inference_mode()
    def step(self) -> bool:
        """One scheduling step (see the module docstring). Returns False when there was nothing to do."""
        started = time.perf_counter()
        for seq in [s for s in self._running if s.cancelled or s.finished]:
            self._release(seq)
        self._admit()
        prefilling = [s for s in self._running if s.reading_prompt and s.leader is None]
        decoding = [s for s in self._running if not s.reading_prompt]
        if not prefilling and not decoding:
            return False
        if prefilling:
            limit = self.prefill_chunk if decoding else self.solo_prefill_chunk
            self._guarded([prefilling[0]], lambda seqs: self._prefill_chunk(seqs, limit))
        if decoding:
            self._guarded(decoding, self._decode)
        self.counters.steps += 1
        self.counters.step_seconds += time.perf_counter() - started
        return True

    def _admit(self) -> None:
        with self._lock:
            while self._waiting:
                seq = self._waiting[0]
                if seq.cancelled:
                    self._waiting.popleft()
                    self.counters.cancelled += 1
                    if (heir := self._promote(seq)) is not None:
                        self._waiting.appendleft(heir)
                    continue
                group = [seq] + seq.followers
                tokens = [s.tokens_needed for s in group]
                # The prompt's first tokens in a finished sequence's retained cache: the request goes on in its slot.
                source = self._retained_prefix(seq, shared=False)
                adopt = None if source is None else source.slot
                if not self.cache.can_open_group(tokens, len(seq.prompt_ids), adopt):
                    if self._evict(keep=source):
                        continue
                    break
                self._waiting.popleft()
                for member, slot in zip(group, self.cache.open_group(tokens, len(seq.prompt_ids), adopt)):
                    member.slot = slot
                    self._running.append(member)
                if source is not None:
                    self.retained.remove(source)
                    self._took(seq, source)

    def _retained_prefix(self, seq: Sequence, shared: bool) -> Retained | None:
        """The retained cache (a finished sequence's, or a shared prompt start's) holding the longest start of
        seq's prompt (at least one prompt token left to read, for the logits), if any; none for a request that
        scores its prompt (every position's logits)."""
        if seq.params.prompt_logprobs is not None:
            return None
        prompt = seq.prompt_ids
        fits = [r for r in self.retained
                if r.shared == shared and len(r.tokens) < len(prompt) and prompt[:len(r.tokens)] == r.tokens]
        return max(fits, key=lambda r: len(r.tokens), default=None)

    def _took(self, seq: Sequence, source: Retained) -> None:
        seq.prefilled = len(source.tokens)
        self.counters.prefix_hits += 1
        self.counters.reused_tokens += len(source.tokens)

    def _start_prompt(self, seq: Sequence) -> None:
        """Before seq reads its first prompt chunk: take a copy of a shared prompt start it begins with (one
        that an older request kept while this one waited), and plan a copy of its own start if others share it."""
        if not seq.prefilled and (source := self._retained_prefix(seq, shared=True)) is not None:
            self.cache.fork(source.slot, seq.slot)
            source.kept = time.monotonic()
            self._took(seq, source)
        self._plan_snapshot(seq)

    def _plan_snapshot(self, seq: Sequence) -> None:
        """If seq's prompt starts with at least shared_prefix_min tokens (beyond what it took from a retained
        cache) that a running or retained sequence also starts with, and is longer, its cache at the end of
        that start will be kept for the next prompts that share it (`_snapshot`)."""
        if not self.config.prefix_reuse or seq.params.prompt_logprobs is not None:
            return
        others = [r.tokens for r in self.retained] + [s.prompt_ids for s in self._running
                                                       if s is not seq and s.leader is not seq]  # not its own choices
        common = max((_common_start(seq.prompt_ids, tokens) for tokens in others), default=0)
        common = min(common, len(seq.prompt_ids) - 1)
        if common >= max(self.config.shared_prefix_min, seq.prefilled + 1) and not any(
                r.shared and len(r.tokens) == common and r.tokens == seq.prompt_ids[:common] for r in self.retained):
            seq.snapshot_at = common

    def _snapshot(self, seq: Sequence) -> None:
        """seq has read its prompt up to snapshot_at: keep a copy of its cache there (history pages shared,
        windows copied) in a free slot, freeing the oldest retained caches for it if need be."""
        tokens = seq.prompt_ids[:seq.prefilled]
        while not self.cache.can_open(len(tokens)) and self._evict():
            pass
        if self.cache.can_open(len(tokens)):
            slot = self.cache.open(len(tokens))
            self.cache.fork(seq.slot, slot)
            self.retained.append(Retained(slot, tokens, shared=True))

    def _evict(self, keep: Retained | None = None) -> bool:
        """Free the oldest retained cache (not `keep`); False if there is none to free."""
        candidates = [r for r in self.retained if r is not keep]
        if not candidates:
            return False
        oldest = min(candidates, key=lambda r: r.kept)
        self.retained.remove(oldest)
        self.cache.close(oldest.slot)
        return True

    def retained_usage(self) -> tuple[int, int]:
        """(slots, distinct pages) the retained caches hold (for /metrics; any thread)."""
        slots = [r.slot for r in list(self.retained)]
        return len(slots), self.cache.held_units(slots)

    def forget_prefixes(self) -> None:
        """Free every retained cache (from the engine thread, or another while the engine is stopped or idle)."""
        while self._evict():
            pass

    def _guarded(self, seqs: list[Sequence], run: Callable[[list[Sequence]], None]) -> None:
        """Run a forward; if it raises, fail just these requests and keep serving."""
        try:
            run(seqs)
        except Exception as exc:
            log.exception("a forward failed")
            for seq in seqs:
                for member in [seq] + seq.followers:  # those waiting for its prompt would read it the same way
                    self._fail(member, f"generation failed: {exc}")

    def _forward(self, slots: list[int], ids: list[list[int]]) -> torch.Tensor:
        """Append `ids` (one equal-length row per slot) to `slots`; last-position logits [B, V]."""
        return forward_slots(self.model, self.cache, slots, to_device(ids, torch.long, self.device))

    def _prefill_chunk(self, seqs: list[Sequence], limit: int) -> None:
        """Read up to `limit` more prompt tokens of seqs[0] (fewer with prompt_logprobs, or up to a shared start)."""
        seq = seqs[0]
        if not seq.prompt_started:
            seq.prompt_started = True
            self._start_prompt(seq)
        start = seq.prefilled
        every_position = seq.params.prompt_logprobs is not None
        end = start + (min(limit, PROMPT_LOGPROBS_CHUNK) if every_position else limit)
        if seq.snapshot_at > start:
            end = min(end, seq.snapshot_at)  # a chunk ends where the shared start does
        chunk = seq.prompt_ids[start:end]
        if not every_position:
            logits = self._forward([seq.slot], [chunk])
        else:  # every position: row r predicts prompt token start + r + 1
            every = forward_slots(self.model, self.cache, [seq.slot], to_device([chunk], torch.long, self.device),
                                  every_position=True)[0]
            if start == 0:
                seq.prompt_logprobs.append(None)  # the first token has nothing before it
            targets = seq.prompt_ids[start + 1:start + len(chunk) + 1]
            seq.prompt_logprobs += self._entries(every[:len(targets)], targets, seq.params.prompt_logprobs,
                                                 texts=[self._token_text(seq.prompt_ids[max(0, j - 4):j + 1])
                                                        for j in range(start + 1, start + 1 + len(targets))])
            logits = every[-1:]
        seq.prefilled += len(chunk)
        self.counters.prompt_tokens += len(chunk)
        if seq.prefilled == seq.snapshot_at:
            self._snapshot(seq)
        if not seq.reading_prompt:
            group = [seq] + self._fork_followers(seq)
            if seq.params.max_tokens == 0:
                for member in group:
                    self._finish(member, "length", final_text="")
                return
            logits = logits.expand(len(group), -1).contiguous()  # each choice draws its first token from them
            tokens = self._choose(group, logits)
            for member, token, logprob in zip(group, tokens, self._logprobs(group, logits, tokens)):
                self._accept(member, token, logprob)

    def _fork_followers(self, seq: Sequence) -> list[Sequence]:
        """The choices waiting for `seq`'s prompt take its cache now (`fork`) and, from here on, go alone."""
        forked = []
        for follower in seq.followers:
            follower.leader = None
            if follower.cancelled or follower.finished:
                continue
            self.cache.fork(seq.slot, follower.slot)
            follower.prefilled = len(follower.prompt_ids)
            follower.prompt_logprobs = list(seq.prompt_logprobs)
            forked.append(follower)
        seq.followers = []
        return forked

    @staticmethod
    def _promote(seq: Sequence) -> Sequence | None:
        """`seq` goes away before its followers took its prompt: the first one still wanted reads it instead."""
        live = [f for f in seq.followers if not (f.cancelled or f.finished)]
        seq.followers = []
        if not live:
            return None
        heir, heir.leader, heir.followers = live[0], None, live[1:]
        for follower in heir.followers:
            follower.leader = heir
        return heir

    def _decode(self, seqs: list[Sequence]) -> None:
        slots, last = [s.slot for s in seqs], [s.generated[-1] for s in seqs]
        logits = self.graphs.logits(slots, last) if self.graphs else self._forward(slots, [[t] for t in last])
        tokens = self._choose(seqs, logits)
        for seq, token, logprob in zip(seqs, tokens, self._logprobs(seqs, logits, tokens)):
            self._accept(seq, token, logprob)

    def _choose(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Each row's next token: greedy at temperature 0, else drawn with its temperature, min_p, top_k and top_p
        (`sampling.sample_tokens`: the batch on the logits' device, one uniform number per request from its
        own generator), after the rows' penalties and logit_bias, and with the tokens `_held_back` excluded. One
        copy to the host for the batch."""
        penalized = [i for i, seq in enumerate(seqs) if seq.params.repetition_penalty != 1.0]
        if penalized:  # their rows of the batch, and of the seen-token mask (their slots)
            marked = to_device([penalized, [seqs[i].slot for i in penalized]], torch.long, logits.device)
            logits = self._repetition_penalized(seqs, penalized, marked, logits)
        held = [self._held_back(seq) for seq in seqs]
        if any(seq.params.adjusts_logits for seq in seqs) or any(held):
            at, tokens, values = logit_adjustments(
                [(seq.counts, seq.params.presence_penalty, seq.params.frequency_penalty, dict(seq.params.logit_bias),
                  banned) for seq, banned in zip(seqs, held)])
            index = to_device([at, tokens], torch.long, logits.device)
            logits = logits.float().index_put((index[0], index[1]), to_device(values, torch.float32, logits.device),
                                              accumulate=True)  # a new tensor: logprobs keep the model's logits
        chosen = logits.argmax(-1)
        rows = [i for i, seq in enumerate(seqs) if seq.params.temperature > 0]
        if rows:
            params = [seqs[i].params for i in rows]
            uniform = [float(torch.rand(1, generator=seqs[i].generator)) for i in rows]
            drawn = sample_tokens(logits[rows], [p.temperature for p in params], [p.top_p for p in params], uniform,
                                  top_k=[p.top_k for p in params], min_p=[p.min_p for p in params])
            chosen[to_device(rows, torch.long, chosen.device)] = drawn
        if penalized:
            self._seen[marked[1], chosen[marked[0]]] = True
        return chosen.tolist()

    def _held_back(self, seq: Sequence) -> tuple[int, ...]:
        """The tokens `seq` may not choose now: its EOS (unless ignore_eos) and stop tokens before min_tokens."""
        if len(seq.generated) >= seq.params.min_tokens:
            return ()
        eos = () if seq.params.ignore_eos else tuple(sorted(self.eos_ids))
        return eos + seq.params.stop_token_ids

    def _repetition_penalized(self, seqs: list[Sequence], rows: list[int], marked: torch.Tensor,
                              logits: torch.Tensor) -> torch.Tensor:
        """The logits with rows[i]'s repetition penalty applied over the tokens its sequence has seen (a new
        tensor); marked: [2, len(rows)], the rows and their slots on the device. Each slot's seen tokens are a row
        of a device mask: its prompt marked when the sequence first chooses, each chosen token after (`_choose`)."""
        if self._seen is None or self._seen.shape[1] != logits.shape[-1]:
            self._seen = torch.zeros(self.config.max_seqs, logits.shape[-1], dtype=torch.bool, device=logits.device)
        for i in rows:
            seq = seqs[i]
            if not seq.seen_marked:
                self._seen[seq.slot] = False
                self._seen[seq.slot, to_device(seq.prompt_ids + seq.generated, torch.long, logits.device)] = True
                seq.seen_marked = True
        index, slots = marked
        penalty = to_device([seqs[i].params.repetition_penalty for i in rows], torch.float32, logits.device)[:, None]
        logits = logits.float().clone()
        logits[index] = repetition_penalized(logits[index], self._seen[slots], penalty)
        return logits

    def _logprobs(self, seqs: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob | None]:
        """The chosen tokens' log-probabilities (and top alternatives) for the rows that asked for them: one
        log-softmax and one copy to the host for all of them, nothing where no row asked. Their texts are set
        when the tokens are accepted, after their context."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        found: list[TokenLogprob | None] = [None] * len(seqs)
        if rows:
            k = max(seqs[i].params.logprobs for i in rows)
            entries = self._entries(logits[rows], [tokens[i] for i in rows], k, texts=[""] * len(rows))
            for i, entry in zip(rows, entries):
                found[i] = replace(entry, top=entry.top[:seqs[i].params.logprobs])
        return found

    def _entries(self, logits: torch.Tensor, tokens: list[int], k: int, texts: list[str]) -> list[TokenLogprob]:
        """Row i of logits [N, V] scored at tokens[i]: its log-softmax there and the k most likely tokens (one
        log-softmax and one copy to the host for all rows)."""
        if not tokens:  # a prompt's last chunk of one token scores nothing (its logits predict the reply)
            return []
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen = logp.gather(1, to_device([[t] for t in tokens], torch.long, logp.device))[:, 0].tolist()
        top_p, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
        return [TokenLogprob(token, text, value, tuple((t, self.tokenizer.decode([t]), p) for t, p in zip(ids, ps)))
                for token, text, value, ids, ps in zip(tokens, texts, chosen, top_ids.tolist(), top_p.tolist())]

    def _accept(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> None:
        """Record a sampled token, send its text, and end the request when it is done."""
        if seq.cancelled:
            return
        self.counters.generated_tokens += 1
        if (token in self.eos_ids and not seq.params.ignore_eos) or token in seq.params.stop_token_ids:
            self._finish(seq, "stop", final_text=self._text(seq, final=True))
            return
        seq.generated.append(token)
        seq.counts[token] = seq.counts.get(token, 0) + 1
        if logprob is not None:
            seq.logprobs.append(replace(logprob, text=self._token_text(seq.generated)))
        text = self._text(seq, final=len(seq.generated) >= seq.params.max_tokens)
        for stop in seq.params.stop:
            at = text.find(stop, max(0, seq.text_sent - len(stop)))
            if at >= 0:
                self._finish(seq, "stop", final_text=text[:at])
                return
        if len(seq.generated) >= seq.params.max_tokens:
            self._finish(seq, "length", final_text=text)
            return
        # Hold back what could still turn into a stop string, and half-decoded characters.
        hold = max((len(s) - 1 for s in seq.params.stop), default=0)
        ready = len(text) - hold
        while ready > seq.text_sent and text[ready - 1] == "\ufffd":
            ready -= 1
        if ready > seq.text_sent or seq.logprobs:
            seq.emit(Event("token", text[seq.text_sent:ready], logprobs=self._take_logprobs(seq),
                           prompt_logprobs=self._take_prompt_logprobs(seq)))
            seq.text_sent = max(seq.text_sent, ready)

    @staticmethod
    def _take_logprobs(seq: Sequence) -> list[TokenLogprob]:
        taken, seq.logprobs = seq.logprobs, []
        return taken

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence) -> list[TokenLogprob | None] | None:
        """The prompt's log-probabilities, with the first event that follows its reading (if asked for)."""
        if seq.params.prompt_logprobs is None or seq.prompt_logprobs_sent:
            return None
        seq.prompt_logprobs_sent = True
        return seq.prompt_logprobs

    def _token_text(self, tokens: list[int]) -> str:
        """The text the last of `tokens` adds, decoded after a few tokens before it (so a leading space
        comes out as in the full text; a character split over tokens shows as U+FFFD here)."""
        context = tokens[-5:-1]
        return self.tokenizer.decode(context + tokens[-1:], skip_special_tokens=True)[
            len(self.tokenizer.decode(context, skip_special_tokens=True)):]

    def _text(self, seq: Sequence, final: bool = False) -> str:
        """The text of seq.generated so far, decoded incrementally: each call decodes the few tokens
        since the last complete character, with the tokens before them as context (so leading
        spaces and multi-byte characters come out as in a full decode), not the whole list. A final
        call also returns the complete characters of an unfinished tail."""
        tokens = seq.generated
        context = self.tokenizer.decode(tokens[seq.prefix_offset:seq.read_offset], skip_special_tokens=True)
        window = self.tokenizer.decode(tokens[seq.prefix_offset:], skip_special_tokens=True)
        if len(window) > len(context) and not window.endswith("\ufffd"):
            seq.text += window[len(context):]
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(tokens)
        elif final and len(window) > len(context):
            return seq.text + window[len(context):].rstrip("\ufffd")
        return seq.text

    def _finish(self, seq: Sequence, reason: str, final_text: str) -> None:
        rest = final_text[seq.text_sent:] if len(final_text) > seq.text_sent else ""
        seq.finished = True
        self.counters.completed += 1
        seq.emit(Event("done", rest.rstrip("\ufffd"), reason, len(seq.generated),
                       logprobs=self._take_logprobs(seq), prompt_logprobs=self._take_prompt_logprobs(seq)))

    def _fail(self, seq: Sequence, message: str) -> None:
        if not seq.finished and not seq.cancelled:
            seq.emit(Event("error", message))
        seq.finished = seq.failed = True
        self.counters.failed += 1
        with self._lock:
            if seq in self._waiting:
                self._waiting.remove(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.cancelled and not seq.finished:
            self.counters.cancelled += 1
        self._promote(seq)  # followers still waiting for its prompt (they hold their slots)
        self._running.remove(seq)
        if seq.slot < 0:
            return
        held = self.cache.length(seq.slot)
        if self.config.prefix_reuse and seq.finished and not seq.cancelled and not seq.failed and held:
            self.retained.append(Retained(seq.slot, (seq.prompt_ids + seq.generated)[:held]))
        else:
            self.cache.close(seq.slot)
        seq.slot = -1


def _common_start(a: list[int], b: list[int]) -> int:
    """How many first tokens two token lists share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = (torch.tensor(a[:n]) != torch.tensor(b[:n])).nonzero()
    return int(differ[0, 0]) if len(differ) else n


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
