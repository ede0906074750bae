"""Token-level stop checks: `check_stop` for a token just appended, `find_stop` for a run of
new tokens (a step that accepted drafts), which truncates the run at the first stop.

Stop *strings* are the detokenizer's business (`engine.output.detokenizer`): they need text.

Contract:

* The token that ends a request (EOS or one of `stop_token_ids`) stays in the sequence's
  output token ids and counts towards `num_output_tokens`, like vLLM. Its text is not emitted
  when it is a special token and `skip_special_tokens` is set (the detokenizer skips it).
* EOS and `stop_token_ids` end a request only once at least `min_tokens` output tokens precede
  them; an earlier one is an ordinary token (the sampler bans them in that window, so this only
  matters for tokens that did not come from the sampler). `ignore_eos` disables EOS only.
* A stop token wins over a length limit reached on the same token (finish reason "stop").
* `max_tokens` output tokens, or `max_model_len` tokens in all (prompt + output), end the
  request with finish reason "length".
"""

from __future__ import annotations

from engine.request import FinishReason
from engine.sequence import Sequence


def check_stop(
    seq: Sequence, token_id: int, eos_token_ids: tuple[int, ...], max_model_len: int
) -> FinishReason | None:
    """Why `seq` finishes now that `token_id` (its last token) was appended, or None."""
    return _reason(
        seq, token_id, seq.num_output_tokens, seq.num_tokens, eos_token_ids, max_model_len
    )


def find_stop(
    seq: Sequence, new_token_ids: list[int], eos_token_ids: tuple[int, ...], max_model_len: int
) -> tuple[int, FinishReason | None]:
    """Where a run of new tokens (not yet appended to `seq`) ends the request.

    Returns `(n, reason)`: the first `n` tokens are kept and `reason` is why the request
    finishes with the `n`-th (`check_stop` applied token by token), or
    `(len(new_token_ids), None)`. Tokens after a stop are dropped: never counted or emitted.
    """
    num_output, num_tokens = seq.num_output_tokens, seq.num_tokens
    for i, token_id in enumerate(new_token_ids, start=1):
        reason = _reason(
            seq, token_id, num_output + i, num_tokens + i, eos_token_ids, max_model_len
        )
        if reason is not None:
            return i, reason
    return len(new_token_ids), None


def _reason(
    seq: Sequence,
    token_id: int,
    num_output: int,
    num_tokens: int,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
) -> FinishReason | None:
    """The checks for `token_id` as the last of `num_output` output tokens (`num_tokens` in all)."""
    sp = seq.sampling
    if num_output - 1 >= sp.min_tokens:
        if not sp.ignore_eos and token_id in eos_token_ids:
            return FinishReason.STOP
        if token_id in sp.stop_token_ids:
            return FinishReason.STOP
    if num_output >= sp.max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
