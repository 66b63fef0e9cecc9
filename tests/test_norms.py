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
@pytest.mark.parametrize("rows,n,scale", [(1, 64, 3.0), (1, 576, 3.0), (1, 2560, 3.0), (32, 128, 3.0), (3, 100, 3.0),
                                          (4, 64, 0.003)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_the_module(rows, n, scale, dtype):
    from oscarkv.kernels.triton_norm import launch_rms_norm

    norm = _norm(n, dtype, eps=1e-5)
    x = (scale * torch.randn(rows, n, generator=torch.Generator().manual_seed(rows + n))).to(DEVICE, dtype)
    out = torch.full_like(x, float("nan"))
    launch_rms_norm(x, norm.weight, norm.variance_epsilon, out)
    with torch.no_grad():
        expected = norm(x)
    # the sum's order and rsqrt's last bit may flip a rounding: one ulp, and exact almost everywhere
    torch.testing.assert_close(out.float(), expected.float(), rtol=2.0**-7, atol=0)
    assert (out == expected).float().mean() > 0.95


def test_swapped_norms_and_fallbacks(monkeypatch):
    """A bfloat16 model's norms (layer norms, q/k norms, the final norm) run the kernel and give the model's
    logits within rounding; float32 rows go to the forward that was there; the forwards come back."""
    from oscarkv.kernels import triton_norm

    launches = []
    launch = triton_norm.launch_rms_norm
    monkeypatch.setattr(triton_norm, "launch_rms_norm", lambda *a, **kw: (launches.append(a[0].shape), launch(*a, **kw)))
    model = tiny_model("qwen3", dtype=torch.bfloat16).to(DEVICE)
    norms = [m for m in model.modules() if is_known_rms_norm(m)]
    ids = torch.randint(0, 128, (1, 3), device=DEVICE)
    with torch.no_grad():
        expected = model(ids).logits.float()
        with triton_norms(model):
            got = model(ids).logits.float()
            assert len(launches) == len(norms)  # 2 layer norms and q/k norms per layer, and the final norm
            model.model.norm(torch.randn(2, model.config.hidden_size, device=DEVICE))  # float32: not the kernel
            assert len(launches) == len(norms)
    assert not any("forward" in vars(m) for m in model.modules())
    torch.testing.assert_close(got, expected, atol=0.02 * expected.abs().max().item(), rtol=0)


def test_only_known_norm_classes():
    assert all(not is_known_rms_norm(m) for m in tiny_model("gemma3").modules())  # (1 + w) scaling: left alone
    assert any(is_known_rms_norm(m) for m in tiny_model("llama").modules())
