"""GPU check of the static decode path on the Qwen3-4B architecture (random weights).

Greedy generations must be equal token for token between
- transformers' own generate loop over the paged cache (eager, one forward per token),
- the static path run eagerly (same buffers, no graph),
- the static path replayed from a CUDA graph, and
- `model.generate`, which a patched model routes to the static path on CUDA.
Also prints the mean step time of the eager static steps and of the graph replays.

    python scripts/check_static_decode.py [--prompt 1000] [--new 64] [--batch 2]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Callable

import torch

import oscarkv
from oscarkv.integrations.paged import PagedOscarCache
from oscarkv.integrations.static_decode import StaticDecoder, forward_slots, generate_static, slot_cache_for
from oscarkv.models import load_model


def warm_decoder(model, prompt, steps: int, graphs: bool):
    """(decoder, slots, last tokens): the prompt prefilled and a few steps decoded (kernels compiled),
    with room left for `steps` more."""
    total = prompt.shape[1] + steps + 8
    cache = slot_cache_for(model, prompt.shape[0], total)
    slots = [cache.open(total) for _ in range(prompt.shape[0])]
    with torch.inference_mode():
        first = forward_slots(model, cache, slots, prompt).argmax(-1)
        decoder = StaticDecoder(model, cache, graphs=graphs)
        last = decoder.decode(slots, first, 4)[:, -1]
    torch.cuda.synchronize()
    return decoder, slots, last


def step_ms(model, prompt, new: int, graphs: bool) -> float:
    decoder, slots, last = warm_decoder(model, prompt, new, graphs)
    started = time.perf_counter()
    decoder.decode(slots, last, new)
    torch.cuda.synchronize()
    if graphs:
        replays, seconds = decoder.replay_timing
        return 1e3 * seconds / replays
    return 1e3 * (time.perf_counter() - started) / new


def ablation_arguments(**extra: str) -> argparse.Namespace:
    """The options of the ablation probes (scripts/probe_*_ablation.py): model, batch-1 contexts, batch, and
    string options named in `extra` with their defaults."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:qwen3-4b")
    parser.add_argument("--contexts", default="100000,30000")
    parser.add_argument("--batch", type=int, default=1)
    for name, default in extra.items():
        parser.add_argument(f"--{name}", default=default)
    return parser.parse_args()


def alternating_step_ms(model, prompt, variants: dict[str, Callable[[], None]], reps: int = 3,
                        new: int = 64) -> dict[str, list[float]]:
    """ms per CUDA-graph step of each variant, the variants run in turn `reps` times in this process;
    each variant's callable puts its code in place before its run."""
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name, use in variants.items():
            use()
            times[name].append(step_ms(model, prompt, new, graphs=True))
            gc.collect()
            torch.cuda.empty_cache()
    return times


def print_ablation(args: argparse.Namespace, context: int, method: str, times: dict[str, list[float]]) -> None:
    print(args.model, args.batch, context, method, {k: [round(v, 3) for v in vs] for k, vs in times.items()},
          flush=True)


def sweep(args: argparse.Namespace, variants: dict[str, Callable[[], None]], reps: int = 2,
          method: str = "hadamard") -> None:
    """For each of `args.contexts` at `args.batch` (random prompt, `args.model`): the variants' ms per CUDA-graph step,
    run in turn `reps` times in this process (`alternating_step_ms`), printed as one line (`print_ablation`)."""
    model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(0)
    for ctx in (int(c) for c in args.contexts.split(",")):
        prompt = torch.randint(0, model.config.vocab_size, (args.batch, ctx), device="cuda")
        oscarkv.patch(model, method=method)
        print_ablation(args, ctx, method, alternating_step_ms(model, prompt, variants, reps=reps))


def profile(model, prompt, steps: int = 8, layer_kernels: int = 0) -> None:
    """The GPU kernels of `steps` eager static steps, by total time (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    decoder, slots, last = warm_decoder(model, prompt, steps, graphs=False)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        decoder.decode(slots, last, steps)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.time_range.elapsed_us() for e in kernels)
    print(f"kernels per step {len(kernels) / steps:.0f}, sum of kernel times per step {total_us / steps / 1e3:.3f} ms",
          flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)
    if layer_kernels:
        # the kernels of one step in launch order, from the middle of the step (one decoder layer and more)
        ordered = sorted(kernels, key=lambda e: e.time_range.start)
        per_step = len(ordered) // steps
        middle = ordered[(steps - 1) * per_step + per_step // 2:][:layer_kernels]
        for e in middle:
            print(f"  {e.time_range.elapsed_us():7.1f} us  {e.name[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:qwen3-4b")
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="also print the GPU kernels of 8 static steps")
    parser.add_argument("--profile-only", action="store_true", help="only the kernel profile, no equality checks")
    parser.add_argument("--layer-kernels", type=int, default=0,
                        help="with the profile, also list this many kernels of one step in launch order")
    args = parser.parse_args()
    model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device="cuda")
    context = args.prompt + args.new
    report = {}
    for method in ("hadamard", "bf16"):
        oscarkv.patch(model, method=method)
        if args.profile_only:
            print(f"{method}, batch {args.batch}, prompt {args.prompt}:")
            profile(model, prompt, layer_kernels=args.layer_kernels)
            continue
        state = model.oscar
        outputs = {}
        if method != "bf16":
            cache = PagedOscarCache(state.specs, state.cache, state.kv_heads, state.head_dim, context)
            with torch.inference_mode():
                outputs["transformers loop"] = type(model).generate(model, prompt, past_key_values=cache,
                                                                    max_new_tokens=args.new, do_sample=False)
        else:
            with torch.inference_mode():
                outputs["transformers loop"] = type(model).generate(model, prompt, max_new_tokens=args.new,
                                                                    do_sample=False)
        outputs["static, eager"] = generate_static(model, prompt, args.new, graphs=False)
        outputs["static, CUDA graph"] = generate_static(model, prompt, args.new, graphs=True)
        outputs["model.generate"] = model.generate(prompt, max_new_tokens=args.new, do_sample=False)
        base = outputs["static, CUDA graph"]
        report[method] = {
            "equal_to_graph": {k: bool(torch.equal(v, base)) for k, v in outputs.items()},
            "first_mismatch": {k: int((v[:, args.prompt:] != base[:, args.prompt:]).any(0).long().argmax())
                               if not torch.equal(v, base) else None for k, v in outputs.items()},
            "eager_step_ms": step_ms(model, prompt, args.new, graphs=False),
            "graph_step_ms": step_ms(model, prompt, args.new, graphs=True),
        }
        print(method, json.dumps(report[method]), flush=True)
        if args.profile:
            profile(model, prompt)
    print(json.dumps({"model": args.model, "device": torch.cuda.get_device_name(), "batch": args.batch,
                      "prompt": args.prompt, "new": args.new, **report}))


if __name__ == "__main__":
    main()
