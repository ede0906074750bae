from __future__ import annotations

import random

import pytest

from engine.output.stop import check_stop, find_stop
from engine.request import FinishReason, Request, SamplingParams
from engine.sequence import Sequence

EOS = (2, 7)
PROMPT = [10, 11, 12]


def make_seq(outputs: list[int], **sampling: object) -> Sequence:
    """A sequence whose output tokens are `outputs` (the last one just appended)."""
    seq = Sequence.from_request(Request("r", list(PROMPT), SamplingParams(**sampling)))
    seq.token_ids.extend(outputs)
    return seq


def stop(outputs: list[int], max_model_len: int = 1000, **sampling: object):
    return check_stop(make_seq(outputs, **sampling), outputs[-1], EOS, max_model_len)


def test_ordinary_token_does_not_stop() -> None:
    assert stop([5, 6]) is None


@pytest.mark.parametrize("eos", EOS)
def test_any_eos_stops(eos: int) -> None:
    assert stop([5, eos]) is FinishReason.STOP


def test_ignore_eos_continues_but_stop_token_ids_still_stop() -> None:
    assert stop([5, 2], ignore_eos=True) is None
    assert stop([5, 9], ignore_eos=True, stop_token_ids=(9,)) is FinishReason.STOP


def test_stop_token_ids() -> None:
    assert stop([5, 9], stop_token_ids=(9, 4)) is FinishReason.STOP
    assert stop([5, 9], stop_token_ids=(4,)) is None


def test_min_tokens_defers_eos_and_stop_ids() -> None:
    # min_tokens=2: EOS ends the request only when at least 2 output tokens precede it.
    assert stop([2], min_tokens=2) is None
    assert stop([5, 2], min_tokens=2) is None
    assert stop([5, 6, 2], min_tokens=2) is FinishReason.STOP
    assert stop([5, 9], min_tokens=2, stop_token_ids=(9,)) is None
    assert stop([5, 6, 9], min_tokens=2, stop_token_ids=(9,)) is FinishReason.STOP


def test_max_tokens_gives_length() -> None:
    assert stop([5, 6], max_tokens=3) is None
    assert stop([5, 6, 8], max_tokens=3) is FinishReason.LENGTH


def test_stop_token_wins_over_length_on_same_token() -> None:
    assert stop([5, 6, 2], max_tokens=3) is FinishReason.STOP
    # ...but not when min_tokens says EOS is still an ordinary token.
    assert stop([5, 6, 2], max_tokens=3, min_tokens=3) is FinishReason.LENGTH


def test_max_model_len_gives_length() -> None:
    # 3 prompt + 2 output tokens = 5 tokens in all.
    assert stop([5, 6], max_model_len=6) is None
    assert stop([5, 6], max_model_len=5) is FinishReason.LENGTH


def test_eos_token_stays_in_output_ids() -> None:
    seq = make_seq([5, 2])
    assert check_stop(seq, 2, EOS, 1000) is FinishReason.STOP
    assert seq.output_token_ids == [5, 2]  # check_stop does not remove the ending token
    assert seq.num_output_tokens == 2


def test_find_stop_cuts_a_run_at_its_first_stop() -> None:
    seq = make_seq([5])
    assert find_stop(seq, [6, 8, 9], EOS, 1000) == (3, None)
    assert find_stop(seq, [6, 2, 9, 7], EOS, 1000) == (
        2,
        FinishReason.STOP,
    )  # EOS kept, rest dropped
    assert find_stop(make_seq([5], stop_token_ids=(9,)), [6, 9, 2], EOS, 1000) == (
        2,
        FinishReason.STOP,
    )
    assert find_stop(make_seq([5], max_tokens=3), [6, 8, 9, 4], EOS, 1000) == (
        2,
        FinishReason.LENGTH,
    )
    assert find_stop(seq, [6, 8, 9], EOS, len(PROMPT) + 3) == (2, FinishReason.LENGTH)
    # min_tokens: an EOS before it is an ordinary token, one after it stops.
    assert find_stop(make_seq([5], min_tokens=3), [2, 6, 2], EOS, 1000) == (3, FinishReason.STOP)
    assert seq.token_ids == [*PROMPT, 5]  # not mutated


def test_find_stop_agrees_with_check_stop_token_by_token() -> None:
    rng = random.Random(0)
    for _ in range(300):
        sampling = dict(
            max_tokens=rng.randint(1, 8),
            min_tokens=rng.randint(0, 3),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=tuple(rng.sample(range(12), 2)),
        )
        sampling["min_tokens"] = min(sampling["min_tokens"], sampling["max_tokens"])
        run = [rng.randrange(12) for _ in range(6)]
        max_model_len = rng.randint(4, 14)
        seq = make_seq([], **sampling)
        kept, reason = find_stop(seq, run, EOS, max_model_len)
        want: tuple[int, FinishReason | None] = (len(run), None)
        for n, token in enumerate(run, start=1):
            seq.token_ids.append(token)
            if (why := check_stop(seq, token, EOS, max_model_len)) is not None:
                want = (n, why)
                break
        assert (kept, reason) == want
