"""Verification of speculative (draft) tokens against the target model's distributions.

A sequence that carries `k` drafts `d[0..k)` gets `k + 1` target rows: row `j` is the target's
distribution for the position of `d[j]` (row `k` follows the last draft). Verification keeps
a prefix of the drafts and always adds one token of the target's own, so it yields 1..k+1
tokens:

* greedy: drafts are kept while each equals its row's argmax; the first mismatching row's
  argmax (or, after all `k`, the bonus row's argmax) is appended. The output equals plain
  greedy decoding token for token.
* random (Leviathan et al. / Chen et al.): draft `x = d[j]` drawn from `q_j` is kept with
  probability `min(1, p_j(x) / q_j(x))`; at the first rejection a token is drawn from the
  residual `max(0, p_j - q_j)` renormalised, and after `k` acceptances a bonus token is drawn
  from `p_k`. Each kept or drawn token then follows the target `p` exactly. `q` may be None:
  the proposer gave point masses (`q_j(x) = 1`), so acceptance is `p_j(x)` and the residual is
  `p_j` with `x` removed.

Randomness: exactly `2k + 1` uniforms are used per sequence, `u[0:k]` for the acceptance tests,
`u[k:2k]` for a residual draw at each position, `u[2k]` for the bonus, whatever is accepted;
so a seeded request's generator advances by a count that depends only on its own drafts.
"""

from __future__ import annotations

import torch


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """`len(targets) == len(drafts) + 1`; the kept drafts plus the target's next token."""
    out: list[int] = []
    for draft, target in zip(drafts, targets, strict=False):
        if draft != target:
            break
        out.append(draft)
    out.append(targets[len(out)])
    return out


def inverse_cdf(weights: torch.Tensor, u: float) -> int:
    """The token that uniform `u` picks from the unnormalised, non-negative `weights [V]`, in
    vocabulary order (as the sampler's ordinary draw does); -1 when every weight is 0."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[-1:]
    if not bool(total > 0):
        return -1
    target = torch.minimum(total * u, torch.nextafter(total, torch.zeros_like(total)))
    return int(torch.searchsorted(cdf, target, right=True))


def accept_random(
    probs: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> list[int]:
    """Rejection sampling (module doc). `probs [k+1, V]` are the target's normalised
    distributions, `draft_probs [k, V]` the proposer's (None: point masses), `uniforms
    [2k+1]` in [0, 1)."""
    k = len(drafts)
    u = uniforms.tolist()
    if k:
        idx = torch.arange(k, device=probs.device)
        d = torch.tensor(drafts, dtype=torch.long, device=probs.device)
        p_x = probs[idx, d]
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[idx, d].float()
        accepted = (uniforms[:k].to(p_x.device) * q_x < p_x).tolist()
        for j in range(k):
            if accepted[j]:
                continue
            if draft_probs is None:
                residual = probs[j].clone()
                residual[drafts[j]] = 0.0
            else:
                residual = (probs[j] - draft_probs[j].float()).clamp(min=0.0)
            token = inverse_cdf(residual, u[k + j])
            if token < 0:  # p == q up to rounding: the residual is empty, p itself is exact
                token = inverse_cdf(probs[j], u[k + j])
            return [*drafts[:j], token]
    return [*drafts, inverse_cdf(probs[k], u[2 * k])]
