"""Developer tool (GPU): does a decode step gain when the weights of the products after the attention are
prefetched into L2 while the attention runs? At batch 1 one layer's attention cannot stream at the copy bandwidth
(a copy of its bytes alone reaches about 60%); a side stream, forked at the start of each attention module's
forward, issues `prefetch.global.L2` over weights that the following products then read. Both caches take it, so
the ratio stays fair. Runs `bench decode` with the arguments after `--` for each variant in turn:

    PYTHONPATH=src python scripts/probe_weight_prefetch.py [--variants shipped,o,o-late,o+mlp-late,shipped] -- \
        --model random:qwen3-4b --contexts 100000 --batch 2 --batch-contexts 1024 --no-largest --prefill 0

Variants: `shipped` (no prefetch); `o`: o_proj's weight, the main stream waiting for the prefetch before o_proj;
`o-late`: the same, joined only after the last layer's attention (nothing waits on it before then);
`o+mlp-late`: also the first MLP_MB megabytes of each of gate_proj and up_proj, joined late; `o-at-attention`: o_proj's
weight, forked just before the attention launch instead of at the start of the module's forward, joined late.
A probe, not shipped: the side stream is outside the static path's design (one stream, launches overlapped)."""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from oscarkv.kernels.triton_decode_qk import _prefetch_run

LINES_PER_POINTER = 2  # 128-byte lines prefetched from each pointer
BLOCK = 1024  # pointers per program
MLP_MB = 12


@triton.jit
def _prefetch_kernel(ptr, nbytes, BLOCK: tl.constexpr, SPAN: tl.constexpr):
    first = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * SPAN
    _prefetch_run(ptr.to(tl.pointer_type(tl.uint8)) + first, SPAN, first < nbytes)


def prefetch(tensor: torch.Tensor, nbytes: int | None = None) -> None:
    nbytes = min(tensor.numel() * tensor.element_size(), nbytes or 1 << 62)
    span = 128 * LINES_PER_POINTER
    _prefetch_kernel[(triton.cdiv(nbytes, span * BLOCK),)](tensor, nbytes, BLOCK=BLOCK, SPAN=span, num_warps=4)


def main() -> None:
    from oscarkv.cli import main as cli
    from oscarkv.integrations import decode_attention
    from oscarkv.integrations.paged import AttendingLayer, PagedOscarLayer

    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="shipped,o,o-late,o+mlp-late,shipped")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    shipped_forward, shipped_modules = decode_attention._forward, decode_attention.fused_modules
    decoder_layers: dict[int, torch.nn.Module] = {}
    state = {"variant": "shipped", "side": None}

    def is_last(module) -> bool:
        """Whether this attention module is the step's last (where the late variants join the side stream)."""
        return not decoder_layers or module.layer_idx == len(decoder_layers) - 1

    def recording_modules(model):
        layers = getattr(getattr(model, "model", model), "layers", [])
        decoder_layers.clear()
        decoder_layers.update(enumerate(layers))
        return shipped_modules(model)

    shipped_attends = {cls: cls.__dict__["attend_decode"] for cls in (AttendingLayer, PagedOscarLayer)}

    def fork(module):
        side = state["side"] = state["side"] or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            prefetch(module.o_proj.weight)
        return side

    def attending(cls):
        def attend_decode(self, *aargs, **akwargs):
            if state.get("module") is not None:
                fork(state["module"])
            return shipped_attends[cls](self, *aargs, **akwargs)
        return attend_decode

    def forward(module, norms, previous, *fargs, **kwargs):
        variant = state["variant"]
        hidden = kwargs.get("hidden_states")
        if variant == "shipped" or hidden is None or not hidden.is_cuda or hidden.shape[1] != 1:
            return shipped_forward(module, norms, previous, *fargs, **kwargs)
        main_stream = torch.cuda.current_stream()
        if variant == "o-at-attention":
            state["module"] = module
            try:
                out = shipped_forward(module, norms, previous, *fargs, **kwargs)
            finally:
                state["module"] = None
            if is_last(module):
                main_stream.wait_stream(state["side"])
            return out
        side = fork(module)
        with torch.cuda.stream(side):
            mlp = getattr(decoder_layers.get(module.layer_idx), "mlp", None)
            if variant == "o+mlp-late" and mlp is not None:
                prefetch(mlp.gate_proj.weight, MLP_MB << 20)
                prefetch(mlp.up_proj.weight, MLP_MB << 20)
        if variant == "o":
            # join before o_proj: run the module's forward up to the attention, then wait, then o_proj
            o_proj = module.o_proj

            class Joined(torch.nn.Module):
                def forward(self, x):
                    main_stream.wait_stream(side)
                    return o_proj(x)

            module.o_proj = Joined()
            try:
                return shipped_forward(module, norms, previous, *fargs, **kwargs)
            finally:
                module.o_proj = o_proj
        out = shipped_forward(module, norms, previous, *fargs, **kwargs)
        if is_last(module):
            main_stream.wait_stream(side)
        return out

    decode_attention._forward, decode_attention.fused_modules = forward, recording_modules
    for cls in shipped_attends:
        cls.attend_decode = attending(cls)
    try:
        for variant in args.variants.split(","):
            state["variant"] = variant
            print(f"== prefetch variant: {variant}", flush=True)
            cli(["bench", "decode", *bench_args])
    finally:
        decode_attention._forward, decode_attention.fused_modules = shipped_forward, shipped_modules
        for cls, shipped_attend in shipped_attends.items():
            cls.attend_decode = shipped_attend


if __name__ == "__main__":
    main()
