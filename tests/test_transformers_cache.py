"""The patched model on tiny random models of every family: exactness, decode semantics, padding."""

import pytest
import torch

import oscarkv
from oscarkv import CacheConfig, QuantConfig
from oscarkv.cache.mixed import OscarCache
from oscarkv.errors import OscarError
from oscarkv.quant import Int2Tensor
from tiny_models import FAMILIES, VOCAB, tiny_model

SMALL = dict(sink_tokens=4, recent_tokens=8)


def _ids(n, batch=1, seed=0):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _left_padded(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows a [1, n] and b [1, m] (m < n) as one batch, b left-padded with zeros: (ids, attention mask)."""
    pad = a.shape[1] - b.shape[1]
    ids = torch.cat([a, torch.cat([torch.zeros_like(b[:, :1]).expand(1, pad), b], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


def _random_rotation(d, seed):
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q.float()


def _random_artifact(model, per_head: bool = False):
    """An 'oscar' artifact with random orthogonal rotations: exercises every code path of R_K and R_V.
    per_head: R_K is one random rotation per KV head ([Hkv, d, d])."""
    from oscarkv.methods import data_free_artifact

    artifact = data_free_artifact(model, "identity", QuantConfig(group_size=16))
    artifact.method = "oscar"
    kv_heads = artifact.model.num_kv_heads
    for i, layer in enumerate(artifact.layers):
        d = layer.k_rotation.shape[0]
        layer.k_rotation = _random_rotation(d, 2 * i)
        if per_head:
            layer.k_rotation = torch.stack([_random_rotation(d, 100 * i + h) for h in range(kv_heads)])
        layer.v_rotation = _random_rotation(d, 2 * i + 1)
    return artifact


@pytest.mark.parametrize("family,per_head", [(family, False) for family in FAMILIES] + [("llama", True),
                                                                                        ("qwen2", True)])
def test_rotation_and_absorption_without_quantization_is_exact(family, per_head):
    """Also with one key rotation per KV head: a query head must take the rotation of its own KV head."""
    model = tiny_model(family, bias_scale=1.0 if family == "qwen2" else 0.0)
    ids = _ids(40)
    with torch.no_grad():
        reference = model(ids).logits
    oscarkv.patch(model, _random_artifact(model, per_head), cache=CacheConfig(window_dtype=torch.float32,
                                                                             quantize_history=False, **SMALL))
    with torch.no_grad():
        patched = model(ids).logits
    assert torch.allclose(patched, reference, atol=1e-4, rtol=1e-4), (patched - reference).abs().max()


@pytest.mark.parametrize("family,per_head", [(family, False) for family in FAMILIES] + [("qwen2", True)])
def test_prefill_equals_token_by_token_decode(family, per_head):
    # float64 end to end: any difference would be a semantic one, not rounding.
    model = tiny_model(family, dtype=torch.float64)
    oscarkv.patch(model, _random_artifact(model, per_head), cache=CacheConfig(window_dtype=torch.float64, **SMALL))
    ids = _ids(60)
    with torch.no_grad():
        full = model(ids).logits
        cache = model.oscar.new_cache()
        steps = torch.cat([model(ids[:, i : i + 1], past_key_values=cache).logits for i in range(ids.shape[1])], 1)
        cache = model.oscar.new_cache()
        chunked = torch.cat([model(ids[:, i : i + 13], past_key_values=cache).logits for i in range(0, 60, 13)], 1)
    assert (steps - full).abs().max() < 1e-9
    assert (chunked - full).abs().max() < 1e-9


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_quantization_changes_the_history_only(family):
    model = tiny_model(family, dtype=torch.float64)
    oscarkv.patch(model, _random_artifact(model), cache=CacheConfig(window_dtype=torch.float64, **SMALL))
    ids = _ids(40)
    with torch.no_grad():
        quantized = model(ids).logits
        model.oscar.cache = CacheConfig(window_dtype=torch.float64, quantize_history=False, **SMALL)
        exact = model(ids).logits
    # Until position sink + recent nothing is in the history: identical; after it, different.
    first = SMALL["sink_tokens"] + SMALL["recent_tokens"]
    assert (quantized[:, :first] - exact[:, :first]).abs().max() < 1e-9
    assert (quantized[:, first:] - exact[:, first:]).abs().max() > 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_left_padded_batch_matches_single_rows(family):
    model = tiny_model(family, dtype=torch.float64)
    oscarkv.patch(model, _random_artifact(model), cache=CacheConfig(window_dtype=torch.float64, **SMALL))
    a, b = _ids(50, seed=1)[0], _ids(37, seed=2)[0]
    pad = torch.zeros(13, dtype=torch.long)
    ids = torch.stack([a, torch.cat([pad, b])])
    mask = torch.stack([torch.ones(50, dtype=torch.long), torch.cat([pad, torch.ones(37, dtype=torch.long)])])
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() computes them
        batched = model(ids, attention_mask=mask, position_ids=positions).logits
        alone_a = model(a[None]).logits
        alone_b = model(b[None]).logits
    assert (batched[0] - alone_a[0]).abs().max() < 1e-9
    assert (batched[1, 13:] - alone_b[0]).abs().max() < 1e-9


def test_the_cache_hooks_take_the_cache_under_either_keyword():
    """transformers 5.24 renamed forward's `past_key_values` to `cache`; a cache passed under either
    name is used as it is, and a missing one is created under the name the installed version takes."""
    import inspect

    from oscarkv.integrations.transformers import _inject_cache, _prepare_cache_with_oscar, cache_keyword

    model = tiny_model("llama")
    oscarkv.patch(model, method="naive", quant=QuantConfig(group_size=16), cache=CacheConfig(**SMALL))
    name = cache_keyword(model)
    assert name in inspect.signature(type(model).forward).parameters
    for given in ("cache", "past_key_values"):
        mine = model.oscar.new_cache()
        _, kwargs = _inject_cache(model, (), {given: mine})
        assert kwargs == {given: mine}
        model_kwargs = {given: mine}
        try:
            _prepare_cache_with_oscar(model, model.generation_config, model_kwargs)
        except TypeError:  # transformers' own preparation, called after ours, needs arguments not given here
            pass
        assert model_kwargs == {given: mine}
    _, kwargs = _inject_cache(model, (), {})
    assert list(kwargs) == [name] and isinstance(kwargs[name], OscarCache)


def test_generate_uses_the_int2_cache_and_matches_stepwise_decoding():
    model = tiny_model("llama", dtype=torch.float64)
    oscarkv.patch(model, _random_artifact(model), cache=CacheConfig(window_dtype=torch.float64, **SMALL))
    prompt = _ids(30)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                         return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache, OscarCache)
    layer = cache.layers[0]
    stored = layer.history_k.stored()
    assert isinstance(stored, Int2Tensor) and stored.packed.dtype == torch.uint8
    # 30 prompt tokens + 11 fed back (the 12th is never fed): 41 slots, the last one not yet flushed.
    assert layer.history_k.length == 40 - SMALL["sink_tokens"] - SMALL["recent_tokens"]
    # Greedy tokens equal a manual loop over full forwards (which re-reads the prompt each time).
    seq = prompt
    for _ in range(12):
        with torch.no_grad():
            logits = model(seq).logits[:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out.sequences, seq)


def test_no_dequantized_history_is_kept_between_steps():
    model = tiny_model("llama")
    oscarkv.patch(model, _random_artifact(model), cache=CacheConfig(**SMALL))
    cache = model.oscar.new_cache()
    with torch.no_grad():
        model(_ids(64), past_key_values=cache)
        model(_ids(1), past_key_values=cache)
    for layer in cache.layers:
        floats = [t for t in (layer.sink_k, layer.tail_k) if t.is_floating_point()]
        assert sum(t.shape[2] for t in floats) <= SMALL["sink_tokens"] + SMALL["recent_tokens"] + 1
        assert layer.history_k.length == 65 - SMALL["sink_tokens"] - SMALL["recent_tokens"] - 1
        for part in layer.history_k.parts[:1]:
            assert part.data.dtype == torch.uint8


def test_memory_is_about_eight_times_smaller_than_bf16():
    model = tiny_model("llama", head_dim=64)
    ids = _ids(400)
    sizes = {}
    for method in ("bf16", "naive"):
        oscarkv.patch(model, method=method, quant=QuantConfig(group_size=64))
        cache = model.oscar.new_cache()
        with torch.no_grad():
            model(ids, past_key_values=cache)
        sizes[method] = cache.nbytes()
    expected_bf16 = 2 * 2 * 2 * 400 * 64 * 2  # K+V, layers, kv heads, tokens, dim, bytes
    assert sizes["bf16"] == expected_bf16
    history = 400 - 320
    expected_int2 = 2 * 2 * 2 * (320 * 64 * 2 + history * (64 // 4 + 4))
    assert sizes["naive"] == expected_int2


def test_gemma3_sliding_layers_drop_tokens_beyond_the_window():
    model = tiny_model("gemma3")
    oscarkv.patch(model, method="naive", quant=QuantConfig(group_size=32), cache=CacheConfig(**SMALL))
    cache = model.oscar.new_cache()
    with torch.no_grad():
        model(_ids(100), past_key_values=cache)
        model(_ids(1), past_key_values=cache)
    sliding, full = cache.layers[0], cache.layers[2]
    assert sliding.history_k.length + sliding.tail_k.shape[2] <= 24 + 1
    assert sliding.sink_k.shape[2] == 4
    assert full.history_k.length == 101 - 4 - 8 - 1


def test_right_padding_is_refused_clearly():
    model = tiny_model("llama")
    oscarkv.patch(model, method="naive", quant=QuantConfig(group_size=32))
    ids = _ids(10, batch=2)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    with pytest.raises(OscarError, match="left padding"):
        model(ids, attention_mask=mask)


def test_oscar_without_artifact_names_the_fix():
    with pytest.raises(OscarError, match="oscarkv calibrate"):
        oscarkv.patch(tiny_model("llama"), method="oscar")


def test_crop_beyond_the_recent_window_is_refused():
    model = tiny_model("llama")
    oscarkv.patch(model, method="naive", quant=QuantConfig(group_size=32), cache=CacheConfig(**SMALL))
    cache = model.oscar.new_cache()
    with torch.no_grad():
        model(_ids(40), past_key_values=cache)
        model(_ids(1), past_key_values=cache)  # moves aged tokens to the history
    cache.crop(39)
    assert cache.get_seq_length() == 39
    with pytest.raises(OscarError, match="recent window"):
        cache.crop(10)
