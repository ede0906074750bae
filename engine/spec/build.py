"""Build the engine's proposer and speculation policy from `EngineConfig.speculative`."""

from __future__ import annotations

from engine.config import EngineConfig, SpeculativeConfig
from engine.models.resolve import ModelResolver
from engine.spec.policy import SpeculationPolicy
from engine.spec.proposer import NoopProposer, Proposer


def build_proposer(config: EngineConfig, resolve_model: ModelResolver, vocab_size: int) -> Proposer:
    spec = config.speculative
    if spec.method == "prompt_lookup":
        from engine.spec.prompt_lookup import PromptLookupProposer

        return PromptLookupProposer(spec.prompt_lookup_min_ngram, spec.prompt_lookup_max_ngram)
    if spec.method == "draft_model":
        from engine.spec.draft_model import DraftModel, DraftModelProposer

        draft = DraftModel(
            resolve_model(spec.draft_model),
            kv_cache_bytes=spec.draft_kv_cache_bytes,
            dtype=config.dtype,
            device=config.device,
            block_size=config.cache.block_size,
            seed=config.seed,
            fused_ops=config.fused_ops,
        )
        if draft.vocab_size != vocab_size:
            raise ValueError(
                f"draft model {spec.draft_model!r} has a vocabulary of {draft.vocab_size}, "
                f"the target {vocab_size}: they must share one tokenizer"
            )
        return DraftModelProposer(draft)
    return NoopProposer()


def build_policy(spec: SpeculativeConfig) -> SpeculationPolicy:
    import policies.speculation  # noqa: F401  # registers the policies
    from policies.base import create

    return create(SpeculationPolicy, spec.policy, max_tokens=spec.max_num_tokens)
