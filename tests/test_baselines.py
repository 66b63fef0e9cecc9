"""The int4 and fp8 baselines on the same harness as the INT2 methods (tiny model, CPU)."""

import torch

from oscarkv import CacheConfig, QuantConfig
from oscarkv.evaluation.ppl import evaluate_methods
from tiny_models import VOCAB, tiny_model


def test_int4_and_fp8_sit_between_bf16_and_naive_int2_at_their_true_bits():
    model = tiny_model("llama", head_dim=32, attention_scale=3.0, value_scale=3.0)
    ids = torch.randint(0, VOCAB, (1, 400), generator=torch.Generator().manual_seed(0))
    cache = CacheConfig(sink_tokens=4, recent_tokens=8, window_dtype=torch.float32)
    results = {r.method: r for r in evaluate_methods(model, ids, ["bf16", "naive", "int4", "fp8"],
                                                     QuantConfig(group_size=32), cache, context=200,
                                                     max_tokens=None)}
    bf16 = results["bf16"].ppl
    gap = {name: abs(r.ppl - bf16) for name, r in results.items()}
    assert gap["int4"] < gap["naive"] and gap["fp8"] < gap["naive"]
    assert gap["fp8"] < 0.05 * bf16
    # Bits measured from the stored bytes: 188 history tokens and 12 float32 window tokens of 200.
    assert abs(results["int4"].bits_per_element - (188 * (4 + 32 / 32) + 12 * 32) / 200) < 1e-6
    assert abs(results["fp8"].bits_per_element - (188 * 8 + 12 * 32) / 200) < 1e-6
