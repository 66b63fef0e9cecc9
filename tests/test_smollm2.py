"""The real embedded model, SmolLM2-135M-Instruct, end to end on CPU."""

import json
import math
import subprocess
import sys

import pytest
import torch

import oscarkv
from oscarkv import CacheConfig, QuantConfig
from oscarkv.assets import news_articles
from oscarkv.calibration.artifact import RotationArtifact
from oscarkv.errors import ArtifactError, InputTooLongError
from oscarkv.evaluation.ppl import perplexity, window_nll

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def artifact(smollm2_artifact):
    """The session's SmolLM2 artifact (conftest.py), which test_vllm_plugin.py shares."""
    return smollm2_artifact


@pytest.fixture(scope="module")
def news_tokens(smollm2):
    _, tokenizer = smollm2
    return tokenizer("\n\n".join(news_articles()[:20]), return_tensors="pt").input_ids[0]


def test_artifact_loads_and_matches_the_model(artifact, smollm2):
    loaded = RotationArtifact.load(artifact)
    assert loaded.method == "oscar" and loaded.model.head_dim == 64 and loaded.model.num_layers == 30
    from oscarkv.models import model_identity

    loaded.check_model(model_identity(smollm2[0]))
    from tiny_models import tiny_model

    with pytest.raises(ArtifactError, match="another model"):
        oscarkv.patch(tiny_model("llama"), artifact)


def test_rotations_and_absorption_keep_logits(artifact, smollm2, news_tokens):
    model, _ = smollm2
    ids = news_tokens[None, :200]
    oscarkv.patch(model, method="bf16", cache=CacheConfig(window_dtype=torch.float32, quantize_history=False))
    with torch.no_grad():
        reference = model(ids).logits
    oscarkv.patch(model, artifact, cache=CacheConfig(window_dtype=torch.float32, quantize_history=False))
    with torch.no_grad():
        rotated = model(ids).logits
    assert (rotated - reference).abs().max() < 2e-3 * reference.abs().max()


def test_perplexity_equals_token_by_token_decoding(artifact, smollm2, news_tokens):
    """The scored tokens of a window, decoded one by one, give the window's perplexity. The first 321 tokens fill
    the 64-token sink and the 256-token recent window in one prefill (one token reaches the INT2 history); then
    each of the 78 decode steps moves one more token into the history."""
    model, _ = smollm2
    oscarkv.patch(model, artifact)
    window = news_tokens[:400]
    nll, count, _ = window_nll(model, window, 320)
    cache = model.oscar.new_cache()
    with torch.no_grad():
        logits = [model(window[None, :321], past_key_values=cache).logits[0, -1]]
        for i in range(321, 399):
            logits.append(model(window[None, i : i + 1], past_key_values=cache).logits[0, -1])
    total = float(torch.nn.functional.cross_entropy(torch.stack(logits), window[321:400], reduction="sum"))
    assert count == 79 and len(logits) == 79
    # fp32 rounding can flip an INT2 code between the two paths; the perplexities agree closely.
    assert math.isclose(math.exp(nll / count), math.exp(total / 79), rel_tol=5e-3)


def test_oscar_beats_naive_int2(artifact, smollm2, news_tokens):
    model, _ = smollm2
    quant = QuantConfig(group_size=64)
    results = {}
    for method in ("bf16", "naive", "oscar"):
        oscarkv.patch(model, artifact if method == "oscar" else None, method=method, quant=quant)
        results[method] = perplexity(model, news_tokens, 1024, max_tokens=700)[0]
    assert results["naive"] > 2 * results["bf16"]
    assert results["oscar"] < 1.3 * results["bf16"]


def test_generate_with_a_long_prompt(artifact, smollm2, news_tokens):
    model, tokenizer = smollm2
    oscarkv.patch(model, artifact)
    prompt = news_tokens[None, :400]
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                         return_dict_in_generate=True)
    assert out.sequences.shape[1] == 408
    assert out.past_key_values.layers[0].history_k.length > 0


def test_context_longer_than_the_model_is_refused(smollm2):
    model, _ = smollm2
    oscarkv.patch(model, method="naive", quant=QuantConfig(group_size=64))
    with pytest.raises(InputTooLongError, match="8192"):
        perplexity(model, torch.zeros(20000, dtype=torch.long), 9000)


def test_cli_eval_ppl_json(tmp_path):
    cmd = [sys.executable, "-m", "oscarkv.cli", "eval", "ppl", "smollm2-135m", "--methods", "bf16,naive",
           "--context", "448", "--max-tokens", "100", "--group-size", "64", "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["method"] for r in rows] == ["bf16", "naive"]
    for row in rows:
        assert {"method", "ppl", "tokens", "bits_per_element", "kv_bytes"} <= row.keys()
    assert rows[0]["bits_per_element"] == 16.0
    assert rows[1]["bits_per_element"] < rows[0]["bits_per_element"]
    assert rows[1]["ppl"] > rows[0]["ppl"]


def test_a_device_this_machine_cannot_run_is_one_clear_line(capsys, monkeypatch):
    """--device cuda without a visible GPU (as on the CI machine; simulated where there is one), a GPU index past the
    last, and a name torch does not know: one line and status 2 from calibrate, eval and serve, before any weights
    load (the check is `models.resolve_device`, at the top of `load_model`; before it, a traceback)."""
    import torch

    from oscarkv.cli import main
    from oscarkv.models import model_config

    model_config("smollm2-135m")  # a first run on a machine fetches and converts the model's files, with bars
    for available, count, device, line in [
        (False, 0, "cuda", "device 'cuda': no CUDA GPU is visible on this machine; use cpu (--device cpu), or run on a "
                           "machine with a GPU."),
        (True, 1, "cuda:1", "device 'cuda:1': this machine has 1 visible CUDA GPU(s), cuda:0 to cuda:0."),
        (False, 0, "potato", "device 'potato' is not a device name; use cpu, cuda or cuda:N."),
    ]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        for args in (["eval", "ppl", "smollm2-135m", "--methods", "bf16"], ["calibrate", "smollm2-135m", "--out", "x"],
                     ["serve", "smollm2-135m", "--method", "bf16", "--port", "0"]):
            capsys.readouterr()
            assert main(args + ["--device", device]) == 2, (args, device)
            assert capsys.readouterr().err.strip().splitlines() == ["oscarkv: error: " + line], (args, device)


def test_cli_errors_are_one_clear_line(tmp_path, capsys):
    """The first case as a process of its own (its exit status and stderr); the others, which load the model,
    through `cli.main` in this process (the same handler turns the error into one line and status 2)."""
    from oscarkv.cli import main

    result = subprocess.run([sys.executable, "-m", "oscarkv.cli", "eval", "ppl", "no-such-model"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "not a built-in alias" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    for args, expected in [
        (["eval", "ppl", "smollm2-135m", "--rotations", str(bad)], "corrupt or truncated"),
        (["eval", "ppl", "smollm2-135m", "--methods", "oscar"], "needs a rotations artifact"),
        (["eval", "ppl", "smollm2-135m", "--methods", "bf16", "--context", "9000"], "exceeds the model's maximum"),
    ]:
        capsys.readouterr()
        assert main(args) == 2, args
        last = capsys.readouterr().err.strip().splitlines()[-1]  # after the model's loading bar
        assert expected in last and last.startswith("oscarkv: error:"), (args, last)
