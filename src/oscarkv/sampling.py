"""Sampling the next token of a batch on the logits' device: the server's requests and `generate(do_sample=True)`.

A token is found by inverting its row's distribution at a uniform number u in [0, 1): the tokens in order
(most likely first where top_k or top_p filter), their cumulative probabilities, and the first one whose
cumulative probability passes u times the total.

- `sample_tokens` (serve): each row has its own temperature, min_p, top_k and top_p, and u is drawn on the host from the
  request's own generator, so a request with a seed gets the same tokens whatever else shares its batch. The
  whole batch costs a few device operations, not a copy of every row's logits to the host and a softmax, sort
  and draw there per request (about 25 ms per request and step on the H100 machine's host at a 152K vocabulary).
- `Sampling.choose` (the static decode path): one temperature, top_k and top_p for the batch, as
  transformers' sampling applies them, and u from the device's generator, with no host synchronisation, so
  that it runs inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import OscarError
from .transfer import to_device

# top_p first ranks this many most likely tokens per row; only where their mass falls short of top_p (a flat
# distribution) is the whole vocabulary sorted. On an H100 sorting 32 rows of 152K logits per decode step cost
# about 11% of a Qwen3-4B server's throughput.
TOP_P_CANDIDATES = 1024


def sample_tokens(logits: torch.Tensor, temperature: list[float], top_p: list[float],
                  uniform: list[float], candidates: int = TOP_P_CANDIDATES, top_k: list[int] | None = None,
                  min_p: list[float] | None = None) -> torch.Tensor:
    """logits [B, V] -> long [B]: row i drawn from softmax(logits_i / temperature_i) at the uniform number
    uniform_i, filtered in vLLM's order: tokens less likely than min_p_i times the most likely one dropped (the
    rest renormalised), then all but the top_k_i most likely (0: none dropped), then all but the smallest set of
    most likely tokens whose probabilities reach top_p_i of what is left (the most likely token always stays).
    Temperatures must be > 0, top_p in (0, 1], top_k >= 0 and min_p in [0, 1].

    Rows that rank (top_k or top_p) take the `candidates` most likely tokens (or their top_k, if more) first and
    sort the whole vocabulary only where a row without top_k finds less than top_p of the mass among them; rows
    that do not rank draw from the whole distribution as it is."""
    rows, vocab = logits.shape
    top_k = [k if 0 < k < vocab else vocab for k in (top_k or [0] * rows)]  # tokens each row keeps by top_k
    min_p = min_p or [0.0] * rows
    scale, limit, target, floor = to_device([temperature, top_p, uniform, min_p], torch.float32,
                                            logits.device)[:, :, None]
    probs = torch.softmax(logits.float() / scale, dim=-1)
    if any(m > 0 for m in min_p):
        kept = probs * (probs >= floor * probs.amax(dim=-1, keepdim=True))
        probs = torch.where(floor > 0, kept / kept.sum(dim=-1, keepdim=True), probs)
    ranking = [i for i in range(rows) if top_p[i] < 1 or top_k[i] < vocab]
    if not ranking:
        return _draw(probs, None, target)[:, 0]
    if len(ranking) == rows:
        return _ranked_draw(probs, limit, target, top_k, candidates)
    chosen = torch.empty(rows, dtype=torch.long, device=logits.device)
    plain = [i for i in range(rows) if top_p[i] == 1 and top_k[i] == vocab]
    index = to_device(ranking + plain, torch.long, logits.device)
    at, others = index[:len(ranking)], index[len(ranking):]
    chosen[others] = _draw(probs[others], None, target[others])[:, 0]
    chosen[at] = _ranked_draw(probs[at], limit[at], target[at], [top_k[i] for i in ranking], candidates)
    return chosen


def _ranked_draw(probs: torch.Tensor, limit: torch.Tensor, target: torch.Tensor, top_k: list[int],
                 candidates: int) -> torch.Tensor:
    """`sample_tokens` for rows that rank: probs [R, V] (each summing to 1), limit (top_p) and target [R, 1],
    top_k per row (V: all)."""
    vocab = probs.shape[-1]
    keep = to_device(top_k, torch.long, probs.device)[:, None]
    width = min(vocab, max([candidates] + [k for k in top_k if k < vocab]))
    ranked, order = probs.topk(width, dim=-1)  # most likely first
    unlimited = keep >= vocab  # rows without top_k (every top_k lies within the width)
    # Exact when each such row's candidates hold top_p of the mass: every token after them has that much before it.
    if width < vocab and not bool(((ranked.sum(dim=-1, keepdim=True) >= limit) | ~unlimited).all()):
        ranked, order = probs.sort(dim=-1, descending=True)
    ranked = ranked * (torch.arange(ranked.shape[-1], device=probs.device) < keep)
    # top_p of the mass top_k left (all of it, 1, for rows without top_k)
    mass = torch.where(unlimited, torch.ones_like(limit), ranked.sum(dim=-1, keepdim=True))
    return _draw(_nucleus(ranked, limit * mass), order, target)[:, 0]


def logit_adjustments(rows: list[tuple]) -> tuple[list[int], list[int], list[float]]:
    """OpenAI's penalties and logit_bias as sparse additions to a batch's logits: for row i with
    (counts of the tokens it generated, presence_penalty, frequency_penalty, logit_bias[, banned tokens]), each
    generated token t gets -(presence + frequency * count_t), each biased token its bias, and each banned token
    -inf (never chosen). Returns (rows, token ids, values), the form
    `torch.Tensor.index_put_(..., accumulate=True)` takes."""
    at, tokens, values = [], [], []
    for i, (counts, presence, frequency, bias, *banned) in enumerate(rows):
        if presence or frequency:
            for token, count in counts.items():
                at.append(i)
                tokens.append(token)
                values.append(-(presence + frequency * count))
        for token, value in bias.items():
            at.append(i)
            tokens.append(token)
            values.append(value)
        for token in (banned[0] if banned else ()):
            at.append(i)
            tokens.append(token)
            values.append(float("-inf"))
    return at, tokens, values


def repetition_penalized(logits: torch.Tensor, seen: torch.Tensor, penalty: float | torch.Tensor) -> torch.Tensor:
    """transformers' repetition penalty: the float32 logits [B, V] of the tokens marked in seen [B, V] (bool)
    divided by `penalty` (a number, or [B, 1] per row) where positive, multiplied where negative."""
    logits = logits.float()
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def _nucleus(ranked: torch.Tensor, top_p) -> torch.Tensor:
    """Probabilities ranked most likely first, zero after the smallest prefix that reaches top_p: a token stays
    while the mass before it is below top_p (so the most likely one always does)."""
    return ranked * (ranked.cumsum(dim=-1) - ranked < top_p)


def _draw(probs: torch.Tensor, order: torch.Tensor | None, target: torch.Tensor) -> torch.Tensor:
    """[B, 1] tokens: where the cumulative probabilities pass target [B, 1] (in [0, 1)) times their total;
    order maps positions in probs to token ids (None: the identity)."""
    cdf = probs.cumsum(dim=-1)
    index = torch.searchsorted(cdf, target * cdf[:, -1:], right=True).clamp_(max=probs.shape[-1] - 1)
    return index if order is None else order.gather(1, index)


@dataclass(frozen=True)
class Sampling:
    """transformers' sampling for a whole batch: logits / temperature, then the top_k most likely tokens (0:
    all), then the nucleus of top_p, then a draw. `choose` runs on the device with no host synchronisation (a
    CUDA graph can capture it; its random numbers come from the device's generator, so torch.manual_seed
    makes a run repeatable). Ties at the top_k boundary keep exactly top_k tokens (transformers keeps every
    token tied with the k-th)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise OscarError(f"sampling needs temperature > 0, top_k >= 0 and top_p in (0, 1]; got {self}.")

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> long [B, 1]."""
        scores = logits.float() / self.temperature
        order = None
        if 0 < self.top_k < scores.shape[-1]:
            scores, order = scores.topk(self.top_k, dim=-1)  # most likely first
        elif self.top_p < 1:
            scores, order = scores.sort(dim=-1, descending=True)
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1:
            probs = _nucleus(probs, self.top_p)
        return _draw(probs, order, torch.rand(probs.shape[0], 1, device=probs.device))
