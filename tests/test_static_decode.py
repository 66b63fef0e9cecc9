"""The static decode path (`StaticDecoder`, `generate_static`) against transformers' generate.

On a CPU the static steps run eagerly (no CUDA graph) through the same buffers and frozen
cache metadata; on a GPU the same tests also capture and replay the graph.
"""

from __future__ import annotations

import pytest
import torch

import oscarkv
from oscarkv import CacheConfig
from oscarkv.errors import OscarError
from oscarkv.integrations.paged import PagedOscarCache
from oscarkv.integrations.slots import DenseSlotCache, SlotError
from oscarkv.integrations.static_decode import (StaticDecoder, _sampling, forward_slots, generate_static,
                                                slot_cache_for, static_generate_arguments, stop_at_eos)
from oscarkv.sampling import Sampling, repetition_penalized
from transformers import GenerationConfig
from oscarkv.kernels.ops import triton_available
from test_transformers_cache import _ids, _left_padded, _random_artifact
from tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGED = dict(sink_tokens=16, recent_tokens=32, page_size=16)
GRAPHS = [False, True] if DEVICE == "cuda" else [False]
# The paged kernels in the CPU interpreter take minutes for these runs; their torch references
# (tested against the kernels in test_kernels.py) exercise the same static-path logic.
PAGED_BACKEND = "auto" if DEVICE == "cuda" else "torch"


def _model(method: str, per_head: bool = False, centered: bool = False):
    """centered: the artifact centers keys and values as a calibrated one does (random means, start positions in
    16-token chunks), so the paged cache takes RoPE-following key shifts that change every page, and the values'
    mean becomes a v_proj bias."""
    model = tiny_model("llama", head_dim=64, attention_scale=3.0).to(DEVICE)
    if method == "bf16":
        return oscarkv.patch(model, method="bf16", cache=CacheConfig(**PAGED))
    artifact = _random_artifact(model, per_head)
    artifact.group_size = 64
    if centered:
        gen = torch.Generator().manual_seed(7)
        for layer in artifact.layers:
            layer.k_mean = 2.0 * torch.randn(artifact.model.num_kv_heads, 64, generator=gen)
            layer.v_mean = 0.5 * torch.randn(artifact.model.num_kv_heads, 64, generator=gen)
        artifact.calibration = {"tokens": 0, "sources": [], "positions": "start", "chunk_tokens": PAGED["page_size"]}
    return oscarkv.patch(model, artifact, quant=oscarkv.QuantConfig(group_size=64),
                         cache=CacheConfig(kernel="paged", **PAGED))


@pytest.mark.parametrize("graphs,per_head,centered", [(graphs, False, False) for graphs in GRAPHS]
                         + [(GRAPHS[-1], True, False), (GRAPHS[-1], False, True)])
def test_int2_static_generation_equals_transformers_generate(graphs, per_head, centered):
    """70-token prompts, 30 new tokens: ring flushes at 80 and 96 happen inside the static steps
    (also with one key rotation per KV head, and with a centered artifact's key shifts and value bias)."""
    model = _model("oscar", per_head, centered)
    ids = _ids(70, batch=2).to(DEVICE)
    state = model.oscar
    if centered:
        assert all(spec.k_mean_shifts is not None and spec.k_mean_shifts.shape[0] > 1 for spec in state.specs)
    cache = PagedOscarCache(state.specs, state.cache, state.kv_heads, state.head_dim, 100, backend=PAGED_BACKEND)
    with torch.no_grad():
        reference = type(model).generate(model, ids, past_key_values=cache, max_new_tokens=30, do_sample=False)
    static = generate_static(model, ids, 30, graphs=graphs, backend=PAGED_BACKEND)
    assert torch.equal(static, reference)


@pytest.mark.parametrize("graphs", GRAPHS)
def test_repetition_penalty_equals_transformers_generate(graphs):
    """transformers' repetition penalty (over the prompt and the new tokens) on the static path: the tokens of
    transformers' loop over the same cache, and not the unpenalized ones."""
    model = _model("oscar")
    ids = _ids(40, batch=2).to(DEVICE)
    state = model.oscar
    cache = PagedOscarCache(state.specs, state.cache, state.kv_heads, state.head_dim, 80, backend=PAGED_BACKEND)
    with torch.no_grad():
        reference = type(model).generate(model, ids, past_key_values=cache, max_new_tokens=20, do_sample=False,
                                         repetition_penalty=1.8)
    static = generate_static(model, ids, 20, graphs=graphs, backend=PAGED_BACKEND, repetition_penalty=1.8,
                             eos_token_id=model.generation_config.eos_token_id)  # row 0 ends at EOS here
    assert torch.equal(static, reference)
    assert not torch.equal(static, generate_static(model, ids, 20, graphs=graphs, backend=PAGED_BACKEND))


def test_repetition_penalized_equals_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4)) * 3  # both signs
    ids = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(5))
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter_(1, ids, True)
    expected = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    assert torch.equal(repetition_penalized(logits, seen, 1.7), expected)


@pytest.mark.parametrize("graphs", GRAPHS)
def test_bf16_static_generation_equals_transformers_generate(graphs):
    model = _model("bf16")
    ids = _ids(40, batch=2).to(DEVICE)
    with torch.no_grad():
        reference = type(model).generate(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                         do_sample=False)
    assert torch.equal(generate_static(model, ids, 20, graphs=graphs), reference)


@pytest.mark.parametrize("method", ["oscar", "bf16"])
def test_decoding_in_two_runs_equals_one_run(method):
    """thaw() leaves the cache as step-by-step decoding would: a second static run continues exactly."""
    model = _model(method)
    ids = _ids(50).to(DEVICE)
    runs = []
    for split in ([12], [5, 7]):
        cache = slot_cache_for(model, 1, 100, PAGED_BACKEND if method == "oscar" else "auto")
        slot = cache.open(100)
        last = forward_slots(model, cache, [slot], ids).argmax(dim=-1)
        tokens = [last]
        decoder = StaticDecoder(model, cache, graphs=False)
        for steps in split:
            new = decoder.decode([slot], last, steps)
            tokens.append(new[0])
            last = new[:, -1]
        assert cache.length(slot) == 50 + 12
        runs.append(torch.cat(tokens))
    assert torch.equal(runs[0], runs[1])


def test_frozen_cache_refuses_a_new_batch_and_overflow():
    model = _model("oscar")
    cache = slot_cache_for(model, 2, 64)
    slots = [cache.open(64), cache.open(64)]
    cache.set_batch(slots)
    cache.freeze(4)
    with pytest.raises(OscarError, match="static decode"):
        cache.set_batch(slots[:1])
    cache.thaw(0)
    dense = DenseSlotCache(2, 1, 16, device=DEVICE)
    slot = dense.open(16)
    dense.set_batch([slot])
    with pytest.raises(SlotError, match="max_context=16"):
        dense.freeze(17)


@pytest.mark.parametrize("method", ["oscar", "bf16"])
def test_left_padded_static_generation_equals_each_row_alone(method):
    """Each padded row reads its prompt without the padding; the rows then decode together from different
    lengths (71 and 52 tokens: flushes at different steps) and give what each row gives alone."""
    model = _model(method)
    a, b = _ids(71, seed=3).to(DEVICE), _ids(52, seed=4).to(DEVICE)
    ids, mask = _left_padded(a, b)
    pad = a.shape[1] - b.shape[1]
    backend = PAGED_BACKEND  # the dense cache's decode kernel too: the torch reference on a CPU
    batched = generate_static(model, ids, 25, attention_mask=mask, backend=backend)
    assert torch.equal(batched[0], generate_static(model, a, 25, backend=backend)[0])
    assert torch.equal(batched[1, pad:], generate_static(model, b, 25, backend=backend)[0])
    mask[1] = 0
    with pytest.raises(OscarError, match="all padding"):
        generate_static(model, ids, 5, attention_mask=mask, backend=backend)


def test_stop_at_eos_matches_greedy_search():
    new = torch.tensor([[1, 5, 2, 3], [5, 1, 1, 1]])
    assert stop_at_eos(new, 5, 0).tolist() == [[1, 5], [5, 0]]  # every row stopped: ends at the last EOS
    assert stop_at_eos(new, [7, 5], None).tolist() == [[1, 5], [5, 7]]  # pad defaults to the first EOS id
    assert stop_at_eos(torch.tensor([[1, 5, 2], [4, 1, 1]]), 5, 0).tolist() == [[1, 5, 0], [4, 1, 1]]
    assert torch.equal(stop_at_eos(new, None, 0), new)


def test_generate_routes_only_plain_greedy_calls_on_cuda():
    model = _model("oscar")
    ids = _ids(20).to(DEVICE)
    arguments = static_generate_arguments(model, (ids,), {"max_new_tokens": 4})
    if DEVICE == "cpu":
        assert arguments is None  # transformers' loop on the CPU
        return
    assert arguments["max_new_tokens"] == 4 and arguments["input_ids"] is ids
    sampled = static_generate_arguments(model, (ids,), {"max_new_tokens": 4, "do_sample": True, "top_p": 0.9})
    assert sampled["sampling"] == Sampling(1.0, 50, 0.9)  # transformers' defaults where the call sets nothing
    copies = static_generate_arguments(model, (ids,), {"max_new_tokens": 4, "do_sample": True,
                                                       "num_return_sequences": 3})
    assert copies["input_ids"] is ids and copies["copies"] == 3
    penalized = static_generate_arguments(model, (ids,), {"max_new_tokens": 4, "repetition_penalty": 1.2})
    assert penalized["repetition_penalty"] == 1.2
    for extra in ({"num_return_sequences": 2}, {"num_beams": 2}, {"no_repeat_ngram_size": 2}, {"streamer": object()}, {"min_p": 0.1},
                  {"attention_mask": torch.cat([torch.ones_like(ids[:, :1]), torch.zeros_like(ids[:, 1:])], 1)}):
        assert static_generate_arguments(model, (ids,), {"max_new_tokens": 4, **extra}) is None
    left_padded = torch.cat([torch.zeros_like(ids[:, :3]), torch.ones_like(ids[:, 3:])], 1)
    assert static_generate_arguments(model, (ids,), {"max_new_tokens": 4, "attention_mask": left_padded}) is not None
    model.oscar.cache = CacheConfig(kernel="paged", static_decode=False, **PAGED)
    assert static_generate_arguments(model, (ids,), {"max_new_tokens": 4}) is None


def test_sampling_settings_come_from_the_call_then_the_config():
    config = GenerationConfig(temperature=0.6, top_k=20)
    assert _sampling(config, {"top_p": 0.8}) == Sampling(0.6, 20, 0.8)
    assert _sampling(config, {"temperature": 1.3, "top_k": 0}) == Sampling(1.3, 0, 1.0)
    assert _sampling(GenerationConfig(), {}) == Sampling(1.0, 50, 1.0)
    assert _sampling(GenerationConfig(typical_p=0.5), {}) is None  # a filter the static path does not apply
    assert _sampling(GenerationConfig(), {"temperature": 0.0}) is None  # transformers' loop names the problem


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (6, 1.0), (0, 0.8), (6, 0.8)])
def test_sampling_draws_from_transformers_filtered_distribution(top_k, top_p):
    """Sampling.choose on 40,000 copies of one row: token frequencies match the softmax of the logits after
    transformers' own temperature, top_k and top_p warpers, within 4 standard errors; filtered tokens never come."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(2)) * 2
    warped = TemperatureLogitsWarper(0.8)(None, logits)
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1:
        warped = TopPLogitsWarper(top_p)(None, warped)
    expected = torch.softmax(warped, dim=-1)[0]
    n = 40000
    torch.manual_seed(0)
    drawn = Sampling(0.8, top_k, top_p).choose(logits.expand(n, -1).to(DEVICE))[:, 0].cpu()
    counts = torch.bincount(drawn, minlength=40) / n
    assert ((counts - expected).abs() <= 4 * (expected * (1 - expected) / n).sqrt() + 1e-4).all()
    assert counts[expected == 0].sum() == 0


@pytest.mark.parametrize("graphs", GRAPHS)
def test_sampled_static_generation_is_seeded_and_top_k_1_is_greedy(graphs):
    model = _model("oscar")
    ids = _ids(50, batch=2).to(DEVICE)
    greedy = generate_static(model, ids, 12, graphs=graphs, backend=PAGED_BACKEND)
    assert torch.equal(generate_static(model, ids, 12, graphs=graphs, backend=PAGED_BACKEND,
                                       sampling=Sampling(top_k=1)), greedy)
    hot = Sampling(temperature=1.5)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(generate_static(model, ids, 12, graphs=graphs, backend=PAGED_BACKEND, sampling=hot))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2]) and not torch.equal(runs[0], greedy)


@pytest.mark.skipif(DEVICE != "cuda", reason="generate() takes the static path on CUDA only")
def test_sampled_generate_with_copies_runs_the_static_path():
    """generate(do_sample=True, num_return_sequences=3) is the static path with copies=3: the same tokens as
    generate_static from the same seed, in transformers' row order (the copies of a prompt together)."""
    model = _model("oscar")
    ids = _ids(30, batch=2).to(DEVICE)
    settings = dict(do_sample=True, temperature=1.5, max_new_tokens=8, pad_token_id=0)
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_return_sequences=3, **settings)
    torch.manual_seed(0)
    expected = generate_static(model, ids, 8, pad_token_id=0, sampling=Sampling(1.5, 50, 1.0), copies=3)
    assert torch.equal(out, expected) and out.shape == (6, 38)
    assert torch.equal(out[:, :30], ids.repeat_interleave(3, dim=0))
    assert len({tuple(row) for row in out[:3, 30:].tolist()}) > 1  # the copies of a prompt sample apart


@pytest.mark.parametrize("method", ["oscar", "bf16"])
def test_copies_read_each_prompt_once_and_equal_the_repeated_batch(method):
    """copies=3 (num_return_sequences) reads each of two prompts once, the second left-padded, and forks it:
    greedy and seeded sampled tokens equal those of the batch with every prompt repeated three times. The
    prompt reaches the INT2 history pages, which the copies share."""
    model = _model(method)
    ids = _ids(150, batch=2).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    forwards = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: forwards.append(args[0].shape))
    try:
        for sampling in (None, Sampling(temperature=1.5)):
            runs = []
            for batch, copies in ((ids, 3), (ids.repeat_interleave(3, dim=0), 1)):
                forwards.clear()
                torch.manual_seed(0)
                runs.append(generate_static(model, batch, 10, graphs=False, backend=PAGED_BACKEND, sampling=sampling,
                                            attention_mask=mask.repeat_interleave(4 - copies, dim=0), copies=copies))
                if copies == 3:
                    assert forwards[:2] == [(1, 150), (1, 141)]  # each prompt read once, then decode steps of 6
                    assert all(shape == (6, 1) for shape in forwards[2:])
            assert torch.equal(runs[0], runs[1]) and runs[0].shape == (6, 160)
    finally:
        hook.remove()


def test_generate_static_refuses_bad_requests():
    model = _model("oscar")
    with pytest.raises(OscarError, match="max_new_tokens=0"):
        generate_static(model, _ids(10).to(DEVICE), 0)
    with pytest.raises(OscarError, match="512 positions"):
        generate_static(model, _ids(500).to(DEVICE), 20)
    if DEVICE == "cpu":
        with pytest.raises(OscarError, match="CUDA"):
            StaticDecoder(model, slot_cache_for(model, 1, 32), graphs=True)
