"""The batch-1 matrix-vector kernels against F.linear, and `gemv_linears` swapping them in and back."""

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


# K below and at a power of two, between two, and past one load of CHUNK columns; one and many programs
@pytest.mark.parametrize("n,k", [(1, 16), (7, 1024), (33, 2500), (64, 3000), (3, 40000)])
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
    # float32 sums, then one rounding to nearest in the output dtype (half an ulp: 2^-8 relative or less)
    torch.testing.assert_close(out.double(), expected, rtol=2.0**-8, atol=1e-3 * k**0.5)


def test_only_single_rows_take_the_kernel():
    linear = torch.nn.Linear(64, 8, bias=False).to(DEVICE, torch.bfloat16)
    assert takes_gemv(linear, torch.randn(1, 1, 64, device=DEVICE, dtype=torch.bfloat16))
    assert not takes_gemv(linear, torch.randn(2, 1, 64, device=DEVICE, dtype=torch.bfloat16))  # batch 2
    assert not takes_gemv(linear, torch.randn(1, 64, device=DEVICE))  # float32
    assert not takes_gemv(linear.float(), torch.randn(1, 64, device=DEVICE))


def _reference_silu_mul(x, gate, up):
    """silu(gate·x) * up·x with the kernel's roundings: each product, the activation, the result."""
    dtype = x.dtype
    g = F.linear(x.double(), gate.double()).to(dtype).float()
    u = F.linear(x.double(), up.double()).to(dtype).float()
    return (F.silu(g).to(dtype).float() * u).to(dtype)


@pytest.mark.parametrize("bias", [False, True])
def test_one_launch_for_three_weights_equals_three_launches(bias):
    """q/k/v in one launch: each output row bit for bit what its own launch gives."""
    from oscarkv.kernels.triton_gemv import launch_gemv

    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(n, 300, generator=g).to(DEVICE, torch.bfloat16) for n in (33, 8, 7)]
    biases = [torch.randn(n, generator=g).to(DEVICE, torch.bfloat16) if bias else None for n in (33, 8, 7)]
    x = torch.randn(300, generator=g).to(DEVICE, torch.bfloat16)
    fused = torch.full((48,), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    launch_gemv(x, weights, biases, fused)
    alone = []
    for w, b in zip(weights, biases):
        alone.append(torch.full((w.shape[0],), float("nan"), dtype=torch.bfloat16, device=DEVICE))
        launch_gemv(x, w, b, alone[-1])
    assert torch.equal(fused, torch.cat(alone))
    with pytest.raises(ValueError, match="every weight has a bias"):
        launch_gemv(x, weights, [None, None, torch.zeros(7, dtype=torch.bfloat16, device=DEVICE)], fused)


@pytest.mark.parametrize("n,k", [(1, 16), (33, 2500), (5, 40000)])  # 40000: a row longer than one load
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_kernel(n, k, dtype):
    from oscarkv.kernels.triton_gemv import launch_gemv_silu_mul

    g = torch.Generator().manual_seed(n + k)
    gate, up = (torch.randn(n, k, generator=g).mul(k**-0.5).to(DEVICE, dtype) for _ in range(2))
    x = torch.randn(k, generator=g).to(DEVICE, dtype)
    out = torch.full((n,), float("nan"), dtype=dtype, device=DEVICE)
    launch_gemv_silu_mul(x, gate, up, out)
    # one ulp: the sums' float32 order against float64 can flip a rounding of the products
    torch.testing.assert_close(out.float(), _reference_silu_mul(x, gate, up).float(), rtol=2.0**-7, atol=1e-6)


def _count_launches(monkeypatch) -> list[str]:
    from oscarkv.kernels import triton_gemv

    launches = []
    for name in ("launch_gemv", "launch_gemv_silu_mul"):
        launch = getattr(triton_gemv, name)
        monkeypatch.setattr(triton_gemv, name,
                            lambda *a, _launch=launch, _name=name, **kw: (launches.append(_name), _launch(*a, **kw)))
    return launches


@pytest.mark.parametrize("family,compiled", [("qwen3", False), ("qwen3", True), ("qwen2", False), ("llama", False),
                                             ("gemma3", False)])
def test_model_forward_with_the_kernels(family, compiled, monkeypatch):
    """One decode token through a bfloat16 model: q/k/v in one launch, a gated SiLU MLP's gate and up
    in one (not Gemma's GELU MLP), the logits of F.linear within rounding; a two-row batch goes to what
    ran before unchanged, and the model's own forwards are back after."""
    if compiled and not fused_ops.can_compile():
        pytest.skip("torch.compile does not run in this Python")
    # One layer (two of Gemma 3's): the launches repeat per layer, and each costs seconds in the CPU interpreter.
    model = tiny_model(family, dtype=torch.bfloat16, bias_scale=1.0 if family == "qwen2" else 0.0,
                       layers=2 if family == "gemma3" else 1).to(DEVICE)
    ids = torch.randint(0, 128, (1, 1), device=DEVICE)
    pair = torch.randint(0, 128, (2, 1), device=DEVICE)
    launches = _count_launches(monkeypatch)
    with torch.no_grad():
        expected, expected_pair = model(ids).logits.float(), model(pair).logits
        with compiled_small_ops(model, enabled=compiled, backend="eager"), gemv_linears(model):
            got, got_pair = model(ids).logits.float(), model(pair).logits
    assert not any("forward" in vars(m) for m in model.modules())
    layers = model.config.num_hidden_layers
    mlp = ["launch_gemv_silu_mul", "launch_gemv"] if family != "gemma3" else ["launch_gemv"] * 3
    assert launches == (["launch_gemv", "launch_gemv"] + mlp) * layers + ["launch_gemv"]  # + the LM head
    assert torch.equal(got_pair, expected_pair)
    torch.testing.assert_close(got, expected, atol=0.05 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_swapped_modules_compute_what_they_replace(family):
    """Module by module, on one row: q/k/v (one launch) and the gated MLP (silu·up in one launch, then
    down) give their own forwards' outputs within a BF16 rounding of each product."""
    model = tiny_model(family, dtype=torch.bfloat16, bias_scale=1.0 if family == "qwen2" else 0.0).to(DEVICE)
    layer = model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    x = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(5)).to(DEVICE,
                                                                                                 torch.bfloat16)
    with torch.no_grad():
        expected = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x), mlp(x)]
        with gemv_linears(model):
            got = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x), mlp(x)]
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        torch.testing.assert_close(g.float(), e.float(), rtol=2.0**-6, atol=2.0**-6 * e.abs().max().item())


def test_shared_projections_give_each_input_its_own_outputs():
    """Kept outputs serve only calls with the very input they were computed for, in any call order."""
    from oscarkv.integrations.gemv import SharedInputProjections

    linears = [torch.nn.Linear(64, n, bias=False).to(DEVICE, torch.bfloat16) for n in (32, 16, 16)]
    group = SharedInputProjections(linears)
    x, other = (torch.randn(1, 1, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    calls = [(0, x), (1, other), (2, x), (1, x), (0, other), (0, x.clone())]
    with torch.no_grad():
        got = [group.forward(i, inp) for i, inp in calls]
        want = [F.linear(inp, linears[i].weight) for i, inp in calls]
    assert set(group.pending) == {1, 2} and group.source is calls[-1][1]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), rtol=2.0**-7, atol=0.02)
    group.clear()
    assert group.source is None and not group.pending


def test_disabled_swaps_nothing():
    model = tiny_model("llama")
    with gemv_linears(model, enabled=False):
        assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.skipif(DEVICE != "cuda", reason="the static decode path runs the kernels on CUDA only")
@pytest.mark.parametrize("method", ["hadamard", "bf16"])
def test_static_decode_at_batch_one_replays_what_it_runs(method, monkeypatch):
    """Batch-1 static decoding of a bfloat16 model goes through the kernels (kept q/k/v outputs and
    overlapped launches included), and the CUDA graph's replays give the tokens of the eager steps."""
    import oscarkv
    from oscarkv.config import CacheConfig
    from oscarkv.integrations.static_decode import generate_static

    model = tiny_model("qwen3", dtype=torch.bfloat16, head_dim=64, attention_scale=3.0).to(DEVICE)
    oscarkv.patch(model, method=method, cache=CacheConfig(sink_tokens=16, recent_tokens=32, page_size=16))
    ids = torch.randint(0, 128, (1, 70), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    launches = _count_launches(monkeypatch)
    eager = generate_static(model, ids, 30, graphs=False)
    assert "launch_gemv_silu_mul" in launches
    assert torch.equal(generate_static(model, ids, 30, graphs=True), eager)
    assert not any("forward" in vars(m) for m in model.modules())
