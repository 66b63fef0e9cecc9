"""The TurboQuant 3-bit baseline (vLLM's turboquant_3bit_nc) on the reference harness."""

from __future__ import annotations

import math

import pytest
import torch

from oscarkv import CacheConfig, QuantConfig
from oscarkv.calibration.rotations import hadamard
from oscarkv.errors import OscarError
from oscarkv.evaluation.ppl import evaluate_methods
from oscarkv.quant import turboquant as tq
from tiny_models import VOCAB, tiny_model


def test_centroids_are_the_gaussian_lloyd_max_levels():
    # The 8-level Lloyd-Max quantizer of N(0, 1) (Max, 1960), scaled by 1/sqrt(D).
    standard = (0.2451, 0.7560, 1.3439, 2.1520)
    for d in (64, 128):
        c = tq.lloyd_max_centroids(d, 3)
        assert len(c) == 8 and all(a < b for a, b in zip(c, c[1:]))
        for value, expected in zip(c[4:], standard):
            assert abs(value * math.sqrt(d) - expected) < 2e-4
        assert all(abs(a + b) < 1e-12 for a, b in zip(c, reversed(c)))


def test_three_bit_packing_layout_and_roundtrip():
    codes = torch.zeros(1, 16, dtype=torch.long)
    codes[0, 0], codes[0, 7], codes[0, 9] = 1, 7, 5
    packed = tq.pack3(codes)
    assert packed.tolist() == [[1, 0, 7 << 5, 5 << 3, 0, 0]]  # code i in bits 3i..3i+2 of each 24-bit word
    x = torch.randint(0, 8, (3, 4, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(tq.unpack3(tq.pack3(x)), x)


def test_keys_take_the_nearest_centroid_of_the_rotated_unit_vector_and_keep_their_norm():
    k = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(1)) * 3
    packed, norm = tq.encode_keys(k)
    assert packed.shape == (5, 2, 24) and packed.dtype == torch.uint8 and norm.dtype == torch.float16
    y = (k / (k.norm(dim=-1, keepdim=True) + 1e-8)) @ hadamard(64, torch.float32)
    centroids = torch.tensor(tq.lloyd_max_centroids(64, 3))
    nearest = (y[..., None] - centroids).abs().argmin(-1)
    assert (tq.unpack3(packed) == nearest).float().mean() > 0.999  # ties at a midpoint may go either way
    k_hat = tq.decode_keys(packed, norm)
    assert torch.allclose(k_hat.norm(dim=-1), norm.float().squeeze(-1), rtol=1e-5)  # norm correction
    cosine = torch.nn.functional.cosine_similarity(k_hat, k, dim=-1)
    assert cosine.min() > 0.95  # 3 bits per coordinate


def test_values_are_three_bit_per_token_groups_over_all_channels():
    v = torch.randn(4, 3, 64, generator=torch.Generator().manual_seed(2))
    packed, scale, low = tq.encode_values(v)
    assert packed.shape == (4, 3, 24) and scale.shape == (4, 3, 1)
    v_hat = tq.decode_values(packed, scale, low)
    step = (v.amax(-1, keepdim=True) - v.amin(-1, keepdim=True)) / 7
    assert ((v_hat - v).abs() <= step / 2 + 1e-2 * step + 2e-3).all()
    assert tq.bits_per_element(64) == 3.375 and tq.bits_per_element(128) == 3.1875


def test_turboquant3_method_on_the_harness_with_boundary_layers_uncompressed():
    model = tiny_model("llama", head_dim=32, attention_scale=3.0, value_scale=3.0, layers=6)
    ids = torch.randint(0, VOCAB, (1, 400), generator=torch.Generator().manual_seed(0))
    cache = CacheConfig(sink_tokens=4, recent_tokens=8, window_dtype=torch.float32)
    results = {r.method: r for r in evaluate_methods(model, ids, ["bf16", "naive", "turboquant3"],
                                                     QuantConfig(group_size=32), cache, context=200,
                                                     max_tokens=None)}
    bf16 = results["bf16"].ppl
    assert results["turboquant3"].ppl != bf16
    assert abs(results["turboquant3"].ppl - bf16) < abs(results["naive"].ppl - bf16)
    # Layers 2 and 3 keep 188 history tokens in TurboQuant (3.75 bits at D = 32) and 12 window tokens in
    # float32; layers 0, 1, 4 and 5 keep everything in float32.
    expected = (2 * (188 * tq.bits_per_element(32) + 12 * 32) + 4 * 200 * 32) / (6 * 200)
    assert abs(results["turboquant3"].bits_per_element - expected) < 1e-6


def test_turboquant3_refuses_the_paged_cache():
    import oscarkv

    model = tiny_model("llama", head_dim=64, layers=6)
    oscarkv.patch(model, method="turboquant3", cache=CacheConfig(kernel="paged"))
    with pytest.raises(OscarError, match="turboquant3"):
        model.oscar.new_cache("cpu")
