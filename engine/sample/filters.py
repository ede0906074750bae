"""Temperature, top-k, top-p and min-p as per-row weights, one draw per row, and the small
per-step tensors they need on the logits' device (through pinned memory on a GPU).

Every function is a per-row function of the row's own logits and parameters, so a seeded row
draws the same token in any batch (`engine.sample.sampler`).
"""

from __future__ import annotations

import torch

from engine.request import SamplingParams


def weights(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p: unnormalised weights, the best token's exactly 1.

    Every step is a per-row function of the row's own logits and params (filters cut by
    value, so ties at a cut are all kept and no tie order matters), so a seeded row draws
    the same token in any batch."""
    dev, vocab = x.device, x.shape[1]
    x = x / to_device([p.temperature for p in params], torch.float32, dev).unsqueeze(1)
    neg_inf = float("-inf")

    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in ks):
        k_max = max(k for k in ks if k < vocab)
        top_vals = x.topk(k_max, dim=-1).values
        k_t = to_device(ks, torch.int64, dev)
        thresh = top_vals.gather(1, (k_t.clamp(max=k_max) - 1).unsqueeze(1))
        thresh = thresh.masked_fill((k_t >= vocab).unsqueeze(1), neg_inf)
        x = x.masked_fill(x < thresh, neg_inf)

    if any(p.top_p < 1.0 for p in params):
        x = x.masked_fill(top_p_drop(x, [p.top_p for p in params]), neg_inf)

    weights = (x - x.max(dim=-1, keepdim=True).values).exp()
    if any(p.min_p > 0.0 for p in params):
        min_p = to_device([p.min_p for p in params], torch.float32, dev).unsqueeze(1)
        weights = weights.masked_fill(weights < min_p, 0.0)
    return weights


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One inverse-CDF draw per row of `weights [N, V]` with uniforms `u [N, 1]`, searched in
    vocabulary order (cheap on CPU: no per-token random numbers)."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = u * total
    # Strictly below the total, so the draw lands on a token of positive weight.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def top_p_drop(x: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Mask of tokens outside each row's nucleus: the most likely tokens whose mass reaches
    `top_p` (at least one) are kept, together with any token tied with the least likely kept.

    No full-vocabulary sort: a token with probability `q` has at most `V * q` mass at or below
    it, so when `V * q <= 1 - top_p` the mass above it already reaches `top_p` and it is out.
    Only the tokens above that floor (usually a few hundred) are sorted, by `topk`. Only
    sorted *values* are used, so which of several tied tokens sorts first never matters.
    """
    vocab = x.shape[1]
    top_p = to_device(top_ps, torch.float32, x.device).unsqueeze(1)
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


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-step tensor on `device`. On a GPU it goes through pinned memory with a
    non-blocking copy: a copy from pageable memory makes the host wait for the device's queue
    (torch synchronises the stream after it), which would stall a step launched ahead."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def index(rows: list[int], device: torch.device) -> torch.Tensor:
    return to_device(rows, torch.int64, device)
