"""Turn one step's logits into one token per sequence.

Order of work for a row (all rows of a kind are processed together, one tensor op each):

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
its request id and advanced by exactly one uniform per randomly sampled token, so its tokens
depend on the seed and its own logits only, never on batch neighbours or batch position. Call
`forget(request_id)` when a request ends. Unseeded rows share one sampler-wide generator.

Every row is computed in float32 and the sampler never mutates its inputs (logits or
sequences). When every row is plain greedy (no penalties, bans or logprobs) the whole step is
one `argmax`: this runs every engine step, so per-step overhead matters.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import torch

from engine.request import SamplingParams, TokenLogprob
from engine.sequence import Sequence

_GREEDY_EPS = 1e-5  # temperatures below this are greedy (dividing by them overflows float32)


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprob: TokenLogprob | None = None


def _is_plain_greedy(sp: SamplingParams, num_output_tokens: int) -> bool:
    return (
        sp.temperature < _GREEDY_EPS
        and sp.logprobs is None
        and sp.repetition_penalty == 1.0
        and sp.frequency_penalty == 0.0
        and sp.presence_penalty == 0.0
        and num_output_tokens >= sp.min_tokens
    )


@dataclass(slots=True)
class Sampler:
    """Samples one token per row of `logits [N, V']` (V' >= vocab_size; extra columns, e.g.
    a padded LM head, are ignored). `seed` seeds the generator of unseeded requests (random
    when None)."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    seed: int | None = None
    _generators: dict[str, torch.Generator] = field(default_factory=dict, init=False)
    _shared: dict[torch.device, torch.Generator] = field(default_factory=dict, init=False)

    def forget(self, request_id: str) -> None:
        """Drop the per-request generator (call when a request finishes or is aborted)."""
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(seqs)} sequences")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns < vocab {self.vocab_size}")
        if not seqs:
            return []
        logits = logits[:, : self.vocab_size]
        if all(_is_plain_greedy(s.sampling, s.num_output_tokens) for s in seqs):
            return [SampleResult(t) for t in logits.argmax(dim=-1).tolist()]

        rows = range(len(seqs))
        rep = [i for i in rows if seqs[i].sampling.repetition_penalty != 1.0]
        freq_pres = [i for i in rows if _has_freq_pres(seqs[i].sampling)]
        banned = self._banned(seqs)
        if rep or freq_pres or banned[0]:
            proc = logits.to(torch.float32, copy=True)  # the sampler's own copy, edited in place
            self._apply_penalties(proc, seqs, rep, freq_pres)
            if banned[0]:
                dev = proc.device
                proc[torch.tensor(banned[0], device=dev), torch.tensor(banned[1], device=dev)] = (
                    float("-inf")
                )
        else:
            proc = logits.float()  # read-only from here on: may alias the caller's tensor

        greedy = [i for i in rows if seqs[i].sampling.temperature < _GREEDY_EPS]
        if len(greedy) == len(seqs):
            tokens = proc.argmax(dim=-1)
        elif not greedy:
            tokens = self._sample_random(proc, seqs)
        else:
            rand = [i for i in rows if seqs[i].sampling.temperature >= _GREEDY_EPS]
            tokens = torch.empty(len(seqs), dtype=torch.long, device=proc.device)
            g_idx = torch.tensor(greedy, device=proc.device)
            r_idx = torch.tensor(rand, device=proc.device)
            tokens[g_idx] = proc[g_idx].argmax(dim=-1)
            tokens[r_idx] = self._sample_random(proc[r_idx], [seqs[i] for i in rand])

        token_list: list[int] = tokens.tolist()
        logprobs = self._logprobs(proc, seqs, token_list)
        return [SampleResult(t, lp) for t, lp in zip(token_list, logprobs, strict=True)]

    # ---- logit processing (in place on `proc`, the sampler's own copy) ----

    def _apply_penalties(
        self, proc: torch.Tensor, seqs: list[Sequence], rep: list[int], freq_pres: list[int]
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

    def _banned(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
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

    def _sample_random(self, x: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one inverse-CDF draw per row.

        Every step is a per-row function of the row's own logits and params (filters cut by
        value, so ties at a cut are all kept and no tie order matters), so a seeded row draws
        the same token in any batch."""
        dev, vocab = x.device, x.shape[1]
        params = [s.sampling for s in seqs]
        x = x / torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
        neg_inf = float("-inf")

        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if any(k < vocab for k in ks):
            k_max = max(k for k in ks if k < vocab)
            top_vals = x.topk(k_max, dim=-1).values
            k_t = torch.tensor(ks, device=dev)
            thresh = top_vals.gather(1, (k_t.clamp(max=k_max) - 1).unsqueeze(1))
            thresh = thresh.masked_fill((k_t >= vocab).unsqueeze(1), neg_inf)
            x = x.masked_fill(x < thresh, neg_inf)

        if any(p.top_p < 1.0 for p in params):
            x = x.masked_fill(_top_p_drop(x, [p.top_p for p in params]), neg_inf)

        # Unnormalised weights; the best token weighs exactly 1.
        weights = (x - x.max(dim=-1, keepdim=True).values).exp()
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1)
            weights = weights.masked_fill(weights < min_p, 0.0)

        cdf = weights.cumsum(dim=-1)
        total = cdf[:, -1:]
        target = self._uniforms(seqs, dev) * total
        # Strictly below the total, so the draw lands on a token of positive weight.
        target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1)

    def _uniforms(self, seqs: list[Sequence], dev: torch.device) -> torch.Tensor:
        """One U[0, 1) draw per row: seeded rows from their own generator, others shared."""
        seeded = [i for i, s in enumerate(seqs) if s.sampling.seed is not None]
        if not seeded:
            return torch.rand(len(seqs), 1, device=dev, generator=self._shared_generator(dev))
        u = torch.empty(len(seqs), 1, device=dev)
        unseeded = [i for i, s in enumerate(seqs) if s.sampling.seed is None]
        if unseeded:
            u[torch.tensor(unseeded, device=dev)] = torch.rand(
                len(unseeded), 1, device=dev, generator=self._shared_generator(dev)
            )
        for i in seeded:
            seq = seqs[i]
            gen = self._request_generator(seq, seq.sampling.seed or 0, dev)
            u[i] = torch.rand(1, device=dev, generator=gen)
        return u

    def _request_generator(self, seq: Sequence, seed: int, dev: torch.device) -> torch.Generator:
        gen = self._generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=dev)
            gen.manual_seed(seed)
            self._generators[seq.request_id] = gen
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
        self, proc: torch.Tensor, seqs: list[Sequence], tokens: list[int]
    ) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(seqs)
        want = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
        if not want:
            return out
        idx = torch.tensor(want, device=proc.device)
        lp = proc[idx].log_softmax(dim=-1)
        chosen_ids = torch.tensor([tokens[i] for i in want], device=proc.device)
        chosen = lp.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
        n_max = max(seqs[i].sampling.logprobs or 0 for i in want)
        top_vals, top_ids = lp.topk(min(n_max, lp.shape[1]), dim=-1)
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        for row, i in enumerate(want):
            n = seqs[i].sampling.logprobs or 0
            top = list(zip(top_ids_l[row][:n], top_vals_l[row][:n], strict=True))
            out[i] = TokenLogprob(tokens[i], chosen[row], top)
        return out


def _flatten(
    row_ids: list[int], id_lists: list[list[int]], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) pairs of ragged token lists (CPU), ids outside the vocab dropped."""
    lengths = torch.tensor([len(x) for x in id_lists])
    rows = torch.tensor(row_ids).repeat_interleave(lengths)
    ids = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.long)
    keep = (ids >= 0) & (ids < vocab)
    return rows[keep], ids[keep]


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
    top_p = torch.tensor(top_ps, device=x.device).unsqueeze(1)
    probs = x.softmax(dim=-1)
    floor = (1.0 - top_p) / (2 * vocab)  # half the bound: a margin for rounding
    active = top_p < 1.0
    num_candidates = int(((probs >= floor) & active).sum(dim=-1).max().clamp(min=1))
    if num_candidates > vocab // 8:  # flat distributions: a full sort is cheaper than topk
        top_vals = probs.sort(dim=-1, descending=True).values
    else:
        top_vals = probs.topk(num_candidates, dim=-1).values  # sorted, most likely first
    mass_before = top_vals.cumsum(dim=-1) - top_vals
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)
    cut = top_vals.gather(1, num_kept - 1)
    return (probs < cut) & active
