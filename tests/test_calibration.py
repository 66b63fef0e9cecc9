"""Calibration on tiny models: statistics, methods, artifacts and the bad-input errors."""

import math

import pytest
import torch
import transformers

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


def test_head_dim_96_runs_naive_int2_and_refuses_the_rotations_clearly():
    """A head_dim of 96 takes the default group 32 (`QuantConfig.for_head_dim`): INT2 without a rotation runs
    through `patch` and generates; the Hadamard-based method is refused naming the head_dim and the way out."""
    import oscarkv

    config = transformers.LlamaConfig(hidden_size=192, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=128)
    torch.manual_seed(0)
    model = oscarkv.patch(transformers.LlamaForCausalLM(config).eval(), method="naive")
    out = model.generate(torch.randint(0, 128, (1, 340)), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 343)
    with pytest.raises(UnsupportedModelError, match=r"head_dim=96 is not a power of two.*method 'naive'"):
        oscarkv.patch(transformers.LlamaForCausalLM(config).eval(), method="hadamard")


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


def _fake_layer(kv_heads: int, d: int, seed: int):
    """What `choose_layer` reads of a layer: its rotations (pooled OSCAR = paper here) and means."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(seed)
    rotation = lambda: torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].float()  # noqa: E731
    k_rot, v_rot = rotation(), rotation()
    return SimpleNamespace(k_rotation=k_rot, paper_k_rotation=k_rot, v_rotation=v_rot, paper_v_rotation=v_rot,
                           k_mean=torch.randn(kv_heads, d, generator=g), v_mean=torch.randn(kv_heads, d, generator=g))


def test_per_head_key_choice_is_scored_as_the_rotation_it_stores():
    """Each KV head picks its own key transform; the recorded error equals the error of the stacked
    [Hkv, d, d] rotation scored as one candidate, and is at most that of one transform per layer."""
    from oscarkv.calibration.selection import LayerScorer, choose_layer
    from oscarkv.config import CacheConfig

    from oscarkv.calibration.rotations import hadamard

    kv_heads, group, tokens, d = 3, 2, 96, 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(kv_heads * group, tokens, d, generator=g) * 2
    heads = torch.stack([torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
                         for _ in range(kv_heads)])
    # Keys of ±1 (four INT2 levels hold them exactly) seen through a different rotation per head:
    # head 0 as they are, head 1 through its own OSCAR rotation, head 2 through the Hadamard.
    signs = torch.randint(0, 2, (kv_heads, tokens, d), generator=g).double() * 2 - 1
    k = torch.stack([signs[0], signs[1] @ heads[1].T, signs[2] @ hadamard(d).T]).float()
    v = torch.randn(kv_heads, tokens, d, generator=g)
    quant, cache = QuantConfig(group_size=8), CacheConfig(sink_tokens=4, recent_tokens=8)
    pooled = choose_layer(_fake_layer(kv_heads, d, 2), q, k, v, quant, cache)
    layer = _fake_layer(kv_heads, d, 2)
    choice = choose_layer(layer, q, k, v, quant, cache, head_k_rotation=heads)
    assert choice["error_k"] <= pooled["error_k"] + 1e-12
    assert choice["k_transform"] == "per-head", choice["k_transform"]
    assert choice["k_head_transforms"] == ["identity", "oscar-head", "hadamard"] and not choice["k_centered"]
    assert layer.k_rotation.shape == (kv_heads, d, d)
    assert choice["error_k"] < 1e-4 < pooled["error_k"]
    scorer = LayerScorer(q, k, v, cache.sink_tokens, cache.recent_tokens, quant.group_size)
    mean = layer.k_mean if choice["k_centered"] else None
    stacked = scorer.key_error(layer.k_rotation.double(), mean, choice["clip_k"], 2)
    assert math.isclose(stacked, choice["error_k"], rel_tol=1e-6)
    for h, name in enumerate(choice["k_head_transforms"]):  # head h holds the rotation its name says
        if name == "oscar-head":
            torch.testing.assert_close(layer.k_rotation[h].double(), heads[h], atol=1e-6, rtol=0)
        elif name == "identity":
            torch.testing.assert_close(layer.k_rotation[h], torch.eye(d))


def test_lloyd_max_levels_are_chosen_where_they_lower_the_error():
    """With an inner-level grid, a stream takes Lloyd–Max levels only when some (clip, inner) beats
    the uniform choice, the recorded error is that of the levels it stores, and the uniform error
    is kept beside it."""
    from oscarkv.calibration.selection import LayerScorer, choose_layer
    from oscarkv.config import CacheConfig

    kv_heads, group, tokens, d = 2, 2, 96, 64
    g = torch.Generator().manual_seed(4)
    q = torch.randn(kv_heads * group, tokens, d, generator=g) * 2
    k = torch.randn(kv_heads, tokens, d, generator=g)  # bell-shaped groups: Lloyd–Max levels fit better
    v = torch.randn(kv_heads, tokens, d, generator=g)
    quant, cache = QuantConfig(group_size=64), CacheConfig(sink_tokens=4, recent_tokens=8)
    uniform = choose_layer(_fake_layer(kv_heads, d, 2), q, k, v, quant, cache)
    layer = _fake_layer(kv_heads, d, 2)
    lloyd = choose_layer(layer, q, k, v, quant, cache, inner_grid=(0.37, 0.39))
    assert uniform["inner_k"] is None and uniform["inner_v"] is None
    for kind in ("k", "v"):
        assert lloyd[f"uniform_error_{kind}"] == uniform[f"error_{kind}"]
        if lloyd[f"inner_{kind}"] is None:
            assert lloyd[f"error_{kind}"] == uniform[f"error_{kind}"]
        else:
            assert lloyd[f"inner_{kind}"] in (0.37, 0.39) and lloyd[f"error_{kind}"] < uniform[f"error_{kind}"]
    assert lloyd["inner_k"] is not None
    scorer = LayerScorer(q, k, v, cache.sink_tokens, cache.recent_tokens, quant.group_size)
    mean = layer.k_mean if lloyd["k_centered"] else None
    stored = scorer.key_error(layer.k_rotation.double(), mean, lloyd["clip_k"], 2, lloyd["inner_k"])
    assert math.isclose(stored, lloyd["error_k"], rel_tol=1e-6)
    # A fixed inner level: every stream takes it, on the transform and clip of the uniform choice.
    fixed = choose_layer(_fake_layer(kv_heads, d, 2), q, k, v, quant, cache, inner_fixed=0.4)
    for kind in ("k", "v"):
        assert fixed[f"inner_{kind}"] == 0.4 and fixed[f"clip_{kind}"] == uniform[f"clip_{kind}"]
        assert fixed[f"{kind}_transform"] == uniform[f"{kind}_transform"]
    with pytest.raises(OscarError, match="levels='lloyd'"):
        CalibrationConfig(inner=0.37)
    with pytest.raises(OscarError, match="outside"):
        CalibrationConfig(levels="lloyd", inner=0.6)


def test_per_head_key_rotations_through_calibration_and_the_cache(tmp_path, capsys):
    import oscarkv
    from oscarkv.calibration.artifact import RotationArtifact
    from oscarkv.calibration.rotations import hadamard
    from oscarkv.cli import print_calibration_report

    model = tiny_model("llama")
    runs = {mode: calibrate(model, _tokens(200), QUANT, CalibrationConfig(chunk_tokens=32, max_chunks=3, max_bits=0,
                                                                          key_rotations=mode), show_progress=False)
            for mode in ("layer", "head")}
    head = runs["head"]
    assert head.calibration["key_rotations"] == "head"
    for per_layer, per_head in zip(runs["layer"].layers, head.layers):
        assert per_head.choice["error_k"] <= per_layer.choice["error_k"] + 1e-9
        torch.testing.assert_close(per_head.v_rotation, per_layer.v_rotation)  # values: one rotation per layer
        assert {"c:oscar-head@0", "u:per-head@0"} <= set(per_head.choice["candidates_k"])
    # Tiny random models pick one transform for all heads; give layer 0 a per-head pick by hand.
    first = head.layers[0]
    first.k_rotation = torch.stack([torch.eye(32), hadamard(32).float()])
    first.choice.update(k_transform="per-head", k_head_transforms=["oscar-head", "hadamard"])
    loaded = RotationArtifact.load(head.save(tmp_path / "heads.safetensors"))
    assert loaded.layers[0].k_rotation.shape == (2, 32, 32)
    print_calibration_report(loaded)
    assert "per-head(o/H)" in capsys.readouterr().out
    oscarkv.patch(model, loaded, cache=oscarkv.CacheConfig(sink_tokens=4, recent_tokens=8))
    with torch.no_grad():
        logits = model(_tokens(60)[None]).logits
    assert torch.isfinite(logits).all()
    with pytest.raises(OscarError, match="key_rotations"):
        CalibrationConfig(key_rotations="token")


@pytest.mark.parametrize("inner", [None, 0.37])
def test_lloyd_max_levels_through_calibration_and_the_cache(tmp_path, inner):
    """`calibrate --levels lloyd [--inner A]` end to end: the artifact records the levels, they survive
    save and load, and the patched model's cache layers read them."""
    import oscarkv
    from oscarkv.calibration.artifact import RotationArtifact

    model = tiny_model("llama")
    artifact = calibrate(model, _tokens(200), QUANT, CalibrationConfig(chunk_tokens=32, max_chunks=3, max_bits=0,
                                                                       levels="lloyd", inner=inner),
                         show_progress=False)
    assert artifact.calibration["levels"] == "lloyd" and artifact.calibration["inner"] == inner
    loaded = RotationArtifact.load(artifact.save(tmp_path / "rot.safetensors"))
    chosen = [layer.inner(kind) for layer in loaded.layers for kind in ("k", "v")]
    assert chosen == [layer.choice.get(f"inner_{kind}") for layer in artifact.layers for kind in ("k", "v")]
    if inner is not None:
        assert chosen == [inner] * len(chosen)
    oscarkv.patch(model, loaded, quant=QUANT)
    assert [(s.key_inner, s.value_inner) for s in model.oscar.specs] == [(layer.inner("k"), layer.inner("v"))
                                                                        for layer in loaded.layers]
    with torch.no_grad():
        assert torch.isfinite(model(_tokens(120)[None]).logits).all()
