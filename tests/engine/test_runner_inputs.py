"""Persistent step input buffers against the tensors `ModelRunner._run` builds from lists."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.runner.inputs import StepBuffers, StepTensors
from engine.runner.model_runner import ModelRunner, StepInputs
from engine.sched.output import ScheduledChunk, SchedulerOutput
from engine.sequence import Sequence
from tests.engine.hf_tiny import make_sequence, random_prompt

NUM_BLOCKS = 96


def list_built(step: StepInputs, block_size: int = 16) -> dict[str, torch.Tensor | int]:
    """What `ModelRunner._run` builds from a step's lists with `torch.tensor` (as of the
    commit that introduced StepBuffers): the expectation every fill must equal."""
    width = max(len(t) for t in step.block_tables)
    cu = step.cu_seqlens_q
    return dict(
        input_ids=torch.tensor(step.input_ids, dtype=torch.int64),
        positions=torch.tensor(step.positions, dtype=torch.int64),
        sample_rows=torch.tensor(step.sample_rows, dtype=torch.int64),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens_k=torch.tensor(step.seq_lens_k, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in step.block_tables]).int(),
        slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.int64),
        max_seqlen_q=max(b - a for a, b in itertools.pairwise(cu)),
        max_seqlen_k=max(step.seq_lens_k),
        block_size=block_size,
    )


def assert_filled_like_lists(got: StepTensors, step: StepInputs) -> None:
    want = list_built(step)
    meta = got.meta
    actual = dict(
        input_ids=got.input_ids,
        positions=got.positions,
        sample_rows=got.sample_rows,
        cu_seqlens_q=meta.cu_seqlens_q,
        seq_lens_k=meta.seq_lens_k,
        block_table=meta.block_table,
        slot_mapping=meta.slot_mapping,
        max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k,
        block_size=meta.block_size,
    )
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            tensor = actual[name]
            assert isinstance(tensor, torch.Tensor)
            assert tensor.dtype == value.dtype and tensor.shape == value.shape, name
            assert torch.equal(tensor, value), name
            assert tensor.is_contiguous(), name
        else:
            assert actual[name] == value, name
    assert meta.state is None  # a fresh metadata object every step: no stale backend state


def disjoint_sequences(prompts: list[list[int]], capacity: int, seed: int) -> list[Sequence]:
    """Sequences that own shuffled, disjoint blocks for up to `capacity` tokens each."""
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    per_seq = (capacity + 15) // 16
    seqs = []
    for i, prompt in enumerate(prompts):
        seq = make_sequence(prompt, 0, NUM_BLOCKS, seed=seed + i)
        seq.block_ids = blocks[i * per_seq : (i + 1) * per_seq]
        seqs.append(seq)
    return seqs


def make_runner(path, backend: str | None) -> ModelRunner:
    config = EngineConfig(
        model=str(path), attention_backend=backend, cache=CacheConfig(num_blocks=NUM_BLOCKS)
    )
    return ModelRunner(config, str(path))


def buffers_for(runner: ModelRunner) -> StepBuffers:
    """Sized as the runner will size them (see engine/runner/inputs.py)."""
    return StepBuffers(
        max_num_tokens=runner.config.scheduler.max_num_batched_tokens,
        max_num_seqs=runner.config.scheduler.max_num_seqs,
        max_blocks_per_seq=-(-runner.max_model_len // runner.block_size),
        block_size=runner.block_size,
        device=runner.device,
    )


@pytest.fixture(scope="module")
def runner(checkpoints) -> ModelRunner:
    return make_runner(checkpoints["llama3"][1], "torch_ref")


def mixed_schedules(seqs: list[Sequence]) -> list[list[tuple[Sequence, int, int]]]:
    """Steps of (seq, start, num_tokens): a long prefill, chunked prefill, decodes among them."""
    a, b, c = seqs
    return [
        [(a, 0, a.num_tokens)],
        [(b, 0, 20), (c, 0, c.num_tokens)],
        [(b, 20, b.num_tokens - 20)],
    ]


def test_fill_equals_the_list_built_tensors_for_packed_runner_steps(runner: ModelRunner):
    seqs = disjoint_sequences([random_prompt(n, seed=n) for n in (40, 70, 5)], 160, seed=1)
    buffers = buffers_for(runner)
    for chunks in mixed_schedules(seqs):
        step = runner.pack(SchedulerOutput([ScheduledChunk(*c) for c in chunks]))
        assert_filled_like_lists(buffers.fill(step), step)
    # Decodes of all three (one token each, the long one with many blocks) after the prefills.
    for seq in seqs:
        seq.token_ids.append(3)
    out = SchedulerOutput([ScheduledChunk(s, s.num_tokens - 1, 1) for s in seqs])
    step = runner.pack(out)
    assert len(set(map(len, step.block_tables))) > 1  # ragged: the table needs padding
    assert_filled_like_lists(buffers.fill(step), step)


def test_buffers_are_reused_and_padding_never_leaks():
    buffers = StepBuffers(max_num_tokens=64, max_num_seqs=4, max_blocks_per_seq=8, block_size=16)
    wide = StepInputs(
        input_ids=[1, 2, 3, 4],
        positions=[100, 90, 80, 70],
        slot_mapping=[1000, 1100, 1200, 1300],
        cu_seqlens_q=[0, 1, 2, 3, 4],
        seq_lens_k=[101, 91, 81, 71],
        block_tables=[[70 + i] * 7 for i in range(4)],  # 7 blocks each, ids 70..73
        sample_rows=[0, 1, 2, 3],
    )
    first = buffers.fill(wide)
    assert_filled_like_lists(first, wide)
    ragged = StepInputs(
        input_ids=[5] * 20 + [6],
        positions=[*range(20), 40],
        slot_mapping=[*range(16, 36), 140],
        cu_seqlens_q=[0, 20, 21],
        seq_lens_k=[20, 41],
        block_tables=[[1, 2], [7, 8, 9]],
        sample_rows=[19, 20],
    )
    second = buffers.fill(ragged)
    assert_filled_like_lists(second, ragged)
    assert second.meta.block_table.tolist() == [[1, 2, 0], [7, 8, 9]]  # 0, not 70
    # The same storage every step: nothing allocated per step beyond the views.
    assert second.input_ids.data_ptr() == first.input_ids.data_ptr()
    assert second.meta.block_table.data_ptr() == first.meta.block_table.data_ptr()
    assert second.meta.slot_mapping.data_ptr() == first.meta.slot_mapping.data_ptr()


def test_steps_past_the_limits_are_refused():
    buffers = StepBuffers(max_num_tokens=4, max_num_seqs=2, max_blocks_per_seq=2, block_size=16)
    ok = StepInputs([1, 2], [0, 1], [0, 1], [0, 2], [2], [[0]], [1])
    assert buffers.fill(ok).input_ids.tolist() == [1, 2]
    too_many_tokens = StepInputs([1] * 5, list(range(5)), list(range(5)), [0, 5], [5], [[0]], [4])
    with pytest.raises(ValueError, match="5 tokens over 1 sequences exceeds"):
        buffers.fill(too_many_tokens)
    three_seqs = StepInputs(
        [1] * 3, [0] * 3, [0, 16, 32], [0, 1, 2, 3], [1] * 3, [[0], [1], [2]], []
    )
    with pytest.raises(ValueError, match="3 sequences exceeds"):
        buffers.fill(three_seqs)
    long_table = StepInputs([1], [40], [40], [0, 1], [41], [[0, 1, 2]], [0])
    with pytest.raises(ValueError, match="3 blocks exceeds the buffers' 2"):
        buffers.fill(long_table)
    with pytest.raises(ValueError, match="at least 1"):
        StepBuffers(max_num_tokens=0, max_num_seqs=1, max_blocks_per_seq=1, block_size=16)


@pytest.mark.parametrize("backend", ["torch_ref", None])  # None: the best here (cpu_paged)
def test_model_on_filled_buffers_gives_the_runners_logits(checkpoints, backend: str | None):
    """Real forwards: each step runs once through the runner and once on the buffers' views,
    over the same KV cache; the logits agree, and the greedy continuation goes on."""
    runner = make_runner(checkpoints["llama3"][1], backend)
    buffers = buffers_for(runner)
    seqs = disjoint_sequences([random_prompt(n, seed=n) for n in (40, 70, 5)], 160, seed=2)
    schedules = mixed_schedules(seqs)
    for _ in range(6):  # then decode steps over all three
        schedules.append([(s, -1, 1) for s in seqs])
    for chunks in schedules:
        out = SchedulerOutput(
            [
                ScheduledChunk(s, s.num_tokens - 1 if start < 0 else start, n)
                for s, start, n in chunks
            ]
        )
        want = runner.execute(out)
        t = buffers.fill(runner.pack(out))
        with torch.inference_mode():
            hidden = runner.model(t.input_ids, t.positions, runner.kv_caches, t.meta)
            got = runner.model.compute_logits(hidden.index_select(0, t.sample_rows)).float()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        sampling = [c.seq for c in out.chunks if c.samples]
        assert got.shape[0] == len(sampling)
        for seq, row in zip(sampling, want, strict=True):
            seq.token_ids.append(int(row.argmax()))
    assert all(s.num_tokens > s.num_prompt_tokens for s in seqs)
