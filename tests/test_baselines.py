"""The int4 and fp8 baselines on the same harness as the INT2 methods (tiny model, CPU)."""

import torch

from oscarkv import CacheConfig, QuantConfig
from oscarkv.evaluation.ppl import evaluate_methods
from tiny_models import FAMILIES, VOCAB, tiny_model


def test_int4_and_fp8_sit_between_bf16_and_naive_int2_at_their_true_bits():
    model = tiny_model("llama", head_dim=32, attention_scale=3.0, value_scale=3.0)
    ids = torch.randint(0, VOCAB, (1, 400), generator=torch.Generator().manual_seed(0))
    cache = CacheConfig(sink_tokens=4, recent_tokens=8, window_dtype=torch.float32)
    results = {r.method: r for r in evaluate_methods(model, ids, ["bf16", "naive", "int4", "fp8"],
                                                     QuantConfig(group_size=32), cache, context=200,
                                                     max_tokens=None)}
    bf16 = results["bf16"].ppl
    gap = {name: abs(r.ppl - bf16) for name, r in results.items()}
    assert gap["int4"] < gap["naive"] and gap["fp8"] < gap["naive"]
    assert gap["fp8"] < 0.05 * bf16
    # Bits measured from the stored bytes: 188 history tokens and 12 float32 window tokens of 200.
    assert abs(results["int4"].bits_per_element - (188 * (4 + 32 / 32) + 12 * 32) / 200) < 1e-6
    assert abs(results["fp8"].bits_per_element - (188 * 8 + 12 * 32) / 200) < 1e-6


def test_kivi2_stores_int2_bits_in_whole_token_groups_and_decodes_like_prefill():
    from oscarkv.integrations.transformers import patch_model
    from oscarkv.methods import method_setup

    model = tiny_model("llama", head_dim=32, attention_scale=3.0, value_scale=3.0)
    ids = torch.randint(0, VOCAB, (1, 400), generator=torch.Generator().manual_seed(0))
    cache = CacheConfig(sink_tokens=4, recent_tokens=8, window_dtype=torch.float32)
    results = {r.method: r for r in evaluate_methods(model, ids, ["bf16", "naive", "kivi2"], QuantConfig(group_size=32),
                                                     cache, context=200, max_tokens=None)}
    assert results["kivi2"].ppl != results["bf16"].ppl
    # 200 tokens: sink 4, history 160 (5 groups of 32), recent window 36 (8 + a partial group).
    expected = (160 * (2 + 32 / 32) + 40 * 32) / 200
    assert abs(results["kivi2"].bits_per_element - expected) < 1e-6

    ids = ids[:, :60]
    for family in FAMILIES:  # gemma3: sliding-window layers drop whole groups
        model = tiny_model(family, dtype=torch.float64)
        setup = method_setup("kivi2", model, QuantConfig(group_size=8),
                             CacheConfig(sink_tokens=4, recent_tokens=8, window_dtype=torch.float64))
        patch_model(model, setup.artifact, setup.quant, setup.cache)
        with torch.no_grad():
            full = model(ids).logits
            stepwise = model.oscar.new_cache()
            steps = torch.cat([model(ids[:, i:i + 1], past_key_values=stepwise).logits for i in range(60)], 1)
            chunked = model.oscar.new_cache()
            chunks = torch.cat([model(ids[:, i:i + 13], past_key_values=chunked).logits for i in range(0, 60, 13)], 1)
        assert (steps - full).abs().max() < 1e-9, family
        assert (chunks - full).abs().max() < 1e-9, family
        if family == "llama":
            layer = stepwise.layers[0]
            assert layer.history_k.length == 40 and layer.tail_k.shape[2] == 16  # 4 + 40 + 16 = 60


def test_kivi2_keys_are_quantized_per_channel_over_token_groups():
    from oscarkv.cache.history import ChannelGroupedHistory
    from oscarkv.quant.format import dequantize, quantize

    store = ChannelGroupedHistory(8, 0.0, torch.float16, torch.float32)
    x = torch.randn(2, 3, 16, 32, generator=torch.Generator().manual_seed(1))
    x[:, :, :, 5] += 40.0  # an outlier channel: per-channel groups absorb it
    store.append(x[:, :, :8])
    store.append(x[:, :, 8:])
    expected = torch.cat([dequantize(quantize(x[:, :, g:g + 8].transpose(-1, -2), 2, 8, 0.0, torch.float16),
                                     torch.float32).transpose(-1, -2) for g in (0, 8)], dim=2)
    assert store.length == 16
    assert torch.equal(store.read(torch.float32), expected)
    assert store.nbytes() == 2 * 3 * 16 * 32 * (2 + 32 / 8) // 8
    store.drop_front(8)
    assert torch.equal(store.read(torch.float32), expected[:, :, 8:])


def test_kivi2_refuses_left_padding_and_the_paged_cache():
    import pytest

    from oscarkv.errors import OscarError
    from oscarkv.integrations.transformers import patch_model
    from oscarkv.methods import method_setup

    model = tiny_model("llama")
    setup = method_setup("kivi2", model, QuantConfig(group_size=8), CacheConfig(sink_tokens=4, recent_tokens=8))
    patch_model(model, setup.artifact, setup.quant, setup.cache)
    ids = torch.randint(0, VOCAB, (2, 20))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(OscarError, match="left padding"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    model.oscar.cache = CacheConfig(sink_tokens=4, recent_tokens=8, key_grouping="channel", kernel="paged")
    with pytest.raises(OscarError, match="kivi2"):
        model.oscar.uses_paged(torch.device("cuda"))


def test_a_method_list_that_cannot_run_fails_before_any_method_runs(monkeypatch):
    """`eval ppl --methods bf16,oscar` without an artifact used to score every BF16 window (minutes on a real
    model) and only then refuse 'oscar'; likewise an unknown name or an artifact of another model."""
    import pytest

    import oscarkv.evaluation.ppl as ppl
    from oscarkv.errors import ArtifactError, OscarError
    from oscarkv.methods import check_methods, data_free_artifact

    check_methods(["bf16", "naive", "oscar"], have_artifact=True)
    for names, have, message in [
        ([], False, "no method given"),
        (["bf16", "foo", "bar"], True, "unknown methods 'foo', 'bar'; choose from bf16, oscar,"),
        (["bf16", "oscar"], False, r"method 'oscar' needs a rotations artifact: pass rotations=FILE \(a path or a "
                                   r"RotationArtifact\) \(make one with `oscarkv calibrate MODEL --out FILE`\)\.$"),
        (["oscar", "oscar-paper"], False, "methods 'oscar', 'oscar-paper' need a rotations artifact"),
    ]:
        with pytest.raises(OscarError, match=message):
            check_methods(names, have)
    with pytest.raises(OscarError, match="needs a rotations artifact: pass --rotations FILE \\(make one"):
        check_methods(["oscar"], False, how="pass --rotations FILE")  # the CLI's words

    model = tiny_model("llama", head_dim=32)
    other = data_free_artifact(tiny_model("qwen2", head_dim=32), "hadamard", QuantConfig(group_size=32))
    ids = torch.randint(0, VOCAB, (1, 100), generator=torch.Generator().manual_seed(0))
    scored = []
    monkeypatch.setattr(ppl, "perplexity", lambda *args, **kwargs: scored.append(kwargs["desc"]) or (1.0, 1, 0))
    cache = CacheConfig(sink_tokens=4, recent_tokens=8)
    for methods, artifact, error in [(["bf16", "oscar"], None, OscarError), (["bf16", "naive", "nope"], None, OscarError),
                                     (["bf16", "oscar"], other, ArtifactError)]:
        with pytest.raises(error):
            evaluate_methods(model, ids, methods, QuantConfig(group_size=32), cache, context=50, max_tokens=None,
                             artifact=artifact)
        assert scored == [], methods
    # An artifact the methods do not read is not checked, and every method then runs, in order.
    evaluate_methods(model, ids, ["bf16", "naive"], QuantConfig(group_size=32), cache, context=50, max_tokens=None,
                     artifact=other)
    assert scored == ["bf16", "naive"]
