"""CacheConfig(key_centering="rope"): history keys centered by the RoPE-turned key mean of their block."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import oscarkv
from oscarkv import CacheConfig, QuantConfig, rope
from oscarkv.calibration.calibrate import CalibrationConfig, calibrate
from oscarkv.errors import OscarError
from oscarkv.kernels.reference import stored_kv_reference
from oscarkv.models import attention_shape
from tiny_models import VOCAB, tiny_model

QUANT = QuantConfig(group_size=16)
SMALL = CacheConfig(sink_tokens=4, recent_tokens=16)
CHUNK = 64


def _tokens(n, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _calibrated(model, **config):
    cfg = CalibrationConfig(chunk_tokens=CHUNK, max_chunks=3, **config)
    return calibrate(model, _tokens(600), QUANT, cfg, show_progress=False, cache=SMALL)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_turn_is_the_models_rope(family):
    model = tiny_model(family)
    layer_type = attention_shape(model).layer_types[-1]
    x = torch.randn(2, 32, dtype=torch.float64)
    rotary = model.model.rotary_emb
    for position in (0, 1, 77, 500):
        ids = torch.tensor([[position]])
        cos, sin = rotary(x[None].float(), ids, layer_type) if family == "gemma3" else rotary(x[None].float(), ids)
        expected, _ = apply_rotary_pos_emb(x[None].float(), x[None].float(), cos, sin, unsqueeze_dim=0)
        turned = rope.turn(x, position * rope.inverse_frequencies(model, layer_type))
        torch.testing.assert_close(turned.float(), expected.reshape(2, 32), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_config_frequencies_are_the_rotary_modules(family):
    """vLLM's plugin has the model config but no transformers rotary module."""
    model = tiny_model(family)
    torch.testing.assert_close(rope.config_inverse_frequencies(model.config, 32), rope.inverse_frequencies(model),
                               rtol=1e-6, atol=0)
    scaled = type(model.config)(**{**model.config.to_dict(), "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(OscarError, match="plain RoPE"):
        rope.config_inverse_frequencies(scaled, 32)


def test_mean_shifts_turn_the_mean_by_each_block_offset():
    inv_freq = torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64)
    mean = torch.randn(3, 8, dtype=torch.float64)
    shifts = rope.mean_shifts(mean, inv_freq, block=100, max_positions=250)
    assert shifts.shape == (3, 3, 8)
    assert shifts[0].abs().max() == 0  # block 0 is where calibration measured the mean
    torch.testing.assert_close(shifts[2] + mean, rope.turn(mean, 200 * inv_freq))
    index = torch.tensor([[-3, 0, 99, 100, 249, 10_000]])
    rows = rope.shift_rows(shifts, index, 100)
    assert rows.shape == (1, 6, 3, 8)
    for i, block in enumerate([0, 0, 0, 1, 2, 2]):  # clamped at both ends
        assert torch.equal(rows[0, i], shifts[block])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_rope_centering_without_quantization_is_exact_in_prefill_and_decode(family):
    model = tiny_model(family, bias_scale=3.0 if family == "qwen2" else 0.0)
    artifact = _calibrated(model)
    ids = _tokens(300, seed=3)[None]
    with torch.no_grad():
        reference = model(ids).logits
    cache = CacheConfig(sink_tokens=4, recent_tokens=16, window_dtype=torch.float32, quantize_history=False,
                        key_centering="rope")
    oscarkv.patch(model, artifact, cache=cache)
    assert any(spec.k_mean_shifts is not None and spec.k_mean_shifts[1:].abs().max() > 0
               for spec in model.oscar.specs)
    with torch.no_grad():
        whole = model(ids).logits
        kv = model.oscar.new_cache()
        steps = [model(ids[:, :200], past_key_values=kv).logits]
        for t in range(200, 300):
            steps.append(model(ids[:, t:t + 1], past_key_values=kv).logits)
    scale = max(1.0, reference.abs().max().item())
    assert (whole - reference).abs().max() < 1e-4 * scale
    assert (torch.cat(steps, dim=1) - reference).abs().max() < 1e-4 * scale


def _drifting_bias_model(head_dim=32):
    """Keys with a large offset on a mid-frequency RoPE pair (as Qwen2's k_proj bias has): after RoPE
    the offset turns by ~0.5 rad per 64 positions, so a mean taken at positions 0-63 goes stale."""
    model = tiny_model("qwen2", head_dim=head_dim, attention_scale=3.0, value_scale=3.0)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.self_attn.k_proj.bias.view(-1, head_dim)
            for pair in range(head_dim // 4, head_dim // 4 + head_dim // 32):  # inv_freq ~ 10000^(-1/2) = 0.01
                bias[:, pair] += 20.0
                bias[:, pair + head_dim // 2] -= 12.0
    return model


def _history_keys(model, artifact, ids, **cache):
    """Layer 0's history keys as read back ([B, Hkv, n, d], rotated basis, shifts added back)."""
    oscarkv.patch(model, artifact, cache=CacheConfig(sink_tokens=4, recent_tokens=16, **cache))
    kv = model.oscar.new_cache()
    with torch.no_grad():
        model(ids, past_key_values=kv)
        model(ids[:, :1], past_key_values=kv)  # flushes the prompt's aged tail into the history
    return kv.layers[0].history_keys(torch.float32), kv.layers[0].history_start


def test_rope_centering_keeps_far_keys_as_well_centered_as_near_ones():
    model = _drifting_bias_model()
    artifact = _calibrated(model)
    ids = _tokens(500, seed=5)[None]
    exact, start = _history_keys(model, artifact, ids, window_dtype=torch.float32, quantize_history=False)
    far = slice(3 * CHUNK - start, None)  # positions >= 192: past the calibrated ones

    def far_error(centering):
        keys, _ = _history_keys(model, artifact, ids, key_centering=centering)
        return (keys - exact)[:, :, far].pow(2).sum().item() / exact[:, :, far].pow(2).sum().item()

    fixed, turned = far_error("fixed"), far_error("rope")
    assert turned < 0.3 * fixed, (turned, fixed)


def test_calibration_drift_check_scores_the_turned_mean():
    """The drift check re-scores the far chunk with the mean turned to its positions: back to the near error."""
    artifact = _calibrated(_drifting_bias_model())
    assert artifact.calibration["drift_check_offset"] == 512 - CHUNK
    centered = [layer.choice for layer in artifact.layers if layer.k_mean is not None]
    assert centered
    for choice in centered:
        assert choice["error_k_far"] > 3 * choice["error_k_far_rope"], choice
        assert choice["error_k_far_rope"] < 1.5 * choice["error_k"], choice


def test_paged_cache_shifts_far_keys_as_the_reference_cache_does():
    """The paged cache (its torch reference here, the kernels on a GPU) with key_centering="rope"."""
    model = _drifting_bias_model(head_dim=64)
    artifact = _calibrated(model)
    ids = _tokens(500, seed=5)[None]
    layout = dict(sink_tokens=16, recent_tokens=16, page_size=16)
    oscarkv.patch(model, artifact, cache=CacheConfig(**layout, window_dtype=torch.float32, quantize_history=False,
                                                     kernel="reference"))
    centered = next(i for i, layer in enumerate(artifact.layers) if layer.k_mean is not None)
    kv = model.oscar.new_cache()
    with torch.no_grad():
        model(ids, past_key_values=kv)
    first = kv.layers[centered]
    assert first.history_k.length == 0  # one forward: every key is still in the (float32) windows
    exact = torch.cat([first.sink_k, first.tail_k], dim=2)[0]  # [Hkv, 500, d]: (k - μ_K)·R_K

    def far_error(centering):
        oscarkv.patch(model, artifact, cache=CacheConfig(**layout, kernel="paged", key_centering=centering))
        paged = model.oscar.new_cache()
        with torch.no_grad():
            model(ids, past_key_values=paged)
        layer = paged.storage.layers[centered]
        assert (layer.key_shifts is not None) == (centering == "rope")
        end = layer.layout.history_end(500)
        keys, _ = stored_kv_reference(layer, paged.storage.block_table, paged.slots[0], 500, end)
        far = slice(3 * CHUNK, end)
        return (keys[:, far] - exact[:, far]).pow(2).sum().item() / exact[:, far].pow(2).sum().item()

    fixed, turned = far_error("fixed"), far_error("rope")
    assert turned < 0.3 * fixed, (turned, fixed)


def test_rope_centering_is_refused_where_it_cannot_hold():
    model = tiny_model("llama")
    spread = _calibrated(model, positions="spread")
    start = _calibrated(model)
    with pytest.raises(OscarError, match="positions='spread'"):
        oscarkv.patch(model, spread, cache=CacheConfig(key_centering="rope"))
    oscarkv.patch(model, spread)  # the default, "auto", keeps the fixed mean there
    assert all(spec.k_mean_shifts is None for spec in model.oscar.specs)
    oscarkv.patch(model, start)  # and turns it where it applies
    assert any(spec.k_mean_shifts is not None for spec in model.oscar.specs)
    with pytest.raises(OscarError, match="key_centering"):
        CacheConfig(key_centering="moving")
