"""Needle in a haystack: can the model still retrieve one fact after it was stored in INT2?

A haystack of real prose (the built-in news text by default) is cut to a target prompt
length. One needle sentence, "The secret passcode of the <colour> <object> is <6 digits>.",
is inserted between two sentences at a depth of 0-100% of the haystack, and the prompt ends
with the question "What is the secret passcode of the <colour> <object>? The secret
passcode of the <colour> <object> is". Greedy decoding through the method's cache must
produce the six digits (exact match of the first six digits generated).

Every method sees the same prompts (same haystack, needles, depths). Where the needle
lands matters: the first `sink` and the last `recent` tokens of the prompt stay in BF16
in every method, so only needles in between test the INT2 history; each case records
which region its needle lies in.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from ..config import CacheConfig, QuantConfig
from ..errors import OscarError
from ..integrations.transformers import patch_model
from ..methods import method_setups
from ..models import attention_shape
from .ppl import check_context

COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "silver", "golden", "black", "white")
OBJECTS = ("door", "lamp", "river", "tower", "violin", "garden", "engine", "mirror", "bridge", "kettle")
ANSWER_TOKENS = 10  # generated tokens; six digits need at most this many with any tokenizer here


@dataclass
class NiahCase:
    target: int  # requested prompt length
    length: int  # prompt tokens (at most `target`)
    depth: float  # 0..1, where in the haystack the needle sits
    trial: int
    subject: str  # "<colour> <object>"
    passcode: str
    needle_token: int  # index of the needle's first token in the prompt
    region: str  # "sink", "history" or "recent": where the needle's first token is stored
    input_ids: torch.Tensor


@dataclass
class NiahResult:
    method: str
    target: int
    length: int
    depth: float
    trial: int
    region: str
    correct: bool
    answer: str  # what the model generated (stripped)
    passcode: str

    def as_dict(self) -> dict:
        return asdict(self)


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


def check_lengths(model_or_config, lengths: list[int]) -> None:
    """Refuse needle prompts of `lengths` tokens (none: nothing to check) whose answer would not fit the model's
    positions; `model_or_config` may be the model's config, for a check before its weights load."""
    if lengths:
        limit = attention_shape(model_or_config).max_positions
        check_context(model_or_config, max(lengths) + ANSWER_TOKENS,
                      f"use --lengths of at most {limit - ANSWER_TOKENS} (the answer takes {ANSWER_TOKENS} tokens more)")


def build_cases(tokenizer, haystack: str, lengths: list[int], depths: list[float], trials: int, cache: CacheConfig,
                bos_id: int | None = None, seed: int = 0) -> list[NiahCase]:
    """One prompt per length, depth and trial, of at most `lengths` tokens (the haystack is cut at a sentence)."""
    rng = random.Random(seed)
    sentences = _sentences(haystack)
    if not sentences:
        raise OscarError("the haystack text has no sentences.")
    lengths_per_sentence = [len(tokenizer(" " + s, add_special_tokens=False).input_ids) for s in sentences]
    cases = []
    for length in lengths:
        for trial in range(trials):
            subject = f"{rng.choice(COLOURS)} {rng.choice(OBJECTS)}"
            passcode = f"{rng.randrange(10**5, 10**6)}"
            needle = f" The secret passcode of the {subject} is {passcode}."
            question = (f"\n\nWhat is the secret passcode of the {subject}? "
                        f"The secret passcode of the {subject} is")
            fixed = len(tokenizer(needle + question, add_special_tokens=False).input_ids) + (bos_id is not None)
            budget = length - fixed
            if budget < 16:
                raise OscarError(f"length {length} leaves no room for a haystack; use lengths of at least {fixed + 16}.")
            start = rng.randrange(len(sentences))  # each trial reads the prose from a different place
            chosen, used = [], 0
            for i in range(len(sentences)):
                j = (start + i) % len(sentences)
                if used + lengths_per_sentence[j] > budget:
                    break
                chosen.append(sentences[j])
                used += lengths_per_sentence[j]
            for depth in depths:
                cut = round(depth * len(chosen))
                before = "".join(" " + s for s in chosen[:cut])
                after = "".join(" " + s for s in chosen[cut:])
                ids = tokenizer(before, add_special_tokens=False).input_ids
                needle_token = len(ids) + (bos_id is not None)
                ids = ids + tokenizer(needle, add_special_tokens=False).input_ids
                ids = ids + tokenizer(after + question, add_special_tokens=False).input_ids
                if bos_id is not None:
                    ids = [bos_id] + ids
                total = len(ids)
                if needle_token < cache.sink_tokens:
                    region = "sink"
                elif needle_token >= total - cache.recent_tokens:
                    region = "recent"
                else:
                    region = "history"
                cases.append(NiahCase(length, total, depth, trial, subject, passcode, needle_token, region,
                                      torch.tensor(ids, dtype=torch.long)))
    return cases


def answer_of(text: str) -> str:
    digits = re.sub(r"[^0-9]", "", text.strip().split("\n")[0])
    return digits[:6]


def run_case(model, tokenizer, case: NiahCase) -> tuple[bool, str]:
    device = next(model.parameters()).device
    ids = case.input_ids[None].to(device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ANSWER_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return answer_of(text) == case.passcode, text.strip()


def evaluate_niah(model, tokenizer, cases: list[NiahCase], methods: list[str], quant: QuantConfig,
                  cache: CacheConfig, artifact=None) -> list[NiahResult]:
    """Every case through every method's cache (greedy), in the same order."""
    check_lengths(model, [case.length for case in cases])
    results = []
    for setup in method_setups(methods, model, quant, cache, artifact):
        name = setup.name
        patch_model(model, setup.artifact, setup.quant, setup.cache)
        for case in tqdm(cases, desc=f"niah {name}", unit="prompt", leave=False):
            correct, text = run_case(model, tokenizer, case)
            results.append(NiahResult(name, case.target, case.length, case.depth, case.trial, case.region, correct, text,
                                      case.passcode))
    return results


def summarise(results: list[NiahResult]) -> list[dict]:
    """Accuracy (%) per method and target length: over all cases, and over the needles stored in the history."""
    groups: dict[tuple[str, int], list[NiahResult]] = {}
    for r in results:
        groups.setdefault((r.method, r.target), []).append(r)
    rows = []
    for (method, target), group in groups.items():
        history = [r for r in group if r.region == "history"]
        rows.append({
            "method": method, "length": target, "cases": len(group),
            "accuracy": 100.0 * sum(r.correct for r in group) / len(group),
            "history_cases": len(history),
            "history_accuracy": 100.0 * sum(r.correct for r in history) / len(history) if history else None,
        })
    return rows
