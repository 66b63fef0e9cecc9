"""The Triton RMSNorm against the modules' own forward, and `triton_norms` swapping it in and back."""

from __future__ import annotations

import pytest
import torch

from oscarkv.integrations.norms import is_known_rms_norm, triton_norms
from oscarkv.kernels.ops import triton_available
from tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _norm(n: int, dtype: torch.dtype, eps: float = 1e-6):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(n, eps=eps).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(n, generator=torch.Generator().manual_seed(n)) + 0.5)
    return norm


# scale 0.003: mean(x²) near eps, so eps counts
# 33,000 x 128 and 33,000 x 100: a prompt's short rows, several a program (`norm_plan`), the last tile part-full
@pytest.mark.parametrize("rows,n,scale", [(1, 64, 3.0), (1, 576, 3.0), (1, 2560, 3.0), (32, 128, 3.0), (3, 100, 3.0),
                                          (4, 64, 0.003), (33000, 128, 3.0), (33000, 100, 0.003)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_the_module(rows, n, scale, dtype):
    from oscarkv.kernels.triton_norm import launch_rms_norm

    norm = _norm(n, dtype, eps=1e-5)
    x = (scale * torch.randn(rows, n, generator=torch.Generator().manual_seed(rows + n))).to(DEVICE, dtype)
    out = torch.full_like(x, float("nan"))
    launch_rms_norm(x, norm.weight, norm.variance_epsilon, out)
    with torch.no_grad():
        expected = norm(x)
    # the sum's order and rsqrt's last bit may flip a rounding: one ulp of the normalized value, which the product
    # with the weight (rounded again) can make two; exact almost everywhere
    torch.testing.assert_close(out.float(), expected.float(), rtol=2.0**-6, atol=0)
    assert (out == expected).float().mean() > 0.95


def _recorded_launches(monkeypatch) -> list[bool]:
    """The norm kernel's launches from now on, each as whether it took a residual."""
    from oscarkv.kernels import triton_norm

    launches = []
    launch = triton_norm.launch_rms_norm
    monkeypatch.setattr(triton_norm, "launch_rms_norm",
                        lambda *a, **kw: (launches.append(kw.get("residual") is not None), launch(*a, **kw)))
    return launches


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_swapped_norms_and_fallbacks(family, monkeypatch):
    """A bfloat16 model's norms run the kernel, each once per forward: a layer's residual adds go into the
    launches of the norm after attention and of the next layer's (or the final) norm. The logits are the
    model's within rounding; float32 rows go to the forwards that were there; the forwards come back."""
    launches = _recorded_launches(monkeypatch)
    model = tiny_model(family, dtype=torch.bfloat16, layers=3).to(DEVICE)
    norms = [m for m in model.modules() if is_known_rms_norm(m)]
    ids = torch.randint(0, 128, (1, 3), device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits.float()
        with triton_norms(model):
            got = model(ids).logits.float()
            assert len(launches) == len(norms)
            assert sum(launches) == 2 * 3  # two adds per layer
            model.model.norm(torch.randn(2, model.config.hidden_size, device=DEVICE))  # float32: not the kernel
            assert len(launches) == len(norms)
    assert not any("forward" in vars(m) for m in model.modules())
    torch.testing.assert_close(got, expected, atol=0.02 * expected.abs().max().item(), rtol=0)


def test_float32_layers_keep_their_own_forward():
    model = tiny_model("qwen3", layers=2).to(DEVICE)
    ids = torch.randint(0, 128, (2, 5), device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits
        with triton_norms(model):
            got = model(ids).logits
    assert torch.equal(got, expected)


@pytest.mark.parametrize("rows", [2, 32770])  # one row a program; several (`norm_plan`)
def test_kernel_with_a_residual_adds_as_eager_then_normalizes(rows):
    from oscarkv.kernels.triton_norm import launch_rms_norm, norm_plan

    assert (norm_plan(rows, 256)[0] > 1) == (rows > 2) and norm_plan(rows, 2560)[0] == 1
    norm = _norm(256, torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    x, r = (torch.randn(rows, 256, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    out, summed = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    launch_rms_norm(x, norm.weight, norm.variance_epsilon, out, residual=r, summed=summed)
    assert torch.equal(summed, r + x)
    with torch.no_grad():
        torch.testing.assert_close(out.float(), norm(r + x).float(), rtol=2.0**-6, atol=0)  # as above


def test_norms_computed_ahead_serve_only_their_input():
    from oscarkv.integrations.norms import NormAhead

    ahead, norm, other = NormAhead(), torch.nn.Identity(), torch.nn.Identity()
    x, y, result = torch.zeros(3), torch.zeros(3), torch.ones(3)
    ahead.kept[norm] = (x, result)
    assert ahead.take(norm, y) is None and ahead.take(other, x) is None  # an equal tensor, another norm
    assert ahead.take(norm, x) is result
    assert ahead.take(norm, x) is None  # taken once


def test_only_known_norm_classes():
    assert all(not is_known_rms_norm(m) for m in tiny_model("gemma3").modules())  # (1 + w) scaling: left alone
    assert any(is_known_rms_norm(m) for m in tiny_model("llama").modules())


@pytest.mark.parametrize("asks,tokens", [(True, 9), (True, 8), (False, 9)])
def test_prompts_run_the_norms_where_the_config_asks(asks, tokens, monkeypatch):
    """A prompt through `forward_slots` (engine chunks, generate_static's prefill) runs each known RMSNorm as one
    kernel launch, the residual adds inside, where the static path compiles its small operations (CUDA; forced
    here) and the forward reads at least PROMPT_NORM_TOKENS tokens (9 here), and none otherwise; the logits equal
    the eager prompt's within rounding; the forwards come back."""
    import oscarkv
    from oscarkv.integrations import static_decode

    launches = _recorded_launches(monkeypatch)
    monkeypatch.setattr(static_decode, "PROMPT_NORM_TOKENS", 9)
    model = oscarkv.patch(tiny_model("qwen3", dtype=torch.bfloat16, layers=3).to(DEVICE), method="bf16")
    norms = [m for m in model.modules() if is_known_rms_norm(m)]
    ids = torch.randint(0, 128, (1, tokens), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    logits = {}
    for forced in (False, asks):
        monkeypatch.setattr(static_decode, "compiles_small_ops", lambda m, forced=forced: forced)
        cache = static_decode.slot_cache_for(model, 1, 16)
        with torch.no_grad():
            logits[forced] = static_decode.forward_slots(model, cache, [cache.open(16)], ids)
    kernel = asks and tokens >= 9
    assert len(launches) == (len(norms) if kernel else 0)
    assert sum(launches) == (2 * 3 if kernel else 0)
    assert not any("forward" in vars(m) for m in model.modules())
    torch.testing.assert_close(logits[asks], logits[False], atol=0.02 * logits[False].abs().max().item(), rtol=0)
