"""Decode steps replayed from CUDA graphs captured at warm-up (`engine.runner.graphs`), on a
GPU with the Triton backend. Skipped without CUDA.

Run on a GPU host: `pytest -m gpu tests/gpu/test_cuda_graphs.py` (tests/engine/
test_decode_graphs.py also captures for real there).
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.runner.model_runner import ModelRunner
from tests.engine.engine_fixture import greedy, make_request, prompt_ids
from tests.engine.hf_tiny import FAMILIES, greedy_with_runner, random_prompt, save_hf_model
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


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_model_family_replays_graphs_on_fused_ops_as_on_torchs(family, tmp_path):
    """Biases, tied embeddings, MHA and GQA, Qwen3's q/k norms inside the RoPE + K/V write
    kernel: with decode graphs captured (padding rows write nothing), the fused ops give
    torch's greedy tokens in float32, and bfloat16 runs; each family's own kernel variants."""
    save_hf_model(family, tmp_path)

    def run(fused: bool | None, dtype: str) -> tuple[list[int], ModelRunner]:
        config = EngineConfig(
            model=str(tmp_path), device="cuda", dtype=dtype, fused_ops=fused,
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
        )  # fmt: skip
        runner = ModelRunner(config, str(tmp_path))
        runner.warmup()
        assert runner.graphs is not None
        return greedy_with_runner(runner, random_prompt(21, seed=3), 40), runner

    fused, runner = run(None, "float32")
    assert runner.ops.name == "triton" and runner.graphs is not None
    assert runner.graphs.num_replays >= 39
    assert fused == run(False, "float32")[0]
    tokens, runner = run(None, "bfloat16")
    assert len(tokens) == 40 and runner.ops.name == "triton"
