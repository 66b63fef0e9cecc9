"""The paged cache (the GPU kernels' path) inside transformers, on tiny models.

On a CPU the kernels run in the Triton interpreter; the same tests on a GPU run them compiled.
"""

from __future__ import annotations

import pytest
import torch

import oscarkv
from oscarkv import CacheConfig
from oscarkv.cache.mixed import OscarCache
from oscarkv.errors import OscarError
from oscarkv.integrations.paged import PagedOscarCache
from oscarkv.kernels.ops import resolve_backend, triton_available
from test_transformers_cache import _ids, _left_padded, _random_artifact
from tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGED = dict(sink_tokens=16, recent_tokens=32, page_size=16)


def _patched(family: str, kernel: str = "paged", per_head: bool = False, dtype=torch.float32,
             inner: float | None = None):
    """inner: every layer's INT2 keys and values at Lloyd–Max levels with that inner level."""
    model = tiny_model(family, head_dim=64, attention_scale=3.0).to(DEVICE, dtype)
    artifact = _random_artifact(model, per_head)
    artifact.group_size = 64
    for layer in artifact.layers:
        layer.choice.update(inner_k=inner, inner_v=inner)
    oscarkv.patch(model, artifact, quant=oscarkv.QuantConfig(group_size=64), cache=CacheConfig(kernel=kernel, **PAGED))
    return model


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_paged_prefill_equals_reference_cache_before_any_quantization(family):
    # 40 tokens < sink + recent: both caches hold everything in BF16, so only rounding differs.
    model = _patched(family)
    ids = _ids(40).to(DEVICE)
    with torch.no_grad():
        paged_cache = model.oscar.new_cache(DEVICE)
        assert isinstance(paged_cache, PagedOscarCache)
        paged = model(ids, past_key_values=paged_cache).logits
        model.oscar.cache = CacheConfig(kernel="reference", **PAGED)
        reference = model(ids, past_key_values=model.oscar.new_cache(DEVICE)).logits
    assert (paged - reference).abs().max() < 2e-2


@pytest.mark.parametrize("per_head", [False, True])
def test_paged_decode_reads_rotated_keys_as_the_reference_cache_does(per_head):
    """Decode steps over keys the write path rotated (36 tokens < sink + recent: no INT2 yet): the
    paged cache must rotate each query by its KV head's R_K, as the reference cache does."""
    model = _patched("llama", per_head=per_head)
    ids = _ids(36).to(DEVICE)
    logits = {}
    for kernel in ("paged", "reference"):
        model.oscar.cache = CacheConfig(kernel=kernel, **PAGED)
        cache = model.oscar.new_cache(DEVICE)
        with torch.no_grad():
            steps = [model(ids[:, :30], past_key_values=cache).logits[:, -1:]]
            steps += [model(ids[:, i:i + 1], past_key_values=cache).logits for i in range(30, 36)]
        logits[kernel] = torch.cat(steps, 1)
    assert (logits["paged"] - logits["reference"]).abs().max() < 2e-2


@pytest.mark.parametrize("per_head", [False, True])
def test_paged_generation_kernels_equal_torch_references(per_head):
    """A prompt written straight into pages, then greedy decoding across a page flush (at 80):
    Triton kernels vs their torch references (also with one key rotation per KV head)."""
    model = _patched("llama", per_head=per_head)
    ids = _ids(76).to(DEVICE)
    outputs = []
    for backend in ("auto", "torch"):
        state = model.oscar
        cache = PagedOscarCache(state.specs, state.cache, state.kv_heads, state.head_dim, 256, backend=backend)
        with torch.no_grad():
            outputs.append(model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False))
        assert cache.storage.allocator.used_pages == cache.layouts[0].pages_needed(76 + 6 - 1)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("per_head", [False, True])
def test_bfloat16_model_kernels_equal_torch_references(per_head):
    """A bfloat16 model: its keys take the write kernel's bfloat16-piece rotation, prepared once per
    layer. The same 82 tokens (a 76-token prompt into pages, then 6 decode steps across a flush)
    through the Triton kernels and through their torch references give the same logits, up to
    bfloat16 rounding. (Greedy tokens are no test here: this tiny random model's bfloat16 logits tie
    exactly at some steps, with or without the pieces.)"""
    model = _patched("llama", per_head=per_head, dtype=torch.bfloat16)
    ids = _ids(82).to(DEVICE)
    logits = {}
    for backend in ("auto", "torch"):
        state = model.oscar
        cache = PagedOscarCache(state.specs, state.cache, state.kv_heads, state.head_dim, 256, backend=backend)
        with torch.no_grad():
            steps = [model(ids[:, :76], past_key_values=cache).logits[:, -1:]]
            steps += [model(ids[:, i:i + 1], past_key_values=cache).logits for i in range(76, 82)]
        logits[backend] = torch.cat(steps, 1).float()
        assert all(layer.rotation_pieces is not None for layer in cache.layers)
    assert (logits["auto"] - logits["torch"]).abs().max() < 2e-2


def _prompt_then_decode_logits(model, backend: str, ids) -> torch.Tensor:
    state = model.oscar
    cache = PagedOscarCache(state.specs, state.cache, state.kv_heads, state.head_dim, 256, backend=backend)
    with torch.no_grad():
        steps = [model(ids[:, :76], past_key_values=cache).logits[:, -1:]]
        steps += [model(ids[:, i:i + 1], past_key_values=cache).logits for i in range(76, 82)]
    return torch.cat(steps, 1).float()


def test_lloyd_max_levels_through_the_paged_model():
    """An artifact whose INT2 streams take Lloyd–Max levels (`calibrate --levels lloyd`): the paged
    cache writes and reads them with the kernels as its torch references do (a 76-token prompt into
    pages, 6 decode steps across a flush), and the levels reach the logits (they differ from uniform levels)."""
    ids = _ids(82).to(DEVICE)
    model = _patched("llama", inner=0.39)
    assert all(spec.key_inner == 0.39 and spec.value_inner == 0.39 for spec in model.oscar.specs)
    lloyd = {backend: _prompt_then_decode_logits(model, backend, ids) for backend in ("auto", "torch")}
    assert (lloyd["auto"] - lloyd["torch"]).abs().max() < 2e-2
    uniform = _prompt_then_decode_logits(_patched("llama"), "torch", ids)
    assert (uniform - lloyd["torch"]).abs().max() > 1e-2


def test_extend_attention_setting_reaches_the_kernels(monkeypatch):
    """`CacheConfig.extend_attention` picks the path of the paged cache's extend steps (a 70-token prompt
    into pages, then a 40-token chunk over it): each path is called with it, and both give the torch
    reference's logits. The dequantizing path gets its queries rotated straight into float16 (its SDPA's dtype),
    the others in the model's dtype."""
    import oscarkv.integrations.paged as paged
    from oscarkv.kernels.extend import COMPUTE_DTYPE

    seen, dtypes = [], []
    original = paged.attend_step
    monkeypatch.setattr(paged, "attend_step", lambda *a, **kw: seen.append(kw["extend"]) or dtypes.append(a[2].dtype)
                        or original(*a, **kw))
    model = _patched("llama")
    ids = _ids(110).to(DEVICE)
    logits = {}
    for path, backend in (("fused", "auto"), ("dequantize", "auto"), ("auto", "torch")):
        model.oscar.cache = CacheConfig(extend_attention=path, **PAGED)
        state = model.oscar
        cache = PagedOscarCache(state.specs, state.cache, state.kv_heads, state.head_dim, 256, backend=backend)
        seen.clear()
        dtypes.clear()
        with torch.no_grad():
            model(ids[:, :70], past_key_values=cache)
            logits[path] = model(ids[:, 70:], past_key_values=cache).logits.float()
        assert set(seen) == {path}
        dequantized = path == "dequantize" and resolve_backend(backend, torch.device(DEVICE)) != "torch"
        assert set(dtypes) == {COMPUTE_DTYPE if dequantized else next(model.parameters()).dtype}
    for path in ("fused", "dequantize"):
        assert (logits[path] - logits["auto"]).abs().max() < 2e-2


def test_auto_uses_reference_cache_on_cpu():
    model = _patched("llama", kernel="auto")
    if DEVICE == "cpu":
        assert isinstance(model.oscar.new_cache("cpu"), OscarCache)


def _greedy_steps(model, ids, mask, steps):
    """Prefill and `steps` greedy decode steps through one paged cache, positions as generate() gives
    them; returns the logits of every forward, concatenated along the tokens. On a CPU the cache runs the
    kernels' torch references (the kernels are tested against them; the interpreter takes a minute here)."""
    state = model.oscar
    cache = PagedOscarCache(state.specs, state.cache, state.kv_heads, state.head_dim, 256,
                            backend="auto" if DEVICE == "cuda" else "torch")
    logits = []
    for _ in range(steps + 1):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        out = model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache).logits.float()
        logits.append(out)
        ids = out[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_paged_cache_takes_left_padded_batches(family):
    """A left-padded batch gives each row what the row alone gives: the padding is never stored (each slot
    holds its real tokens from position 0) and never read. 97 and 70 tokens put 3 and 1 pages of both rows in
    INT2 (sink 16, ring 32..47); Gemma3's sliding layers (window 24 in the tiny model) take the paged kernel
    already in the prompt."""
    model = _patched(family)
    a, b = _ids(97, seed=1).to(DEVICE), _ids(70, seed=2).to(DEVICE)
    ids, mask = _left_padded(a, b)
    pad = a.shape[1] - b.shape[1]
    with torch.no_grad():
        batched = _greedy_steps(model, ids, mask, 3)
        alone_a = _greedy_steps(model, a, torch.ones_like(a), 3)
        alone_b = _greedy_steps(model, b, torch.ones_like(b), 3)
    assert (batched[0] - alone_a[0]).abs().max() < 2e-3
    assert (batched[1, pad:] - alone_b[0]).abs().max() < 2e-3
    assert torch.isfinite(batched).all()


def test_paged_cache_refuses_right_padding_and_empty_rows():
    model = _patched("llama")
    ids = _ids(10, batch=2).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    with pytest.raises(OscarError, match="left padding"), torch.no_grad():
        model(ids, attention_mask=mask)
    mask[0] = 0
    with pytest.raises(OscarError, match="all padding"), torch.no_grad():
        model(ids, attention_mask=mask)


def test_paged_cache_refuses_unsupported_head_dim():
    model = tiny_model("llama", head_dim=32).to(DEVICE)
    with pytest.raises(OscarError, match="head_dim=32"):
        oscarkv.patch(model, _random_artifact(model), cache=CacheConfig(kernel="paged", **PAGED))
        model.oscar.new_cache(DEVICE)
