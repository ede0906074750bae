"""A draft model that follows sequences in its own KV pool and proposes their next tokens.

Used in the target's process (`DraftModelProposer`, engine/spec/) and by the `DraftReplica`
deployment (actors/draft_replica.py), which serves many target replicas from one pool.

`DraftModel.propose(queries)` takes, per sequence, its true tokens (prompt + accepted output)
and how many drafts to make. The draft keeps, per request, the tokens whose K/V sit in its
pool; a query first rolls that back to the longest prefix the true tokens confirm (drafts the
target rejected go, accepted ones stay: draft KV follows the accepted tokens), then catches up
on the rest in one forward, which also yields the first draft, and makes each further draft
with one batched decode forward. `k` drafts cost `k` forwards for the whole batch.

Greedy requests get the draft's argmax (point masses: `probs` None). Sampled requests get a
token drawn from the draft's distribution after the request's temperature, top-k, top-p and
min-p, with that distribution in `probs`, so rejection sampling keeps the target's
distribution exactly (engine/sample/rejection.py).

`release(request_id)` frees a request's draft KV; call it when the request finishes or is
aborted. Not thread-safe: one caller at a time.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import CacheConfig, Dtype, EngineConfig, SchedulerConfig
from engine.kv.cache_manager import KVCacheManager
from engine.request import Request, SamplingParams
from engine.runner.model_runner import ModelRunner
from engine.sample.filters import weights
from engine.sample.sampler import GREEDY_EPS
from engine.sched.output import ScheduledChunk, SchedulerOutput
from engine.sequence import Sequence
from engine.spec.proposer import Draft


@dataclass(slots=True)
class DraftQuery:
    """Drafts wanted for one sequence: its true tokens so far and how many to propose."""

    request_id: str
    token_ids: list[int]  # prompt + accepted output; read, never mutated
    num_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(slots=True)
class _Followed:
    seq: Sequence  # token_ids = true tokens + this round's drafts; K/V of a prefix computed
    verified: int = 0  # leading tokens known to equal the true tokens


class DraftModel:
    def __init__(
        self,
        model_path: str | Path,
        *,
        kv_cache_bytes: int = 32 * 1024 * 1024,
        dtype: Dtype = "float32",
        device: str = "cpu",
        block_size: int = 16,
        seed: int = 0,
        max_batched_tokens: int = 4096,
        max_seqs: int = 256,
        fused_ops: bool | None = None,
    ) -> None:
        """`max_batched_tokens`: one forward's most tokens (a longer catch-up is split);
        `max_seqs`: one forward's most sequences (queries past it get no drafts);
        `fused_ops`: as the target's (`EngineConfig.fused_ops`)."""
        self.max_batched_tokens = max_batched_tokens
        self.max_seqs = max_seqs
        config = EngineConfig(
            model=str(model_path),
            dtype=dtype,
            device=device,
            fused_ops=fused_ops,
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_bytes=kv_cache_bytes,
                enable_prefix_caching=False,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_batched_tokens, max_num_seqs=max_seqs
            ),
        )
        self.runner = ModelRunner(config, str(model_path))
        self.vocab_size = self.runner.info.vocab_size
        self.max_model_len = min(
            self.runner.max_model_len, self.runner.num_blocks * self.runner.block_size
        )
        self.kv = KVCacheManager(
            self.runner.num_blocks, self.runner.block_size, enable_prefix_caching=False
        )
        self._gen = torch.Generator(device=self.runner.device)
        self._gen.manual_seed(seed)
        self._followed: dict[str, _Followed] = {}
        self.runner.warmup()

    @property
    def num_followed(self) -> int:
        return len(self._followed)

    def release(self, request_id: str) -> None:
        followed = self._followed.pop(request_id, None)
        if followed is not None:
            self.kv.free(followed.seq)

    def release_all(self) -> None:
        for request_id in list(self._followed):
            self.release(request_id)

    @torch.inference_mode()
    def propose(self, queries: list[DraftQuery]) -> dict[str, Draft]:
        """Drafts per request id; a query the pool cannot hold (or too long) gets none."""
        live: list[tuple[DraftQuery, Sequence]] = []
        for q in queries:
            k = min(q.num_tokens, self.max_model_len - len(q.token_ids))
            if k <= 0 or not q.token_ids:
                continue
            if k != q.num_tokens:
                q = DraftQuery(q.request_id, q.token_ids, k, q.sampling)
            live.append((q, self._follow(q)))
            if len(live) == self.max_seqs:  # one forward's most: the rest go without drafts
                break
        self._catch_up_all_but_last(live, keep={q.request_id for q in queries})
        tokens: dict[str, list[int]] = {q.request_id: [] for q, _ in live}
        probs: dict[str, list[torch.Tensor]] = {}
        while live:
            chunks, kept = [], []
            for q, seq in live:
                n = seq.num_tokens - seq.num_computed_tokens
                if self._allocate(seq, n, keep=tokens.keys()):
                    chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                    kept.append((q, seq))
            if not kept:
                break
            logits = self.runner.execute(SchedulerOutput(chunks))
            picked, dists = self._choose(logits, [q.sampling for q, _ in kept])
            live = []
            for (q, seq), token, dist in zip(kept, picked, dists, strict=True):
                seq.num_computed_tokens = seq.num_tokens
                seq.token_ids.append(token)
                tokens[q.request_id].append(token)
                if dist is not None:
                    probs.setdefault(q.request_id, []).append(dist)
                if len(tokens[q.request_id]) < q.num_tokens:
                    live.append((q, seq))
        return {
            rid: Draft(ids, torch.stack(probs[rid]) if rid in probs else None)
            for rid, ids in tokens.items()
            if ids
        }

    # -- following the true tokens -------------------------------------------------------------

    def _follow(self, q: DraftQuery) -> Sequence:
        """The request's draft sequence, rolled back to what the true tokens confirm and then
        extended with them (the last true token is always left to compute: it gives logits)."""
        followed = self._followed.get(q.request_id)
        if followed is None:
            request = Request(q.request_id, [], q.sampling, arrival_time=0.0)
            followed = self._followed[q.request_id] = _Followed(Sequence.from_request(request))
        seq, true = followed.seq, q.token_ids
        limit = min(seq.num_computed_tokens, len(true) - 1)
        v = min(followed.verified, limit)
        while v < limit and seq.token_ids[v] == true[v]:
            v += 1
        seq.num_computed_tokens = v
        self.kv.rollback(seq)
        del seq.token_ids[v:]
        seq.token_ids.extend(true[v:])
        followed.verified = len(true)
        return seq

    def _catch_up_all_but_last(
        self, live: list[tuple[DraftQuery, Sequence]], keep: set[str]
    ) -> None:
        """Compute pending tokens but the last of each sequence in forwards of at most
        `max_batched_tokens`, when the whole catch-up would not fit in one forward."""
        pending = sum(seq.num_tokens - seq.num_computed_tokens for _, seq in live)
        if pending <= self.max_batched_tokens:
            return
        for _, seq in live:
            while seq.num_tokens - 1 - seq.num_computed_tokens > 0:
                n = min(seq.num_tokens - 1 - seq.num_computed_tokens, self.max_batched_tokens)
                if not self._allocate(seq, n, keep=keep):
                    break
                self.runner.execute(
                    SchedulerOutput([ScheduledChunk(seq, seq.num_computed_tokens, n)])
                )
                seq.num_computed_tokens += n

    def _allocate(self, seq: Sequence, n: int, keep: Container[str]) -> bool:
        """Slots for `n` more tokens of `seq`, freeing sequences outside `keep` (requests the
        target no longer asks about) when the pool is full."""
        if self.kv.allocate_slots(seq, n):
            return True
        for request_id in [r for r in self._followed if r not in keep]:
            self.release(request_id)
            if self.kv.allocate_slots(seq, n):
                return True
        return False

    # -- choosing drafts ---------------------------------------------------------------------

    def _choose(
        self, logits: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Argmax for greedy rows; for the others a draw from the filtered distribution,
        returned with it."""
        logits = logits[:, : self.vocab_size]
        picked = logits.argmax(dim=-1).tolist()
        dists: list[torch.Tensor | None] = [None] * len(params)
        rand = [i for i, p in enumerate(params) if p.temperature >= GREEDY_EPS]
        if rand:
            idx = torch.tensor(rand, device=logits.device)
            w = weights(logits[idx].float(), [params[i] for i in rand])
            q = w / w.sum(dim=-1, keepdim=True)
            drawn = torch.multinomial(q, 1, generator=self._gen).squeeze(1).tolist()
            for j, i in enumerate(rand):
                picked[i] = drawn[j]
                dists[i] = q[j]
        return picked, dists


class DraftModelProposer:
    """A `Proposer` backed by a `DraftModel` in this process."""

    def __init__(self, draft: DraftModel) -> None:
        self.draft = draft

    def propose(self, seqs: list[Sequence], num_tokens: dict[str, int]) -> dict[str, Draft]:
        return self.draft.propose(
            [
                DraftQuery(s.request_id, s.token_ids, num_tokens[s.request_id], s.sampling)
                for s in seqs
                if num_tokens.get(s.request_id, 0) > 0
            ]
        )

    def forget(self, request_id: str) -> None:
        self.draft.release(request_id)
