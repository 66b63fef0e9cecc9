"""The decode steps' linear kernels (batch 1: matrix-vector; batch 2 to 32: few rows, split-K) against F.linear,
and `gemv_linears` swapping them in and back."""

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


def test_decode_batches_take_the_kernels():
    from oscarkv.kernels.triton_gemv import MAX_ROWS

    linear = torch.nn.Linear(64, 8, bias=False).to(DEVICE, torch.bfloat16)
    for rows in (1, 2, MAX_ROWS):
        assert takes_gemv(linear, torch.randn(rows, 1, 64, device=DEVICE, dtype=torch.bfloat16))
    assert not takes_gemv(linear, torch.randn(MAX_ROWS + 1, 1, 64, device=DEVICE, dtype=torch.bfloat16))
    assert not takes_gemv(linear, torch.randn(0, 1, 64, device=DEVICE, dtype=torch.bfloat16))
    assert not takes_gemv(linear, torch.randn(1, 64, device=DEVICE))  # float32
    assert not takes_gemv(linear.float(), torch.randn(1, 64, device=DEVICE))


# Tiles small enough for the CPU interpreter (4 multiprocessors off CUDA). SMALL_TILE asks for a quarter of a program
# per multiprocessor: one split per tile; SPLIT_TILE asks for 8, so K is split over several programs per tile (split-K)
# wherever there are few tiles.
SMALL_TILE = dict(block_n=16, block_k=32, warps=4, stages=2, waves=0.25)
SPLIT_TILE = dict(block_n=16, block_k=32, warps=4, stages=2, waves=8.0)


def _tile(name: str):
    from oscarkv.kernels.triton_gemv import RowTile

    return RowTile(**{"small": SMALL_TILE, "split": SPLIT_TILE}[name])


@pytest.mark.parametrize("m,n,k", [(2, 7, 40), (5, 33, 300), (32, 20, 130), (3, 70, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile", ["small", "split"])
def test_few_rows_kernel_matches_linear(m, n, k, dtype, tile):
    """Each output element is one row of x times one weight row, summed in float32 and rounded once,
    whether a tile's columns are in one program or split over several (partial sums added in split order)."""
    from oscarkv.kernels.triton_gemv import launch_gemv

    g = torch.Generator().manual_seed(m + n + k)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    launch_gemv(x, w, b, out, tile=_tile(tile))
    expected = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(out.double(), expected, rtol=2.0**-8, atol=1e-3 * k**0.5)


def test_split_k_programs_leave_their_counts_at_zero_and_repeat_exactly():
    """The last program of each tile adds the partial sums and sets the tile's arrival count back to 0, so the
    next launch (or CUDA-graph replay) starts from zeros; the sum does not depend on which program came last."""
    from oscarkv.kernels import triton_gemv
    from oscarkv.kernels.ops import _multiprocessor_count

    tile = _tile("split")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 600, generator=g).to(DEVICE, torch.bfloat16)
    x = torch.randn(3, 600, generator=g).to(DEVICE, torch.bfloat16)
    tiles = -(-40 // tile.block_n)
    splits, _ = tile.splits(tiles, 600, _multiprocessor_count(x.device))
    assert splits > 1
    outs = []
    for _ in range(2):
        outs.append(torch.full((3, 40), float("nan"), dtype=torch.bfloat16, device=DEVICE))
        triton_gemv.launch_gemv(x, w, None, outs[-1], tile=tile)
        counts = triton_gemv._split_counts(x.device, tiles)
        assert not counts.any()
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0].double(), F.linear(x.double(), w.double()), rtol=2.0**-8, atol=0.03)


@pytest.mark.parametrize("tile", ["small", "split"])
@pytest.mark.parametrize("bias", [False, True])
def test_one_few_rows_launch_for_three_weights_equals_three_launches(tile, bias):
    from oscarkv.kernels.triton_gemv import launch_gemv

    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(n, 300, generator=g).to(DEVICE, torch.bfloat16) for n in (33, 8, 7)]
    biases = [torch.randn(n, generator=g).to(DEVICE, torch.bfloat16) if bias else None for n in (33, 8, 7)]
    x = torch.randn(4, 300, generator=g).to(DEVICE, torch.bfloat16)
    fused = torch.full((4 * 48,), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    launch_gemv(x, weights, biases, fused, tile=_tile(tile))
    alone = []
    for w, b in zip(weights, biases):
        alone.append(torch.full((4, w.shape[0]), float("nan"), dtype=torch.bfloat16, device=DEVICE))
        launch_gemv(x, w, b, alone[-1], tile=_tile(tile))
    # each product a contiguous [M, N_i] block after the one before
    assert torch.equal(fused, torch.cat([a.reshape(-1) for a in alone]))


def test_few_rows_launch_refuses_an_output_of_another_layout():
    from oscarkv.kernels.triton_gemv import launch_gemv

    weights = [torch.zeros(n, 64, device=DEVICE, dtype=torch.bfloat16) for n in (16, 8)]
    x = torch.zeros(3, 64, device=DEVICE, dtype=torch.bfloat16)
    for out in (torch.empty(3, 30, device=DEVICE, dtype=torch.bfloat16)[:, :24],  # a column slice
                torch.empty(3, 16, device=DEVICE, dtype=torch.bfloat16)):  # too few elements
        with pytest.raises(ValueError, match="out must be contiguous"):
            launch_gemv(x, weights, [None, None], out)


def test_more_rows_than_the_kernels_take_are_refused():
    from oscarkv.kernels.triton_gemv import MAX_ROWS, launch_gemv, launch_gemv_silu_mul

    w = torch.zeros(8, 64, device=DEVICE, dtype=torch.bfloat16)
    x = torch.zeros(MAX_ROWS + 1, 64, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty(MAX_ROWS + 1, 8, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"1 to {MAX_ROWS} input rows, not {MAX_ROWS + 1}"):
        launch_gemv(x, w, None, out)
    with pytest.raises(ValueError, match=f"1 to {MAX_ROWS} input rows"):
        launch_gemv_silu_mul(x, w, w, out)


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


@pytest.mark.parametrize("m,tile", [(3, "small"), (17, "split")])
def test_few_rows_silu_mul_kernel(m, tile):
    from oscarkv.kernels.triton_gemv import launch_gemv_silu_mul

    g = torch.Generator().manual_seed(m)
    gate, up = (torch.randn(40, 500, generator=g).mul(500**-0.5).to(DEVICE, torch.bfloat16) for _ in range(2))
    x = torch.randn(m, 500, generator=g).to(DEVICE, torch.bfloat16)
    out = torch.full((m, 40), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    launch_gemv_silu_mul(x, gate, up, out, tile=_tile(tile))
    torch.testing.assert_close(out.float(), _reference_silu_mul(x, gate, up).float(), rtol=2.0**-7, atol=1e-6)


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
    """Decode tokens through a bfloat16 model, one row and a batch of two: q/k/v in one launch, a gated SiLU
    MLP's gate and up in one (not Gemma's GELU MLP), the logits of F.linear within rounding; a prompt of
    MAX_ROWS + 1 tokens goes to what ran before unchanged, and the model's own forwards are back after."""
    from oscarkv.kernels.triton_gemv import MAX_ROWS

    if compiled and not fused_ops.can_compile():
        pytest.skip("torch.compile does not run in this Python")
    # One layer (two of Gemma 3's): the launches repeat per layer, and each costs seconds in the CPU interpreter.
    model = tiny_model(family, dtype=torch.bfloat16, bias_scale=1.0 if family == "qwen2" else 0.0,
                       layers=2 if family == "gemma3" else 1).to(DEVICE)
    ids = torch.randint(0, 128, (1, 1), device=DEVICE)
    pair = torch.randint(0, 128, (2, 1), device=DEVICE)
    prompt = torch.randint(0, 128, (1, MAX_ROWS + 1), device=DEVICE)
    launches = _count_launches(monkeypatch)
    with torch.no_grad():
        expected, expected_pair, expected_prompt = (model(i).logits.float() for i in (ids, pair, prompt))
        with compiled_small_ops(model, enabled=compiled, backend="eager"), gemv_linears(model):
            got, got_pair, got_prompt = (model(i).logits.float() for i in (ids, pair, prompt))
    assert not any("forward" in vars(m) for m in model.modules())
    layers = model.config.num_hidden_layers
    mlp = ["launch_gemv_silu_mul", "launch_gemv"] if family != "gemma3" else ["launch_gemv"] * 3
    assert launches == ((["launch_gemv", "launch_gemv"] + mlp) * layers + ["launch_gemv"]) * 2  # + the LM head
    assert torch.equal(got_prompt, expected_prompt)
    for g, e in ((got, expected), (got_pair, expected_pair)):
        torch.testing.assert_close(g, e, atol=0.05 * e.abs().max().item(), rtol=0)


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
    for rows in (1, 3):  # one row: the matrix-vector kernel; more: the few-rows kernel
        x, other = (torch.randn(rows, 1, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        calls = [(0, x), (1, other), (2, x), (1, x), (0, other), (0, x.clone())]
        with torch.no_grad():
            got = [group.forward(i, inp) for i, inp in calls]
            want = [F.linear(inp, linears[i].weight) for i, inp in calls]
        assert set(group.pending) == {1, 2} and group.source is calls[-1][1]
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.is_contiguous()  # the values go to the cache write without a copy
            torch.testing.assert_close(g.float(), w.float(), rtol=2.0**-7, atol=0.02)
        group.clear()
        assert group.source is None and not group.pending


def test_shared_projections_take_a_bias_on_some_of_them():
    """An `oscar` artifact's value mean becomes a v_proj bias on a model without biases: q, k and v still share one
    launch (the others add zeros), and each output is its own projection's, bias included."""
    from oscarkv.integrations.gemv import SharedInputProjections, attention_projections

    linears = [torch.nn.Linear(64, n, bias=i == 2).to(DEVICE, torch.bfloat16) for i, n in enumerate((32, 16, 16))]
    with torch.no_grad():
        linears[2].bias.normal_()
    module = torch.nn.Module()
    module.q_proj, module.k_proj, module.v_proj = linears
    assert attention_projections(module) == linears
    group = SharedInputProjections(linears)
    for rows in (1, 3):
        x = torch.randn(rows, 1, 64, device=DEVICE, dtype=torch.bfloat16)
        with torch.no_grad():
            first = group.forward(0, x)
            assert set(group.pending) == {1, 2}  # one launch computed all three
            got = [first, group.forward(1, x), group.forward(2, x)]
            want = [F.linear(x, m.weight, m.bias) for m in linears]
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w.float(), rtol=2.0**-7, atol=0.02)
        assert (got[2] - F.linear(x, linears[2].weight)).abs().max() > 0.1  # the bias is in
        group.clear()


def test_disabled_swaps_nothing():
    model = tiny_model("llama")
    with gemv_linears(model, enabled=False):
        assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.skipif(DEVICE != "cuda", reason="the static decode path runs the kernels on CUDA only")
@pytest.mark.parametrize("method", ["hadamard", "bf16"])
@pytest.mark.parametrize("batch", [1, 3])
def test_static_decode_replays_what_it_runs(method, batch, monkeypatch):
    """Static decoding of a bfloat16 model at batch 1 (matrix-vector kernels) and 3 (few-rows kernels) goes
    through the kernels (kept q/k/v outputs and overlapped launches included), and the CUDA graph's replays
    give the tokens of the eager steps."""
    import oscarkv
    from oscarkv.config import CacheConfig
    from oscarkv.integrations.static_decode import generate_static

    model = tiny_model("qwen3", dtype=torch.bfloat16, head_dim=64, attention_scale=3.0).to(DEVICE)
    oscarkv.patch(model, method=method, cache=CacheConfig(sink_tokens=16, recent_tokens=32, page_size=16))
    ids = torch.randint(0, 128, (batch, 70), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    launches = _count_launches(monkeypatch)
    eager = generate_static(model, ids, 30, graphs=False)
    assert "launch_gemv_silu_mul" in launches
    assert torch.equal(generate_static(model, ids, 30, graphs=True), eager)
    assert not any("forward" in vars(m) for m in model.modules())
