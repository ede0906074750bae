"""Decode steps replayed from CUDA graphs captured at warm-up (`engine.runner.graphs`), on a
GPU with the Triton backend. Skipped without CUDA.

Run on a GPU host: `pytest -m gpu tests/gpu/test_cuda_graphs.py` (tests/engine/
test_decode_graphs.py also captures for real there).
"""

from __future__ import annotations

import pytest
import torch

from engine.llm_engine import LLMEngine
from tests.engine.engine_fixture import greedy, make_request, prompt_ids
from tests.gpu.helpers import warm_gpu_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def outputs(cuda_graphs: bool, dtype: str) -> tuple[dict[str, list[int]], LLMEngine]:
    engine = warm_gpu_engine(dtype, cuda_graphs=cuda_graphs)
    lengths = [(5, 400), (40, 300), (200, 250), (17, 120), (3, 60)]  # (prompt, new tokens)
    for i, (prompt, new) in enumerate(lengths):
        engine.add_request(make_request(f"r{i}", prompt_ids(i, prompt), greedy(new)))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.error is None
            out.setdefault(delta.request_id, []).extend(delta.token_ids)
    return out, engine


def test_warmup_captures_graphs_and_greedy_output_is_unchanged():
    eager, plain = outputs(False, "float32")
    assert plain.runner.graphs is None
    got, engine = outputs(True, "float32")
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.graphs and graphs.num_replays >= 300
    assert got == eager  # hundreds of tokens each, through buckets 8, 4, 2, 1
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_bfloat16_graphs_run():
    got, engine = outputs(True, "bfloat16")
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays >= 300
    assert [len(v) for v in got.values()] == [400, 300, 250, 120, 60]
