"""Tiny random models of every supported family (built from configs; nothing downloaded)."""

from __future__ import annotations

import torch

VOCAB = 128


def tiny_model(family: str, *, head_dim: int = 32, bias_scale: float = 0.0, dtype=torch.float32, seed: int = 0,
               attention_scale: float = 1.0, value_scale: float = 1.0, layers: int | None = None):
    """A model of `family` with random weights and `layers` layers (default 2; Gemma 3: 4, whose types
    repeat sliding, sliding, full, sliding).

    bias_scale: adds Qwen2-like k/v biases: a large offset on a few channels of every KV head
    (real QKV-bias models concentrate their offset that way), plus small noise elsewhere.
    attention_scale: multiplies q/k weights, so that attention is peaked as in trained models.
    value_scale: multiplies v/o weights, so that attention outputs matter in the residual stream.
    """
    import transformers as tf

    torch.manual_seed(seed)
    layers = layers or (4 if family == "gemma3" else 2)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512)
    if family == "llama":
        config, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "mistral":
        config, cls = tf.MistralConfig(**common, sliding_window=None), tf.MistralForCausalLM
    elif family == "qwen2":
        config, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif family == "qwen3":
        config, cls = tf.Qwen3Config(**common), tf.Qwen3ForCausalLM
    elif family == "gemma3":
        common.update(num_key_value_heads=1)
        types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        config = tf.Gemma3TextConfig(**common, sliding_window=24, layer_types=[types[i % 4] for i in range(layers)])
        cls = tf.Gemma3ForCausalLM
    else:
        raise ValueError(family)
    config._attn_implementation = "sdpa"
    model = cls(config).to(dtype).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.mul_(attention_scale)
            attn.k_proj.weight.mul_(attention_scale)
            attn.v_proj.weight.mul_(value_scale)
            attn.o_proj.weight.mul_(value_scale / max(1.0, bias_scale / 10))
            if bias_scale:
                for proj in (attn.k_proj, attn.v_proj):
                    offset = 0.1 * bias_scale * torch.randn_like(proj.bias)
                    heads = offset.view(-1, head_dim)
                    heads[:, :3] += bias_scale * torch.sign(torch.randn(heads.shape[0], 3))
                    proj.bias.add_(offset)
    return model


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
