import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oscarkv import CacheConfig, QuantConfig, cache_bits_per_element, dequantize_int2, quantize_int2
from oscarkv.errors import OscarError
from oscarkv.quant import (
    bits_per_element,
    clip_rows,
    dequantize,
    int2_bits_per_element,
    pack_codes,
    pack_int2,
    quantize,
    unpack_codes,
    unpack_int2,
)

dims = st.sampled_from([16, 32, 64, 128, 256])


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 7), d=dims, bits=st.sampled_from([2, 4]), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_roundtrip(rows, d, bits, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, d), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (rows, d * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits), codes)
    if bits == 2:
        assert torch.equal(pack_int2(codes), packed) and torch.equal(unpack_int2(packed), codes)


def test_int4_packing_is_half_planar():
    codes = torch.zeros(8, dtype=torch.uint8)
    codes[2], codes[2 + 4] = 7, 12
    assert pack_codes(codes, 4)[2].item() == 7 | (12 << 4)


def test_packing_is_quarter_planar():
    codes = torch.zeros(16, dtype=torch.uint8)
    codes[1], codes[1 + 4], codes[1 + 8], codes[1 + 12] = 1, 2, 3, 1
    packed = pack_int2(codes)
    assert packed[1].item() == 1 | (2 << 2) | (3 << 4) | (1 << 6)
    assert packed[0].item() == 0


@settings(max_examples=60, deadline=None)
@given(d=dims, group_log=st.integers(2, 8), scale=st.floats(1e-3, 1e3), offset=st.floats(-100, 100),
       scale_dtype=st.sampled_from([torch.float16, torch.float32]), bits=st.sampled_from([2, 4]),
       seed=st.integers(0, 2**31 - 1))
def test_error_within_half_a_step(d, group_log, scale, offset, scale_dtype, bits, seed):
    group = 2**group_log
    if group > d:
        group = d
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, d, generator=g) * scale + offset
    q = quantize(x, bits, group, 0.0, scale_dtype) if bits == 4 else quantize_int2(x, group, 0.0, scale_dtype)
    assert q.packed.shape == (5, 3, d * bits // 8)
    assert q.scale.shape == q.zero.shape == (5, 3, d // group)
    assert q.scale.dtype == scale_dtype
    x_hat = dequantize(q)
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    # scale is (max - min) / (2^bits - 1): the levels span the group exactly.
    span = (x.reshape(5, 3, d // group, group).amax(-1) - x.reshape(5, 3, d // group, group).amin(-1))
    # ... unless floored so that |zero| stays below 2^15 (near-constant groups far from 0).
    absmax = x.abs().reshape(5, 3, d // group, group).amax(-1)
    expected = torch.maximum(span.clamp(min=1e-8) / ((1 << bits) - 1), absmax * 2.0**-15)
    subnormal = 2.0**-24 * 2 if scale_dtype == torch.float16 else 0.0
    assert torch.allclose(q.scale.float(), expected, rtol=2e-3, atol=subnormal + 1e-7 * (abs(offset) + scale))
    step = q.scale.float().repeat_interleave(group, dim=-1)
    # Codes are chosen against the stored (rounded) scale and zero; the only extra error is the
    # rounding of zero itself in the storage dtype, and that of float32 arithmetic.
    zero = q.zero.float().repeat_interleave(group, dim=-1)
    zero_rounding = zero.abs() * (2.0 ** -10 if scale_dtype == torch.float16 else 2.0 ** -23)
    lo = x.reshape(5, 3, d // group, group).amin(-1).repeat_interleave(group, -1)
    hi = x.reshape(5, 3, d // group, group).amax(-1).repeat_interleave(group, -1)
    tol = step * (0.5 + zero_rounding) + 1e-5 * (x.abs() + step) + 2e-3 * (hi - lo)
    assert torch.all((x_hat - x).abs() <= tol)


def test_int4_is_about_five_times_more_accurate_than_int2():
    torch.manual_seed(0)
    x = torch.randn(1000, 128)
    e2 = (dequantize(quantize(x, 2, 64)) - x).pow(2).mean()
    e4 = (dequantize(quantize(x, 4, 64)) - x).pow(2).mean()
    assert e4 < e2 / 20  # (15/3)^2 = 25 times smaller steps squared
    assert bits_per_element(4, 128) == 4.25


def test_unsupported_bits():
    with pytest.raises(OscarError, match="bits=3"):
        quantize(torch.randn(2, 64), 3, 64)


def test_constant_groups_are_exact_enough():
    x = torch.full((2, 64), 3.25)
    assert torch.allclose(dequantize_int2(quantize_int2(x, 64)), x, atol=1e-3)


def test_clip_uses_rank_floor_c_d():
    x = torch.arange(1.0, 65.0)[None]  # |x| = 1..64
    clipped = clip_rows(x, 0.96)  # floor(0.96 * 64) = 61 -> 62nd smallest = 62
    assert clipped.max().item() == 62.0 and clipped.min().item() == 1.0
    assert torch.equal(clip_rows(x, 0.0), x)
    assert clip_rows(-x, 0.5).min().item() == -33.0  # floor(32) -> 33rd smallest


def test_clip_ratio_applies_before_quantization():
    torch.manual_seed(0)
    x = torch.randn(100, 64)
    x[:, 0] = 50.0  # one outlier channel per row
    plain = (dequantize_int2(quantize_int2(x, 64)) - x)[:, 1:].abs().mean()
    clipped = (dequantize_int2(quantize_int2(x, 64, clip_ratio=0.96)) - x)[:, 1:].abs().mean()
    assert clipped < plain / 3


@pytest.mark.parametrize("d,group", [(64, 48), (64, 128), (30, 30)])
def test_bad_shapes_raise(d, group):
    with pytest.raises(OscarError, match="group_size|head_dim"):
        quantize_int2(torch.randn(2, d), group)


def test_integer_input_rejected():
    with pytest.raises(OscarError, match="floating-point"):
        quantize_int2(torch.ones(2, 64, dtype=torch.int32), 64)


def test_empty_input():
    q = quantize_int2(torch.randn(0, 64), 64, clip_ratio=0.96)
    assert dequantize_int2(q).shape == (0, 64)


def test_bits_per_element_matches_the_paper():
    assert int2_bits_per_element(128) == 2.25
    assert int2_bits_per_element(64) == 2.5
    bpe = cache_bits_per_element(131072, CacheConfig(), QuantConfig(group_size=128))
    expected = (320 * 16 + (131072 - 320) * 2.25) / 131072
    assert math.isclose(bpe, expected) and 2.28 < bpe < 2.29
    assert cache_bits_per_element(100, CacheConfig(), QuantConfig()) == 16.0
    assert cache_bits_per_element(1000, CacheConfig(quantize_history=False), QuantConfig()) == 16.0


def test_nbytes_counts_codes_scales_and_zeros():
    q = quantize_int2(torch.randn(10, 128), 64)
    assert q.nbytes() == 10 * (128 // 4) + 10 * 2 * 2 * 2


@pytest.mark.parametrize("kwargs", [dict(group_size=48), dict(group_size=2), dict(clip_ratio_k=1.5),
                                    dict(scale_dtype=torch.bfloat16)])
def test_quant_config_validates(kwargs):
    with pytest.raises(OscarError):
        QuantConfig(**kwargs)


def test_default_group_size_divides_any_head_dim():
    """The default group is the largest power of two up to 128 that divides head_dim, so a head_dim the OSCAR
    rotations refuse (96) fails there, naming the head_dim, not on a group size the user never chose."""
    from oscarkv.errors import UnsupportedModelError

    assert [QuantConfig.for_head_dim(d).group_size for d in (64, 128, 256, 96, 80)] == [64, 128, 128, 32, 16]
    assert QuantConfig.for_head_dim(96, group_size=16).group_size == 16
    with pytest.raises(UnsupportedModelError, match="head_dim=6: no group size of 4 or more divides it"):
        QuantConfig.for_head_dim(6)


def test_layers_bits_per_element_weighs_what_each_layer_holds():
    from oscarkv.quant import layers_bits_per_element

    cache, quant = CacheConfig(), QuantConfig(group_size=128)
    # a full layer at 32K in INT4 and a sliding layer holding 576 tokens in INT2
    bits = layers_bits_per_element([32448, 256], [320, 320], [4, 2], cache, quant)
    expected = (32448 * 4.25 + 256 * 2.25 + 640 * 16) / (32768 + 576)
    assert math.isclose(bits, expected)
    assert layers_bits_per_element([], [], [], cache, quant) == 0.0


def test_lloyd_max_levels_nearest_level_and_readback():
    """Inner levels a: codes are the nearest of 0, 3a, 3 - 3a, 3 (code units), read back there; a = 1/3
    is the uniform grid; a bell-shaped group reads back closer with a little above 1/3."""
    from oscarkv.quant.format import dequantize, inner_levels, quantize, unpack_codes

    x = torch.randn(64, 8, 64, generator=torch.Generator().manual_seed(0))
    uniform = quantize(x, 2, 64)
    assert torch.equal(quantize(x, 2, 64, inner=1 / 3).packed, uniform.packed)
    q = quantize(x, 2, 64, inner=0.38)
    assert torch.equal(q.scale, uniform.scale) and torch.equal(q.zero, uniform.zero)
    units = x / q.scale.float() + q.zero.float()
    levels = inner_levels(0.38)
    nearest = (units[..., None] - levels).abs().argmin(-1)
    codes = unpack_codes(q.packed)
    assert (codes.long() != nearest).float().mean() < 1e-3  # ties and float rounding of the units only
    torch.testing.assert_close(dequantize(q), (levels[codes.long()] - q.zero.float()) * q.scale.float())
    error = {a: (dequantize(quantize(x, 2, 64, inner=a)) - x).pow(2).mean() for a in (None, 0.38)}
    assert error[0.38] < 0.95 * error[None]


@pytest.mark.parametrize("bits,inner,match", [(4, 0.38, "INT2 codes only"), (2, 0.5, "outside"), (2, 0.2, "outside")])
def test_lloyd_max_levels_are_checked(bits, inner, match):
    from oscarkv.quant.format import quantize

    with pytest.raises(OscarError, match=match):
        quantize(torch.randn(2, 64), bits, 64, inner=inner)


def test_lloyd_max_levels_are_linear_in_the_code_bits():
    """level(q) = 3a·(q + kappa·b1), the form the attention kernels compute with raw codes."""
    from oscarkv.quant.format import inner_kappa, inner_levels

    for a in (0.35, 0.38, 0.41):
        q = torch.arange(4, dtype=torch.float32)
        torch.testing.assert_close(3 * a * (q + inner_kappa(a) * (q >= 2).float()), inner_levels(a))
