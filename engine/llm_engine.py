"""The synchronous engine core: one `step()` = schedule, execute, sample, update, emit.

Not thread-safe: exactly one thread calls `add_request`, `abort` and `step` (the AsyncEngine
runs all three on its single engine thread). Deltas are produced only for sequences that
sampled a token this step, for aborted ones, and for ones that failed validation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.errors import InvalidRequest
from engine.kv.block_hash import model_key
from engine.kv.cache_manager import KVCacheManager
from engine.models.resolve import ModelResolver, local_model_dir
from engine.output.detokenizer import IncrementalDetokenizer
from engine.output.stop import check_stop
from engine.request import FinishReason, Request, TokenDelta
from engine.runner.model_runner import ModelRunner
from engine.sample.sampler import Sampler, SampleResult
from engine.sched.scheduler import Scheduler
from engine.sequence import Sequence
from engine.tokenizer import load_tokenizer


@dataclass(slots=True)
class EngineCounters:
    steps: int = 0
    generated_tokens: int = 0
    aborted: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, *, resolve_model: ModelResolver = local_model_dir):
        self.config = config
        self.model_path = resolve_model(config.model)
        self.model_name = config.model
        self.tokenizer = load_tokenizer(self.model_path)
        self.runner = ModelRunner(config, str(self.model_path))
        info = self.runner.info
        eos = set(info.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        # One sequence must always fit in the pool on its own (after preempting the rest).
        pool_tokens = self.runner.num_blocks * self.runner.block_size
        self.max_model_len = min(self.runner.max_model_len, pool_tokens)
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            self.runner.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            extra_key=model_key(str(self.model_path.name)),
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.sampler = Sampler(info.vocab_size, self.eos_token_ids, seed=config.seed)
        self.counters = EngineCounters()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._deadlines: dict[str, float] = {}  # only requests that carry one

    # -- requests -------------------------------------------------------------------------

    def validate(self, request: Request) -> None:
        """Raise `InvalidRequest(param, message)` for a request this engine cannot serve."""
        request.sampling.validate()
        n = len(request.prompt_token_ids)
        if n == 0:
            raise InvalidRequest("prompt", "the prompt is empty")
        if n >= self.max_model_len:
            raise InvalidRequest(
                "prompt",
                f"the prompt has {n} tokens; this model's context is {self.max_model_len}",
            )
        vocab = self.runner.info.vocab_size
        if any(t < 0 or t >= vocab for t in request.prompt_token_ids):
            raise InvalidRequest("prompt", f"token ids must be in [0, {vocab})")

    def add_request(self, request: Request) -> None:
        """Queue a request; raises InvalidRequest (bad request) or QueueFull (overload)."""
        self.validate(request)
        seq = Sequence.from_request(request)
        self.scheduler.add(seq)
        if request.deadline is not None:
            self._deadlines[request.request_id] = request.deadline
        self._detok[request.request_id] = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            stop=request.sampling.stop,
            skip_special_tokens=request.sampling.skip_special_tokens,
        )

    def abort(self, request_id: str) -> TokenDelta | None:
        """Abort at once; its KV blocks return to the pool before this returns."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        self.counters.aborted += 1
        seq.timings.finished = time.monotonic()
        self._forget(request_id)
        return self._delta(seq, [], "", FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[TokenDelta]:
        expired = self._expire_deadlines() if self._deadlines else []
        out = self.scheduler.schedule()
        if out.is_empty:
            return expired
        logits = self.runner.execute(out)
        sampling = [c.seq for c in out.chunks if c.samples]
        results = self.sampler.sample(logits, sampling) if sampling else []
        self.scheduler.update(out)
        self.counters.steps += 1
        now = time.monotonic()
        deltas = [self._append(seq, r, now) for seq, r in zip(sampling, results, strict=True)]
        return expired + deltas if expired else deltas

    def _expire_deadlines(self) -> list[TokenDelta]:
        """Abort requests whose deadline passed (they end with finish reason "abort")."""
        now = time.monotonic()
        late = [rid for rid, deadline in self._deadlines.items() if deadline <= now]
        for rid in late:
            del self._deadlines[rid]
        return [d for rid in late if (d := self.abort(rid)) is not None]

    def _append(self, seq: Sequence, result: SampleResult, now: float) -> TokenDelta:
        token = result.token_id
        seq.token_ids.append(token)
        self.counters.generated_tokens += 1
        if seq.timings.first_token is None:
            seq.timings.first_token = now
        reason = check_stop(seq, token, self.eos_token_ids, self.max_model_len)
        detok = self._detok[seq.request_id]
        text, stop_hit = detok.push([token])
        if stop_hit:
            reason = FinishReason.STOP
        elif reason is not None:
            text += detok.flush()
        logprobs = None if result.logprob is None else [result.logprob]
        if reason is not None:
            seq.timings.finished = now
            self.scheduler.finish(seq, reason)
            self._forget(seq.request_id)
        return self._delta(seq, [token], text, reason, logprobs)

    def _forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._deadlines.pop(request_id, None)
        self.sampler.forget(request_id)

    @staticmethod
    def _delta(
        seq: Sequence,
        token_ids: list[int],
        text: str,
        reason: FinishReason | None,
        logprobs: list | None = None,
    ) -> TokenDelta:
        return TokenDelta(
            request_id=seq.request_id,
            token_ids=token_ids,
            text=text,
            finish_reason=reason,
            logprobs=logprobs,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            timings=seq.timings,
        )

    # -- observability ----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Plain numbers for metrics and routing (safe to pickle)."""
        s = self.scheduler.stats()
        kv = self.kv.stats()
        return {
            "model": self.model_name,
            "num_requests_running": dict(s.running),
            "num_requests_waiting": dict(s.waiting),
            "kv_cache_usage_perc": kv.usage,
            "kv_num_blocks": kv.num_blocks,
            "kv_num_free_blocks": kv.num_free,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "num_preemptions": s.num_preemptions,
            "num_aborted": self.counters.aborted,
            "num_steps": self.counters.steps,
            "generation_tokens": self.counters.generated_tokens,
        }
