"""The OpenAI-compatible HTTP API of `oscarkv serve` (FastAPI; run by uvicorn).

Endpoints: POST /v1/completions and /v1/chat/completions (with `"stream": true` as
server-sent events, ending with `data: [DONE]`), vLLM's POST /tokenize and /detokenize, GET /v1/models, /health and
/metrics
(Prometheus text: KV pages and bytes, slots, queue, request and token counters, process RSS).

Log-probabilities: completions' `logprobs: N` and chat's `logprobs: true` with `top_logprobs: N` (N <= 20)
report each generated token's log-probability under the model (before temperature and top_p) and the N most
likely tokens at its position, in OpenAI's shapes, streamed or not. Completions' `echo` puts the prompt before
the completion, with the prompt tokens' log-probabilities (every position's logits in prefill; `max_tokens: 0`
scores the prompt alone, as evaluation harnesses do), streamed as a first chunk. `presence_penalty`,
`frequency_penalty` (over the tokens generated so far) and `logit_bias` are added to the logits before a token
is chosen, after vLLM's `repetition_penalty` (over the prompt and the generated tokens). `n` choices read the
prompt once (`Engine.submit_choices`); completions' `best_of` generates that
many and returns the n with the highest mean log-probability per token (not streamed). A completions `prompt` may
be a list of prompts (texts or token-id lists): each gets its n choices, numbered prompt after prompt, and each
gives what it gives alone. vLLM's `top_k`, `min_p`, `stop_token_ids` and `min_tokens` are taken too; fields that
would change the answer and that this server does not do (`UNSUPPORTED_FIELDS`: tools, JSON response formats,
guided decoding, ...) are refused by name.

Errors use OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for a bad
body or a request the context cannot hold, 404 for another model name, 503 when the queue
is full or the engine has stopped. A client that disconnects frees its slot at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid
from dataclasses import replace
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .engine import Engine, Event, RequestRejected, SamplingParams, TokenLogprob

DEFAULT_CHAT_MAX_TOKENS = 256
MAX_CHOICES = 16  # `n`: each choice is a sequence of its own; they read the prompt once (`Engine.submit_choices`)
MAX_PROMPTS = 256  # prompts in one completions request (a list of them, as evaluation harnesses send batches)


# Fields that change what a request returns and that this server does not do: a request that sets one to
# something other than its "off" value gets a 400 naming it instead of an answer that silently ignored it.
# (Other unknown fields, such as user or metadata, are ignored.)
UNSUPPORTED_FIELDS = {
    "tools": lambda v: bool(v), "functions": lambda v: bool(v),
    "tool_choice": lambda v: v not in (None, "none", "auto"), "function_call": lambda v: v not in (None, "none", "auto"),
    "response_format": lambda v: v is not None and (v.get("type") if isinstance(v, dict) else v) != "text",
    "suffix": lambda v: bool(v), "use_beam_search": lambda v: bool(v), "prompt_logprobs": lambda v: v is not None,
    "guided_json": lambda v: v is not None, "guided_regex": lambda v: v is not None,
    "guided_choice": lambda v: v is not None, "guided_grammar": lambda v: v is not None,
    "structured_outputs": lambda v: v is not None, "bad_words": lambda v: bool(v),
    "allowed_token_ids": lambda v: v is not None, "include_stop_str_in_output": lambda v: bool(v),
    # fields of completions (declared there, so only a chat request reaches these)
    "echo": lambda v: bool(v), "best_of": lambda v: v not in (None, 1),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields we do not use (user, metadata, ...)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices per request, each generated as its own sequence "
                                                       "from one reading of the prompt")
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    stream_options: dict | None = None
    ignore_eos: bool = Field(False, description="vLLM's extension: generate max_tokens tokens regardless of EOS")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100]")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="vLLM's extension: transformers' penalty "
                                      "over the prompt and the generated tokens (1: none)")
    top_k: int = Field(0, ge=-1, description="vLLM's extension: sample among the k most likely tokens (0 or -1: all)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM's extension: drop tokens less likely than min_p "
                                                         "times the most likely one")
    stop_token_ids: list[int] | None = Field(None, description="vLLM's extension: token ids that end the sequence")
    min_tokens: int = Field(0, ge=0, description="vLLM's extension: no EOS or stop token before this many tokens")

    def unsupported(self) -> str | None:
        """The first field set to something this server does not do, or None (a request that sets one gets a
        400 naming it, not a silent no-op)."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and UNSUPPORTED_FIELDS[name](value):
                return name
        return None

    def stop_tokens(self, vocab: int) -> tuple[int, ...]:
        """stop_token_ids as a tuple; ValueError naming the first id outside the vocabulary."""
        for token in self.stop_token_ids or ():
            if not 0 <= token < vocab:
                raise ValueError(f"stop_token_ids: {token} is not a token id in [0, {vocab}).")
        return tuple(self.stop_token_ids or ())

    def bias(self, vocab: int) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs; ValueError naming the first bad entry."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab:
                raise ValueError(f"logit_bias: {key!r} is not a token id in [0, {vocab}).")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias: the bias of token {key} is {value}, outside [-100, 100].")
            pairs.append((int(key), float(value)))
        return tuple(pairs)

    def logprobs_count(self) -> int | None:
        """How many top alternatives to report per token (None: no log-probabilities)."""
        return None

    @property
    def candidates(self) -> int:
        """Choices to generate; the n best are returned (`best_of`, completions only)."""
        return self.n


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="text or token ids, or a list of them (several prompts: n choices each, in prompt order)")
    max_tokens: int | None = Field(None, ge=0, description="0 only with echo: score the prompt, generate nothing")
    logprobs: int | None = Field(None, ge=0, le=20, description="log-probabilities of the tokens and of the N "
                                                                "most likely ones at each position")
    echo: bool = Field(False, description="the prompt before the completion, with its log-probabilities")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description="generate this many choices and return "
                                "the n with the highest log-probability per token (not streamed)")

    def unsupported(self) -> str | None:
        return "best_of with stream" if self.stream and self.candidates > self.n else super().unsupported()

    @property
    def candidates(self) -> int:
        return self.best_of or self.n

    def logprobs_count(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The content as text: text parts joined by newlines (as vLLM joins them); None is empty. ValueError
        for a part that is not text (images, audio: this server serves text-only models)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported (text-only model); "
                                 f"send text parts or a string.")
        return "\n".join(part.text for part in self.content)


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: a prompt (text) or a chat (messages, through the chat template)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _error(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def create_app(engine: Engine, served_model: str, api_key: str | None = None) -> FastAPI:
    """The app over a started or not-yet-started engine (it is started and stopped with the app). api_key: if
    set, every /v1, /tokenize and /detokenize request must carry `Authorization: Bearer <api_key>` (401
    otherwise); /health and /metrics stay open, as vLLM keeps them."""
    tokenizer = engine.tokenizer
    max_context = engine.config.max_context
    created = int(time.time())

    async def lifespan(app):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="oscarkv", lifespan=lifespan)

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def _authorized(request: Request, call_next):
            if request.url.path.startswith(("/v1", "/tokenize", "/detokenize")):
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return _error(401, "this server needs an API key: send the header `Authorization: Bearer "
                                  "<key>` with the key the server was started with.", "invalid_api_key")
            return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            where = ""
            message = f"the body is not valid JSON ({first.get('ctx', {}).get('error', message)})"
        return _error(400, f"{where + ': ' if where else ''}{message}", "invalid_request", where or None)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return _error(503, f"the engine is not running ({engine.crashed or 'stopped'}).", "engine_down")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model, "object": "model", "created": created,
                                            "owned_by": "oscarkv", "max_model_len": max_context}]}

    def other_model(name: str | None) -> JSONResponse | None:
        """404 for a request that names another model than the one served."""
        if name is None or name == served_model:
            return None
        return _error(404, f"the model {name!r} is not served here; this server serves {served_model!r}.",
                      "model_not_found", "model")

    def chat_tokens(messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int] | JSONResponse:
        """A chat's tokens through the model's chat template, or the error to answer."""
        if getattr(tokenizer, "chat_template", None) is None:
            return _error(400, "this model has no chat template; send a prompt (text) to /v1/completions instead.",
                          "no_chat_template")
        try:
            texts = [{"role": m.role, "content": m.text()} for m in messages]
        except ValueError as exc:
            return _error(400, f"messages: {exc}", "unsupported_parameter", "messages")
        return tokenizer.apply_chat_template(texts, add_generation_prompt=add_generation_prompt, tokenize=True,
                                             return_dict=True)["input_ids"]

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        if (wrong := other_model(body.model)) is not None:
            return wrong
        if (body.prompt is None) == (body.messages is None):
            return _error(400, "send either prompt (text) or messages (a chat).", "invalid_request", "prompt")
        if body.messages is not None:
            tokens = chat_tokens(body.messages, body.add_generation_prompt)
            if isinstance(tokens, JSONResponse):
                return tokens
        else:
            tokens = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        return {"count": len(tokens), "max_model_len": max_context, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        if (wrong := other_model(body.model)) is not None:
            return wrong
        if any(t < 0 or t >= len(tokenizer) for t in body.tokens):
            return _error(400, f"tokens must lie in [0, {len(tokenizer)}).", "invalid_request", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_metrics_text(engine), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        several = isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int)
        batch = body.prompt if several else [body.prompt]  # a list of prompts, or one (text or token ids)
        if len(batch) > MAX_PROMPTS:
            return _error(400, f"prompt: {len(batch)} prompts in one request, more than {MAX_PROMPTS}; send them in "
                          "several requests.", "invalid_request", "prompt")
        prompts = [p if isinstance(p, list) else tokenizer(p).input_ids for p in batch]
        if any(t < 0 or t >= len(tokenizer) for p in prompts for t in p):
            return _error(400, f"prompt token ids must lie in [0, {len(tokenizer)}).", "invalid_request", "prompt")
        if body.max_tokens == 0 and not body.echo:
            return _error(400, "max_tokens: 0 needs echo: true (to score the prompt); ask for at least 1 token.",
                          "invalid_request", "max_tokens")
        echo = [(p if isinstance(p, str) else tokenizer.decode(ids), tokenizer.decode(ids[:1], skip_special_tokens=True))
                for p, ids in zip(batch, prompts)] if body.echo else None
        return await _run(body, request, prompts, 16 if body.max_tokens is None else body.max_tokens, chat=False,
                          echo=echo)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        prompt = chat_tokens(body.messages)
        if isinstance(prompt, JSONResponse):
            return prompt
        room = max(1, max_context - len(prompt))
        return await _run(body, request, [prompt], body.max_completion_tokens or body.max_tokens
                          or min(DEFAULT_CHAT_MAX_TOKENS, room), chat=True)

    async def _run(body: _Body, request: Request, prompts: list[list[int]], max_tokens: int, chat: bool,
                   echo: list[tuple[str, str]] | None = None):
        """prompts: each gets body.candidates choices, numbered prompt by prompt (OpenAI's order); echo: completions
        with echo, per prompt (its text, its first token's text)."""
        if (wrong := other_model(body.model)) is not None:
            return wrong
        if (field := body.unsupported()) is not None:
            return _error(400, f"{field} is not supported by this server; leave it out of the request.",
                          "unsupported_parameter", field)
        if chat and body.top_logprobs is not None and not body.logprobs:
            return _error(400, "top_logprobs needs logprobs: true.", "invalid_request", "top_logprobs")
        if body.candidates < body.n:
            return _error(400, f"best_of ({body.candidates}) must be at least n ({body.n}).", "invalid_request",
                          "best_of")
        if not engine.alive:
            return _error(503, "the engine is not running; see /health.", "engine_down")
        try:
            bias = body.bias(len(tokenizer))
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request", "logit_bias")
        try:
            stop_tokens = body.stop_tokens(len(tokenizer))
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request", "stop_token_ids")
        if body.min_tokens > max_tokens:
            return _error(400, f"min_tokens ({body.min_tokens}) is more than max_tokens ({max_tokens}).",
                          "invalid_request", "min_tokens")
        stop = tuple([body.stop] if isinstance(body.stop, str) else body.stop or ())
        ranked = body.candidates > body.n  # best_of: every candidate's token log-probabilities rank it
        logprobs = body.logprobs_count()
        params = SamplingParams(max_tokens, body.temperature, body.top_p, body.seed, tuple(s for s in stop if s),
                                body.ignore_eos, 0 if ranked and logprobs is None else logprobs,
                                body.presence_penalty, body.frequency_penalty, bias,
                                prompt_logprobs=logprobs if echo is not None else None,
                                repetition_penalty=body.repetition_penalty, top_k=max(body.top_k, 0),
                                min_p=body.min_p, stop_token_ids=stop_tokens, min_tokens=body.min_tokens)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def emitter(index: int):
            def emit(event: Event) -> None:
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
                except RuntimeError:  # the event loop is gone (shutdown)
                    pass
            return emit

        seqs, per_prompt = [], body.candidates
        try:  # choice j of a prompt, with a seed, draws from seed + j (as the prompt alone would)
            for p, prompt in enumerate(prompts):
                seqs += engine.submit_choices(prompt, [
                    (replace(params, seed=None if body.seed is None else body.seed + j), emitter(p * per_prompt + j))
                    for j in range(per_prompt)])
        except RequestRejected as exc:
            _cancel(engine, seqs)
            return _error(exc.status, str(exc), exc.code)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        shape = _Shape(rid, served_model, chat, logprobs is not None, sum(len(p) for p in prompts), echo=echo,
                       per_prompt=body.n)
        if body.stream:
            usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(_stream(engine, seqs, events, shape, usage), media_type="text/event-stream")
        choices = [_Choice() for _ in seqs]
        try:
            while not all(choice.last for choice in choices):
                try:
                    index, event = await asyncio.wait_for(events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        _cancel(engine, seqs)
                        return _error(499, "client closed the request", "client_closed")
                    continue
                if event.kind == "error":
                    _cancel(engine, seqs)
                    return _error(500, event.text, "generation_failed")
                choices[index].add(event)
        except asyncio.CancelledError:
            _cancel(engine, seqs)
            raise
        billed = sum(c.last.completion_tokens for c in choices)  # every candidate's tokens, as OpenAI counts them
        if ranked:  # the n best of each prompt's candidates
            choices = [c for p in range(len(prompts)) for c in _best(choices[p * per_prompt:(p + 1) * per_prompt],
                                                                      body.n)]
        return shape.full(choices, billed)

    return app


def _best(choices: list[_Choice], n: int) -> list[_Choice]:
    """best_of: the n choices of highest mean log-probability per generated token, best first (a choice that
    generated nothing, ended by EOS at once, ranks last)."""
    def score(c: _Choice) -> float:
        return sum(e.logprob for e in c.logprobs) / len(c.logprobs) if c.logprobs else float("-inf")

    return sorted(choices, key=score, reverse=True)[:n]


def _cancel(engine: Engine, seqs) -> None:
    for seq in seqs:
        if not seq.finished:
            engine.cancel(seq)


class _Choice:
    """What one choice of a non-streamed request has received."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.last: Event | None = None

    def add(self, event: Event) -> None:
        self.text.append(event.text)
        self.logprobs += event.logprobs
        self.prompt_logprobs = event.prompt_logprobs or self.prompt_logprobs
        if event.kind == "done":
            self.last = event


def _completion_logprobs(entries: list[TokenLogprob], offset: int) -> tuple[dict, int]:
    """The completions API's parallel lists for some tokens whose texts start at `offset`, and the offset after."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.text)
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: p for _, t, p in e.top} for e in entries], "text_offset": offsets}, offset


class _Shape:
    """OpenAI response objects for one request. logprobs: the request asked for log-probabilities."""

    def __init__(self, rid: str, model: str, chat: bool, logprobs: bool = False, prompt_tokens: int = 0,
                 echo: list[tuple[str, str]] | None = None, per_prompt: int = 1) -> None:
        self.rid, self.model, self.chat, self.logprobs = rid, model, chat, logprobs
        self.prompt_tokens = prompt_tokens
        self.echo = echo  # completions with echo, per prompt: (its text, its first token's text)
        self.per_prompt = per_prompt  # choices per prompt: choice i belongs to prompt i // per_prompt
        self.created = int(time.time())
        self.text_offset: dict[int, int] = {}  # completions: where each choice's next token text starts

    def _logprobs(self, entries: list[TokenLogprob], index: int = 0) -> dict | None:
        """OpenAI's logprobs object of some generated tokens: chat's `content` list, or the completions
        API's parallel lists (text_offset counts the token texts before each, from the completion's start)."""
        if not self.logprobs:
            return None
        if self.chat:
            def item(text: str, logprob: float) -> dict:
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {"content": [{**item(e.text, e.logprob), "top_logprobs": [item(t, p) for _, t, p in e.top]}
                                for e in entries]}
        lists, self.text_offset[index] = _completion_logprobs(entries, self.text_offset.get(index, 0))
        return lists

    def _wrap(self, choices: list[dict], chunk: bool, usage: dict | None = None) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        out = {"id": self.rid, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def usage(self, completion_tokens: int) -> dict:
        """Each prompt counted once, however many choices read it."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def _prompt_text(self, index: int) -> str:
        return self.echo[index // self.per_prompt][0]

    def _prompt_lists(self, prompt_logprobs: list[TokenLogprob | None], index: int) -> tuple[dict, int]:
        """echo: the completions API's lists for the tokens of choice `index`'s prompt (the first has no
        log-probability: null, as OpenAI gives it), and the text offset after the prompt."""
        _, first = self.echo[index // self.per_prompt]
        lists, offset = _completion_logprobs(list(prompt_logprobs[1:]), len(first))
        return {"tokens": [first] + lists["tokens"], "token_logprobs": [None] + lists["token_logprobs"],
                "top_logprobs": [None] + lists["top_logprobs"], "text_offset": [0] + lists["text_offset"]}, offset

    def _echoed(self, choice: _Choice, index: int) -> tuple[str, dict | None]:
        """A completions choice with echo: the prompt's text before the completion's, and the prompt tokens'
        log-probabilities before the generated ones."""
        text = self._prompt_text(index) + "".join(choice.text)
        if not self.logprobs:
            return text, None
        lists, offset = self._prompt_lists(choice.prompt_logprobs, index)
        generated, _ = _completion_logprobs(choice.logprobs, offset)
        return text, {key: lists[key] + generated[key] for key in lists}

    def echo_chunk(self, index: int, prompt_logprobs: list[TokenLogprob | None] | None) -> dict:
        """Streamed echo: the first chunk of a choice holds the prompt (and its tokens' log-probabilities); the
        generated tokens' text offsets then count from the prompt's end."""
        lists = None
        if self.logprobs:
            lists, self.text_offset[index] = self._prompt_lists(prompt_logprobs, index)
        else:
            self.text_offset[index] = len(self._prompt_text(index))
        return self._wrap([{"index": index, "text": self._prompt_text(index), "logprobs": lists,
                            "finish_reason": None}], chunk=True)

    def full(self, choices: list[_Choice], completion_tokens: int) -> dict:
        out = []
        for index, c in enumerate(choices):
            text, reason = "".join(c.text), c.last.finish_reason
            if self.echo is not None:
                text, logprobs = self._echoed(c, index)
                out.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})
                continue
            if self.chat:
                out.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": self._logprobs(c.logprobs, index), "finish_reason": reason})
            else:
                out.append({"index": index, "text": text, "logprobs": self._logprobs(c.logprobs, index),
                            "finish_reason": reason})
        return self._wrap(out, chunk=False, usage=self.usage(completion_tokens))

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False,
              logprobs: list[TokenLogprob] | None = None, index: int = 0) -> dict:
        entries = self._logprobs(logprobs, index) if logprobs else None
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": entries, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": entries, "finish_reason": finish_reason}
        return self._wrap([choice], chunk=True)


async def _stream(engine: Engine, seqs, events: asyncio.Queue, shape: _Shape, include_usage: bool):
    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    try:
        if shape.chat:
            for index in range(len(seqs)):
                yield sse(shape.chunk("", first=True, index=index))
        open_choices, completion_tokens = len(seqs), 0
        echoed: set[int] = set()
        while open_choices:
            index, event = await events.get()
            if event.kind == "error":
                yield sse({"error": {"message": event.text, "type": "server_error", "code": "generation_failed"}})
                break
            if shape.echo is not None and index not in echoed:
                echoed.add(index)
                yield sse(shape.echo_chunk(index, event.prompt_logprobs))
            if event.kind == "token":
                yield sse(shape.chunk(event.text, logprobs=event.logprobs, index=index))
                continue
            if event.text or event.logprobs:
                yield sse(shape.chunk(event.text, logprobs=event.logprobs, index=index))
            yield sse(shape.chunk(None, event.finish_reason, index=index))
            open_choices -= 1
            completion_tokens += event.completion_tokens
        else:
            if include_usage:
                yield sse({**shape._wrap([], chunk=True), "usage": shape.usage(completion_tokens)})
        yield "data: [DONE]\n\n"
    finally:
        _cancel(engine, seqs)  # those not finished: the client went away mid-stream, or one choice failed


def _metrics_text(engine: Engine) -> str:
    usage = engine.cache.usage()
    load = engine.load()
    c = engine.counters
    retained_slots, retained_pages = engine.retained_usage()
    rows = [
        ("oscarkv_kv_pages_total", "gauge", "INT2 history pages in the pool", usage.pages_total),
        ("oscarkv_kv_pages_used", "gauge", "pages holding history now (retained caches included)", usage.pages_used),
        ("oscarkv_kv_pages_free", "gauge", "pages not holding history", usage.pages_total - usage.pages_used),
        ("oscarkv_kv_pages_promised", "gauge", "pages promised to admitted requests", usage.pages_promised),
        ("oscarkv_kv_bytes_total", "gauge", "bytes of all KV cache tensors", usage.bytes_total),
        ("oscarkv_kv_bytes_used", "gauge", "bytes of KV held for open sequences", usage.bytes_used),
        ("oscarkv_slots_total", "gauge", "sequence slots", usage.slots_total),
        ("oscarkv_slots_used", "gauge", "sequence slots in use (retained caches included)", usage.slots_used),
        ("oscarkv_prefix_slots", "gauge", "slots holding a finished sequence's cache for reuse", retained_slots),
        ("oscarkv_prefix_pages", "gauge", "pages the retained caches hold", retained_pages),
        ("oscarkv_requests_running", "gauge", "requests holding a slot", load["running"]),
        ("oscarkv_requests_waiting", "gauge", "requests queued for a slot", load["waiting"]),
        ("oscarkv_requests_completed_total", "counter", "requests that ended normally", c.completed),
        ("oscarkv_requests_cancelled_total", "counter", "requests whose client went away", c.cancelled),
        ("oscarkv_requests_failed_total", "counter", "requests ended by an error", c.failed),
        ("oscarkv_requests_rejected_total", "counter", "requests refused at submission", c.rejected),
        ("oscarkv_prompt_tokens_total", "counter", "prompt tokens prefilled", c.prompt_tokens),
        ("oscarkv_prefix_hits_total", "counter", "requests started from a retained cache", c.prefix_hits),
        ("oscarkv_prefix_reused_tokens_total", "counter", "prompt tokens taken from retained caches, not read",
         c.reused_tokens),
        ("oscarkv_generation_tokens_total", "counter", "tokens generated", c.generated_tokens),
        ("oscarkv_engine_steps_total", "counter", "scheduler steps run", c.steps),
        ("oscarkv_engine_step_seconds_total", "counter", "seconds spent in scheduler steps", round(c.step_seconds, 6)),
        ("process_resident_memory_bytes", "gauge", "resident memory of the server process", _rss_bytes()),
    ]
    lines = []
    for name, kind, doc, value in rows:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"
