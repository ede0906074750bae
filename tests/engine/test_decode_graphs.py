"""Decode graphs (`engine.runner.graphs`) with the Triton backend: the static path a CUDA graph
replays (persistent inputs, static metadata, padded buckets, key-length bounds), run without
the capture itself on the CPU through Triton's interpreter; `tests/gpu` captures for real.

Like test_triton_paged.py this module needs triton imported under the interpreter, so a
whole-suite CPU run skips it here and `tests/kernels/test_triton_interpreter.py` runs it in a
process of its own.
"""

from __future__ import annotations

import functools

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.runner.graphs import DecodeGraphs, batch_buckets, seqlen_bounds
from engine.runner.inputs import StepInputs
from tests.engine.engine_fixture import (
    greedy,
    kv_freed_once_dropped,
    make_request,
    prompt_ids,
    tiny_config,
)
from tests.kernels.helpers import triton_kernel_device

DEVICE = triton_kernel_device()  # imports triton under the interpreter on a CPU host

from kernels.triton_paged import TritonPagedBackend, TritonTuning  # noqa: E402


@pytest.fixture(autouse=True)
def interpreter_on(monkeypatch: pytest.MonkeyPatch) -> None:
    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_engine(async_scheduling: bool = False) -> LLMEngine:
    config = tiny_config(
        device=DEVICE.type,
        async_scheduling=async_scheduling,
        attention_backend="triton_paged",
        cache=CacheConfig(num_blocks=96),
        scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=256),
    )
    engine = LLMEngine(config)
    engine.runner.warmup()  # on CUDA this captures the graphs; tests below replace them
    engine.runner.graphs = None
    return engine


def static_graphs(engine: LLMEngine, split_min_keys: int | None = None) -> DecodeGraphs:
    """The engine's decode graphs without CUDA capture, key bounds from 64; with
    `split_min_keys`, Triton splits the keys from that many on (so bounds change the plan)."""
    runner = engine.runner
    assert isinstance(runner.backend, TritonPagedBackend)
    if split_min_keys is not None:
        runner.backend.tuning = TritonTuning(split_min_keys=split_min_keys)
    graphs = DecodeGraphs(
        runner.model,
        runner.backend,
        runner.kv_caches,
        runner.buffers,
        max_batch=runner.config.scheduler.max_num_seqs,
        max_model_len=runner.max_model_len,
        dtype=runner.info.dtype,
        capture=DEVICE.type == "cuda",
        min_seqlen_bound=64,
    )
    graphs.capture_all()
    runner.graphs = graphs
    return graphs


def run(engine: LLMEngine, late_after: int = 3) -> dict[str, list[int]]:
    """Greedy outputs of requests of different lengths (so the decode batch shrinks through
    the buckets), one of them arriving mid-decode (a mixed step, which runs eagerly)."""
    first = [
        make_request("short", prompt_ids(1, 9), greedy(8)),
        make_request("long", prompt_ids(2, 140), greedy(4)),  # bound 256
        make_request("mid", prompt_ids(3, 58), greedy(12)),  # crosses the 64 bound
    ]
    late = make_request("late", prompt_ids(4, 20), greedy(6))
    for request in first:
        engine.add_request(request)
    out: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.error is None, delta.error
            out.setdefault(delta.request_id, []).extend(delta.token_ids)
        steps += 1
        if steps == late_after:
            engine.add_request(late)
    return out


def test_buckets_and_bounds():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert seqlen_bounds(512) == [512]
    assert seqlen_bounds(131072) == [512, 2048, 8192, 32768, 131072]
    assert seqlen_bounds(512, 64) == [64, 256, 512]


def test_lookup_takes_the_smallest_bucket_and_bound_that_hold_a_decode_step():
    engine = make_engine()
    graphs = static_graphs(engine)
    assert sorted(graphs.graphs) == [(b, k) for b in (1, 2, 4, 6) for k in (64, 256, 512)]
    buffers = engine.runner.buffers

    def meta(q_lens: list[int], k_lens: list[int]):
        n = sum(q_lens)
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        tables = [[0] * -(-k // 16) for k in k_lens]
        step = StepInputs([0] * n, [0] * n, [0] * n, cu, k_lens, tables, [n - 1])
        return buffers.fill(step).meta

    def key(graph):
        return None if graph is None else (graph.bs, graph.max_seqlen_k)

    assert key(graphs.lookup(meta([1, 1, 1], [5, 70, 64]))) == (4, 256)
    assert key(graphs.lookup(meta([1], [64]))) == (1, 64)
    assert key(graphs.lookup(meta([1] * 6, [300] * 6))) == (6, 512)
    assert graphs.lookup(meta([1, 2], [5, 9])) is None  # a 2-token chunk: eager


@functools.cache
def eager_outputs() -> dict[str, list[int]]:
    return run(make_engine())


@pytest.mark.parametrize("split_min_keys", [None, 32], ids=["plain", "split"])
def test_greedy_output_is_the_same_with_graphs(split_min_keys):
    eager = eager_outputs()
    engine = make_engine()
    graphs = static_graphs(engine, split_min_keys)
    assert run(engine) == eager
    assert graphs.num_replays >= 8
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_launched_steps_feed_the_graphs_inputs_from_the_device():
    """Async scheduling with graphs: a launched decode step's placeholder inputs are written
    into the buffer the graph reads, from the previous step's tokens."""
    engine = make_engine(async_scheduling=True)
    graphs = static_graphs(engine)
    assert run(engine) == eager_outputs()
    assert graphs.num_replays >= 8 and engine.counters.launched_steps == engine.counters.steps
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_an_engine_with_graphs_is_freed_once_dropped():
    """No reference cycle through the graphs' forward closures keeps the model and KV cache
    alive (on a GPU, most of its memory) after the engine is dropped."""

    def make() -> LLMEngine:
        engine = make_engine(async_scheduling=True)
        static_graphs(engine)
        run(engine)
        return engine

    assert kv_freed_once_dropped(make)


def test_a_padded_replay_writes_only_the_live_slots():
    engine = make_engine()
    graphs = static_graphs(engine)
    runner = engine.runner
    # first four sequences fill bucket 4 (its static rows now hold real slots and lengths)
    four = StepInputs(
        [1, 2, 3, 4], [3, 3, 3, 3], [11 * 16 + 3, 12 * 16 + 3, 13 * 16 + 3, 14 * 16 + 3],
        [0, 1, 2, 3, 4], [4, 4, 4, 4], [[11], [12], [13], [14]], [0, 1, 2, 3],
    )  # fmt: skip
    runner._run(four)
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    # then three (bucket 4 again, one padding row) at positions 40, 0 and 17
    slots = [5 * 16 + 8, 9 * 16, 2 * 16 + 1]
    tables = [[3, 4, 5], [9], [7, 2]]
    step = StepInputs([7, 8, 9], [40, 0, 17], slots, [0, 1, 2, 3], [41, 1, 18], tables, [0, 1, 2])
    logits = runner._run(step)
    assert graphs.num_replays == 2 and logits.shape == (3, runner.info.vocab_size)
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches, strict=True):
        changed = ((k0 != k1).flatten(2).any(-1) | (v0 != v1).flatten(2).any(-1)).nonzero()
        assert changed.tolist() == [[2, 1], [5, 8], [9, 0]]  # the live slots only
    padded = graphs.graphs[4, 64].meta
    assert padded.seq_lens_k.tolist() == [41, 1, 18, 0] and padded.slot_mapping[3] == -1


def test_a_failing_replay_turns_the_graphs_off_and_the_step_runs_eagerly(monkeypatch, caplog):
    engine = make_engine()
    graphs = static_graphs(engine)

    def broken(bs, meta):
        raise RuntimeError("replay broke")

    monkeypatch.setattr(graphs.backend, "prepare_for_replay", broken)
    want = eager_outputs()
    assert run(engine) == want
    assert engine.runner.graphs is None and "decode steps run eagerly" in caplog.text
