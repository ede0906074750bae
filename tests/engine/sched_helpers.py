"""Builders for scheduler and KV-cache tests: no model, fake tokens, a controllable clock."""

from __future__ import annotations

import zlib
from collections.abc import Sequence as Seq

from engine.config import SchedulerConfig
from engine.kv.cache_manager import KVCacheManager
from engine.request import FinishReason, Request, RequestClass, SamplingParams
from engine.sched.order import StepOrderPolicy
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.sequence import Sequence

BLOCK = 16


class FakeClock:
    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now


def make_seq(
    request_id: str,
    prompt: Seq[int] | int,
    *,
    cls: RequestClass = RequestClass.INTERACTIVE,
    arrival: float = 0.0,
    max_tokens: int = 16,
) -> Sequence:
    """A sequence whose prompt is `prompt` (or that many distinct tokens, keyed by the id)."""
    if isinstance(prompt, int):
        base = zlib.crc32(request_id.encode()) << 16
        prompt = [base + i for i in range(prompt)]
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling=SamplingParams(max_tokens=max_tokens),
        request_class=cls,
        arrival_time=arrival,
    )
    return Sequence.from_request(request)


def make_requests(
    n: int,
    prompt_len: int,
    *,
    cls: RequestClass = RequestClass.INTERACTIVE,
    prefix: str = "r",
    start_arrival: float = 0.0,
) -> list[Sequence]:
    """`n` sequences with distinct prompts and increasing arrival times."""
    return [
        make_seq(f"{prefix}{i}", prompt_len, cls=cls, arrival=start_arrival + i) for i in range(n)
    ]


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = BLOCK,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 16,
    max_waiting: int = 64,
    bulk_min_share: float = 0.1,
    max_model_len: int = 4096,
    enable_prefix_caching: bool = True,
    clock: FakeClock | None = None,
    order: StepOrderPolicy | None = None,
    first_token_alone: bool = False,
) -> Scheduler:
    """A scheduler over a fresh KV pool; `order` defaults to the config's (priority).
    `first_token_alone` is off unless a test is about it (tests/engine/test_scheduler_order.py):
    the others check how the budget is shared."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_waiting=max_waiting,
        bulk_min_share=bulk_min_share,
        first_token_alone=first_token_alone,
    )
    return Scheduler(config, kv, max_model_len, clock=clock or FakeClock(), order=order)


def fake_token(seq: Sequence) -> int:
    """A deterministic 'sampled' token: depends only on the sequence so far."""
    return (seq.num_tokens * 7919 + len(seq.request_id)) % 50_000


def run_step(sched: Scheduler) -> tuple[SchedulerOutput, list[Sequence]]:
    """One engine step without a model: schedule → update → append a fake token to each
    sampling chunk → finish the sequences that reached max_tokens. Returns (out, finished).
    """
    out = sched.schedule()
    sampled = [c.seq for c in out.chunks if c.samples]
    sched.update(out)
    finished = []
    for seq in sampled:
        seq.token_ids.append(fake_token(seq))
        if seq.num_output_tokens >= seq.sampling.max_tokens:
            sched.finish(seq, FinishReason.LENGTH)
            finished.append(seq)
    return out, finished
