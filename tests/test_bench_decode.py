"""`oscarkv bench decode`: the byte accounting behind its rooflines, its tables and plot, and its refusal
without a GPU (the measurements themselves need a CUDA GPU; docs/decode.md has them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import oscarkv
from oscarkv.benchmarks.decode import Settings, kv_bytes_per_sequence, kv_bytes_read, run, weight_bytes
from oscarkv.cli import main
from oscarkv.errors import OscarError
from oscarkv.integrations.slots import DenseSlotCache, PagedSlotCache
from tiny_models import tiny_model

DATA = Path(__file__).parent.parent / "docs" / "data"


def test_kv_bytes_per_sequence_equals_the_allocated_cache():
    model = oscarkv.patch(tiny_model("llama", head_dim=64), method="hadamard")
    state = model.oscar
    context = 8000
    pages = PagedSlotCache.pages_for_budget(state, 1, context, None)
    cache = PagedSlotCache(state, 1, pages, context, torch.device("cpu"))
    expected = kv_bytes_per_sequence(model, context)
    assert expected["int2"] == cache.storage.nbytes()
    dense = DenseSlotCache(len(state.specs), 1, context, kv_heads=state.kv_heads, head_dim=state.head_dim)
    assert expected["bf16"] == dense.usage().bytes_total
    # INT2 history: 2 bits + fp16 scale and zero per group of 64 -> 2.5 bits, BF16 16 bits; the BF16
    # windows (64 sink + 320 ring tokens) bring the ratio down from 6.4.
    assert 16 / 2.5 * 0.6 < expected["bf16"] / expected["int2"] < 16 / 2.5
    # What a step reads at full length: the history pages in use plus the windows' stored tokens.
    assert kv_bytes_read(cache, 1, context) <= expected["int2"]
    assert kv_bytes_read(dense, 2, context) == 2 * expected["bf16"]


def test_weight_bytes_counts_an_untied_input_embedding_out():
    model = tiny_model("llama")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    assert weight_bytes(model) == params - (0 if tied else embed.numel() * embed.element_size())


def test_tables_and_plot_from_saved_results(tmp_path, capsys):
    saved = [str(DATA / "bench-decode-qwen3-4b.json"), str(DATA / "bench-decode-smollm2-135m.json")]
    assert main(["bench", "decode", "--from-json", *saved, "--plot", str(tmp_path / "decode.png")]) == 0
    out = capsys.readouterr().out
    assert "equal KV memory" in out and "INT2/BF16 tok/s" in out and "bits per K/V element" in out
    assert (tmp_path / "decode.png").stat().st_size > 10_000
    assert out.count("both caches' steps: small operations compiled, linear layers by oscarkv's Triton kernels") == 2


def test_tables_say_which_linear_layers_and_small_operations_the_steps_ran():
    from oscarkv.report import decode_tables

    ours = str(DATA / "bench-decode-qwen3-4b-h200-few-rows.json")
    theirs = str(DATA / "bench-decode-qwen3-4b-h200-few-rows-cublas.json")
    eager = str(DATA / "bench-decode-qwen3-4b-eager-small-ops.json")
    tables = {name: decode_tables(json.loads(Path(path).read_text())) for name, path in
              (("ours", ours), ("theirs", theirs), ("eager", eager))}
    assert "linear layers by oscarkv's Triton kernels" in tables["ours"]
    assert "linear layers by cuBLAS (--cublas)" in tables["theirs"]
    assert "small operations eager (--eager-small-ops)" in tables["eager"] and "linear layers" not in tables["eager"]
    untold = json.loads(Path(ours).read_text())
    del untold["settings"]
    assert "both caches' steps" not in decode_tables(untold)


def test_centered_runs_the_int2_cache_with_key_shifts_and_the_tables_say_so():
    """`bench decode --centered` patches the INT2 cache as a calibrated oscar artifact runs: centered keys with
    RoPE-following shifts (what the default key centering takes); without it, the hadamard method, no shifts."""
    from oscarkv.benchmarks.decode import _patch
    from oscarkv.report import decode_tables

    model = tiny_model("qwen3")
    _patch(model, "int2", centered=True)
    assert model.oscar.artifact.centered and all(spec.k_mean_shifts is not None for spec in model.oscar.specs)
    _patch(model, "int2")
    assert all(spec.k_mean_shifts is None and spec.k_mean is None for spec in model.oscar.specs)
    saved = json.loads((DATA / "bench-decode-qwen3-4b-h200-few-rows.json").read_text())
    saved["settings"]["centered"] = True
    assert "INT2 cache: an oscar artifact's centering, keys with RoPE-following shifts (--centered)" in \
        decode_tables(saved)
    saved["settings"]["centered"] = False
    assert "INT2 cache: the hadamard method, no centering" in decode_tables(saved)


def test_bits_line_names_the_key_shift_tables_that_sequences_share():
    """A centered cache holds one key-shift table per layer for all its sequences: `bits_per_element` counts it in
    the allocation and reports the bits without it too; the line says both."""
    from oscarkv.benchmarks.decode import _patch
    from oscarkv.report import decode_tables

    model = tiny_model("qwen3", head_dim=64)
    model.config.max_position_embeddings = 8192
    _patch(model, "int2", centered=True)
    state = model.oscar
    assert all(spec.k_mean_shifts.shape[0] == 8 for spec in state.specs)  # a row per 1024-position block
    cache = PagedSlotCache(state, 1, PagedSlotCache.pages_for_budget(state, 1, 2100, None), 2100, torch.device("cpu"))
    tables = [layer.key_shifts for layer in cache.storage.layers]
    # the rows of the blocks below the cache's 2100 positions, not the model's 8192
    assert all(torch.equal(t, spec.k_mean_shifts[:3].float()) for t, spec in zip(tables, state.specs))
    saved = json.loads((DATA / "bench-decode-qwen3-4b-centered-h200-s57.json").read_text())
    assert "bits per K/V element (group 128)" in decode_tables(saved) and "without the" not in decode_tables(saved)
    bits = saved["bits"]
    shared = sum(t.nbytes for t in tables)
    unshared = 8 * (bits["allocated_bytes"] - shared) / bits["elements"]
    bits.update(shared_bytes=shared, bits_per_element_unshared=unshared)
    line = next(line for line in decode_tables(saved).splitlines() if "bits per K/V element" in line)
    assert line.endswith(f"; {unshared:.3f} without the {shared / 2**20:.1f} MiB of key-shift "
                         "tables that all sequences share")


def test_output_its_reader_stops_reading_ends_quietly():
    """`oscarkv bench decode --from-json ... | head`: once the reader has gone, the command stops without a
    traceback (its JSON here is 150 KB, more than a pipe holds, so the writes do meet the closed pipe)."""
    import subprocess
    import sys

    saved = sorted(str(p) for p in DATA.glob("bench-decode-*.json"))
    command = [sys.executable, "-m", "oscarkv.cli", "bench", "decode", "--from-json", *saved, "--json"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.read(100)
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 1
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_bench_decode_without_gpu_says_so():
    with pytest.raises(OscarError, match="CUDA GPU"):
        run(Settings())


@pytest.mark.parametrize("command, args", [("bench decode", ["--contexts", "1000"]), ("bench attention", []),
                                           ("bench attention", ["--model", "random:smollm2-135m"])])
def test_gpu_benchmarks_without_gpu_say_so_in_one_line_before_any_progress_bar(command, args, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # so that it also holds on a GPU machine
    assert main([*command.split(), *args]) == 2
    captured = capsys.readouterr()
    # bench decode used to draw its progress bar ("bench decode: 00:00") before it refused
    assert captured.err.splitlines() == [captured.err.strip()]
    assert captured.err.startswith(f"oscarkv: error: `oscarkv {command}` measures a CUDA GPU and none is visible")
    assert captured.out == ""


def test_bench_attention_takes_the_layer_shape_of_a_model_and_refuses_what_the_cache_cannot_hold(tmp_path, capsys):
    """`bench attention --model` reads heads, head_dim and the default group size from the model's config (no
    weights); a head_dim the paged cache does not support, or an unknown model, is refused in one line before
    the GPU is looked for."""
    import json as json_

    from oscarkv.benchmarks.attention import QWEN3_LAYER, LayerShape, layer_shape

    assert layer_shape("random:smollm2-135m") == LayerShape(9, 3, 64, 64)
    assert layer_shape("random:qwen3-4b") == QWEN3_LAYER == LayerShape(32, 8, 128, 128)
    assert "9 query / 3 KV heads, head_dim 64, group 64" in LayerShape(9, 3, 64, 64).describe()
    model = tmp_path / "odd"
    model.mkdir()
    (model / "config.json").write_text(json_.dumps(dict(
        model_type="llama", hidden_size=384, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256)))  # head_dim 96
    with pytest.raises(OscarError, match="head_dim=96 is not supported by the paged cache"):
        layer_shape(str(model))
    for name, message in ((str(model), "head_dim=96"), ("no-such-model", "random:smollm2-135m")):
        assert main(["bench", "attention", "--model", name]) == 2
        err = capsys.readouterr().err
        assert err.startswith("oscarkv: error: ") and message in err and "CUDA" not in err, err


def test_bench_attention_table_names_both_sdpa_baselines(monkeypatch, capsys):
    """The table prints the issue's baseline (SDPA, flash backend) and SDPA with its own backend choice, with the
    speed-up over each; the legend says which is which. (The GPU run is replaced by fixed figures.)"""
    from dataclasses import asdict

    from oscarkv.benchmarks import attention

    row = attention.AttentionResult(256, 4000, 366.1, 115.0, 366.1 / 115.0, 1, 1, 1.0, 1175.0, 0.277, 4244.0, 2e-4,
                                    1e-2, 4, "flash", None, None, 44.6, 44.6 / 115.0, 190.7, 190.7 / 115.0, "gluon",
                                    same_bytes_read_us=40.0, same_bytes_read_fraction=0.8, speedup_ceiling=366.1 / 40.0)
    write = attention.WriteResult(32768, 36.0, 9.1e8, 1, 1171.0, 0.28, None, 116.0)
    monkeypatch.setattr(attention, "run", lambda *args: {
        "device": "GPU", "copy_bandwidth_gbs": 4244.0, "layer": {}, "decode": [asdict(row)], "write": asdict(write),
        "torch": "x"})
    assert main(["bench", "attention"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if line.lstrip().startswith("batch"))
    assert "SDPA us" in header and "SDPA* us" in header and "speedup*" in header
    values = next(line for line in out if line.split()[:2] == ["256", "4000"]).split()
    assert values[2:7] == ["366.1", "115.0", "3.18x", "190.7", "1.66x"]
    assert header.split()[-1] == "history" and values[-1] == "gluon"  # which decode history kernel ran
    # the plain read of the same bytes, its share of the copy bandwidth, and the speed-up ceiling it sets
    assert "read us" in header and "ceiling" in header and values[11:14] == ["40.0", "80.0%", "9.15x"]
    assert any("ceiling: SDPA us / read us" in line for line in out)
    assert any("SDPA* us: SDPA with its own backend choice" in line for line in out)


def test_version_names_oscarkv_as_installed_and_its_libraries(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    line = capsys.readouterr().out.strip()
    # oscarkv.__version__ and the installed metadata (pyproject.toml) must agree
    assert line.startswith(f"oscarkv {version('oscarkv')} (torch {version('torch')}, transformers ")
    assert oscarkv.__version__ == version("oscarkv")
