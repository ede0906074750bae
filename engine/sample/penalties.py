"""Penalties and bans on raw logits, in place on the sampler's own float32 copy: repetition
(HF semantics, over prompt + output tokens: a positive logit is divided by the penalty, a
negative one multiplied), frequency and presence (OpenAI semantics, over output tokens only),
and the `min_tokens` ban of EOS and stop tokens. Sparse: only the (row, token) pairs that
occurred are touched, never a full `[N, V]` pass.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch

from engine.request import SamplingParams


class Row(Protocol):
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


def apply_penalties(
    proc: torch.Tensor, seqs: list[Row], rep: list[int], freq_pres: list[int], vocab: int
) -> None:
    """Sparse: touches only the (row, token) pairs that occurred, never a full [N, V] pass."""
    dev = proc.device

    def by_row(indices: list[int], values: list[float], default: float) -> torch.Tensor:
        out = torch.full((len(seqs),), default, dtype=torch.float32)
        out[torch.tensor(indices, dtype=torch.long)] = torch.tensor(values, dtype=out.dtype)
        return out

    if rep:
        rows, ids = flatten(rep, [seqs[i].token_ids for i in rep], vocab)
        pen_row = by_row(rep, [seqs[i].sampling.repetition_penalty for i in rep], 1.0)
        pen = pen_row[rows].to(dev)
        rows, ids = rows.to(dev), ids.to(dev)
        vals = proc[rows, ids]  # a repeated token reads and writes the same value
        proc[rows, ids] = torch.where(vals > 0, vals / pen, vals * pen)
    if freq_pres:
        outputs = [seqs[i].output_token_ids for i in freq_pres]
        rows, ids = flatten(freq_pres, outputs, vocab)
        freq_row = by_row(freq_pres, [seqs[i].sampling.frequency_penalty for i in freq_pres], 0)
        pres_row = by_row(freq_pres, [seqs[i].sampling.presence_penalty for i in freq_pres], 0)
        # Frequency once per occurrence (accumulated), presence once per distinct token.
        proc.index_put_((rows.to(dev), ids.to(dev)), -freq_row[rows].to(dev), accumulate=True)
        key = torch.unique(rows * vocab + ids)
        rows, ids = key // vocab, key % vocab
        proc.index_put_((rows.to(dev), ids.to(dev)), -pres_row[rows].to(dev), accumulate=True)


def bans_tokens(sp: SamplingParams, num_output_tokens: int) -> bool:
    """Whether `min_tokens` may forbid tokens this step: inside its window, with stop token
    ids or an EOS that counts (`ignore_eos` off). `min_tokens` with `ignore_eos` and no stop
    ids bans nothing, so such rows keep the fast paths (greedy, and picks on the device)."""
    return num_output_tokens < sp.min_tokens and (bool(sp.stop_token_ids) or not sp.ignore_eos)


def banned(
    seqs: list[Row], eos_token_ids: tuple[int, ...], vocab: int
) -> tuple[list[int], list[int]]:
    """(rows, token ids) that `min_tokens` forbids this step."""
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(seqs):
        sp = s.sampling
        if not bans_tokens(sp, s.num_output_tokens):
            continue
        tokens = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            tokens.update(eos_token_ids)
        tokens = {t for t in tokens if 0 <= t < vocab}
        rows.extend([i] * len(tokens))
        cols.extend(tokens)
    return rows, cols


def flatten(
    row_ids: list[int], id_lists: list[list[int]], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) pairs of ragged token lists (CPU), ids outside the vocab dropped."""
    lengths = torch.tensor([len(x) for x in id_lists])
    rows = torch.tensor(row_ids).repeat_interleave(lengths)
    ids = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.long)
    keep = (ids >= 0) & (ids < vocab)
    return rows[keep], ids[keep]


def has_freq_pres(sp: SamplingParams) -> bool:
    return sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0
