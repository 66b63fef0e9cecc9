"""Random-weight models of real architectures, for speed measurements (nothing downloaded).

Decode speed does not depend on weight values, only on shapes, so `random:qwen3-4b`,
`random:qwen3-8b` and `random:smollm2-135m` build those architectures from their published
configs with random weights. Their outputs are meaningless; use them for `bench` and for serving throughput,
never for accuracy. For Qwen3, max_position_embeddings is raised to 131072 (the length Qwen3
reaches with YaRN) so that 100K-token contexts can be timed.
"""

from __future__ import annotations

import torch

from .errors import AssetError

PREFIX = "random:"

_QWEN3 = dict(model_type="qwen3", num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
              max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
              attention_bias=False, bos_token_id=151643, eos_token_id=151645)
CONFIGS = {
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     tie_word_embeddings=False),
    # The embedded model's shapes (its real 8192-position limit kept), for GPU runs without its weights.
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
}


class TokenIdTokenizer:
    """The tokenizer of a random-weight model: text is UTF-8 bytes (one id per byte), and ids decode
    as their bytes when < 256, else as `<id>`. Enough for a server to run; the text means nothing."""

    chat_template = None

    def __init__(self, vocab_size: int, eos_token_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str, return_tensors: str | None = None):
        ids = [b % self.vocab_size for b in text.encode("utf-8")]
        return _Encoding(torch.tensor([ids]) if return_tensors == "pt" else ids)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out, raw = [], bytearray()
        for i in (int(x) for x in ids):
            if skip_special_tokens and i == self.eos_token_id:
                continue
            if i < 256:
                raw.append(i)
                continue
            out.append(raw.decode("utf-8", errors="replace"))
            raw.clear()
            out.append(f"<{i}>")
        out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)


class _Encoding(dict):
    def __init__(self, input_ids) -> None:
        super().__init__(input_ids=input_ids)
        self.input_ids = input_ids


def random_config(name: str):
    """The transformers config of `random:NAME` (no weights built)."""
    from transformers import AutoConfig

    key = name[len(PREFIX):]
    if key not in CONFIGS:
        raise AssetError(f"{name!r}: random-weight architectures are {', '.join(PREFIX + k for k in CONFIGS)}.")
    settings = dict(CONFIGS[key])
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


def random_model(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(model, tokenizer) for `random:NAME`, built on `device` with random weights."""
    from transformers import AutoModelForCausalLM

    config = random_config(name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # a scale that keeps activations finite through 36 layers
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return model.eval(), TokenIdTokenizer(config.vocab_size, config.eos_token_id)
