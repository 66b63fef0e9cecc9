"""The decode step's query/key kernel (RMSNorm, RoPE, ·R_K in one launch) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from oscarkv.errors import OscarError
from oscarkv.kernels.ops import decode_query_key, triton_available
from oscarkv.kernels.reference import decode_query_key_reference

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from oscarkv.kernels.triton_decode_qk import _first_page_blocks  # noqa: E402 (needs Triton)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(b: int, hq: int, hkv: int, d: int, dtype: torch.dtype, rotation: str, norms: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(b, (hq + 2 * hkv) * d, generator=g)).to(DEVICE, dtype)  # one projection output
    q = qkv[:, :hq * d].view(b, hq, d)  # views with the row stride of the fused q/k/v output
    k = qkv[:, hq * d:(hq + hkv) * d].view(b, hkv, d)
    angles = torch.rand(b, d // 2, generator=g) * 100
    cos = torch.cat([angles.cos()] * 2, -1).to(DEVICE, dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(DEVICE, dtype)
    if rotation == "none":
        r = None
    else:
        shape = (hkv, d, d) if rotation == "per_head" else (d, d)
        r = torch.linalg.qr(torch.randn(*shape, generator=g, dtype=torch.float64))[0].float().to(DEVICE)
    q_norm = k_norm = None
    if norms:
        q_norm = ((torch.rand(d, generator=g) + 0.5).to(DEVICE, dtype), 1e-6)
        k_norm = ((torch.rand(d, generator=g) + 0.5).to(DEVICE, dtype), 1e-5)
    return q, k, cos, sin, r, q_norm, k_norm


def _assert_within_an_ulp(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal but where the norm's sum order flips a rounding (one ulp of the dtype, on a few values)."""
    eps = torch.finfo(expected.dtype).eps
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 * eps, atol=2 * eps)
    assert (got == expected).float().mean() > 0.95


SHAPES = [(1, 4, 4, 64), (1, 32, 8, 128), (3, 8, 1, 128), (17, 8, 2, 64), (2, 4, 2, 256), (1, 8, 1, 256)]
VARIANTS = [("shared", True, "plain"), ("per_head", True, "centered"), ("shared", False, "rotated"),
            ("none", True, "plain"), ("none", False, "rotated"), ("per_head", False, "rotated"),
            ("shared", True, "centered")]
# Qwen3-4B's shape (the slowest in the CPU interpreter) takes three variants; the other shapes take all of them,
# the batch-1 launch plan included (at D = 256).
QWEN3_VARIANTS = [("shared", True, "centered"), ("per_head", False, "rotated"), ("none", True, "plain")]


@pytest.mark.parametrize("b,hq,hkv,d,rotation,norms,keys", [
    shape + variant for shape in SHAPES for variant in VARIANTS
    if shape != (1, 32, 8, 128) or variant in QWEN3_VARIANTS])
def test_kernel_matches_reference(b, hq, hkv, d, rotation, norms, keys):
    """Queries normalized, RoPE'd and rotated; keys normalized and RoPE'd, and with rotate_keys also centered
    and rotated as the cache stores them (nothing to rotate by without R_K)."""
    from oscarkv.kernels.reference import rotate_keys_reference

    inputs = _inputs(b, hq, hkv, d, torch.bfloat16, rotation, norms, seed=b + d)
    q, k, cos, sin, r, q_norm, k_norm = inputs
    mean = torch.randn(hkv, d, generator=torch.Generator().manual_seed(3)).to(DEVICE) if keys == "centered" else None
    query, key = decode_query_key(*inputs, backend="triton", rotate_keys=keys != "plain", key_mean=mean)
    ref_query, ref_key = decode_query_key_reference(*inputs)
    if keys != "plain":
        ref_key = rotate_keys_reference(ref_key, r, mean if r is not None else None, ref_key.dtype)
    assert query.shape == (b, hq, d) and key.shape == (b, hkv, d)
    _assert_within_an_ulp(key, ref_key)
    _assert_within_an_ulp(query, ref_query)


def test_launch_plan_keeps_a_single_rows_reductions_in_one_warp():
    """Batch 1 at D >= 128: 16 R_K columns per one-warp program (measured faster on the H100); D = 64 and more
    rows keep 32 columns in four warps, more rows as one 16-row dot."""
    from oscarkv.kernels.triton_decode_qk import launch_plan

    assert launch_plan(1, 128) == (1, 16, 1) and launch_plan(1, 256) == (1, 16, 1)
    assert launch_plan(1, 64) == (1, 32, 4)
    assert launch_plan(2, 128) == (16, 32, 4) and launch_plan(33, 64) == (16, 32, 4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_dtypes(dtype):
    inputs = _inputs(2, 8, 2, 128, dtype, "shared", True, seed=5)
    query, key = decode_query_key(*inputs, backend="triton")
    ref_query, ref_key = decode_query_key_reference(*inputs)
    assert query.dtype == key.dtype == dtype
    _assert_within_an_ulp(key, ref_key)
    _assert_within_an_ulp(query, ref_query)


def test_empty_batch_and_bad_shapes():
    q, k, cos, sin, r, qn, kn = _inputs(1, 8, 2, 64, torch.bfloat16, "shared", True)
    query, key = decode_query_key(q[:0], k[:0], cos[:0], sin[:0], r, qn, kn, backend="triton")
    assert query.shape == (0, 8, 64) and key.shape == (0, 2, 64)
    with pytest.raises(OscarError, match="multiple"):
        decode_query_key(q[:, :7], k, cos, sin, r, qn, kn)
    with pytest.raises(OscarError, match="cos and sin"):
        decode_query_key(q, k, cos[:, :32], sin, r, qn, kn)
    with pytest.raises(OscarError, match="R_K"):
        decode_query_key(q, k, cos, sin, r[:32, :32], qn, kn)
    with pytest.raises(OscarError, match="norm's weight"):
        decode_query_key(q, k, cos, sin, r, (qn[0][:32], 1e-6), kn)


# ---- the attention modules' decode forward (`fused_decode_attention`) ---------------------------------------

def _patched(family: str, method: str, dtype=torch.float32):
    import oscarkv
    from oscarkv import CacheConfig
    from test_transformers_cache import _random_artifact
    from tiny_models import tiny_model

    model = tiny_model(family, head_dim=64, attention_scale=3.0, dtype=dtype).to(DEVICE)
    paged = dict(sink_tokens=16, recent_tokens=32, page_size=16)
    if method == "bf16":
        return oscarkv.patch(model, method="bf16", cache=CacheConfig(**paged))
    artifact = _random_artifact(model)
    artifact.group_size = 64
    return oscarkv.patch(model, artifact, quant=oscarkv.QuantConfig(group_size=64),
                         cache=CacheConfig(kernel="paged", **paged))


@pytest.mark.parametrize("family,method,dtype", [("qwen3", "oscar", torch.float32), ("llama", "oscar", torch.float32),
                                                  ("qwen3", "bf16", torch.float32), ("qwen3", "oscar", torch.bfloat16)])
def test_fused_decode_steps_equal_the_modules_own(family, method, dtype, monkeypatch):
    """Static decode steps with the fused forward give the tokens of transformers' own forwards (the torch
    reference of the fusion computes as the modules do), one fused call per layer and step; prompts go
    through the modules' own forward, and the forwards come back. In bfloat16 the INT2 cache takes the keys
    rotated by the fusion, and its write (in the same launch on the kernels) only stores them."""
    from oscarkv.integrations import decode_attention
    from oscarkv.integrations.static_decode import generate_static
    from test_transformers_cache import _ids

    model = _patched(family, method, dtype)
    ids = _ids(40, batch=2).to(DEVICE)
    backend = "auto" if DEVICE == "cuda" else "torch"
    expected = generate_static(model, ids, 12, graphs=False, backend=backend)
    calls, rotating_writes = [], []
    from oscarkv.integrations import paged
    from oscarkv.kernels import ops
    for name in ("decode_query_key", "decode_query_key_write"):  # a layer's decode step calls one of them once
        fused = getattr(paged, name)
        monkeypatch.setattr(paged, name, lambda *a, _fused=fused, **kw: (calls.append(1), _fused(*a, **kw))[1])
    for module in (paged, ops):  # the cache's own write, and the one after `decode_query_key_write`'s torch path
        write = module.write_step
        monkeypatch.setattr(module, "write_step", lambda *a, _write=write, **kw: (
            rotating_writes.append(a[4] is not None), _write(*a, **kw))[1])
    with decode_attention.fused_decode_attention(model):
        got = generate_static(model, ids, 12, graphs=False, backend=backend)
    assert torch.equal(got, expected)
    layers = model.config.num_hidden_layers
    assert len(calls) == layers * 11  # the prompt's forward and its first token are not one-token rows
    if method == "oscar":  # in bfloat16 only the prompt's write rotates keys: the decode steps' come rotated
        assert sum(rotating_writes) == layers * (1 if dtype == torch.bfloat16 else 12)
    assert not any("forward" in vars(m) for m in model.modules())


def test_only_known_attention_classes_are_swapped():
    from oscarkv.integrations.decode_attention import fused_modules

    assert len(fused_modules(_patched("qwen3", "oscar"))) == 2
    assert fused_modules(_patched("gemma3", "bf16")) == []


def test_fused_decode_with_the_kernels_follows_the_unfused_steps(monkeypatch):
    """bfloat16 Qwen3 (q/k norms) on the kernels: the fused steps' tokens are the unfused steps' (rounding may
    differ by an ulp in a norm, which these well-separated logits do not feel)."""
    from oscarkv.integrations.decode_attention import fused_decode_attention
    from oscarkv.kernels import triton_decode_qk
    from oscarkv.integrations.static_decode import generate_static
    from test_transformers_cache import _ids

    model = _patched("qwen3", "oscar", dtype=torch.bfloat16)
    ids = _ids(20, batch=1).to(DEVICE)
    expected = generate_static(model, ids, 4, graphs=False, backend="triton")
    launches = []
    launch = triton_decode_qk.launch_decode_qk
    monkeypatch.setattr(triton_decode_qk, "launch_decode_qk", lambda *a, **kw: (launches.append(1), launch(*a, **kw)))
    with fused_decode_attention(model):
        got = generate_static(model, ids, 4, graphs=False, backend="triton")
    assert torch.equal(got, expected)
    assert len(launches) == 2 * 3


def test_a_layer_refuses_rotated_keys_before_its_first_step():
    from oscarkv.integrations.paged import PagedOscarCache

    model = _patched("qwen3", "oscar", torch.bfloat16)
    state = model.oscar
    cache = PagedOscarCache(state.specs, state.cache, state.kv_heads, state.head_dim, 64, backend="torch")
    keys = torch.zeros(1, state.kv_heads, 1, state.head_dim, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(OscarError, match="rotated keys"):
        cache.update(keys, keys, 0, keys_rotated=True)


# ---- the cache write in the query/key launch (`ops.decode_query_key_write`) ----------------------------------

def _layer_buffers(run) -> dict[str, torch.Tensor]:
    layer = run.layer
    return {name: getattr(layer, name).clone() for name in
            ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "sink_k", "sink_v", "ring_k", "ring_v")}


@pytest.mark.parametrize("d,gqa,batch,options", [(64, 1, 3, {}), (128, 2, 1, {}), (128, 1, 3, {"shift_block": 16}),
                                                 (64, 2, 1, {"key_inner": 0.36, "value_inner": 0.35}),
                                                 (64, 1, 3, {"page_size": 32})])
def test_cache_write_in_the_query_key_launch_equals_the_write_launch(d, gqa, batch, options, monkeypatch):
    """Decode steps through one launch (queries, keys, the token's store and the flush) leave the cache, the
    queries and the rotated keys bit for bit as the query/key launch followed by the write launch does, at batch 1
    (one row per program) and 3 (a block of rows). The prompts put the first decode tokens in the sink (8 of 16),
    at its edge (15) and in the ring (60); the fifth step crosses a flush (at sink 16 + recent 32 + page 16); batch
    1 takes the 60-token prompt. With pages of 32 tokens (two flush programs per row and KV head) the third prompt
    is 78 tokens and the third step flushes. The one launch also holds the programs that prefetch the first keys of
    40 history splits into L2 (a hint: on the GPU they prefetch, in the interpreter they return at once); they must
    not take the place of any other program."""
    from oscarkv.cache.paged import PagedLayout
    from oscarkv.kernels.ops import decode_query_key_write, write_step
    from paged_helpers import PagedRun, random_step

    shift_block = options.get("shift_block", 0)
    page = options.get("page_size", 16)
    layout = PagedLayout(kv_heads=2, head_dim=d, group_size=64, page_size=page, sink_tokens=16, recent_tokens=32,
                         key_inner=options.get("key_inner"), value_inner=options.get("value_inner"))
    runs = [PagedRun(layout, batch, 256, 2 * gqa, "triton", device=DEVICE, shift_block=shift_block)
            for _ in range(2)]
    g = torch.Generator().manual_seed(d + batch)
    prompts = [8, 15, 60 if page == 16 else 78] if batch == 3 else [60]
    _, k, v = random_step(layout, 2 * gqa, prompts, g, device=DEVICE)
    for run in runs:
        write_step(run.layer, run.cache.step(run.slots, prompts), k, v, run.rotation, run.mean, 0.96, 0.92)
    fused, unfused = runs
    from oscarkv.kernels import triton_write
    calls = []
    launch_write = triton_write.launch_write
    monkeypatch.setattr(triton_write, "launch_write", lambda *a, **kw: (calls.append(1), launch_write(*a, **kw))[1])
    for step in range(5):
        q, k, cos, sin, _, q_norm, k_norm = _inputs(batch, 2 * gqa, 2, d, torch.bfloat16, "none", True, seed=step)
        v = (torch.randn(batch, 2, d, generator=g)).to(DEVICE, torch.bfloat16)
        common = dict(q_norm=q_norm, k_norm=k_norm, key_mean=fused.mean, clip_k=0.96, clip_v=0.92, backend="triton")
        calls.clear()
        got = decode_query_key_write(fused.layer, fused.cache.step(fused.slots, [1] * batch), q, k, v, cos, sin,
                                     fused.rotation, history_splits=40, **common)
        assert not calls, "the fused step launched the write kernel"
        query, key = decode_query_key(q, k, cos, sin, unfused.rotation, q_norm, k_norm, backend="triton",
                                      rotate_keys=True, key_mean=unfused.mean)
        expected = (query, write_step(unfused.layer, unfused.cache.step(unfused.slots, [1] * batch), key, v,
                                      None, None, 0.96, 0.92, backend="triton"))
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        after, before = _layer_buffers(fused), _layer_buffers(unfused)
        for name in after:
            assert torch.equal(after[name], before[name]), f"{name} differs after step {step}"


def test_cache_write_falls_back_to_two_calls_where_one_launch_cannot_serve():
    """A float32 step (windows in bfloat16) makes the two calls: float32 queries, keys in the windows' dtype."""
    from oscarkv.cache.paged import PagedLayout
    from oscarkv.kernels.ops import decode_query_key_write
    from paged_helpers import PagedRun

    layout = PagedLayout(kv_heads=2, head_dim=64, group_size=64, page_size=16, sink_tokens=16, recent_tokens=32)
    run = PagedRun(layout, 1, 128, 4, "torch", device=DEVICE)
    q, k, cos, sin, _, q_norm, k_norm = _inputs(1, 4, 2, 64, torch.float32, "none", True)
    v = torch.randn(1, 2, 64).to(DEVICE)
    query, key = decode_query_key_write(run.layer, run.cache.step(run.slots, [1]), q, k, v, cos, sin, run.rotation,
                                        q_norm, k_norm, key_mean=run.mean, backend="triton")
    assert query.dtype == torch.float32 and key.dtype == torch.bfloat16 and query.shape == (1, 4, 64)
    assert torch.equal(run.layer.sink_v[run.slots[0], :, 0], v[0].to(torch.bfloat16))
    with pytest.raises(OscarError, match="key rotation"):
        decode_query_key_write(run.layer, run.cache.step(run.slots, [1]), q, k, v, cos, sin, None)


@triton.jit
def _first_blocks_kernel(out_ptr, slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages, HKV: tl.constexpr,
                         P: tl.constexpr, S: tl.constexpr, R: tl.constexpr, SPLITS: tl.constexpr, PAGES: tl.constexpr,
                         BLOCK: tl.constexpr):
    """out [B, HKV, PAGES, chunks·BLOCK]: the blocks the query/key launch prefetches (-1: none)."""
    b, h, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    width = tl.num_programs(2) * BLOCK
    splits = chunk * BLOCK + tl.arange(0, BLOCK)
    for j in tl.static_range(PAGES):
        block, ok = _first_page_blocks(b, h, chunk, j, slots_ptr, cu_ptr, len_ptr, bt_ptr, bt_stride, num_pages,
                                       HKV, P, S, R, SPLITS, BLOCK)
        tl.store(out_ptr + ((b * HKV + h) * PAGES + j) * width + splits, tl.where(ok, block, -1))


@pytest.mark.parametrize("splits,block", [(5, 4), (132, 32), (3, 32)])
def test_prefetched_keys_are_the_first_pages_each_history_split_reads(splits, block):
    """The query/key launch prefetches into L2 the first pages of each history split of the coming attention
    (`PREFETCH_PAGES`); a prefetch is only a hint, so wrong addresses would cost time, not answers. Here the
    blocks it computes are checked against the attention's split plan: split s reads pages s·share ..
    min((s + 1)·share, pages) - 1 of its sequence, share = ceil(pages / splits), through the block table."""
    from oscarkv.cache.paged import PagedKVCache, PagedLayout

    layout = PagedLayout(kv_heads=3, head_dim=64, group_size=64, page_size=16, sink_tokens=16, recent_tokens=32)
    cache = PagedKVCache([layout], 400, 4, 4096, DEVICE)
    slots = [cache.open_slot() for _ in range(4)]
    for tokens in ([700, 40, 2000, 64], [333, 1, 900, 10]):  # two steps, so that the sequences' pages interleave
        cache.step(slots, tokens)
    batch = cache.step(slots, [1, 1, 1, 1])  # a decode step
    pages = 2
    chunks = -(-splits // block)
    got = torch.empty(4, 3, pages, chunks * block, dtype=torch.int64, device=DEVICE)
    bt = batch.block_table
    _first_blocks_kernel[(4, 3, chunks)](got, batch.slots, batch.cu_new, batch.lengths, bt, bt.stride(0),
                                         cache.layers[0].num_pages, HKV=3, P=16, S=16, R=32, SPLITS=splits,
                                         PAGES=pages, BLOCK=block)
    got, bt, lengths = got.cpu(), bt.cpu(), batch.lengths.cpu()
    expected = torch.full_like(got, -1)
    for b, slot in enumerate(slots):
        history_pages = layout.pages_needed(int(lengths[b]) + 1)  # the history pages this decode step reads
        share = -(-history_pages // splits)
        for s in range(splits):
            for j in range(min(pages, share)):
                if s * share + j < history_pages:
                    for h in range(3):
                        expected[b, h, j, s] = int(bt[slot, s * share + j]) * 3 + h
    assert (expected[:, :, 0] >= 0).any() and (expected[:, :, 0] == -1).any()  # some splits have pages, some not
    assert torch.equal(got, expected)


@pytest.mark.parametrize("key_shifts", [False, True])
def test_query_and_key_programs_come_first_in_the_compiled_launch(key_shifts):
    """The decode step's query/key launch also holds the flush's quantizer (about 9,000 SASS instructions on sm_90)
    and the prefetch programs. Compiled with the flush first, its everyday query and key programs began after that
    code and took 2.9 µs a layer at 1x100K on the H200, 3.8-4.0 with key shifts; first, 2.5-2.8 (fifty-ninth session,
    docs/decode-log.md). Their code (the RMSNorm's reciprocal square root, which the flush does not take) must stay in
    the first tenth of the kernel; before the change it began at 89% of it."""
    import os
    import subprocess
    import sys

    code = ("from oscarkv.kernels import compile_check as c; "
            f"s = c.sass_instructions(c.decode_qk_write_kernel(90, 1, {key_shifts})); "
            "print(next(i for i, line in enumerate(s) if 'MUFU.RSQ' in line), len(s))")
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TRITON_INTERPRET="0"),
                          capture_output=True, text=True, timeout=600)  # compiled, not interpreted
    assert done.returncode == 0, done.stdout + done.stderr
    first, total = (int(x) for x in done.stdout.split()[-2:])
    assert total > 5000 and first < total // 10, (first, total)
