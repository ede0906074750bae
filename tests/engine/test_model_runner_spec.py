"""The runner with drafts: a chunk's drafts are fed after its real tokens and give one row of
logits per position, equal to what decoding them one step at a time gives."""

from __future__ import annotations

import pytest
import torch

from engine.request import Request
from engine.runner.model_runner import ModelRunner
from engine.sched.output import ScheduledChunk, SchedulerOutput
from engine.sequence import Sequence
from tests.engine.hf_tiny import make_runner, random_prompt


def make_sequence(prompt: list[int], first_block: int) -> Sequence:
    """A sequence owning blocks `first_block`, +2, +4 (non-contiguous, never shared)."""
    seq = Sequence.from_request(Request(f"s{first_block}", list(prompt)))
    seq.block_ids = [first_block, first_block + 2, first_block + 4]
    return seq


@pytest.fixture(scope="module")
def llama(checkpoints) -> ModelRunner:
    return make_runner(checkpoints["llama3"][1])


def test_drafts_give_the_logits_of_one_token_steps(llama: ModelRunner) -> None:
    prompt = random_prompt(30, seed=4)
    follow = [17, 230, 5, 99]  # the next real token, then three drafts
    # One token per step: the rows after positions 30..33.
    seq = make_sequence(prompt, 0)
    llama.execute(SchedulerOutput([ScheduledChunk(seq, 0, 30)]))
    want = []
    for i, token in enumerate(follow):
        seq.token_ids.append(token)
        want.append(llama.execute(SchedulerOutput([ScheduledChunk(seq, 30 + i, 1)]))[0])

    # The same with drafts, batched with a prefill chunk of another sequence that does not
    # sample (chunked prefill) and a plain decode.
    other = make_sequence(random_prompt(20, seed=5), 1)
    spec = make_sequence(prompt, 10)
    plain = make_sequence(prompt, 11)
    for s in (spec, plain):
        llama.execute(SchedulerOutput([ScheduledChunk(s, 0, 30)]))
        s.token_ids.append(follow[0])
    out = SchedulerOutput(
        [
            ScheduledChunk(other, 0, 12),
            ScheduledChunk(spec, 30, 1, tuple(follow[1:])),
            ScheduledChunk(plain, 30, 1),
        ]
    )
    inputs = llama.pack(out)
    assert inputs.input_ids[12:16] == follow
    assert inputs.positions[12:16] == [30, 31, 32, 33]
    assert inputs.sample_rows == [12, 13, 14, 15, 16]
    assert out.num_batched_tokens == 17
    logits = llama.execute(out)
    assert logits.shape[0] == 5
    torch.testing.assert_close(logits[:4], torch.stack(want), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[4], want[0], atol=1e-4, rtol=1e-4)
