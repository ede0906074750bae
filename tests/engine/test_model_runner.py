"""The model runner driven by hand-built scheduler outputs, against transformers' `generate`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.runner.model_runner import ModelRunner
from engine.sched.output import ScheduledChunk, SchedulerOutput
from engine.sequence import PLACEHOLDER, Sequence
from tests.engine.hf_tiny import (
    FAMILIES,
    greedy_with_hf,
    greedy_with_runner,
    make_runner,
    make_sequence,
    random_prompt,
)

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def llama(checkpoints) -> ModelRunner:
    return make_runner(checkpoints["llama3"][1])


def step(runner: ModelRunner, *chunks: ScheduledChunk) -> torch.Tensor:
    return runner.execute(SchedulerOutput(list(chunks)))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_decode_matches_transformers_generate(family: str, checkpoints):
    hf_model, path = checkpoints[family]
    prompt = random_prompt(20, seed=2)
    want, margin = greedy_with_hf(hf_model, prompt, NEW_TOKENS)
    assert margin > 1e-3, "the fixture model must not have near-tied logits"
    assert len(set(want)) > 10  # a real continuation, not one repeated token
    runner = make_runner(path)
    runner.warmup()
    assert greedy_with_runner(runner, prompt, NEW_TOKENS, seed=7) == want


def test_chunked_prefill_gives_the_same_logits(llama: ModelRunner):
    prompt = random_prompt(45, seed=11)
    whole = make_sequence(prompt, 64, llama.num_blocks, seed=1)
    split = make_sequence(prompt, 64, llama.num_blocks, seed=2)
    want = step(llama, ScheduledChunk(whole, 0, 45))

    first = step(llama, ScheduledChunk(split, 0, 21))  # stops short: samples nothing
    assert first.shape == (0, 256)
    got = step(llama, ScheduledChunk(split, 21, 24))
    assert got.shape == (1, 256) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_mixed_batch_matches_each_sequence_alone(checkpoints, llama: ModelRunner):
    """Prefills, a chunked prefill and decodes share steps; each sequence still decodes
    exactly as transformers does on its own."""
    hf_model, _ = checkpoints["llama3"]
    prompts = [random_prompt(n, seed=20 + n) for n in (9, 33, 50)]
    runs = [greedy_with_hf(hf_model, p, 12) for p in prompts]
    assert min(margin for _, margin in runs) > 1e-3
    want = [tokens for tokens, _ in runs]
    seqs = []
    blocks = iter(range(llama.num_blocks))
    for p in prompts:  # interleaved block ownership: 0,1,2 for a, b, c then 3,4,5 ...
        seq = make_sequence(p, 0, llama.num_blocks)
        seq.block_ids = []
        seqs.append(seq)
    for _ in range(5):
        for seq in seqs:
            seq.block_ids.append(next(blocks))
    a, b, c = seqs
    computed = {id(s): 0 for s in seqs}

    def chunk(seq: Sequence, n: int | None = None) -> ScheduledChunk:
        start = computed[id(seq)]
        n = seq.num_tokens - start if n is None else n
        computed[id(seq)] = start + n
        return ScheduledChunk(seq, start, n)

    schedule = [
        lambda: [chunk(a)],  # a prefills alone
        lambda: [chunk(a), chunk(b), chunk(c, 20)],  # a decodes, b prefills, c's first part
        lambda: [chunk(c), chunk(a), chunk(b)],  # c finishes its prefill between decodes
    ]
    for _ in range(12):
        schedule.append(lambda: [chunk(s) for s in seqs])
    for make_chunks in schedule:
        chunks = [ch for ch in make_chunks() if ch.num_tokens > 0]
        chunks = [ch for ch in chunks if ch.seq.num_output_tokens < 12]
        if not chunks:
            break
        logits = step(llama, *chunks)
        sampling = [ch.seq for ch in chunks if ch.samples]
        assert logits.shape == (len(sampling), 256)
        for seq, row in zip(sampling, logits, strict=True):
            seq.token_ids.append(int(row.argmax()))
    assert [s.output_token_ids for s in seqs] == want


def test_placeholder_inputs_are_fed_from_the_previous_steps_tokens(llama: ModelRunner):
    """A launched-ahead step (async scheduling): each sequence's last input is a placeholder
    whose token comes from the previous step's token tensor, by that step's row; a prompt
    chunk in the same step is packed as usual. Logits equal those of the real tokens."""
    prompts = [random_prompt(n, seed=40 + n) for n in (12, 30)]
    known = [make_sequence(p, 64, llama.num_blocks, seed=i) for i, p in enumerate(prompts)]
    fed = [make_sequence(p, 64, llama.num_blocks, seed=i) for i, p in enumerate(prompts)]
    other = make_sequence(random_prompt(7, seed=5), 32, llama.num_blocks, seed=9)
    for seqs in (known, fed):
        step(llama, *(ScheduledChunk(s, 0, s.num_tokens) for s in seqs))
    tokens = [17, 201]
    for s, t in zip(known, tokens, strict=True):
        s.token_ids.append(t)
    for s in fed:
        s.token_ids.append(PLACEHOLDER)
    rows = {fed[0].request_id: 1, fed[1].request_id: 0}  # the previous step's rows, swapped
    prev = torch.tensor(tokens[::-1])
    want = step(
        llama, ScheduledChunk(other, 0, 7), *(ScheduledChunk(s, s.num_tokens - 1, 1) for s in known)
    )
    packed = llama.pack(
        SchedulerOutput(
            [ScheduledChunk(other, 0, 7), *(ScheduledChunk(s, s.num_tokens - 1, 1) for s in fed)]
        ),
        rows,
    )
    assert (packed.feed_dst, packed.feed_src) == ([7, 8], [1, 0])
    got = llama.execute(
        SchedulerOutput(
            [ScheduledChunk(other, 0, 7), *(ScheduledChunk(s, s.num_tokens - 1, 1) for s in fed)]
        ),
        feed=(rows, prev),
    )
    torch.testing.assert_close(got, want)


def test_execute_does_not_mutate_sequences(llama: ModelRunner):
    seq = make_sequence(random_prompt(10, seed=3), 32, llama.num_blocks, seed=3)
    before = (list(seq.token_ids), list(seq.block_ids), seq.num_computed_tokens, seq.status)
    step(llama, ScheduledChunk(seq, 0, 10))
    assert (seq.token_ids, seq.block_ids, seq.num_computed_tokens, seq.status) == before
    assert llama.execute(SchedulerOutput()).shape == (0, 256)


def test_cache_sizing_and_context_length(checkpoints):
    path = checkpoints["qwen3"][1]  # 2 layers, 1 kv head of 32
    config = EngineConfig(model=str(path), cache=CacheConfig(kv_cache_bytes=100_000))
    runner = ModelRunner(config, str(path))
    assert runner.bytes_per_block == 2 * 2 * 16 * 1 * 32 * 4
    assert runner.num_blocks == 100_000 // runner.bytes_per_block
    assert runner.block_size == 16 and runner.max_model_len == 256
    k_cache, v_cache = runner.kv_caches[1]
    assert k_cache.shape == v_cache.shape == (runner.num_blocks, 16, 1, 32)

    bf16 = dataclasses.replace(config, dtype="bfloat16", max_model_len=100)
    runner = ModelRunner(dataclasses.replace(bf16, cache=CacheConfig(num_blocks=7)), str(path))
    assert (runner.num_blocks, runner.max_model_len) == (7, 100)
    assert runner.kv_caches[0][0].dtype is torch.bfloat16
    assert runner.bytes_per_block == 2 * 2 * 16 * 1 * 32 * 2
    runner.warmup()  # a bf16 forward on scratch blocks
    seq = make_sequence(random_prompt(5, seed=1), 6, runner.num_blocks)
    logits = step(runner, ScheduledChunk(seq, 0, 5))
    assert logits.dtype is torch.float32 and torch.isfinite(logits).all()

    with pytest.raises(ValueError, match="exceeds"):
        ModelRunner(dataclasses.replace(config, max_model_len=1000), str(path))
    with pytest.raises(ValueError, match="holds no block"):
        ModelRunner(dataclasses.replace(config, cache=CacheConfig(kv_cache_bytes=10)), str(path))


def test_the_memory_profile_step_is_the_full_budget_in_several_sequences(checkpoints):
    """The step `_blocks_from_free_memory` measures (on CUDA) runs here: the whole token
    budget, in sequences no longer than the context allows, with a full batch of logits."""
    path = checkpoints["llama3"][1]
    config = EngineConfig(
        model=str(path), max_model_len=100, cache=CacheConfig(kv_cache_bytes=1 << 20)
    )
    config = dataclasses.replace(
        config,
        scheduler=dataclasses.replace(
            config.scheduler, max_num_batched_tokens=250, max_num_seqs=40
        ),
    )
    runner = ModelRunner(config, str(path))
    step, num_blocks = runner._largest_step()
    assert step.cu_seqlens_q == [0, 99, 198, 250]
    assert step.seq_lens_k == [99, 99, 52] and len(step.sample_rows) == 40
    assert num_blocks == 7 + 7 + 4  # each sequence's blocks, one position to spare
    assert sorted(step.slot_mapping) == sorted(set(step.slot_mapping))  # no slot twice
    runner.kv_caches = runner._allocate_kv(num_blocks)
    tokens = runner._profile_run(step)  # the forward, then a sampled draw for each row
    assert tokens.shape == (40,) and bool(((tokens >= 0) & (tokens < runner.info.vocab_size)).all())
    # speculating: each sequence's drafts are verified rows too (40 x 5 of 250 tokens)
    spec = dataclasses.replace(config.speculative, method="prompt_lookup", max_num_tokens=4)
    runner = ModelRunner(dataclasses.replace(config, speculative=spec), str(path))
    assert len(runner._largest_step()[0].sample_rows) == 200
