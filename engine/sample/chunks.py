"""Sampling a step's chunks so that one request's failure stays its own: the batch is
sampled at once; if that raises, each chunk alone, so only the failing ones fail. A chunk
whose grammar failed (`mask_errors`) fails alone without being sampled.
"""

from __future__ import annotations

import logging

import torch

from engine.sample.sampler import Sampler, SampleResult
from engine.sched.output import ScheduledChunk
from engine.structured.masks import TokenMask

logger = logging.getLogger(__name__)


def sample_chunks(
    sampler: Sampler,
    logits: torch.Tensor,
    chunks: list[ScheduledChunk],
    mask: TokenMask | None = None,
    mask_errors: dict[str, str] | None = None,
) -> list[SampleResult | str]:
    """One result per chunk, or the error of a chunk whose sampling failed."""
    if not chunks:
        return []
    if mask_errors:
        return _sample_alone(sampler, logits, chunks, mask, mask_errors)
    seqs = [c.seq for c in chunks]
    drafts = [c.spec_token_ids for c in chunks] if any(c.spec_token_ids for c in chunks) else None
    probs = None if drafts is None else [_draft_probs(c) for c in chunks]
    try:
        return list(sampler.sample(logits, seqs, drafts, probs, mask))
    except Exception:
        logger.exception("batched sampling failed; sampling each request alone")
    return _sample_alone(sampler, logits, chunks, mask, {})


def _sample_alone(
    sampler: Sampler,
    logits: torch.Tensor,
    chunks: list[ScheduledChunk],
    mask: TokenMask | None,
    errors: dict[str, str],
) -> list[SampleResult | str]:
    drafts = any(c.spec_token_ids for c in chunks)
    results: list[SampleResult | str] = []
    row = 0
    for chunk in chunks:
        n = len(chunk.spec_token_ids) + 1
        error = errors.get(chunk.seq.request_id)
        if error is not None:
            results.append(error)
            row += n
            continue
        spec = [chunk.spec_token_ids] if drafts else None
        one = [_draft_probs(chunk)] if drafts else None
        window = mask.window(row, row + n) if mask is not None else None
        try:
            results.append(sampler.sample(logits[row : row + n], [chunk.seq], spec, one, window)[0])
        except Exception as e:
            results.append(f"sampling failed: {type(e).__name__}: {e}")
        row += n
    return results


def _draft_probs(chunk: ScheduledChunk) -> torch.Tensor | None:
    """The proposer's distributions for the drafts the scheduler kept (a prefix)."""
    probs = chunk.seq.spec_probs
    return None if probs is None else probs[: len(chunk.spec_token_ids)]
