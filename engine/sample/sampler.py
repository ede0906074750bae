"""Turn one step's logits into new tokens: one per sequence, or, for a sequence that carries
speculative (draft) tokens, the drafts the target accepts plus one of its own
(`engine.sample.rejection`). A draft position is a row like any other: all of the work below
applies to it, with the drafts before it counted as output tokens.

Order of work for a row (all rows of a kind are processed together, one tensor op each):

0. the grammar's token mask, for the rows of requests that carry one (`engine.structured`):
   every token it disallows is set to -inf (a step with no such row skips this entirely);
1. penalties on the raw logits: repetition (HF semantics, over prompt + output tokens: a
   positive logit is divided by the penalty, a negative one multiplied), then frequency and
   presence (OpenAI semantics, over output tokens only: `logit -= freq * count + pres * seen`);
2. `min_tokens`: while a sequence has fewer than `min_tokens` output tokens, EOS (unless
   `ignore_eos`) and its `stop_token_ids` get `-inf`;
3. logprobs, when asked, are `log_softmax` of these *processed* logits: after penalties and
   bans, before temperature and the top-k/top-p/min-p filters (so they do not depend on the
   sampling temperature, and a token the filters removed still has a finite logprob);
4. greedy rows (`temperature` below 1e-5) take the argmax; the others divide by the
   temperature, apply top-k, then top-p, then min-p, and draw by inverse CDF: one uniform per
   row, searched in the cumulative weights in vocabulary order (cheap on CPU: no per-token
   random numbers).

Steps 1-2 are `engine.sample.penalties`, step 4's filters and draw `engine.sample.filters`.

Randomness: a request with `seed` owns a `torch.Generator` seeded with it, kept here under
its request id and advanced by exactly one uniform per randomly sampled token (`2k + 1` for a
step that verifies `k` drafts), so its tokens
depend on the seed and its own logits only, never on batch neighbours or batch position. Call
`forget(request_id)` when a request ends. Unseeded rows share one sampler-wide generator.

Every row is computed in float32 and the sampler never mutates its inputs (logits or
sequences). When every row is plain greedy (no penalties, bans or logprobs) the whole step is
one `argmax`: this runs every engine step, so per-step overhead matters.

`pick` is the device-only form for rows that read nothing of the token history
(`device_pickable`: no penalties, no `min_tokens` ban, no logprobs) and carry no drafts: it
returns the tokens as a tensor on the logits' device without reading them back and without a
blocking host-to-device copy, so an engine can launch its next step before this one's tokens
are known (`engine.ahead`, async scheduling). Same draws, same generators as `sample`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from engine.request import SamplingParams, TokenLogprob
from engine.sample.filters import draw, index, weights
from engine.sample.penalties import Row, apply_penalties, banned, bans_tokens, has_freq_pres
from engine.sample.rejection import accept_greedy, accept_random
from engine.sequence import Sequence
from engine.structured.masks import TokenMask

GREEDY_EPS = 1e-5  # temperatures below this are greedy (dividing by them overflows float32)


@dataclass(slots=True)
class SampleResult:
    """The new tokens of one sequence this step: the kept drafts, then one token of the
    target's own (so never empty), with their logprobs when asked."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    num_accepted: int = 0  # drafts kept (a prefix of `token_ids`)


@dataclass(slots=True)
class _DraftRow:
    """The row of a draft position: the sequence as it is if the drafts before it are kept."""

    seq: Sequence
    drafts: tuple[int, ...]  # the drafts before this position

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def sampling(self) -> SamplingParams:
        return self.seq.sampling

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + list(self.drafts)

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + list(self.drafts)

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts)


def device_pickable(sp: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a row's token depends on its logits and parameters alone, so `Sampler.pick`
    can choose it on the device: no penalties (they read the token history), no `min_tokens`
    ban in force, no logprobs (read back with the token)."""
    return (
        sp.logprobs is None
        and sp.repetition_penalty == 1.0
        and not has_freq_pres(sp)
        and not bans_tokens(sp, num_output_tokens)
    )


def _is_plain_greedy(sp: SamplingParams, num_output_tokens: int) -> bool:
    return sp.temperature < GREEDY_EPS and device_pickable(sp, num_output_tokens)


@dataclass(slots=True)
class Sampler:
    """Samples the next token of each sequence and verifies its drafts (`sample`).

    Logits rows may have extra columns (V' >= vocab_size, e.g. a padded LM head); they are
    ignored. `seed` seeds the generator of unseeded requests (random when None)."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    seed: int | None = None
    _generators: dict[str, torch.Generator] = field(default_factory=dict, init=False)
    _shared: dict[torch.device, torch.Generator] = field(default_factory=dict, init=False)

    def forget(self, request_id: str) -> None:
        """Drop the per-request generator (call when a request finishes or is aborted)."""
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        drafts: list[tuple[int, ...]] | None = None,
        draft_probs: list[torch.Tensor | None] | None = None,
        token_mask: TokenMask | None = None,
    ) -> list[SampleResult]:
        """One result per sequence. Without drafts `logits` has one row per sequence; with
        them, `len(drafts[i]) + 1` consecutive rows for sequence `i` (the target's logits at
        each draft position and after the last), verified as `engine.sample.rejection` says.
        `draft_probs[i]` (`[len(drafts[i]), V]`, or None for point masses) are the
        proposer's distributions. Every row gets the full processing of the module doc, with
        the drafts before it counted as output tokens (penalties, `min_tokens`).
        `token_mask` (grammar-constrained rows) sets every token it disallows to -inf
        before anything else; without it nothing changes."""
        if drafts is not None and not any(drafts):
            drafts = None
        num_rows = len(seqs) + (sum(len(d) for d in drafts) if drafts is not None else 0)
        if logits.dim() != 2 or logits.shape[0] != num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {num_rows} rows")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns < vocab {self.vocab_size}")
        if not seqs:
            return []
        logits = logits[:, : self.vocab_size]
        if token_mask is not None:
            logits = token_mask.apply(logits)
        plain = all(_is_plain_greedy(s.sampling, s.num_output_tokens) for s in seqs)
        if drafts is None:
            if plain:
                return [SampleResult([t]) for t in logits.argmax(dim=-1).tolist()]
            rows: list[Row] = list(seqs)
            starts = list(range(len(seqs) + 1))
        else:
            starts = [0]
            for d in drafts:
                starts.append(starts[-1] + len(d) + 1)
            if plain:  # one argmax for the whole step, then a prefix match per sequence
                targets = logits.argmax(dim=-1).tolist()
                return [
                    _greedy_result(d, targets[starts[i] : starts[i + 1]])
                    for i, d in enumerate(drafts)
                ]
            rows = [
                _DraftRow(seq, d[:j]) if j else seq
                for seq, d in zip(seqs, drafts, strict=True)
                for j in range(len(d) + 1)
            ]
        proc = self._process(logits, rows)
        new_tokens = self._choose(proc, seqs, rows, starts, drafts, draft_probs)
        logprobs = self._logprobs(proc, seqs, starts, new_tokens)
        return [SampleResult(t, lp, len(t) - 1) for t, lp in zip(new_tokens, logprobs, strict=True)]

    @torch.inference_mode()
    def pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """`[len(seqs)]` int64 tokens on the logits' device, one per row, not read back: the
        argmax for greedy rows, one draw for the others (as `sample` would choose them). Every
        row must be `device_pickable`. A random draw that fell outside the vocabulary
        (non-finite logits) is returned as is: the caller checks the tokens it reads back."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(seqs)} rows")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns < vocab {self.vocab_size}")
        proc = logits[:, : self.vocab_size].float()
        rows: list[Row] = list(seqs)
        is_greedy = [s.sampling.temperature < GREEDY_EPS for s in seqs]
        greedy = [i for i, g in enumerate(is_greedy) if g]
        rand = [i for i, g in enumerate(is_greedy) if not g]
        for i in rand:
            if seqs[i].sampling.seed is not None:
                self._request_generator(seqs[i], proc.device)  # a bad seed raises before draws
        return self._pick_on_device(proc, rows, greedy, rand)

    def _process(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Penalties and `min_tokens` bans (steps 1-2), float32; may alias `logits`."""
        n = range(len(rows))
        rep = [i for i in n if rows[i].sampling.repetition_penalty != 1.0]
        freq_pres = [i for i in n if has_freq_pres(rows[i].sampling)]
        ban = banned(rows, self.eos_token_ids, self.vocab_size)
        if not (rep or freq_pres or ban[0]):
            return logits.float()  # read-only from here on: may alias the caller's tensor
        proc = logits.to(torch.float32, copy=True)  # the sampler's own copy, edited in place
        apply_penalties(proc, rows, rep, freq_pres, self.vocab_size)
        if ban[0]:
            dev = proc.device
            proc[index(ban[0], dev), index(ban[1], dev)] = float("-inf")
        return proc

    def _choose(
        self,
        proc: torch.Tensor,
        seqs: list[Sequence],
        rows: list[Row],
        starts: list[int],
        drafts: list[tuple[int, ...]] | None,
        draft_probs: list[torch.Tensor | None] | None,
    ) -> list[list[int]]:
        """The new tokens of each sequence: argmax or one draw per row without drafts,
        verification (`engine.sample.rejection`) for sequences with drafts."""
        dev, vocab = proc.device, proc.shape[1]
        is_greedy = [r.sampling.temperature < GREEDY_EPS for r in rows]
        for row, g in zip(rows, is_greedy, strict=True):
            if not g and row.sampling.seed is not None:
                # Every generator exists before any draws: a seed the generator rejects
                # raises here, before it could advance a neighbour's generator.
                self._request_generator(row, dev)
        greedy = [i for i, g in enumerate(is_greedy) if g]
        rand = [i for i, g in enumerate(is_greedy) if not g]
        if drafts is None:
            return [[t] for t in self._pick(proc, rows, greedy, rand)]
        tokens: list[int] = [0] * len(rows)
        if greedy:
            g_idx = index(greedy, dev) if rand else None
            picked = (proc if g_idx is None else proc[g_idx]).argmax(dim=-1).tolist()
            for i, t in zip(greedy, picked, strict=True):
                tokens[i] = t
        out: list[list[int]] = []
        weights_by_row: dict[int, int] = {}
        rand_weights: torch.Tensor | None = None
        if rand:
            rand_weights = weights(proc[index(rand, dev)], [rows[i].sampling for i in rand])
            weights_by_row = {row: k for k, row in enumerate(rand)}
        for i, seq in enumerate(seqs):
            a, b = starts[i], starts[i + 1]
            if is_greedy[a]:
                out.append(accept_greedy(list(drafts[i]), tokens[a:b]))
                continue
            assert rand_weights is not None
            w = rand_weights[weights_by_row[a] : weights_by_row[a] + (b - a)]
            probs = w / w.sum(dim=-1, keepdim=True)
            q = draft_probs[i] if draft_probs is not None else None
            k = b - a - 1
            u = self._seq_uniforms(seq, 2 * k + 1, dev)
            out.append(_check_drawn(accept_random(probs, list(drafts[i]), q, u), vocab))
        return out

    def _pick(
        self, proc: torch.Tensor, rows: list[Row], greedy: list[int], rand: list[int]
    ) -> list[int]:
        """One token per row: the argmax for `greedy` rows, one draw for `rand` rows, put
        together on the logits' device and read back to the host once (on a GPU, the step's
        only wait for the device)."""
        tokens = self._pick_on_device(proc, rows, greedy, rand).tolist()
        if rand:
            _check_drawn([tokens[i] for i in rand], proc.shape[1])
        return tokens

    def _pick_on_device(
        self, proc: torch.Tensor, rows: list[Row], greedy: list[int], rand: list[int]
    ) -> torch.Tensor:
        if not rand:
            return proc.argmax(dim=-1)
        dev = proc.device
        r_idx = index(rand, dev) if greedy else None
        x = proc if r_idx is None else proc[r_idx]
        rand_rows = [rows[i] for i in rand]
        w = weights(x, [r.sampling for r in rand_rows])
        drawn = draw(w, self._uniforms(rand_rows, dev))
        return drawn if r_idx is None else proc.argmax(dim=-1).index_copy_(0, r_idx, drawn)

    # ---- randomness ----

    def _uniforms(self, rows: list[Row], dev: torch.device) -> torch.Tensor:
        """One U[0, 1) draw per row: seeded rows from their own generator, others shared."""
        seeded = [i for i, s in enumerate(rows) if s.sampling.seed is not None]
        if not seeded:
            return torch.rand(len(rows), 1, device=dev, generator=self._shared_generator(dev))
        u = torch.empty(len(rows), 1, device=dev)
        unseeded = [i for i, s in enumerate(rows) if s.sampling.seed is None]
        if unseeded:
            u[index(unseeded, dev)] = torch.rand(
                len(unseeded), 1, device=dev, generator=self._shared_generator(dev)
            )
        for i in seeded:
            gen = self._request_generator(rows[i], dev)
            u[i] = torch.rand(1, device=dev, generator=gen)
        return u

    def _seq_uniforms(self, row: Row, n: int, dev: torch.device) -> torch.Tensor:
        """`n` U[0, 1) draws for one sequence, from its own generator when it has a seed."""
        gen = (
            self._shared_generator(dev)
            if row.sampling.seed is None
            else self._request_generator(row, dev)
        )
        return torch.rand(n, device=dev, generator=gen)

    def _request_generator(self, row: Row, dev: torch.device) -> torch.Generator:
        gen = self._generators.get(row.request_id)
        if gen is None:
            gen = torch.Generator(device=dev)
            gen.manual_seed(row.sampling.seed or 0)
            self._generators[row.request_id] = gen
        return gen

    def _shared_generator(self, dev: torch.device) -> torch.Generator:
        gen = self._shared.get(dev)
        if gen is None:
            gen = torch.Generator(device=dev)
            seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little")
            gen.manual_seed(seed)
            self._shared[dev] = gen
        return gen

    # ---- logprobs ----

    def _logprobs(
        self,
        proc: torch.Tensor,
        seqs: list[Sequence],
        starts: list[int],
        new_tokens: list[list[int]],
    ) -> list[list[TokenLogprob] | None]:
        """Per sequence, one entry per new token: token `j` read from the sequence's row `j`."""
        out: list[list[TokenLogprob] | None] = [None] * len(seqs)
        want = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
        if not want:
            return out
        row_ids = [starts[i] + j for i in want for j in range(len(new_tokens[i]))]
        chosen_ids = [t for i in want for t in new_tokens[i]]
        dev = proc.device
        lp = proc[index(row_ids, dev)].log_softmax(dim=-1)
        chosen = lp.gather(1, index(chosen_ids, dev).unsqueeze(1)).squeeze(1)
        n_max = max(seqs[i].sampling.logprobs or 0 for i in want)
        top_vals, top_ids = lp.topk(min(n_max, lp.shape[1]), dim=-1)
        chosen_l, top_vals_l, top_ids_l = chosen.tolist(), top_vals.tolist(), top_ids.tolist()
        k = 0
        for i in want:
            n = seqs[i].sampling.logprobs or 0
            entries = []
            for t in new_tokens[i]:
                top = list(zip(top_ids_l[k][:n], top_vals_l[k][:n], strict=True))
                entries.append(TokenLogprob(t, chosen_l[k], top))
                k += 1
            out[i] = entries
        return out


def _greedy_result(drafts: tuple[int, ...], targets: list[int]) -> SampleResult:
    tokens = accept_greedy(list(drafts), targets)
    return SampleResult(tokens, None, len(tokens) - 1)


def _check_drawn(tokens: list[int], vocab: int) -> list[int]:
    """Non-finite weights (e.g. logits overflowed by extreme parameters) make a draw land
    outside the vocabulary; raise rather than feed the model a token it has no row for."""
    if any(t < 0 or t >= vocab for t in tokens):
        raise ValueError("a draw fell outside the vocabulary (non-finite logits)")
    return tokens
