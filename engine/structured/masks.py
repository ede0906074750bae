"""Per-request grammar state in the engine: the token mask of each constrained logits row of
a step (`GrammarStates.masks`) and the advance of each matcher by the tokens a step kept
(`GrammarStates.advance`).

A constrained sequence with drafts needs one mask per position it verifies: the mask at
draft position `j` is the grammar's state after drafts `0..j-1`. The drafts the grammar
accepts are consumed to compute those masks, then rolled back; past the first draft the
grammar refuses, the remaining rows are left unconstrained, because verification never
reaches them: that draft has target probability 0 under its mask (random sampling rejects
it; greedy never matches it), so the step's own token is drawn at its position, masked.

Masks are computed on a worker thread while the forward pass runs (llguidance releases the
GIL, as do torch's kernels), so the step waits only for what the forward did not cover.
Unconstrained requests never touch any of this.

Tokens the grammar forces (`forced`) become the sequence's drafts for the next step: their
masks allow nothing else, so verification keeps them (a different tokenization of the same
text is the only way one is rejected) and a forced run costs one forward pass.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine.sched.output import ScheduledChunk
from engine.structured.compiler import GrammarCompiler
from engine.structured.grammar import Grammar

_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass(slots=True)
class TokenMask:
    """The allowed tokens of some logits rows: bit `t % 32` of word `t // 32` of `bits[i]`
    is set when token `t` may follow in row `rows[i]`. `blocked` is the same unpacked
    ([len(rows), vocab] bool, True where disallowed), made on the worker thread so the
    sampler's part is one masked fill."""

    rows: list[int]
    bits: torch.Tensor  # [len(rows), words] int32
    blocked: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.blocked is None:
            n = len(self.rows)
            unpacked = (self.bits.unsqueeze(-1) >> _SHIFTS) & 1
            self.blocked = unpacked.view(n, -1) == 0

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[len(rows), vocab_size] bool."""
        assert self.blocked is not None
        return ~self.blocked[:, :vocab_size]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of `logits` ([N, V]) with every disallowed token at -inf."""
        assert self.blocked is not None
        out = logits.to(torch.float32, copy=True)
        blocked = self.blocked[:, : out.shape[1]].to(out.device)
        if len(self.rows) == out.shape[0]:  # every row constrained: rows are 0..N-1 in order
            return out.masked_fill_(blocked, float("-inf"))
        rows = torch.tensor(self.rows, device=out.device)
        out[rows] = out[rows].masked_fill(blocked, float("-inf"))
        return out

    def window(self, start: int, stop: int) -> TokenMask | None:
        """The rows in [start, stop), renumbered from 0 (None when none is constrained)."""
        keep = [i for i, r in enumerate(self.rows) if start <= r < stop]
        if not keep:
            return None
        assert self.blocked is not None
        return TokenMask([self.rows[i] - start for i in keep], self.bits[keep], self.blocked[keep])


class GrammarViolation(Exception):
    """A token the grammar cannot take reached a constrained sequence."""


class GrammarStates:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, Any] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.mask_seconds = 0.0  # spent computing masks (on the worker thread)
        self.masked_rows = 0  # logits rows masked

    def add(self, request_id: str, grammar: Grammar) -> None:
        self._matchers[request_id] = self.compiler.matcher(grammar)

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    # -- masks ------------------------------------------------------------------------------

    def start_masks(
        self, chunks: Sequence[ScheduledChunk]
    ) -> Future[tuple[TokenMask | None, dict[str, str]]] | None:
        """Begin computing this step's masks on the worker thread; None when no chunk is
        constrained. `chunks` are the step's sampling chunks, in logits-row order."""
        if not any(c.seq.request_id in self._matchers for c in chunks):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._pool.submit(self.masks, list(chunks))

    def masks(self, chunks: Sequence[ScheduledChunk]) -> tuple[TokenMask | None, dict[str, str]]:
        """(the mask of every constrained row, the error of each request whose grammar
        failed). Leaves every matcher as it found it."""
        rows: list[int] = []
        plan: list[tuple[Any, list[int]]] = []  # (matcher, drafts) per constrained chunk
        row = 0
        for chunk in chunks:
            drafts = list(chunk.spec_token_ids)
            matcher = self._matchers.get(chunk.seq.request_id)
            if matcher is not None:
                rows.extend(range(row, row + len(drafts) + 1))
                plan.append((matcher, drafts))
            row += len(drafts) + 1
        if not rows:
            return None, {}
        started = time.perf_counter()
        bits = torch.full((len(rows), self.compiler.mask_words), -1, dtype=torch.int32)
        errors: dict[str, str] = {}
        i = 0
        constrained = [c for c in chunks if c.seq.request_id in self._matchers]
        for chunk, (matcher, drafts) in zip(constrained, plan, strict=True):
            try:
                _fill(matcher, drafts, bits[i : i + len(drafts) + 1], self.compiler.eos_token_ids)
            except Exception as exc:  # this request's grammar only
                errors[chunk.seq.request_id] = f"the output grammar failed: {exc}"
            i += len(drafts) + 1
        mask = TokenMask(rows, bits)  # unpacked here, off the sampler's path
        self.mask_seconds += time.perf_counter() - started
        self.masked_rows += len(rows)
        return mask, errors

    # -- after sampling ---------------------------------------------------------------------

    def forced(self, request_id: str, limit: int) -> list[int]:
        """The next tokens the grammar allows no alternative to (a JSON key and its quotes,
        say), at most `limit`: the engine verifies them as drafts in the next step, so a run
        the grammar dictates costs one forward pass, not one per token (jump-forward)."""
        matcher = self._matchers.get(request_id)
        if matcher is None or matcher.is_stopped() or matcher.is_error():
            return []
        return list(matcher.compute_ff_tokens()[:limit])

    def advance(
        self, request_id: str, tokens: list[int], eos_token_ids: tuple[int, ...]
    ) -> tuple[int, bool]:
        """Consume a step's kept tokens: (how many stay, whether the grammar is complete).
        Tokens after the grammar completes are dropped; an EOS where the grammar may end
        completes it. Raises GrammarViolation for a token the grammar cannot take."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return len(tokens), False
        for i, token in enumerate(tokens):
            if matcher.is_error():  # llguidance counts an error as stopped: never "complete"
                raise GrammarViolation(f"the output grammar failed: {matcher.get_error()}")
            if matcher.is_stopped():
                return i, True
            if token in eos_token_ids and matcher.is_accepting():
                return i + 1, True
            if not matcher.consume_token(token):
                raise GrammarViolation(
                    f"token {token} does not fit the output grammar: {matcher.get_error()}"
                )
        return len(tokens), matcher.is_stopped()


def _fill(
    matcher: Any, drafts: list[int], out: torch.Tensor, eos_token_ids: tuple[int, ...]
) -> None:
    """Masks for the position before each draft and after the last the grammar accepts;
    the matcher is left as it was found. Raises GrammarViolation when the grammar has failed
    (llguidance then writes a mask of EOS alone: sampled, it would end the request as if the
    output were complete)."""
    if matcher.is_error():
        raise GrammarViolation(matcher.get_error())
    words = out.shape[1] * 4
    matcher.unsafe_compute_mask_ptr(out[0].data_ptr(), words)
    if drafts:
        valid = matcher.validate_tokens(drafts)
        consumed = 0
        try:
            for j in range(valid):
                if matcher.is_stopped() or drafts[j] in eos_token_ids:
                    # Nothing after an EOS is kept, so the rows after it need no mask of their
                    # own; and a stopped matcher takes an EOS without recording it, so counting
                    # it would roll back one real token too many (the grammar would then lag
                    # the output by a token: a lost quote, and the JSON is off by one string).
                    out[j + 1 :] = out[j]
                    break
                if not matcher.consume_token(drafts[j]):
                    break
                consumed += 1
                matcher.unsafe_compute_mask_ptr(out[j + 1].data_ptr(), words)
        finally:
            if consumed and not matcher.rollback(consumed):
                raise GrammarViolation(f"the grammar could not roll back: {matcher.get_error()}")
    if matcher.is_error():  # failed while computing a mask
        raise GrammarViolation(matcher.get_error())
