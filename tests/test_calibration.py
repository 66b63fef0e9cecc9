"""Calibration on tiny models: statistics, methods, artifacts and the bad-input errors."""

import math

import pytest
import torch

from oscarkv import QuantConfig
from oscarkv.calibration.calibrate import CalibrationConfig, calibrate
from oscarkv.calibration.collect import Collector, attention_mass, collecting
from oscarkv.calibration.rotations import orthogonality_error
from oscarkv.errors import CalibrationError, OscarError, UnsupportedModelError
from tiny_models import VOCAB, tiny_model

CONFIG = CalibrationConfig(chunk_tokens=32, max_chunks=3)
QUANT = QuantConfig(group_size=16)


def _tokens(n, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_query_covariance_pools_gqa_groups_after_rope():
    model = tiny_model("llama")
    seen = {}

    collector = Collector()
    original = collector.observe

    def observe(layer, q, k, v, *window):
        seen.setdefault(layer, []).append(q.double())
        original(layer, q, k, v, *window)

    collector.observe = observe
    ids = _tokens(24)[None]
    with torch.no_grad(), collecting(model, collector):
        model(ids, use_cache=False)
    q = seen[0][0][0]  # [Hq, T, d], after RoPE
    stats = collector.stats[0]
    group = 2  # 4 query heads over 2 KV heads
    for h in range(2):
        qs = q[h * group : (h + 1) * group].reshape(-1, q.shape[-1])
        assert torch.allclose(stats.qq[h], qs.T @ qs)
    assert stats.queries == 24 * group


def test_collecting_restores_the_attention_implementation():
    model = tiny_model("llama")
    with collecting(model, Collector()):
        assert model.config._attn_implementation == "oscar_calibrate"
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("method", ["oscar", "oscar-paper", "ktk", "vtv"])
def test_calibrated_rotations_are_orthogonal_and_recorded(method):
    model = tiny_model("qwen3")
    artifact = calibrate(model, _tokens(200), QUANT, CalibrationConfig(method=method, chunk_tokens=32, max_chunks=3),
                         sources=["random"], show_progress=False)
    assert artifact.method == method
    assert artifact.calibration["tokens"] == 96 and artifact.calibration["warmup_chunks_skipped"] == 1
    for layer in artifact.layers:
        assert orthogonality_error(layer.k_rotation) < 1e-5
        assert orthogonality_error(layer.v_rotation) < 1e-5
        assert torch.all(layer.k_eigenvalues[:-1] >= layer.k_eigenvalues[1:])


def test_oscar_key_rotation_diagonalises_the_query_covariance():
    model = tiny_model("llama")
    tokens = _tokens(200)
    artifact = calibrate(model, tokens, QUANT, CalibrationConfig(method="oscar-paper", chunk_tokens=32, max_chunks=3),
                         show_progress=False)
    # Recompute C_Q on the same chunks; R_K = U·H·P, so U = R_K·Pᵀ·H and UᵀC_QU is diagonal.
    collector = Collector()
    with torch.no_grad(), collecting(model, collector):
        for i in range(1, 4):
            model(tokens[i * 32 : (i + 1) * 32][None], use_cache=False)
    from oscarkv.calibration.rotations import bit_reversal_permutation, hadamard

    layer = artifact.layers[0]
    c_q = collector.stats[0].query_covariance().mean(0)
    p = bit_reversal_permutation(layer.k_eigenvalues)
    u = layer.k_rotation.double() @ p.T @ hadamard(32)
    diagonal = u.T @ c_q @ u
    off = diagonal - torch.diag(torch.diagonal(diagonal))
    assert off.abs().max() < 1e-4 * diagonal.abs().max()
    assert torch.allclose(torch.diagonal(diagonal), layer.k_eigenvalues.double(), rtol=1e-3, atol=1e-6)


def test_data_free_methods_need_no_text():
    model = tiny_model("llama")
    artifact = calibrate(model, _tokens(0), QUANT, CalibrationConfig(method="hadamard"), show_progress=False)
    assert torch.allclose(artifact.layers[0].k_rotation.abs(), torch.full((32, 32), 32**-0.5))


def test_too_little_text_names_the_fix():
    with pytest.raises(CalibrationError, match="warm-up chunk is skipped.*more text"):
        calibrate(tiny_model("llama"), _tokens(70), QUANT, CONFIG, show_progress=False)
    with pytest.raises(CalibrationError, match="0 tokens"):
        calibrate(tiny_model("llama"), _tokens(0), QUANT, CONFIG, show_progress=False)


def test_non_finite_activations_are_reported_with_the_layer():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = math.inf
    with pytest.raises(CalibrationError, match="non-finite keys in layer 1"):
        calibrate(model, _tokens(200), QUANT, CONFIG, show_progress=False)


def test_head_dim_not_a_power_of_two_is_refused():
    model = tiny_model("llama", head_dim=24)
    with pytest.raises(UnsupportedModelError, match="head_dim=24 is not a power of two"):
        calibrate(model, _tokens(200), QuantConfig(group_size=8), CONFIG, show_progress=False)


def test_group_size_must_divide_head_dim():
    with pytest.raises(OscarError, match="does not divide head_dim=32"):
        calibrate(tiny_model("llama"), _tokens(200), QuantConfig(group_size=64), CONFIG, show_progress=False)


def test_patched_model_cannot_be_calibrated_again():
    import oscarkv

    model = oscarkv.patch(tiny_model("llama"), method="naive", quant=QUANT)
    with pytest.raises(OscarError, match="freshly loaded"):
        calibrate(model, _tokens(200), QUANT, CONFIG, show_progress=False)


@pytest.mark.parametrize("window", [None, 5])
def test_attention_mass_is_what_each_key_receives(window):
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)
    mass = attention_mass(q, k, 0.3, window).reshape(2, 9, 2)  # [B, T, Hkv]
    expected = torch.zeros(2, 9, 2, dtype=torch.float64)
    for b in range(2):
        for h in range(4):
            for i in range(9):
                first = 0 if window is None else max(0, i - window + 1)
                p = torch.softmax(0.3 * k[b, h // 2, first:i + 1].double() @ q[b, h, i].double(), 0)
                expected[b, first:i + 1, h // 2] += p
    assert torch.allclose(mass, expected, atol=1e-5)
    assert torch.allclose(mass.sum(1), torch.full((2, 2), 2 * 9.0, dtype=torch.float64))  # each query gives 1


def test_attention_value_weights_change_only_the_value_rotation():
    model = tiny_model("llama")
    runs = {w: calibrate(model, _tokens(200), QUANT, CalibrationConfig(method="oscar-paper", chunk_tokens=32, max_chunks=3,
                                                                       value_weights=w), show_progress=False)
            for w in ("proxy", "attention")}
    assert runs["attention"].calibration["value_weights"] == "attention"
    for proxy, exact in zip(runs["proxy"].layers, runs["attention"].layers):
        assert torch.equal(proxy.k_rotation, exact.k_rotation)
        assert orthogonality_error(exact.v_rotation) < 1e-5
        assert not torch.allclose(proxy.v_rotation, exact.v_rotation, atol=1e-3)
    with pytest.raises(OscarError, match="value_weights"):
        CalibrationConfig(value_weights="exact")


def test_position_offsets_spread_chunks_over_the_context():
    from oscarkv.calibration.calibrate import position_offsets

    assert position_offsets(3, 1024, 8192) == [0, 3584, 7168]
    assert position_offsets(1, 1024, 8192) == [0]
    assert position_offsets(4, 1024, 1024) == [0, 0, 0, 0]  # no room: the chunks start at 0
    with pytest.raises(OscarError, match="positions"):
        CalibrationConfig(positions="everywhere")


def test_spread_positions_move_only_the_key_statistics():
    """Shifted positions change what RoPE does to q and k, not the layers' outputs: μ_V stays, μ_K moves."""
    model = tiny_model("llama")
    runs = {p: calibrate(model, _tokens(200), QUANT, CalibrationConfig(chunk_tokens=32, max_chunks=3, positions=p),
                         show_progress=False)
            for p in ("start", "spread")}
    spread = runs["spread"].calibration
    assert spread["positions"] == "spread"
    assert spread["max_offset"] == model.config.max_position_embeddings - 32 > 0
    assert runs["start"].calibration["max_offset"] == 0
    for start, moved in zip(runs["start"].layers, runs["spread"].layers):
        torch.testing.assert_close(moved.v_mean, start.v_mean, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(moved.k_mean, start.k_mean, atol=1e-3)


def test_drift_check_scores_the_chosen_keys_at_the_end_of_the_context(capsys):
    from oscarkv.cli import print_calibration_report

    model = tiny_model("llama")  # 512 positions: the check runs the held-apart chunk at 480..511
    artifact = calibrate(model, _tokens(200), QUANT, CalibrationConfig(chunk_tokens=32, max_chunks=3),
                         show_progress=False)
    assert artifact.calibration["drift_check_offset"] == 512 - 32
    for layer in artifact.layers:
        assert math.isfinite(layer.choice["error_k_far"]) and layer.choice["error_k_far"] >= 0
    spread = calibrate(model, _tokens(200), QUANT, CalibrationConfig(chunk_tokens=32, max_chunks=3, positions="spread"),
                       show_progress=False)
    assert spread.calibration["drift_check_offset"] == 0
    assert all("error_k_far" not in layer.choice for layer in spread.layers)

    # The report names a layer whose far error is both above 2x its near error and above 0.01.
    first = artifact.layers[0].choice
    first["error_k"], first["error_k_far"] = 0.004, 0.05
    print_calibration_report(artifact)
    err = capsys.readouterr().err
    assert "the key mean drifts with position" in err and "layers 0 (12x)" in err and "key_centering" in err
    first["error_k_far"] = 0.006  # 1.5x: no warning
    for layer in artifact.layers[1:]:
        layer.choice["error_k_far"] = layer.choice["error_k"]
    print_calibration_report(artifact)
    assert "drifts" not in capsys.readouterr().err
