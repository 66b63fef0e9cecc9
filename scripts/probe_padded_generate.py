"""Developer tool (GPU): greedy `generate()` of a left-padded batch, by path, on a random Qwen3-4B.

    PYTHONPATH=src python scripts/probe_padded_generate.py [--lengths 8192,6144,4096,2048] [--new 128]
        [--reference-new 8] [--sample] [--copies N]
        [--paths "transformers,bf16 static,int2 static,int2 loop,int2 reference"]

Paths, each on a freshly built model (same seed), in one process:
- `transformers`: the unpatched model, transformers' own loop over its BF16 DynamicCache (SDPA);
- `bf16 static` / `int2 static`: the patched model (methods bf16 / hadamard), whose generate() now takes a
  left-padded batch on the static decode path (each padded row's prompt read alone, then CUDA-graph steps);
- `int2 loop`: the paged INT2 cache under transformers' own loop (CacheConfig(static_decode=False)): where
  sampled generate() ran before the static path took sampling;
- `int2 reference`: the reference cache (CacheConfig(kernel="reference")), which was the only oscarkv cache
  for padded batches before; it gets --reference-new tokens, as it is slow.

--sample: do_sample=True, temperature 0.7, top_p 0.9 (default: greedy). --copies N: num_return_sequences=N
(sampled only, as transformers requires). Each result also gives the peak GPU memory of its timed calls.

Each path runs generate() once to warm up (compiles, graph captures), then with 1 new token (the prompt) and
with N new tokens; the decode time per token is (t_N - t_1) / (N - 1). Random weights: speed only.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

import oscarkv
from oscarkv.random_models import random_model


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_path(name: str, lengths: list[int], new: int, sample: bool, copies: int = 1) -> dict:
    device = torch.device("cuda")
    model, _ = random_model("random:qwen3-4b", device, torch.bfloat16)
    model.generation_config.eos_token_id = None  # random weights: run every step
    if name != "transformers":
        oscarkv.patch(model, method="bf16" if name.startswith("bf16") else "hadamard")
    if name == "int2 reference":
        model.oscar.cache = replace(model.oscar.cache, kernel="reference")
    if name == "int2 loop":
        model.oscar.cache = replace(model.oscar.cache, static_decode=False)
    n = max(lengths)
    pad = torch.tensor([n - length for length in lengths])
    mask = (torch.arange(n)[None] >= pad[:, None]).long()
    ids = torch.randint(1, model.config.vocab_size, (len(lengths), n), generator=torch.Generator().manual_seed(0))
    ids, mask = (ids * mask).to(device), mask.to(device)

    def generate(tokens: int):
        with torch.inference_mode():
            settings = dict(do_sample=True, temperature=0.7, top_p=0.9) if sample else dict(do_sample=False)
            if copies > 1:
                settings["num_return_sequences"] = copies
            return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, pad_token_id=0, **settings)

    warm = timed(lambda: generate(new))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    prompt = timed(lambda: generate(1))
    total = timed(lambda: generate(new))
    result = dict(path=name, sample=sample, copies=copies, lengths=lengths, new_tokens=new, warm_up_s=round(warm, 2),
                  prompt_s=round(prompt, 3), total_s=round(total, 3),
                  decode_ms_per_token=round(1e3 * (total - prompt) / (new - 1), 2),
                  peak_gib_above_model=round((torch.cuda.max_memory_allocated() - base) / 2**30, 2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="8192,6144,4096,2048", help="real prompt tokens per row")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--reference-new", type=int, default=8)
    parser.add_argument("--sample", action="store_true")
    parser.add_argument("--copies", type=int, default=1, help="num_return_sequences (with --sample)")
    parser.add_argument("--paths", default="transformers,bf16 static,int2 static,int2 reference")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; left-padded batch of {len(lengths)}: {lengths}")
    for name in args.paths.split(","):
        new = args.reference_new if name == "int2 reference" else args.new
        print(json.dumps(run_path(name, lengths, new, args.sample, args.copies)), flush=True)
        torch.cuda.empty_cache()  # the path's model is gone with its call


if __name__ == "__main__":
    main()
