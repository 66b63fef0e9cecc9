"""Developer tool (GPU): the static decode step with the Triton RMSNorm (`integrations/norms.py`), with and
without the residual adds folded in, against the compiled norms it replaces, alternating in one process, three
times each (docs/data/norms-ablation-h100.txt).
Qwen3-4B shape, random weights, batch 1 at 100K and 30K, INT2 (Hadamard) and BF16 caches; ms per graph step.

    PYTHONPATH=src:scripts python scripts/probe_norms_ablation.py
"""
import sys, torch, contextlib, gc
sys.path.insert(0, "scripts")
import oscarkv
from oscarkv.models import load_model
from oscarkv.integrations import norms, static_decode
from check_static_decode import step_ms

real, real_layers = static_decode.triton_norms, norms.decoder_layers
none = lambda model: []  # noqa: E731
@contextlib.contextmanager
def off(model, enabled=True):
    yield
model, _ = load_model("random:qwen3-4b", device="cuda", dtype=torch.bfloat16)
torch.manual_seed(0)
for ctx in (100000, 30000):
    prompt = torch.randint(0, model.config.vocab_size, (1, ctx), device="cuda")
    for method in ("hadamard", "bf16"):
        oscarkv.patch(model, method=method)
        res = {"triton norms with the adds": [], "triton norms": [], "compiled norms": []}
        for rep in range(3):
            for name, fn, layers in (("triton norms with the adds", real, real_layers), ("triton norms", real, none),
                                     ("compiled norms", off, real_layers)):
                static_decode.triton_norms, norms.decoder_layers = fn, layers
                res[name].append(step_ms(model, prompt, 64, graphs=True))
                gc.collect(); torch.cuda.empty_cache()
        static_decode.triton_norms, norms.decoder_layers = real, real_layers
        print(ctx, method, {k: [round(v, 3) for v in vs] for k, vs in res.items()}, flush=True)
