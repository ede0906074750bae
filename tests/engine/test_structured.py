"""Grammar-constrained decoding in the engine, on the tiny random model (whose unconstrained
output is noise, so every structure in the output comes from the grammar)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import torch

from engine.errors import InvalidRequest
from engine.llm_engine import LLMEngine
from engine.request import FinishReason, SamplingParams
from engine.sequence import Sequence
from engine.spec.proposer import Draft
from engine.structured.grammar import Grammar
from engine.structured.masks import GrammarStates
from tests.engine.engine_fixture import make_request, prompt_ids, tiny_config

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tier": {"enum": ["free", "pro", "team"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "tier", "tags"],
    "additionalProperties": False,
}


def run_all(engine: LLMEngine) -> dict[str, list]:
    out: dict[str, list] = {}
    for _ in range(5000):
        if not engine.has_unfinished():
            return out
        for delta in engine.step():
            out.setdefault(delta.request_id, []).append(delta)
    raise AssertionError("engine did not finish")


def text(deltas) -> str:
    return "".join(d.text for d in deltas)


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(tiny_config())


def sampled(grammar: Grammar, seed: int, n: int = 200) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=1.0, seed=seed, grammar=grammar)


def test_json_schema_outputs_validate_sampled_and_greedy(engine):
    grammar = Grammar.json_schema(SCHEMA)
    for i in range(8):
        engine.add_request(make_request(f"s{i}", prompt_ids(i, 9), sampled(grammar, seed=i)))
    engine.add_request(
        make_request(
            "g", prompt_ids(99, 9), SamplingParams(max_tokens=200, temperature=0.0, grammar=grammar)
        )
    )
    out = run_all(engine)
    outputs = set()
    for rid, deltas in out.items():
        assert deltas[-1].finish_reason is FinishReason.STOP, rid
        value = json.loads(text(deltas))
        jsonschema.validate(value, SCHEMA)
        outputs.add(text(deltas))
    assert len(outputs) > 3  # sampled, not forced to one answer


def test_json_mode_regex_and_choice(engine):
    requests = {
        "obj": Grammar("json_object"),
        "re": Grammar("regex", r"[A-Z]{2}-\d{3}", "guided_regex"),
        "pick": Grammar.choice(["yes", "no", "maybe later"]),
    }
    for rid, grammar in requests.items():
        params = SamplingParams(max_tokens=40, temperature=0.7, seed=3, grammar=grammar)
        engine.add_request(make_request(rid, prompt_ids(7, 6), params))
    out = run_all(engine)
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", text(out["re"]))
    assert text(out["pick"]) in ("yes", "no", "maybe later")
    assert out["re"][-1].finish_reason is FinishReason.STOP
    # JSON mode may hit the length limit inside the object; what it wrote is a JSON prefix.
    if out["obj"][-1].finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(text(out["obj"])), dict)
    else:
        assert text(out["obj"]).startswith("{")


def test_unconstrained_neighbours_are_untouched(engine):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request(make_request("alone", prompt_ids(5, 8), plain))
    alone = tokens(run_all(engine)["alone"])
    engine.add_request(make_request("with", prompt_ids(5, 8), plain))
    engine.add_request(
        make_request("json", prompt_ids(6, 8), sampled(Grammar.json_schema(SCHEMA), seed=1))
    )
    out = run_all(engine)
    assert tokens(out["with"]) == alone
    jsonschema.validate(json.loads(text(out["json"])), SCHEMA)


@pytest.mark.parametrize(
    ("grammar", "param"),
    [
        (Grammar("json_schema", json.dumps({"type": "strin"})), "response_format"),
        (Grammar("json_schema", "{not json"), "response_format"),
        (Grammar("regex", "(unclosed", "guided_regex"), "guided_regex"),
        (Grammar("lark", "start: missing_rule", "tools"), "tools"),
        (Grammar.choice([]), "guided_choice"),
    ],
)
def test_a_grammar_that_cannot_compile_is_refused_naming_its_parameter(engine, grammar, param):
    request = make_request("bad", prompt_ids(1, 4), SamplingParams(max_tokens=4, grammar=grammar))
    with pytest.raises(InvalidRequest) as info:
        engine.validate(request)
    assert info.value.param == param
    assert not engine.has_unfinished()


def test_compiled_once_per_grammar(engine):
    grammar = Grammar.json_schema({"type": "object", "properties": {"k": {"type": "integer"}}})
    compiler = engine.grammars().compiler
    before = compiler.compiled
    for i in range(3):
        engine.validate(make_request(f"c{i}", prompt_ids(1, 4), sampled(grammar, seed=i)))
    assert compiler.compiled == before + 1


def test_jump_forward_verifies_forced_tokens_several_per_step():
    grammar = Grammar.json_schema(SCHEMA)
    greedy = SamplingParams(max_tokens=200, temperature=0.0, grammar=grammar)
    on, off = LLMEngine(tiny_config()), LLMEngine(tiny_config(jump_forward=False))
    for eng in (on, off):
        eng.add_request(make_request("g", prompt_ids(11, 9), greedy))
        for i in range(3):
            eng.add_request(make_request(f"r{i}", prompt_ids(i, 9), sampled(grammar, seed=60 + i)))
    out_on, out_off = run_all(on), run_all(off)
    # Greedy: the same text either way; the forced keys and quotes arrive several per step.
    assert text(out_on["g"]) == text(out_off["g"])
    assert len(out_on["g"]) < len(tokens(out_on["g"]))
    assert len(out_off["g"]) == len(tokens(out_off["g"]))
    assert on.counters.steps < off.counters.steps
    assert on.counters.draft_tokens == 0  # not speculation: its statistics stay untouched
    for deltas in out_on.values():
        assert deltas[-1].finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(text(deltas)), SCHEMA)


class NoisyProposer:
    """Drafts random tokens (most of which the grammar refuses) and, now and then, the
    tokens of a valid continuation, so both verification paths run."""

    def __init__(self, k: int = 4) -> None:
        self.k = k
        self.calls = 0

    def propose(self, seqs: list[Sequence], num_tokens: dict[str, int]) -> dict[str, Draft]:
        self.calls += 1
        out = {}
        for seq in seqs:
            n = num_tokens[seq.request_id]
            base = seq.token_ids[-1]
            out[seq.request_id] = Draft([(base * 7 + j * 13 + self.calls) % 300 for j in range(n)])
        return out

    def forget(self, request_id: str) -> None:
        pass


def test_speculative_drafts_the_grammar_refuses_are_rejected():
    grammar = Grammar.json_schema(SCHEMA)
    greedy = SamplingParams(max_tokens=200, temperature=0.0, grammar=grammar)
    plain_engine = LLMEngine(tiny_config())
    spec_engine = LLMEngine(tiny_config(), proposer=NoisyProposer())
    for eng in (plain_engine, spec_engine):
        eng.add_request(make_request("g", prompt_ids(11, 9), greedy))
        for i in range(4):
            eng.add_request(make_request(f"r{i}", prompt_ids(i, 9), sampled(grammar, seed=40 + i)))
    plain, spec = run_all(plain_engine), run_all(spec_engine)
    assert spec_engine.counters.draft_tokens > 0
    assert tokens(spec["g"]) == tokens(plain["g"])  # greedy: drafts never change the output
    for deltas in spec.values():
        jsonschema.validate(json.loads(text(deltas)), SCHEMA)


def test_a_failing_grammar_fails_its_request_alone(engine, monkeypatch):
    grammar = Grammar.json_schema(SCHEMA)
    engine.add_request(make_request("bad", prompt_ids(2, 6), sampled(grammar, seed=5)))
    engine.add_request(
        make_request(
            "ok", prompt_ids(3, 6), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        )
    )
    states = engine.grammars()
    matcher = states._matchers["bad"]
    states._matchers["bad"] = _Broken(matcher)
    out = run_all(engine)
    assert out["bad"][-1].finish_reason is FinishReason.ERROR
    assert "grammar" in out["bad"][-1].error
    assert out["ok"][-1].finish_reason is FinishReason.LENGTH
    assert len(tokens(out["ok"])) == 8
    assert "bad" not in states


class _Broken:
    def __init__(self, inner) -> None:
        self.inner = inner

    def is_error(self) -> bool:
        return False

    def unsafe_compute_mask_ptr(self, *args) -> None:
        raise RuntimeError("mask computation exploded")


STRING_A = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


def _chunk(request_id: str, drafts: list[int]) -> SimpleNamespace:
    return SimpleNamespace(seq=SimpleNamespace(request_id=request_id), spec_token_ids=drafts)


@pytest.mark.parametrize("prefix", ['{"a":"', '{"a":"xy'])
def test_drafts_that_end_the_grammar_then_eos_leave_the_matcher_as_it_was(engine, prefix):
    """Drafts that complete the grammar and go on with EOS (what a draft model writes after
    a closing brace) leave the matcher where it was, whatever verification keeps. llguidance
    takes an EOS on a stopped matcher without recording it: counted as consumed, the
    rollback took one real token too many, and later tokens were matched against the output
    less that token (invalid JSON finishing "stop", or a spurious grammar error)."""
    encode = engine.tokenizer.encode
    eos = engine.eos_token_ids[0]
    states = GrammarStates(engine.grammars().compiler)
    states.add("r", Grammar.json_schema(STRING_A))
    ids = encode(prefix, add_special_tokens=False)
    assert states.advance("r", ids, engine.eos_token_ids) == (len(ids), False)
    before, _ = states.masks([_chunk("r", [])])
    close = encode('"}', add_special_tokens=False)
    mask, errors = states.masks([_chunk("r", [*close, eos, eos])])
    assert not errors and mask is not None and before is not None
    after, _ = states.masks([_chunk("r", [])])
    assert after is not None and torch.equal(after.bits, before.bits)  # where it was
    allowed = mask.allowed(states.compiler.vocab_size)[len(close) :]
    assert allowed.sum(dim=1).tolist() == [1] * allowed.shape[0] and allowed[:, eos].all()
    # Verification rejected the drafts and the target went on inside the string: the
    # grammar follows the real output, and ends where the text does.
    more = encode("z", add_special_tokens=False)
    assert states.advance("r", more, engine.eos_token_ids) == (len(more), False)
    assert states.advance("r", [*close, eos], engine.eos_token_ids)[1] is True


class _FailsAtMask:
    """A matcher that llguidance fails while computing its `at`-th mask (a limit or an
    internal error): the matcher is then in error, and the mask it wrote allows EOS alone."""

    def __init__(self, inner: Any, at: int, bad_token: int) -> None:
        self.inner, self.at, self.bad, self.calls = inner, at, bad_token, 0

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> Any:
        self.calls += 1
        if self.calls == self.at:
            self.inner.consume_token(self.bad)  # puts the matcher in its error state
        return self.inner.unsafe_compute_mask_ptr(ptr, size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_grammar_that_fails_mid_request_fails_it_and_does_not_stop_it(engine):
    """llguidance counts its error state as stopped: taken for a completed grammar, the
    request finished "stop" with its output cut wherever the error came."""
    sp = SamplingParams(
        max_tokens=60, temperature=1.0, seed=3, grammar=Grammar.json_schema(STRING_A)
    )
    engine.add_request(make_request("fails", prompt_ids(4, 6), sp))
    states = engine.grammars()
    states._matchers["fails"] = _FailsAtMask(
        states._matchers["fails"], at=8, bad_token=engine.eos_token_ids[0]
    )
    out = run_all(engine)["fails"]
    assert out[-1].finish_reason is FinishReason.ERROR, text(out)
