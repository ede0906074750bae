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
are known (`engine.llm_engine`, `async_scheduling`). Same draws, same generators as `sample`.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.request import SamplingParams, TokenLogprob
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


class _Row(Protocol):
    """What the sampler reads of a sequence for one row of logits."""

    @property
    def request_id(self) -> str: ...
    @property
    def sampling(self) -> SamplingParams: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def num_output_tokens(self) -> int: ...


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
        and not _has_freq_pres(sp)
        and num_output_tokens >= sp.min_tokens
    )


def _is_plain_greedy(sp: SamplingParams, num_output_tokens: int) -> bool:
    return (
        sp.temperature < GREEDY_EPS
        and sp.logprobs is None
        and sp.repetition_penalty == 1.0
        and sp.frequency_penalty == 0.0
        and sp.presence_penalty == 0.0
        and num_output_tokens >= sp.min_tokens
    )


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
            rows: list[_Row] = list(seqs)
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
        rows: list[_Row] = list(seqs)
        is_greedy = [s.sampling.temperature < GREEDY_EPS for s in seqs]
        greedy = [i for i, g in enumerate(is_greedy) if g]
        rand = [i for i, g in enumerate(is_greedy) if not g]
        for i in rand:
            if seqs[i].sampling.seed is not None:
                self._request_generator(seqs[i], proc.device)  # a bad seed raises before draws
        return self._pick_on_device(proc, rows, greedy, rand)

    def _process(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Penalties and `min_tokens` bans (steps 1-2), float32; may alias `logits`."""
        n = range(len(rows))
        rep = [i for i in n if rows[i].sampling.repetition_penalty != 1.0]
        freq_pres = [i for i in n if _has_freq_pres(rows[i].sampling)]
        banned = self._banned(rows)
        if not (rep or freq_pres or banned[0]):
            return logits.float()  # read-only from here on: may alias the caller's tensor
        proc = logits.to(torch.float32, copy=True)  # the sampler's own copy, edited in place
        self._apply_penalties(proc, rows, rep, freq_pres)
        if banned[0]:
            dev = proc.device
            proc[_index(banned[0], dev), _index(banned[1], dev)] = float("-inf")
        return proc

    def _choose(
        self,
        proc: torch.Tensor,
        seqs: list[Sequence],
        rows: list[_Row],
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
            g_idx = _index(greedy, dev) if rand else None
            picked = (proc if g_idx is None else proc[g_idx]).argmax(dim=-1).tolist()
            for i, t in zip(greedy, picked, strict=True):
                tokens[i] = t
        out: list[list[int]] = []
        weights_by_row: dict[int, int] = {}
        weights: torch.Tensor | None = None
        if rand:
            weights = self.weights(proc[_index(rand, dev)], [rows[i].sampling for i in rand])
            weights_by_row = {row: k for k, row in enumerate(rand)}
        for i, seq in enumerate(seqs):
            a, b = starts[i], starts[i + 1]
            if is_greedy[a]:
                out.append(accept_greedy(list(drafts[i]), tokens[a:b]))
                continue
            assert weights is not None
            w = weights[weights_by_row[a] : weights_by_row[a] + (b - a)]
            probs = w / w.sum(dim=-1, keepdim=True)
            q = draft_probs[i] if draft_probs is not None else None
            k = b - a - 1
            u = self._seq_uniforms(seq, 2 * k + 1, dev)
            out.append(_check_drawn(accept_random(probs, list(drafts[i]), q, u), vocab))
        return out

    def _pick(
        self, proc: torch.Tensor, rows: list[_Row], greedy: list[int], rand: list[int]
    ) -> list[int]:
        """One token per row: the argmax for `greedy` rows, one draw for `rand` rows, put
        together on the logits' device and read back to the host once (on a GPU, the step's
        only wait for the device)."""
        tokens = self._pick_on_device(proc, rows, greedy, rand).tolist()
        if rand:
            _check_drawn([tokens[i] for i in rand], proc.shape[1])
        return tokens

    def _pick_on_device(
        self, proc: torch.Tensor, rows: list[_Row], greedy: list[int], rand: list[int]
    ) -> torch.Tensor:
        if not rand:
            return proc.argmax(dim=-1)
        dev = proc.device
        r_idx = _index(rand, dev) if greedy else None
        x = proc if r_idx is None else proc[r_idx]
        rand_rows = [rows[i] for i in rand]
        w = self.weights(x, [r.sampling for r in rand_rows])
        drawn = _draw(w, self._uniforms(rand_rows, dev))
        return drawn if r_idx is None else proc.argmax(dim=-1).index_copy_(0, r_idx, drawn)

    # ---- logit processing (in place on `proc`, the sampler's own copy) ----

    def _apply_penalties(
        self, proc: torch.Tensor, seqs: list[_Row], rep: list[int], freq_pres: list[int]
    ) -> None:
        """Sparse: touches only the (row, token) pairs that occurred, never a full [N, V] pass."""
        dev = proc.device

        def by_row(indices: list[int], values: list[float], default: float) -> torch.Tensor:
            out = torch.full((len(seqs),), default, dtype=torch.float32)
            out[torch.tensor(indices, dtype=torch.long)] = torch.tensor(values, dtype=out.dtype)
            return out

        if rep:
            rows, ids = _flatten(rep, [seqs[i].token_ids for i in rep], self.vocab_size)
            pen_row = by_row(rep, [seqs[i].sampling.repetition_penalty for i in rep], 1.0)
            pen = pen_row[rows].to(dev)
            rows, ids = rows.to(dev), ids.to(dev)
            vals = proc[rows, ids]  # a repeated token reads and writes the same value
            proc[rows, ids] = torch.where(vals > 0, vals / pen, vals * pen)
        if freq_pres:
            outputs = [seqs[i].output_token_ids for i in freq_pres]
            rows, ids = _flatten(freq_pres, outputs, self.vocab_size)
            freq_row = by_row(freq_pres, [seqs[i].sampling.frequency_penalty for i in freq_pres], 0)
            pres_row = by_row(freq_pres, [seqs[i].sampling.presence_penalty for i in freq_pres], 0)
            # Frequency once per occurrence (accumulated), presence once per distinct token.
            proc.index_put_((rows.to(dev), ids.to(dev)), -freq_row[rows].to(dev), accumulate=True)
            key = torch.unique(rows * self.vocab_size + ids)
            rows, ids = key // self.vocab_size, key % self.vocab_size
            proc.index_put_((rows.to(dev), ids.to(dev)), -pres_row[rows].to(dev), accumulate=True)

    def _banned(self, seqs: list[_Row]) -> tuple[list[int], list[int]]:
        """(rows, token ids) that `min_tokens` forbids this step."""
        rows: list[int] = []
        cols: list[int] = []
        for i, s in enumerate(seqs):
            sp = s.sampling
            if s.num_output_tokens >= sp.min_tokens:
                continue
            banned = set(sp.stop_token_ids)
            if not sp.ignore_eos:
                banned.update(self.eos_token_ids)
            banned = {t for t in banned if 0 <= t < self.vocab_size}
            rows.extend([i] * len(banned))
            cols.extend(banned)
        return rows, cols

    # ---- drawing ----

    @staticmethod
    def weights(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p: unnormalised weights, the best token's exactly 1.

        Every step is a per-row function of the row's own logits and params (filters cut by
        value, so ties at a cut are all kept and no tie order matters), so a seeded row draws
        the same token in any batch."""
        dev, vocab = x.device, x.shape[1]
        x = x / _to_device([p.temperature for p in params], torch.float32, dev).unsqueeze(1)
        neg_inf = float("-inf")

        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if any(k < vocab for k in ks):
            k_max = max(k for k in ks if k < vocab)
            top_vals = x.topk(k_max, dim=-1).values
            k_t = _to_device(ks, torch.int64, dev)
            thresh = top_vals.gather(1, (k_t.clamp(max=k_max) - 1).unsqueeze(1))
            thresh = thresh.masked_fill((k_t >= vocab).unsqueeze(1), neg_inf)
            x = x.masked_fill(x < thresh, neg_inf)

        if any(p.top_p < 1.0 for p in params):
            x = x.masked_fill(_top_p_drop(x, [p.top_p for p in params]), neg_inf)

        weights = (x - x.max(dim=-1, keepdim=True).values).exp()
        if any(p.min_p > 0.0 for p in params):
            min_p = _to_device([p.min_p for p in params], torch.float32, dev).unsqueeze(1)
            weights = weights.masked_fill(weights < min_p, 0.0)
        return weights

    def _uniforms(self, rows: list[_Row], dev: torch.device) -> torch.Tensor:
        """One U[0, 1) draw per row: seeded rows from their own generator, others shared."""
        seeded = [i for i, s in enumerate(rows) if s.sampling.seed is not None]
        if not seeded:
            return torch.rand(len(rows), 1, device=dev, generator=self._shared_generator(dev))
        u = torch.empty(len(rows), 1, device=dev)
        unseeded = [i for i, s in enumerate(rows) if s.sampling.seed is None]
        if unseeded:
            u[_index(unseeded, dev)] = torch.rand(
                len(unseeded), 1, device=dev, generator=self._shared_generator(dev)
            )
        for i in seeded:
            gen = self._request_generator(rows[i], dev)
            u[i] = torch.rand(1, device=dev, generator=gen)
        return u

    def _seq_uniforms(self, row: _Row, n: int, dev: torch.device) -> torch.Tensor:
        """`n` U[0, 1) draws for one sequence, from its own generator when it has a seed."""
        gen = (
            self._shared_generator(dev)
            if row.sampling.seed is None
            else self._request_generator(row, dev)
        )
        return torch.rand(n, device=dev, generator=gen)

    def _request_generator(self, row: _Row, dev: torch.device) -> torch.Generator:
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
        lp = proc[_index(row_ids, dev)].log_softmax(dim=-1)
        chosen = lp.gather(1, _index(chosen_ids, dev).unsqueeze(1)).squeeze(1)
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


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One inverse-CDF draw per row of `weights [N, V]` with uniforms `u [N, 1]`, searched in
    vocabulary order (cheap on CPU: no per-token random numbers)."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = u * total
    # Strictly below the total, so the draw lands on a token of positive weight.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _flatten(
    row_ids: list[int], id_lists: list[list[int]], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) pairs of ragged token lists (CPU), ids outside the vocab dropped."""
    lengths = torch.tensor([len(x) for x in id_lists])
    rows = torch.tensor(row_ids).repeat_interleave(lengths)
    ids = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.long)
    keep = (ids >= 0) & (ids < vocab)
    return rows[keep], ids[keep]


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-step tensor on `device`. On a GPU it goes through pinned memory with a
    non-blocking copy: a copy from pageable memory makes the host wait for the device's queue
    (torch synchronises the stream after it), which would stall a step launched ahead."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return _to_device(rows, torch.int64, device)


def _has_freq_pres(sp: SamplingParams) -> bool:
    return sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0


def _top_p_drop(x: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Mask of tokens outside each row's nucleus: the most likely tokens whose mass reaches
    `top_p` (at least one) are kept, together with any token tied with the least likely kept.

    No full-vocabulary sort: a token with probability `q` has at most `V * q` mass at or below
    it, so when `V * q <= 1 - top_p` the mass above it already reaches `top_p` and it is out.
    Only the tokens above that floor (usually a few hundred) are sorted, by `topk`. Only
    sorted *values* are used, so which of several tied tokens sorts first never matters.
    """
    vocab = x.shape[1]
    top_p = _to_device(top_ps, torch.float32, x.device).unsqueeze(1)
    probs = x.softmax(dim=-1)
    active = top_p < 1.0
    if x.device.type != "cpu":
        # On an accelerator the full sort is cheap, and sizing `topk` would read the
        # candidate count back to the host: a wait for the device in the middle of the step.
        num_candidates = vocab
    else:
        floor = (1.0 - top_p) / (2 * vocab)  # half the bound: a margin for rounding
        num_candidates = int(((probs >= floor) & active).sum(dim=-1).max().clamp(min=1))
    if num_candidates > vocab // 8:  # flat distributions: a full sort is cheaper than topk
        top_vals = probs.sort(dim=-1, descending=True).values
    else:
        top_vals = probs.topk(num_candidates, dim=-1).values  # sorted, most likely first
    mass_before = top_vals.cumsum(dim=-1) - top_vals
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)
    cut = top_vals.gather(1, num_kept - 1)
    return (probs < cut) & active
