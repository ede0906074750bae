"""A tiny random Llama saved with a real (in-test trained) tokenizer, for engine tests.

Random weights with a wide initializer give peaked logits, so greedy runs are deterministic
and comparable with transformers. EOS is id 1 (`<|eos|>`); tests that need full-length runs
pass `ignore_eos`.
"""

from __future__ import annotations

import functools
import gc
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import transformers

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.request import Request, SamplingParams
from tests.engine.tokenizer_fixture import build_tokenizer


def _save_random_llama(prefix: str, seed: int, **shape: int) -> Path:
    """A random Llama of `shape` with the test tokenizer, saved as an HF directory."""
    tok = build_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=512,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        **shape,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    path = Path(tempfile.mkdtemp(prefix=prefix))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@functools.cache
def tiny_model_dir() -> Path:
    return _save_random_llama(
        "firstlight-tiny-",
        0,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@functools.cache
def tiny_draft_dir() -> Path:
    """A 1-layer random Llama sharing the tiny model's tokenizer: a draft that often
    disagrees with the target (the target itself makes a draft that always agrees)."""
    return _save_random_llama(
        "firstlight-tiny-draft-",
        1,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def tiny_config(**overrides) -> EngineConfig:
    cache = overrides.pop("cache", CacheConfig(num_blocks=128))
    scheduler = overrides.pop("scheduler", SchedulerConfig())
    # Tests script their proposers' drafts: the `fixed` policy passes them on as proposed.
    spec = overrides.pop("speculative", SpeculativeConfig(policy="fixed"))
    config = EngineConfig(
        model=str(tiny_model_dir()), cache=cache, scheduler=scheduler, speculative=spec
    )
    return replace(config, **overrides)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def make_request(rid: str, prompt: list[int], params: SamplingParams, **kw) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling=params, **kw)


def prompt_ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g).tolist()


def kv_freed_once_dropped(make: Callable[[], Any]) -> bool:
    """Whether the KV cache of the engine `make()` returns is freed as soon as the engine is
    dropped, with the garbage collector off: no reference cycle holds it (on a GPU it is most
    of the device's memory, which the next engine in the process needs)."""
    engine = make()
    cache = weakref.ref(engine.runner.kv_caches[0][0])
    gc.disable()
    try:
        del engine
        return cache() is None
    finally:
        gc.enable()
