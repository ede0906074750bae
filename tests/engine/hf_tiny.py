"""Tiny random HF checkpoints of each supported family, and a hand-driven greedy loop.

Weights use a large initializer range, and every bias and norm weight is randomised (HF
initialises them to 0 and 1, which would hide a mis-mapped bias or a swapped norm), so logits
have clear argmax margins and every tensor of the checkpoint matters.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import transformers

from engine.config import CacheConfig, EngineConfig
from engine.request import Request
from engine.runner.model_runner import ModelRunner
from engine.sched.output import ScheduledChunk, SchedulerOutput
from engine.sequence import Sequence

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.25,
    bos_token_id=None,
    eos_token_id=None,  # greedy runs go the full length in both engines
    pad_token_id=None,
)

FAMILIES = {
    # Llama 3.1-style rope scaling; a short original context so the scaling bites.
    "llama3": lambda: transformers.LlamaConfig(
        **COMMON,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    # Linear rope scaling, tied embeddings, biases on attention and MLP, plain MHA.
    "llama_linear_tied": lambda: transformers.LlamaConfig(
        **{**COMMON, "num_key_value_heads": 4},
        rope_scaling=dict(rope_type="linear", factor=2.0),
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    ),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=4096),
    "qwen2_tied": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    # Explicit head_dim (hidden / heads would be 16) and GQA 4.
    "qwen3": lambda: transformers.Qwen3Config(**{**COMMON, "num_key_value_heads": 1}, head_dim=32),
}

MODEL_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
}


def make_hf_model(family: str, seed: int = 0) -> transformers.PreTrainedModel:
    config = FAMILIES[family]()
    torch.manual_seed(seed)
    model = MODEL_CLASSES[config.model_type](config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.5)
            elif "norm" in name:
                param.copy_(1.0 + torch.randn_like(param) * 0.3)
    return model


def save_hf_model(family: str, directory: Path, seed: int = 0, **save_kwargs) -> Path:
    model = make_hf_model(family, seed)
    model.save_pretrained(directory, **save_kwargs)
    return directory


def make_runner(path: Path, dtype: str = "float32", num_blocks: int = 64) -> ModelRunner:
    config = EngineConfig(
        model=str(path),
        dtype=dtype,
        attention_backend="torch_ref",
        cache=CacheConfig(num_blocks=num_blocks),
    )
    return ModelRunner(config, str(path))


def make_sequence(prompt: list[int], num_tokens: int, num_blocks: int, seed: int = 0) -> Sequence:
    """A sequence holding enough shuffled, non-contiguous blocks for `num_tokens` tokens."""
    seq = Sequence.from_request(Request(f"req-{seed}", list(prompt)))
    needed = (num_tokens + 15) // 16
    seq.block_ids = random.Random(seed).sample(range(num_blocks), needed)
    return seq


def random_prompt(length: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(VOCAB), k=length)


def greedy_with_runner(
    runner: ModelRunner, prompt: list[int], max_new: int, *, seed: int = 0
) -> list[int]:
    """Prefill in one step, then `max_new - 1` one-token decode steps; argmax each time."""
    seq = make_sequence(prompt, len(prompt) + max_new, runner.num_blocks, seed)
    chunk = ScheduledChunk(seq, 0, len(prompt))
    for _ in range(max_new):
        logits = runner.execute(SchedulerOutput([chunk]))
        seq.token_ids.append(int(logits[0].argmax()))
        chunk = ScheduledChunk(seq, seq.num_tokens - 1, 1)
    return seq.output_token_ids


def greedy_with_hf(model: transformers.PreTrainedModel, prompt: list[int], max_new: int):
    """HF greedy continuation, and the smallest top-1/top-2 logit margin along the way."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new,
            output_scores=True,
            return_dict_in_generate=True,
        )
    top2 = torch.stack([s[0].topk(2).values for s in out.scores])
    return out.sequences[0, len(prompt) :].tolist(), float((top2[:, 0] - top2[:, 1]).min())
