"""`compiled_small_ops`: the norms, MLPs and rotary embedding swapped for compiled versions, and back."""

from __future__ import annotations

import pytest
import torch

import oscarkv
from oscarkv import CacheConfig
from oscarkv.integrations import fused_ops
from oscarkv.integrations.fused_ops import ROTARY_FUNCTION, compiled_small_ops, rotary_namespaces, small_op_modules
from oscarkv.integrations.static_decode import compiles_small_ops
from tiny_models import FAMILIES, tiny_model

needs_dynamo = pytest.mark.skipif(not fused_ops.can_compile(), reason="torch.compile does not run in this Python")


@needs_dynamo
@pytest.mark.parametrize("family", FAMILIES)
def test_swaps_the_small_ops_in_and_back(family):
    model = tiny_model(family)
    modules = small_op_modules(model)
    namespaces = rotary_namespaces(model)
    originals = [getattr(ns, ROTARY_FUNCTION) for ns in namespaces]
    # every layer's two norms and MLP are found (Qwen3 and Gemma3 add q/k norms, Gemma3 two more)
    assert len(modules) >= 3 * model.config.num_hidden_layers + 1
    assert len(namespaces) == 1
    with torch.no_grad(), compiled_small_ops(model, backend="eager"):
        assert all("forward" in vars(m) for m in modules)
        assert all(getattr(ns, ROTARY_FUNCTION) is not f for ns, f in zip(namespaces, originals))
        model(torch.randint(0, 128, (1, 5)))
    assert not any("forward" in vars(m) for m in modules)
    assert all(getattr(ns, ROTARY_FUNCTION) is f for ns, f in zip(namespaces, originals))


@needs_dynamo
def test_restores_the_model_after_an_error():
    model = tiny_model("qwen3")
    namespace = rotary_namespaces(model)[0]
    original = getattr(namespace, ROTARY_FUNCTION)
    with pytest.raises(RuntimeError, match="inside"):
        with compiled_small_ops(model, backend="eager"):
            raise RuntimeError("inside")
    assert not any("forward" in vars(m) for m in small_op_modules(model))
    assert getattr(namespace, ROTARY_FUNCTION) is original


def test_disabled_changes_nothing():
    model = tiny_model("llama")
    namespace = rotary_namespaces(model)[0]
    original = getattr(namespace, ROTARY_FUNCTION)
    with compiled_small_ops(model, enabled=False):
        assert not any("forward" in vars(m) for m in small_op_modules(model))
        assert getattr(namespace, ROTARY_FUNCTION) is original


@needs_dynamo
def test_leaves_a_forward_someone_else_set_alone():
    model = tiny_model("llama")
    norm = model.model.norm
    own = norm.forward  # a bound method stored on the instance, as a user's own patch would be
    norm.forward = own
    with compiled_small_ops(model, backend="eager"):
        assert vars(norm)["forward"] is own
    assert vars(norm)["forward"] is own


@needs_dynamo
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_compiled_forward_equals_eager(family):
    """Inductor's kernels (CPU here, CUDA in the static decode path) give the eager logits, and the
    compiled code really runs: dynamo captures graphs inside the block."""
    from torch._dynamo.utils import counters

    model = tiny_model(family)
    ids = torch.randint(0, 128, (2, 9))
    torch._dynamo.reset()  # compile afresh, whatever ran before
    with torch.no_grad():
        eager = model(ids).logits
        before = counters["stats"]["unique_graphs"]
        with compiled_small_ops(model):
            compiled = model(ids).logits
        assert counters["stats"]["unique_graphs"] > before
        again = model(ids).logits
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, eager)


def test_static_path_compiles_only_on_cuda_and_when_configured():
    model = oscarkv.patch(tiny_model("llama"), method="bf16")
    assert not compiles_small_ops(model)  # a CPU model: the eager steps stay eager
    assert compiles_small_ops(tiny_model("llama")) is False  # not patched
    if torch.cuda.is_available():
        assert compiles_small_ops(model.cuda())
        model.oscar.cache = CacheConfig(compile_small_ops=False)
        assert not compiles_small_ops(model)


@pytest.mark.parametrize("eager", [False, True])
def test_serve_flag_reaches_the_served_model(monkeypatch, eager):
    """`oscarkv serve --eager-small-ops --cublas` serves the model patched with compile_small_ops=False and
    decode_gemv=False."""
    uvicorn = pytest.importorskip("uvicorn")  # a dependency of oscarkv; absent on the bare GPU machine

    import oscarkv.models
    from oscarkv.cli import main
    from oscarkv.random_models import TokenIdTokenizer

    model = tiny_model("llama", head_dim=128)
    monkeypatch.setattr(oscarkv.models, "load_model", lambda name, device=None: (model, TokenIdTokenizer(128)))
    monkeypatch.setattr(oscarkv.models, "model_config", lambda name: model.config)  # read before the weights
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: None)
    assert main(["serve", "tiny", "--method", "hadamard", "--max-seqs", "2", "--port", "0"]
                + (["--eager-small-ops", "--cublas"] if eager else [])) == 0
    assert model.oscar.cache.compile_small_ops is (not eager)
    assert model.oscar.cache.decode_gemv is (not eager)
