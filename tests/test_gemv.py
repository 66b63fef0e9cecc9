"""The batch-1 matrix-vector kernel against F.linear, and `gemv_linears` swapping it in and back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oscarkv.integrations import fused_ops
from oscarkv.integrations.fused_ops import compiled_small_ops
from oscarkv.integrations.gemv import gemv_linears, takes_gemv
from oscarkv.kernels.ops import triton_available
from tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# K below, at and past one 1024-column block; N odd (a half-empty last program), one and many programs
@pytest.mark.parametrize("n,k", [(1, 16), (7, 1024), (33, 2500), (64, 3000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_linear(n, k, dtype, bias):
    from oscarkv.kernels.triton_gemv import launch_gemv

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    x = torch.randn(k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    out = torch.full((n,), float("nan"), dtype=dtype, device=DEVICE)
    launch_gemv(x, w, b, out)
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    # float32 sums, then one rounding to the output dtype
    torch.testing.assert_close(out.double(), expected, rtol=2.0**-7, atol=1e-3 * k**0.5)


def test_only_single_rows_take_the_kernel():
    linear = torch.nn.Linear(64, 8, bias=False).to(DEVICE, torch.bfloat16)
    assert takes_gemv(linear, torch.randn(1, 1, 64, device=DEVICE, dtype=torch.bfloat16))
    assert not takes_gemv(linear, torch.randn(2, 1, 64, device=DEVICE, dtype=torch.bfloat16))  # batch 2
    assert not takes_gemv(linear, torch.randn(1, 64, device=DEVICE))  # float32
    assert not takes_gemv(linear.float(), torch.randn(1, 64, device=DEVICE))


@pytest.mark.parametrize("compiled", [False, True])
def test_model_forward_with_the_kernel(compiled, monkeypatch):
    """One decode token through a bfloat16 model: the swapped linears give the logits of F.linear within
    rounding, a two-row batch goes to F.linear unchanged, and the model's own forwards are back after."""
    if compiled and not fused_ops.can_compile():
        pytest.skip("torch.compile does not run in this Python")
    model = tiny_model("qwen3", dtype=torch.bfloat16).to(DEVICE)
    ids = torch.randint(0, 128, (1, 1), device=DEVICE)
    pair = torch.randint(0, 128, (2, 1), device=DEVICE)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    from oscarkv.kernels import triton_gemv

    launches = []
    launch = triton_gemv.launch_gemv
    monkeypatch.setattr(triton_gemv, "launch_gemv", lambda *a: (launches.append(a[1].shape), launch(*a)))
    with torch.no_grad():
        expected, expected_pair = model(ids).logits.float(), model(pair).logits
        with gemv_linears(model), compiled_small_ops(model, enabled=compiled, backend="eager"):
            assert all("forward" in vars(m) for m in linears)
            got, got_pair = model(ids).logits.float(), model(pair).logits
    assert not any("forward" in vars(m) for m in linears)
    assert len(launches) == len(linears)  # every linear of the one-token forward, none of the pair's
    assert torch.equal(got_pair, expected_pair)
    torch.testing.assert_close(got, expected, atol=0.05 * expected.abs().max().item(), rtol=0)


def test_disabled_swaps_nothing():
    model = tiny_model("llama")
    with gemv_linears(model, enabled=False):
        assert not any("forward" in vars(m) for m in model.modules())
