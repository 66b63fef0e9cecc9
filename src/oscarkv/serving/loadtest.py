"""Load and fault test for an OpenAI-compatible server (`oscarkv bench serve`).

`clients` concurrent clients stream completions with long prompts of real prose until
`duration` seconds have passed; every `disconnect_every`-th request of a client hangs up
after its first chunks (on purpose). Beside them a prober sends bad requests (malformed
JSON, invalid parameters, an unknown model, a prompt longer than the context) and expects
a 4xx with an OpenAI error body for each. After a warm-up round (one request per client) and after the run, /metrics gives the server's
resident memory and KV pages in use; after the run the server must drain to no running
request and no page in use.

A request counts as failed if it gets an unexpected status, a broken stream, an error
event or no `[DONE]`; a probe counts as failed unless it gets a 4xx with an error body.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass(frozen=True)
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    clients: int = 32
    duration: float = 120.0
    prompt_words: int = 600
    max_tokens: int = 32
    disconnect_every: int = 5
    probe_interval: float = 2.0
    seed: int = 0
    api_key: str | None = None  # sent as `Authorization: Bearer` to a server started with --api-key


@dataclass
class LoadReport:
    config: dict
    sent: int = 0
    completed: int = 0
    disconnected_on_purpose: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    probes_sent: int = 0
    probes_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    ttft_ms: dict = field(default_factory=dict)
    latency_ms: dict = field(default_factory=dict)
    rss_before_mib: float = 0.0
    rss_after_mib: float = 0.0
    pages_used_after: int = -1
    slots_used_after: int = -1
    drained: bool = False

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.probes_failed == 0 and self.drained and self.pages_used_after == 0

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header a server started with --api-key wants (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": round(pick(0.50), 1), "p90": round(pick(0.90), 1), "p99": round(pick(0.99), 1),
            "mean": round(statistics.fmean(ordered), 1), "n": len(ordered)}


async def _metrics(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


PROBES = [
    ("malformed JSON", b'{"prompt": "x", ', None),
    ("negative max_tokens", None, {"prompt": "x", "max_tokens": -1}),
    ("temperature out of range", None, {"prompt": "x", "temperature": 9}),
    ("prompt missing", None, {"max_tokens": 4}),
    ("unknown model", None, {"prompt": "x", "model": "no-such-model"}),
    ("n above the limit", None, {"prompt": "x", "n": 1000}),
    ("a parameter the server does not do", None, {"prompt": "x", "best_of": 2, "stream": True}),
]


async def run_load(config: LoadConfig, words: list[str], progress=None) -> LoadReport:
    """Run the test against a live server; `words`: prose to cut prompts from."""
    report = LoadReport(config=asdict(config))
    ttft, latency = [], []
    limits = httpx.Limits(max_connections=config.clients + 8, max_keepalive_connections=config.clients + 8)
    timeout = httpx.Timeout(300.0, connect=10.0)
    async with httpx.AsyncClient(base_url=config.url, limits=limits, timeout=timeout,
                                 headers=auth_headers(config.api_key)) as client:
        served = (await client.get("/v1/models")).json()["data"][0]
        # Warm-up: one request per client, so that "before" is taken with the server's buffers grown.
        warm = {"model": served["id"], "prompt": " ".join(words[:config.prompt_words]), "max_tokens": 2}
        await asyncio.gather(*(client.post("/v1/completions", json=warm) for _ in range(config.clients)))
        before = await _metrics(client)
        report.rss_before_mib = before.get("process_resident_memory_bytes", 0) / 2**20
        context = int(served.get("max_model_len", 4096))
        deadline = time.monotonic() + config.duration
        started = time.monotonic()

        def fail(why: str) -> None:
            report.failed += 1
            if len(report.failures) < 20:
                report.failures.append(why)

        async def one_client(index: int) -> None:
            rng = random.Random(config.seed * 1000 + index)
            count = 0
            while time.monotonic() < deadline:
                count += 1
                hang_up = config.disconnect_every > 0 and count % config.disconnect_every == 0
                start = rng.randrange(max(1, len(words) - config.prompt_words))
                prompt = " ".join(words[start:start + config.prompt_words])
                body = {"model": served["id"], "prompt": prompt, "max_tokens": config.max_tokens, "stream": True,
                        "temperature": 0.7, "seed": index * 7919 + count,
                        "stream_options": {"include_usage": True}}
                report.sent += 1
                t0 = time.perf_counter()
                first, chunks, done, usage = None, 0, False, None
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        if response.status_code != 200:
                            fail(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                            continue
                        async for line in response.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            data = line[6:]
                            if data == "[DONE]":
                                done = True
                                break
                            event = json.loads(data)
                            if "error" in event:
                                fail(f"error event: {event['error'].get('message')}")
                                break
                            if event.get("usage"):
                                usage = event["usage"]
                            if event.get("choices"):
                                chunks += 1
                                if first is None:
                                    first = time.perf_counter()
                            if hang_up and chunks >= 2:
                                break
                except (httpx.HTTPError, json.JSONDecodeError) as exc:
                    fail(f"{type(exc).__name__}: {exc}")
                    continue
                if hang_up and not done:
                    report.disconnected_on_purpose += 1
                    continue
                if not done:
                    if not report.failures or "stream" not in report.failures[-1]:
                        fail("stream ended without [DONE]")
                    continue
                report.completed += 1
                latency.append(1000 * (time.perf_counter() - t0))
                if first is not None:
                    ttft.append(1000 * (first - t0))
                if usage:
                    report.prompt_tokens += usage["prompt_tokens"]
                    report.completion_tokens += usage["completion_tokens"]
                if progress is not None:
                    progress.update(1)

        async def prober() -> None:
            over_long = {"prompt": " ".join(words[:min(len(words), 2 * context)]), "max_tokens": 8}
            probes = PROBES + [("prompt longer than the context", None, over_long)]
            i = 0
            while time.monotonic() < deadline:
                name, raw, body = probes[i % len(probes)]
                i += 1
                report.probes_sent += 1
                try:
                    r = await client.post("/v1/completions", content=raw, json=body,
                                          headers={"content-type": "application/json"})
                    good = 400 <= r.status_code < 500 and "message" in r.json().get("error", {})
                except (httpx.HTTPError, json.JSONDecodeError):
                    good = False
                if not good:
                    report.probes_failed += 1
                    if len(report.failures) < 20:
                        report.failures.append(f"probe '{name}' was not answered with a 4xx error")
                await asyncio.sleep(config.probe_interval)

        await asyncio.gather(*(one_client(i) for i in range(config.clients)), prober())
        report.seconds = time.monotonic() - started
        for _ in range(120):  # the server drains: hung-up streams and the last steps end
            after = await _metrics(client)
            if after.get("oscarkv_requests_running", 1) == 0 and after.get("oscarkv_requests_waiting", 1) == 0:
                report.drained = True
                break
            await asyncio.sleep(0.5)
        report.rss_after_mib = after.get("process_resident_memory_bytes", 0) / 2**20
        # What no request holds: the retained caches (kept for reuse on purpose) do not count as leaked.
        report.pages_used_after = int(after.get("oscarkv_kv_pages_used", -1) - after.get("oscarkv_prefix_pages", 0))
        report.slots_used_after = int(after.get("oscarkv_slots_used", -1) - after.get("oscarkv_prefix_slots", 0))
    report.ttft_ms = _percentiles(ttft)
    report.latency_ms = _percentiles(latency)
    return report


def hang_ups(every: int) -> str:
    """How `LoadConfig.disconnect_every` reads in the report (0: no client hangs up)."""
    if every <= 0:
        return "no request hangs up on purpose"
    if every == 1:
        return "every request hangs up on purpose"
    suffix = "th" if every % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(every % 10, "th")
    return f"every {every}{suffix} request of each client hangs up on purpose"


def format_report(r: LoadReport) -> str:
    c = r.config
    lines = [
        f"{c['clients']} streaming clients for {r.seconds:.0f} s, prompts of {c['prompt_words']} words, "
        f"max_tokens {c['max_tokens']}, {hang_ups(c['disconnect_every'])}",
        f"requests sent {r.sent}, completed {r.completed}, hung up on purpose {r.disconnected_on_purpose}, "
        f"failed {r.failed}",
        f"bad-request probes sent {r.probes_sent}, not answered with a 4xx: {r.probes_failed}",
        f"tokens: {r.prompt_tokens} prompt, {r.completion_tokens} generated "
        f"({r.completion_tokens / max(r.seconds, 1e-9):.1f} generated tokens/s over completed requests)",
        f"time to first token ms: {r.ttft_ms}",
        f"request latency ms: {r.latency_ms}",
        f"server RSS before {r.rss_before_mib:.0f} MiB, after {r.rss_after_mib:.0f} MiB "
        f"({r.rss_after_mib - r.rss_before_mib:+.0f} MiB); after draining: {r.slots_used_after} slots and "
        f"{r.pages_used_after} KV pages in use besides the retained caches",
        "PASS" if r.ok else "FAIL: " + "; ".join(r.failures[:5] or ["the server did not drain"]),
    ]
    return "\n".join(lines)


@dataclass
class ThroughputReport:
    """Decode throughput with `clients` requests running at once (all prompts read, none finished)."""

    clients: int
    prompt_tokens: int
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    choices: int = 1
    all_started_s: float = 0.0
    window_s: float = 0.0
    window_tokens: int = 0
    decode_tokens_per_s: float = 0.0
    completed: int = 0
    failed: int = 0
    kv_bytes_total: int = 0
    kv_bytes_used_peak: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


async def measure_throughput(url: str, clients: int, prompt_tokens: int, max_tokens: int, vocab: int,
                             seed: int = 0, temperature: float = 0.0, top_p: float = 1.0,
                             choices: int = 1, api_key: str | None = None) -> ThroughputReport:
    """Send `clients` streaming requests of `prompt_tokens` random token ids at once; once every one
    has its first token (every choice of it), count the server's generated tokens (/metrics) over a window that ends
    before any request can finish. Prompts are token ids, so lengths are exact. temperature 0: greedy;
    else every request samples with that temperature and top_p. choices: OpenAI's `n` of every request (the
    server runs clients × choices sequences)."""
    report = ThroughputReport(clients, prompt_tokens, max_tokens, temperature, top_p, choices)
    rng = random.Random(seed)
    started = asyncio.Event()
    first_seen = 0
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(3600.0, connect=10.0),
                                 headers=auth_headers(api_key)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()

        async def one(index: int) -> None:
            nonlocal first_seen
            body = {"model": model, "prompt": [rng.randrange(vocab) for _ in range(prompt_tokens)],
                    "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "stream": True,
                    "ignore_eos": True, "n": choices}
            begun: set[int] = set()  # the choices that have sent their first token
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    report.failed += 1
                    return
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and len(begun) < choices:
                        for choice in json.loads(line[6:]).get("choices", []):
                            if choice["index"] not in begun:
                                begun.add(choice["index"])
                                first_seen += 1
                        if first_seen == clients * choices:
                            started.set()
                    if line == "data: [DONE]":
                        report.completed += 1

        async def window() -> None:
            await started.wait()
            report.all_started_s = time.perf_counter() - t0
            first = last = await _metrics(client)
            t1 = t_last = time.perf_counter()
            while True:  # sample until a request finishes; the window ends at the sample before it
                await asyncio.sleep(0.5)
                now = await _metrics(client)
                if now["oscarkv_requests_completed_total"] != first["oscarkv_requests_completed_total"]:
                    break
                last, t_last = now, time.perf_counter()
            report.window_s = t_last - t1
            report.window_tokens = int(last["oscarkv_generation_tokens_total"] - first["oscarkv_generation_tokens_total"])
            if report.window_s <= 0:
                report.failed += 1  # a request finished before all had started: raise max_tokens
                return
            report.decode_tokens_per_s = report.window_tokens / report.window_s
            report.kv_bytes_total = int(last["oscarkv_kv_bytes_total"])
            report.kv_bytes_used_peak = int(last["oscarkv_kv_bytes_used"])

        await asyncio.gather(window(), *(one(i) for i in range(clients)))
    return report
