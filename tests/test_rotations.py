import pytest
import torch

from oscarkv.calibration.rotations import (
    bit_reversal_permutation,
    bit_reverse_indices,
    compose_rotation,
    hadamard,
    orthogonality_error,
    sorted_eigh,
)
from oscarkv.errors import UnsupportedModelError


@pytest.mark.parametrize("n", [1, 2, 4, 64, 128, 256])
def test_hadamard_is_orthogonal_and_symmetric(n):
    h = hadamard(n)
    assert orthogonality_error(h) < 1e-12
    assert torch.allclose(h, h.T)
    assert torch.allclose(h.abs(), torch.full_like(h, n**-0.5))


@pytest.mark.parametrize("n", [3, 48, 96, 0])
def test_non_power_of_two_rejected_with_advice(n):
    with pytest.raises(UnsupportedModelError, match="power of two"):
        hadamard(n)


def test_bit_reverse_indices():
    assert bit_reverse_indices(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert sorted(bit_reverse_indices(64).tolist()) == list(range(64))


@pytest.mark.parametrize("d,group", [(64, 16), (128, 64), (128, 32), (256, 64)])
def test_each_group_gets_one_channel_of_every_importance_level(d, group):
    torch.manual_seed(0)
    eigenvalues = torch.rand(d)
    p = bit_reversal_permutation(eigenvalues)
    rank = torch.empty(d, dtype=torch.long)
    rank[torch.argsort(eigenvalues, descending=True)] = torch.arange(d)
    ranks_out = (rank.double() @ p).long()  # importance rank at each output position
    levels = d // group  # consecutive rank blocks of size d/group = importance levels
    for start in range(0, d, group):
        block = ranks_out[start : start + group] // levels
        assert sorted(block.tolist()) == list(range(group))


def test_composed_rotation_is_orthogonal():
    torch.manual_seed(1)
    a = torch.randn(64, 64, dtype=torch.float64)
    values, vectors = sorted_eigh(a @ a.T)
    assert torch.all(values[:-1] >= values[1:])
    r = compose_rotation(vectors, values)
    assert orthogonality_error(r) < 1e-10
    assert orthogonality_error(r.float()) < 1e-5


@pytest.mark.parametrize("layout", ["heads_then_tokens", "tokens_then_heads"])
def test_rotate_heads_gives_each_query_head_the_rotation_of_its_kv_head(layout):
    from oscarkv.calibration.rotations import rotate_heads

    g = torch.Generator().manual_seed(0)
    kv_heads, group, d = 3, 2, 8
    rotations = torch.stack([torch.linalg.qr(torch.randn(d, d, generator=g))[0] for _ in range(kv_heads)])
    x = torch.randn(2, kv_heads * group, 5, d, generator=g)  # [B, Hq, n, d]
    expected = torch.stack([x[:, h] @ rotations[h // group] for h in range(kv_heads * group)], dim=1)
    if layout == "heads_then_tokens":
        out = rotate_heads(x, rotations, head_axis=1)
    else:  # [T, H, d]
        out = rotate_heads(x[0].transpose(0, 1), rotations, head_axis=1).transpose(0, 1)[None]
        expected = expected[:1]
    torch.testing.assert_close(out, expected)
    assert out.is_contiguous() or layout == "tokens_then_heads"
    torch.testing.assert_close(rotate_heads(x, rotations[0], head_axis=1), x @ rotations[0])  # one for all
