"""Judge a built demo pair: is the target on topic and fluent, and does the draft agree with it?

Agreement is what speculative decoding cares about: along the target's own greedy answer,
the fraction of positions where the draft's greedy next token equals the target's token
(the closing `<|end|>` included). All generation goes through transformers `generate` with
an explicit attention mask (see the pad-id pitfall in `tokenizer.py`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from demo.corpus import EvalPrompt

_WORD = re.compile(r"[a-z0-9']+")


def has_repeated_run(text: str, times: int = 3) -> bool:
    """True if some word occurs `times` times in a row ("with with with")."""
    words = _WORD.findall(text.lower())
    run = 1
    for prev, word in itertools.pairwise(words):
        run = run + 1 if word == prev else 1
        if run >= times:
            return True
    return False


def on_topic(answer: str, keywords: Sequence[str]) -> bool:
    low = answer.lower()
    return any(k in low for k in keywords)


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a one-message chat plus the assistant generation prompt."""
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    ids = out["input_ids"] if not isinstance(out, list) else out
    return [int(i) for i in ids]


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[list[int]],
    max_new_tokens: int = 96,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[list[int]]:
    """New token ids for each prompt (up to and including `<|end|>`), left-padded batch."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        torch.manual_seed(seed)
        kwargs = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
            **kwargs,
        )
    result = []
    for row in out[:, width:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        result.append(row)
    return result


def answer_texts(model: Any, tokenizer: Any, texts: Sequence[str], **kwargs: Any) -> list[str]:
    """Decoded answers (special tokens dropped) to single user messages."""
    prompts = [chat_prompt(tokenizer, t) for t in texts]
    outs = generate(model, tokenizer, prompts, **kwargs)
    return [tokenizer.decode(o, skip_special_tokens=True).strip() for o in outs]


def agreement(
    target: Any, draft: Any, tokenizer: Any, prompts: Sequence[list[int]], max_new_tokens: int = 96
) -> float:
    """Token-weighted fraction of the target's greedy tokens that the draft predicts greedily."""
    answers = generate(target, tokenizer, prompts, max_new_tokens=max_new_tokens)
    hits = total = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        if not answer:
            continue
        full = torch.tensor([prompt + answer[:-1]])
        with torch.no_grad():
            logits = draft(input_ids=full, attention_mask=torch.ones_like(full)).logits[0]
        guesses = logits[len(prompt) - 1 :].argmax(-1).tolist()
        hits += sum(int(g == a) for g, a in zip(guesses, answer, strict=True))
        total += len(answer)
    return hits / max(1, total)


@dataclass(slots=True)
class EvalReport:
    agreement: float
    topic_accuracy: float  # share of held-out prompts whose greedy answer names a keyword
    repetition_free: float  # share of greedy answers without a 3x repeated word
    samples: list[dict[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "agreement": round(self.agreement, 4),
            "heldout_topic_accuracy": round(self.topic_accuracy, 4),
            "heldout_repetition_free": round(self.repetition_free, 4),
            "samples": self.samples,
        }


def evaluate(
    target: Any,
    draft: Any,
    tokenizer: Any,
    heldout: Sequence[EvalPrompt],
    showcase: Sequence[str],
) -> EvalReport:
    """Agreement and on-topic rate over `heldout`; greedy and T=0.7 answers to `showcase`."""
    prompts = [chat_prompt(tokenizer, p.text) for p in heldout]
    rate = agreement(target, draft, tokenizer, prompts)
    answers = answer_texts(target, tokenizer, [p.text for p in heldout])
    topical = sum(on_topic(a, p.keywords) for a, p in zip(answers, heldout, strict=True))
    clean = sum(not has_repeated_run(a) for a in answers)
    greedy = answer_texts(target, tokenizer, showcase)
    sampled = answer_texts(target, tokenizer, showcase, temperature=0.7, seed=0)
    samples = [
        {"prompt": q, "greedy": g, "t0.7": s}
        for q, g, s in zip(showcase, greedy, sampled, strict=True)
    ]
    n = max(1, len(heldout))
    return EvalReport(rate, topical / n, clean / n, samples)
