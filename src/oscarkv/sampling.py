"""Sampling the next token of a batch on the logits' device: the server's requests and `generate(do_sample=True)`.

A token is found by inverting its row's distribution at a uniform number u in [0, 1): the tokens in order
(most likely first where top_k or top_p filter), their cumulative probabilities, and the first one whose
cumulative probability passes u times the total.

- `sample_tokens` (serve): each row has its own temperature and top_p, and u is drawn on the host from the
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
                  uniform: list[float], candidates: int = TOP_P_CANDIDATES) -> torch.Tensor:
    """logits [B, V] -> long [B]: row i drawn from softmax(logits_i / temperature_i), keeping only the
    smallest set of most likely tokens whose probabilities reach top_p_i (the most likely token always
    stays), at the uniform number uniform_i. Temperatures must be > 0 and top_p in (0, 1]."""
    scale, limit, target = to_device([temperature, top_p, uniform], torch.float32, logits.device)[:, :, None]
    probs = torch.softmax(logits.float() / scale, dim=-1)
    order = None
    if any(p < 1 for p in top_p):
        ranked, order = probs.topk(min(candidates, probs.shape[-1]), dim=-1)  # most likely first
        # Exact when the candidates hold top_p of the mass: every token after them has that much before it.
        if ranked.shape[-1] < probs.shape[-1] and not bool((ranked.sum(dim=-1, keepdim=True) >= limit).all()):
            ranked, order = probs.sort(dim=-1, descending=True)
        probs = _nucleus(ranked, limit)
    return _draw(probs, order, target)[:, 0]


def logit_adjustments(rows: list[tuple[dict[int, int], float, float, dict[int, float]]]
                      ) -> tuple[list[int], list[int], list[float]]:
    """OpenAI's penalties and logit_bias as sparse additions to a batch's logits: for row i with
    (counts of the tokens it generated, presence_penalty, frequency_penalty, logit_bias), each generated token t
    gets -(presence + frequency * count_t) and each biased token its bias. Returns (rows, token ids, values),
    the form `torch.Tensor.index_put_(..., accumulate=True)` takes."""
    at, tokens, values = [], [], []
    for i, (counts, presence, frequency, bias) in enumerate(rows):
        if presence or frequency:
            for token, count in counts.items():
                at.append(i)
                tokens.append(token)
                values.append(-(presence + frequency * count))
        for token, value in bias.items():
            at.append(i)
            tokens.append(token)
            values.append(value)
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
