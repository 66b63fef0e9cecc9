"""Developer tool (GPU): time one decode step's token choice for a batch, greedy against sampled.

    PYTHONPATH=src python scripts/probe_sampling.py [--batch 32] [--vocab 151936] [--baseline MODULE]

Logits [batch, vocab] on the GPU: "flat" (a random-weight model's: small spread, so the top 1024 tokens hold
less than top_p and the whole vocabulary is sorted) and "peaked" (spread 5: a trained model's kind, where they
hold it). Times, per step: argmax with one copy to the host (greedy); `sampling.sample_tokens` at temperature
0.7 with top_p 1 and 0.9, with top_k 50 and with min_p 0.05, and a batch of which half samples with top_p 0.9 and
half without filters; and the engine's former way (each row copied to the host, softmax, sort, multinomial).
--baseline MODULE (e.g. a copy of an earlier `oscarkv/sampling.py` saved as `oscarkv.sampling_before`) times that
module's `sample_tokens` on the half-and-half batch beside the current one.
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch

from oscarkv.sampling import sample_tokens


def per_call_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def host_sampling(logits: torch.Tensor, temperature: float, top_p: float) -> list[int]:
    """The engine's sampling before this change: one row at a time on the host."""
    tokens = []
    for row in logits:
        probs = torch.softmax(row.cpu() / temperature, dim=-1)
        if top_p < 1:
            ranked, order = probs.sort(descending=True)
            keep = ranked.cumsum(0) - ranked < top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], ranked[keep])
        tokens.append(int(torch.multinomial(probs, 1)))
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--baseline", default=None, help="module with an earlier sample_tokens")
    args = parser.parse_args()
    before = importlib.import_module(args.baseline).sample_tokens if args.baseline else None
    b = args.batch
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; batch {b}, vocabulary {args.vocab}")
    for name, spread in (("flat", 0.5), ("peaked", 5.0)):
        logits = torch.randn(b, args.vocab, device="cuda") * spread
        probs = torch.softmax(logits / 0.7, dim=-1)
        mass = probs.topk(1024, dim=-1).values.sum(-1)
        print(f"{name}: the top 1024 tokens hold {mass.min():.3f}..{mass.max():.3f} of the mass at temperature 0.7")
        uniform = torch.rand(b).tolist()
        half = [0.9] * (b // 2) + [1.0] * (b - b // 2)
        rows = {
            "greedy (argmax, to the host)": lambda: logits.argmax(-1).tolist(),
            "sample_tokens, top_p 1": lambda: sample_tokens(logits, [0.7] * b, [1.0] * b, uniform).tolist(),
            "sample_tokens, top_p 0.9": lambda: sample_tokens(logits, [0.7] * b, [0.9] * b, uniform).tolist(),
            "sample_tokens, top_p 0.9, whole-vocabulary sort": lambda: sample_tokens(
                logits, [0.7] * b, [0.9] * b, uniform, candidates=args.vocab).tolist(),
            "sample_tokens, top_k 50, top_p 0.9": lambda: sample_tokens(
                logits, [0.7] * b, [0.9] * b, uniform, top_k=[50] * b).tolist(),
            "sample_tokens, min_p 0.05": lambda: sample_tokens(
                logits, [0.7] * b, [1.0] * b, uniform, min_p=[0.05] * b).tolist(),
            "sample_tokens, half top_p 0.9, half unfiltered": lambda: sample_tokens(
                logits, [0.7] * b, half, uniform).tolist(),
            "former: per row on the host, top_p 0.9": lambda: host_sampling(logits, 0.7, 0.9),
        }
        if before is not None:
            rows["baseline module, half top_p 0.9, half unfiltered"] = lambda: before(
                logits, [0.7] * b, half, uniform).tolist()
        for label, fn in rows.items():
            print(f"  {label:50s} {per_call_ms(fn, 5 if 'former' in label else 20):8.3f} ms per step")


if __name__ == "__main__":
    main()
