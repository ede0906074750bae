"""The synchronous engine core: one `step()` = propose, schedule, execute, sample/verify,
append, update, emit. Drafts are proposed at the start of the step that verifies them (for
the sequences the previous step left decoding), so a step's deltas, the first token above
all, are returned before the draft model runs. Which sequences get drafts, and what
verification made of them, is `engine.spec.speculation.Speculation`'s.

Not thread-safe: exactly one thread calls `add_request`, `abort` and `step` (the AsyncEngine
runs all three on its single engine thread). Deltas are produced only for sequences that
sampled this step (all of their new tokens: accepted drafts and the target's own), for
aborted ones, and for ones that failed.

Async scheduling (`EngineConfig.async_scheduling`, on for CUDA engines; `engine.ahead`): a
step whose rows need no token history is launched without reading its tokens back, and the
call returns the previous launched step's deltas (`_land`), so the device never waits for the
host between steps.

A bad request never takes the engine down: `step()` does not raise because of one request.
A failure in one request's own work (sampling or verification, stop checks, detokenization)
ends that request with finish reason "error" and an `error` message on its last delta, its
KV freed; its batch neighbours go on. A failed forward pass ends the requests of that step
the same way, and later steps serve later requests.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.ahead import StepsAhead
from engine.config import EngineConfig
from engine.device import placed
from engine.errors import InvalidRequest
from engine.kv.block_hash import model_key
from engine.kv.cache_manager import KVCacheManager
from engine.kv.sketch import PrefixSketch
from engine.models.llama import StepInterrupted
from engine.models.resolve import ModelResolver, local_model_dir
from engine.output.detokenizer import IncrementalDetokenizer
from engine.output.stop import find_stop
from engine.request import FinishReason, Request, RequestClass, TokenDelta, TokenLogprob
from engine.runner.model_runner import Feed, ModelRunner
from engine.sample.chunks import sample_chunks
from engine.sample.sampler import Sampler, SampleResult
from engine.sched.output import ScheduledChunk, SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from engine.spec.policy import MAX_SPEC_TOKENS, SpeculationPolicy
from engine.spec.proposer import NoopProposer, Proposer
from engine.spec.speculation import Speculation, clear_drafts
from engine.stats import EngineCounters, SpecStats, TTFTWindow
from engine.structured.compiler import start_compiler
from engine.structured.masks import GrammarStates
from engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _NewTokens:
    """One sequence's outcome of a step, before it is emitted."""

    seq: Sequence
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    reason: FinishReason | None = None
    error: str | None = None
    num_accepted: int = 0  # drafts among `token_ids` (a prefix) whose K/V counts as computed


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        resolve_model: ModelResolver = local_model_dir,
        proposer: Proposer | None = None,
        spec_policy: SpeculationPolicy | None = None,
    ):
        config = placed(config)  # device and dtype "auto" made concrete
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
        extra_key = model_key(str(self.model_path.name))
        # What the prefix cache holds, as diffs for routers (None: nothing is ever cached).
        self.sketch = (
            PrefixSketch(extra_key, self.runner.block_size)
            if config.cache.enable_prefix_caching
            else None
        )
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            self.runner.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            extra_key=extra_key,
            sketch=self.sketch,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.sampler = Sampler(info.vocab_size, self.eos_token_ids, seed=config.seed)
        # Speculation: the proposer and policy `config.speculative` names, unless given.
        from engine.spec.build import build_policy, build_proposer

        if proposer is None:
            proposer = build_proposer(config, resolve_model, info.vocab_size)
        self.proposer: Proposer = proposer
        self.counters = EngineCounters()
        self.spec: Speculation | None = None  # None: no proposer, no speculation
        if not isinstance(proposer, NoopProposer):
            policy = spec_policy or build_policy(config.speculative)
            self.spec = Speculation(
                config.speculative, proposer, policy, self.counters, info.vocab_size
            )
        self._to_propose: list[Sequence] = []
        # The grammar compiler is built in the background from now; the per-request state
        # with the first constrained request.
        self._compiler = start_compiler(self.tokenizer, info.vocab_size, self.eos_token_ids)
        self._grammars: GrammarStates | None = None
        self._forced: set[str] = set()  # requests whose drafts are grammar-forced tokens
        self.ttft = TTFTWindow()  # per class, for the autoscaler (EngineStats.ttft_p95_*)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._deadlines: dict[str, float] = {}  # only requests that carry one
        # Async scheduling (engine.ahead): never with speculation, whose drafts are verified
        # on the host.
        overlap = config.async_scheduling
        if overlap is None:
            overlap = self.runner.device.type == "cuda"
        self.async_scheduling = overlap and self.spec is None
        self.ahead: StepsAhead | None = None
        if self.async_scheduling:
            constrained = weakref.WeakMethod(self._constrained)  # no cycle: GPU memory is
            # freed when the engine is dropped, not at the next garbage collection
            self.ahead = StepsAhead(
                self.scheduler,
                self.sampler,
                self.max_model_len,
                lambda request_id: bool((m := constrained()) and m(request_id)),
                device=self.runner.device,
                max_num_seqs=config.scheduler.max_num_seqs,
            )

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
        if request.sampling.grammar is not None:
            self.grammars().compiler.check(request.sampling.grammar)

    def grammars(self) -> GrammarStates:
        """The grammar state of constrained requests (its compiler started building with the
        engine, off this thread; a server that never sees a grammar never uses it)."""
        if self._grammars is None:
            try:
                compiler = self._compiler.result()
            except Exception as exc:
                raise InvalidRequest(
                    "response_format",
                    f"structured output is not available for this model's tokenizer: {exc}",
                ) from exc
            self._grammars = GrammarStates(compiler)
        return self._grammars

    def add_request(self, request: Request) -> None:
        """Queue a request; raises InvalidRequest (bad request) or QueueFull (overload)."""
        self.validate(request)
        seq = Sequence.from_request(request)
        if request.sampling.grammar is not None:
            self.grammars().add(request.request_id, request.sampling.grammar)
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
        if seq.token_ids[-1] == PLACEHOLDER:  # its step's token is not read back: dropped
            seq.token_ids.pop()
        return seq.delta([], "", FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------

    def step(self, interrupt: Callable[[], bool] | None = None) -> list[TokenDelta]:
        """One step. `interrupt` (asked between the model's layers) may stop a step that only
        serves bulk work (no drafts, no grammar), so an interactive request that just arrived
        need not wait for it (`EngineConfig.interrupt_bulk_steps`): the step then counts as
        not run (`counters.interrupted_steps`) and its chunks are scheduled again."""
        if self._to_propose:  # drafts for the sequences the last step left decoding
            assert self.spec is not None
            seqs, self._to_propose = self._to_propose, []
            if self.scheduler.waiting[RequestClass.INTERACTIVE]:
                # An interactive request waits for its first token: a plain step gets it
                # there sooner than drafting and verifying first (TTFT before ITL).
                clear_drafts(seqs)
            else:
                running = [s for s in seqs if s.status is SequenceStatus.RUNNING]
                self.spec.propose(running, self.scheduler)
        started = time.perf_counter()
        expired = self._expire_deadlines() if self._deadlines else []
        out = self.scheduler.schedule()
        if out.is_empty:
            return expired + self._land()
        chunks = [c for c in out.chunks if c.samples]
        steps = self.ahead
        ahead = steps is not None and steps.can_launch(chunks)
        if steps is not None and steps.launched is not None and not ahead:
            # This step samples on the host: the launched one lands first, so its
            # placeholders are tokens (a sequence it ended leaves this step).
            expired += self._land()
            out.chunks = [c for c in out.chunks if not c.seq.is_finished]
            if out.is_empty:
                return expired
            chunks = [c for c in chunks if not c.seq.is_finished]
        masks = self._grammars.start_masks(chunks) if self._grammars else None
        if interrupt is not None and (masks is not None or not self._interruptible(out)):
            interrupt = None
        feed = steps.feed() if steps is not None else None
        try:
            logits = self._execute(out, interrupt, feed)  # the masks are computed meanwhile
        except StepInterrupted:
            # Nothing is updated: every chunk is scheduled again from where it stood.
            self.counters.interrupted_steps += 1
            return expired + self._land()
        if ahead and logits is not None:
            assert steps is not None
            tokens = steps.pick(logits, chunks)
            if tokens is not None:  # launched: the previous step's deltas go out meanwhile
                self.scheduler.advance(out)
                self.counters.steps += 1
                self.counters.launched_steps += 1
                deltas = self._land()
                steps.launch(out, chunks, tokens)
                return expired + deltas if expired else deltas
            # Picking failed: sample on the host (each chunk alone if need be), after the
            # launched step has landed; a sequence it ended keeps no row.
            if landed := self._land():
                expired += landed
                keep = [i for i, c in enumerate(chunks) if not c.seq.is_finished]
                logits = logits[keep]
                chunks = [chunks[i] for i in keep]
        elif logits is None:
            expired += self._land()
        mask, mask_errors = masks.result() if masks is not None else (None, {})
        if logits is None:
            return expired + self._fail_step(out)
        results = sample_chunks(self.sampler, logits, chunks, mask, mask_errors)
        news = [self._append(c, r) for c, r in zip(chunks, results, strict=True)]
        self.scheduler.update(out, self._num_accepted(chunks, news))
        self.counters.steps += 1
        deltas = [self._emit(n) for n in news]
        if self.spec is not None:
            self.spec.observe(out, chunks, results, time.perf_counter() - started, self._forced)
            # Proposed at the start of the next step, so these deltas (a first token above
            # all) leave before the draft model runs.
            self._to_propose = [
                n.seq
                for n in news
                if n.seq.status is SequenceStatus.RUNNING and n.seq.request_id not in self._forced
            ]
        return expired + deltas if expired else deltas

    # -- landing a launched step (engine.ahead) ------------------------------------------------

    def _constrained(self, request_id: str) -> bool:
        return self._grammars is not None and request_id in self._grammars

    def _land(self) -> list[TokenDelta]:
        """Read back the launched step's tokens and finish its work as a synchronous step
        would: placeholders replaced, stops, text, full blocks cached, deltas."""
        launched = self.ahead.take() if self.ahead is not None else None
        if launched is None:
            return []
        try:
            token_ids = launched.read()
        except Exception:
            n = len(launched.out.chunks)
            logger.exception(
                "a launched step failed on the device; ending its %d requests and forgetting "
                "the prefix cache (blocks were cached at launch)",
                n,
            )
            self.kv.forget_prefix_cache()
            for chunk in launched.chunks:
                del chunk.seq.token_ids[chunk.start + chunk.num_tokens :]
            return self._fail_step(launched.out)
        vocab = self.runner.info.vocab_size
        news = []
        for chunk, token in zip(launched.chunks, token_ids, strict=True):
            seq = chunk.seq
            if seq.is_finished:  # aborted, or ended by the step before: a spare row
                self.counters.spare_rows += 1
                continue
            del seq.token_ids[chunk.start + chunk.num_tokens :]  # its placeholder, if any
            if 0 <= token < vocab:
                news.append(self._append(chunk, SampleResult([token])))
            else:
                error = "sampling failed: a draw fell outside the vocabulary (non-finite logits)"
                news.append(self._finish_failed(_NewTokens(seq, error=error)))
        self.scheduler.commit(launched.out)
        return [self._emit(n) for n in news]

    def _expire_deadlines(self) -> list[TokenDelta]:
        """Abort requests whose deadline passed (they end with finish reason "abort")."""
        now = time.monotonic()
        late = [
            rid
            for rid, deadline in self._deadlines.items()
            if deadline <= now and not (self.ahead is not None and self.ahead.ending(rid))
        ]
        for rid in late:
            del self._deadlines[rid]
        return [d for rid in late if (d := self.abort(rid)) is not None]

    def _interruptible(self, out: SchedulerOutput) -> bool:
        """Whether the step may stop midway: on, and every chunk bulk without drafts."""
        return self.config.interrupt_bulk_steps and all(
            c.seq.request.request_class is RequestClass.BULK and not c.spec_token_ids
            for c in out.chunks
        )

    def _execute(
        self,
        out: SchedulerOutput,
        interrupt: Callable[[], bool] | None = None,
        feed: Feed | None = None,
    ) -> torch.Tensor | None:
        """The step's logits, or None when the batched forward pass failed. Raises
        `StepInterrupted` when `interrupt` stopped it."""
        try:
            return self.runner.execute(out, interrupt, feed)
        except StepInterrupted:
            raise
        except Exception:
            logger.exception(
                "the forward pass failed; ending the step's %d requests", len(out.chunks)
            )
            return None

    def _fail_step(self, out: SchedulerOutput) -> list[TokenDelta]:
        """End every request of a step whose forward pass failed (their KV is freed)."""
        message = "the engine failed to run this request's batch"
        news = [_NewTokens(c.seq, error=message) for c in out.chunks]
        return [self._emit(n) for n in news if not n.seq.is_finished]

    def _append(self, chunk: ScheduledChunk, result: SampleResult | str) -> _NewTokens:
        """Cut the new tokens at the first stop (token or string), append them to the sequence
        and detokenize them. A failure here fails this request only (it is finished now)."""
        seq = chunk.seq
        if isinstance(result, str):
            return self._finish_failed(_NewTokens(seq, error=result))
        tokens = result.token_ids
        try:
            kept, reason = find_stop(seq, tokens, self.eos_token_ids, self.max_model_len)
            if kept < len(tokens):
                tokens = tokens[:kept]
            if self._grammars is not None and seq.request_id in self._grammars:
                kept, complete = self._grammars.advance(seq.request_id, tokens, self.eos_token_ids)
                tokens = tokens[:kept]
                if complete:
                    reason = FinishReason.STOP
            detok = self._detok[seq.request_id]
            if len(tokens) > 1 and seq.sampling.stop:
                text, tokens, stop_hit = detok.push_each(tokens)
            else:
                text, stop_hit = detok.push(tokens)
            if stop_hit:
                reason = FinishReason.STOP
            elif reason is not None:
                text += detok.flush()
        except Exception as e:
            logger.exception("request %s failed after sampling", seq.request_id)
            return self._finish_failed(_NewTokens(seq, error=f"{type(e).__name__}: {e}"))
        seq.token_ids.extend(tokens)
        self.counters.generated_tokens += len(tokens)
        forced = seq.request_id in self._forced
        if chunk.spec_token_ids and not forced and self.spec is not None:
            self.spec.count(seq, len(chunk.spec_token_ids), result.num_accepted)
        if self._grammars is not None and seq.request_id in self._grammars:
            self._force_drafts(seq, finished=reason is not None)
        if seq.timings.first_token is None:
            seq.timings.first_token = now = time.monotonic()
            self.ttft.observe(seq.request_class, now - seq.timings.arrival)
        logprobs = result.logprobs
        if logprobs is not None and len(logprobs) > len(tokens):
            logprobs = logprobs[: len(tokens)]
        # As without drafts, every token but the last counts as computed: a run cut at a stop
        # may end on a draft whose K/V is valid, but the request finishes anyway.
        accepted = min(result.num_accepted, len(tokens) - 1)
        return _NewTokens(seq, tokens, text, logprobs, reason, num_accepted=accepted)

    def _force_drafts(self, seq: Sequence, finished: bool) -> None:
        """Make the tokens the grammar forces next `seq`'s drafts (jump-forward), replacing
        the forced drafts it just verified."""
        assert self._grammars is not None
        was_forced = seq.request_id in self._forced
        self._forced.discard(seq.request_id)
        forced = (
            self._grammars.forced(seq.request_id, MAX_SPEC_TOKENS)
            if self.config.jump_forward and not finished
            else []
        )
        if forced:
            seq.spec_token_ids, seq.spec_probs = forced, None
            self._forced.add(seq.request_id)
        elif was_forced:
            seq.spec_token_ids, seq.spec_probs = [], None

    @staticmethod
    def _num_accepted(
        chunks: list[ScheduledChunk], news: list[_NewTokens]
    ) -> dict[str, int] | None:
        """Per chunk with drafts: how many drafts were kept and appended (their K/V is valid)."""
        if not any(c.spec_token_ids for c in chunks):
            return None
        return {
            c.seq.request_id: n.num_accepted
            for c, n in zip(chunks, news, strict=True)
            if c.spec_token_ids
        }

    def _emit(self, new: _NewTokens) -> TokenDelta:
        seq = new.seq
        if new.error is not None:
            self._finish_failed(new)
        elif new.reason is not None:
            seq.timings.finished = time.monotonic()
            self.scheduler.finish(seq, new.reason)
            self._forget(seq.request_id)
        delta = seq.delta(new.token_ids, new.text, new.reason, new.logprobs)
        delta.error = new.error
        return delta

    def _finish_failed(self, new: _NewTokens) -> _NewTokens:
        """End a request that failed in the engine: finish reason "error", KV freed now."""
        new.reason = FinishReason.ERROR
        if not new.seq.is_finished:
            self.counters.failed += 1
            new.seq.timings.finished = time.monotonic()
            self.scheduler.finish(new.seq, FinishReason.ERROR)
            self._forget(new.seq.request_id)
        return new

    def _forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._deadlines.pop(request_id, None)
        self.sampler.forget(request_id)
        if self._grammars is not None:
            self._grammars.forget(request_id)
            self._forced.discard(request_id)
        if self.spec is not None:
            self.spec.forget(request_id)

    # -- observability ----------------------------------------------------------------------

    def spec_stats(self) -> SpecStats | None:
        """Speculative decoding counters; None when the engine does not speculate."""
        return self.spec.stats() if self.spec is not None else None
