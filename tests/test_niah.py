"""Needle in a haystack on the real embedded model (its own copy: the evaluation patches it)."""

import subprocess
import sys

import pytest

from oscarkv.assets import load_text
from oscarkv.config import CacheConfig, QuantConfig
from oscarkv.evaluation.niah import answer_of, build_cases, evaluate_niah, summarise

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def own_model():
    from oscarkv.models import load_model, required_bos

    model, tokenizer = load_model("smollm2-135m", device="cpu")
    return model, tokenizer, required_bos(model, tokenizer)


def test_cases_place_the_needle_by_depth_and_region(own_model):
    model, tokenizer, bos = own_model
    cache = CacheConfig()
    cases = build_cases(tokenizer, load_text("news"), [700], [0.0, 0.5, 1.0], 2, cache, bos)
    assert len(cases) == 6
    for case in cases:
        assert case.length <= 700 and case.length > 600
        text = tokenizer.decode(case.input_ids)
        assert f"The secret passcode of the {case.subject} is {case.passcode}." in text
        assert text.rstrip().endswith(f"The secret passcode of the {case.subject} is")
        needle = tokenizer.decode(case.input_ids[case.needle_token:case.needle_token + 4])
        assert "secret" in needle or "The" in needle
    assert [c.region for c in cases[:3]] == ["sink", "history", "recent"]
    # Same seed, same prompts; another seed, other needles.
    again = build_cases(tokenizer, load_text("news"), [700], [0.0, 0.5, 1.0], 2, cache, bos)
    assert all((a.input_ids == b.input_ids).all() for a, b in zip(cases, again))
    other = build_cases(tokenizer, load_text("news"), [700], [0.5], 1, cache, bos, seed=1)
    assert other[0].passcode != cases[1].passcode or other[0].subject != cases[1].subject


def test_bf16_retrieves_a_needle_in_the_int2_region_and_naive_int2_does_not(own_model):
    model, tokenizer, bos = own_model
    cases = build_cases(tokenizer, load_text("news"), [700], [0.5], 1, CacheConfig(), bos)
    assert cases[0].region == "history"
    results = evaluate_niah(model, tokenizer, cases, ["bf16", "naive"], QuantConfig(group_size=64), CacheConfig())
    by_method = {r.method: r for r in results}
    assert by_method["bf16"].correct, by_method["bf16"].answer
    assert not by_method["naive"].correct
    rows = summarise(results)
    assert {(r["method"], r["accuracy"], r["history_accuracy"]) for r in rows} == {("bf16", 100.0, 100.0),
                                                                                   ("naive", 0.0, 0.0)}


def test_answer_parsing():
    assert answer_of(" 123456.\nMore") == "123456"
    assert answer_of(" 12 34 56") == "123456"
    assert answer_of("no passcode\n123456") == ""  # only the first line counts


def test_cli_rejects_a_depth_outside_0_1_before_loading_the_model(capsys):
    done = subprocess.run([sys.executable, "-m", "oscarkv.cli", "eval", "niah", "smollm2-135m", "--methods", "bf16",
                           "--depths", "0.5,1.5"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["oscarkv: error: --depths 0.5,1.5: each depth is a fraction of the "
                                                "haystack, between 0 and 1."]  # no loading bar: nothing loaded
    from oscarkv.cli import main

    assert main(["eval", "niah", "smollm2-135m", "--depths", "0.5,x"]) == 2
    assert "--depths '0.5,x': expected floats separated by commas" in capsys.readouterr().err


def test_eval_commands_refuse_a_method_list_that_cannot_run_before_loading_the_model(capsys):
    from oscarkv.cli import main

    for command in ("ppl", "niah", "code"):
        for methods, line in [
            ("bf16,oscar", "oscarkv: error: method 'oscar' needs a rotations artifact: pass --rotations FILE (make "
                           "one with `oscarkv calibrate MODEL --out FILE`)."),
            ("bf16,bf17", "oscarkv: error: unknown method 'bf17'; choose from bf16, oscar, oscar-paper, naive, "
                          "hadamard, kivi2, int4, fp8, turboquant3."),
        ]:
            capsys.readouterr()
            assert main(["eval", command, "smollm2-135m", "--methods", methods]) == 2, (command, methods)
            assert capsys.readouterr().err.strip().splitlines() == [line], (command, methods)  # no loading bar
        # A mistyped model is reported first, before the method list.
        assert main(["eval", command, "smollm2-13m", "--methods", "bf16,oscar"]) == 2, command
        assert capsys.readouterr().err.startswith("oscarkv: error: model 'smollm2-13m' is not a built-in alias")
