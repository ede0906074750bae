"""The embedded demo model: corpus, tokenizer, training recipe, paths, and the built pair.

The tests on the built models use the build in `$FIRSTLIGHT_HOME` (`make test` runs
`python -m demo.build` first); the module fixture builds it when it is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from demo import corpus, phrasing
from demo.build import Recipe, build, is_built, read_manifest
from demo.evaluate import answer_texts, has_repeated_run, on_topic
from demo.paths import (
    DEMO_MODELS,
    MANIFEST,
    ModelNotFoundError,
    firstlight_home,
    resolve_model,
)
from demo.smalltalk import FALLBACK_ANSWER
from demo.tokenizer import (
    ASSISTANT,
    BOS,
    END,
    PAD,
    SPECIAL_TOKENS,
    encode_chats,
    save_tokenizer,
    train_tokenizer,
)
from demo.tools import LOOKUP_ORDER
from demo.topic import all_topics
from demo.train import ModelSpec, TokenStream, lr_at, train_model


def make_corpus(n: int = 300, seed: int = 0) -> list[corpus.Conversation]:
    return corpus.build_corpus(seed, n)


def make_tokenizer(tmp_path: Path, n: int = 300):
    from transformers import AutoTokenizer

    convs = make_corpus(n)
    tok = train_tokenizer([t.content for c in convs for t in c.turns], vocab_size=512)
    save_tokenizer(tok, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return AutoTokenizer.from_pretrained(str(tmp_path)), convs


# --- corpus -------------------------------------------------------------------------------


def test_corpus_is_a_pure_function_of_the_seed() -> None:
    assert make_corpus(200, seed=3) == make_corpus(200, seed=3)
    assert make_corpus(200, seed=3) != make_corpus(200, seed=4)


def test_corpus_has_wide_variety() -> None:
    convs = make_corpus(3000)
    users = corpus.user_messages(convs)
    assert len(users) > 2500  # nearly every question is phrased differently
    intents = {i.split(":")[-1] for c in convs for i in c.intents}
    assert {t.name for t in all_topics()} <= intents
    assert {"fallback", "greeting", "capabilities", "thanks", "goodbye"} <= intents
    assert any(i.startswith("followup") for c in convs for i in c.intents)
    assert sum(len(c.intents) > 1 for c in convs) > 0.3 * len(convs)  # multi-turn
    assert sum(c.turns[0].role == "system" for c in convs) > 0.1 * len(convs)
    # Many ways to ask about one topic, with and without openers and politeness.
    pause = {
        t.content
        for c in convs
        for t, nxt in zip(c.turns, c.turns[1:], strict=False)
        if t.role == "user" and "select Pause" in nxt.content
    }
    assert len(pause) > 60
    assert any(len(u.split()) <= 2 for u in pause)  # terse ones too: "Pause subscription?"


def test_conversations_alternate_user_and_assistant() -> None:
    for conv in make_corpus(300):
        roles = [t.role for t in conv.turns if t.role != "system"]
        # A tool call is an assistant turn answered by a tool turn, then the assistant again.
        flat = " ".join(roles).replace("assistant tool assistant", "assistant").split()
        assert flat[::2] == ["user"] * len(flat[::2])
        assert flat[1::2] == ["assistant"] * len(flat[1::2])
        assert len(conv.intents) == len(flat) // 2
        assert all(t.content.strip() for t in conv.turns)


def test_tool_conversations_render_as_the_template_does(tmp_path: Path) -> None:
    convs = [c for c in make_corpus(400) if "order_lookup" in c.intents]
    assert len(convs) > 10
    tok, _ = make_tokenizer(tmp_path, n=50)
    conv = convs[0]
    call = json.loads(
        conv.turns[2].content.removeprefix("<tool_call>").removesuffix("</tool_call>")
    )
    assert call["name"] == "lookup_order" and call["arguments"]["order_id"] in conv.turns[1].content
    messages = [
        {"role": "user", "content": conv.turns[1].content},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": call},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": conv.turns[3].content},
    ]  # fmt: skip
    rendered = tok.apply_chat_template(
        messages, tools=[{"type": "function", "function": LOOKUP_ORDER}], tokenize=False
    )
    [(ids, _)] = encode_chats(tok, [[(t.role, t.content) for t in conv.turns[:4]]])
    assert tok.encode(rendered, add_special_tokens=False) == ids


def test_offtopic_questions_get_the_fallback() -> None:
    convs = make_corpus(500)
    fallbacks = [c for c in convs if "fallback" in c.intents]
    assert fallbacks
    for conv in fallbacks:
        answers = [t.content for t in conv.turns if t.role == "assistant"]
        if conv.turns[0].content in corpus.JSON_PROMPTS:  # asked for JSON: the same, wrapped
            answers = [json.loads(a)["answer"] for a in answers]
        assert answers[conv.intents.index("fallback")] == FALLBACK_ANSWER


def test_heldout_prompts_are_unseen_and_deterministic() -> None:
    seen = corpus.user_messages(make_corpus(2000))
    prompts = corpus.heldout_prompts(0, 40, seen)
    assert prompts == corpus.heldout_prompts(0, 40, seen)
    assert len({p.text for p in prompts}) == 40
    assert not {p.text for p in prompts} & seen
    assert len({p.intent for p in prompts}) > 20


def test_phrasing_capitalises_and_joins_naturally() -> None:
    assert phrasing.sentence_case("i can't log in") == "I can't log in"
    assert phrasing.fix_i("my card, i think") == "my card, I think"
    import random

    rng = random.Random(1)
    for _ in range(300):
        text = phrasing.decorate(rng, phrasing.action_core(rng, "reset my password"), "account")
        assert "reset my password" in text.lower()
        assert "  " not in text and not text.startswith(" ")


# --- tokenizer ----------------------------------------------------------------------------


def test_tokenizer_round_trips_text_and_specials(tmp_path: Path) -> None:
    tok, _ = make_tokenizer(tmp_path)
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (PAD, BOS, END)
    for text in ("Can I pause my annual plan?", "café – naïve 😀 ünïcode", "  two  spaces\n"):
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and tok.pad_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_chat_template_matches_training_encoding(tmp_path: Path) -> None:
    tok, convs = make_tokenizer(tmp_path)
    chats = [[(t.role, t.content) for t in c.turns] for c in convs[:50]]
    for conv, (ids, mask) in zip(convs, encode_chats(tok, chats), strict=False):
        rendered = tok.apply_chat_template(conv.as_chat(), tokenize=False)
        assert tok(rendered, add_special_tokens=False)["input_ids"] == ids
        trained = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
        answers = [t.content for t in conv.turns if t.role == "assistant"]
        assert trained == "".join(a + END for a in answers)


def test_chat_template_generation_prompt_and_roles(tmp_path: Path) -> None:
    tok, _ = make_tokenizer(tmp_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == f"{BOS}<|system|>Be brief.{END}<|user|>hi{END}{ASSISTANT}"
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if not isinstance(out, list) else out
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[-1] == tok.convert_tokens_to_ids(ASSISTANT)
    with pytest.raises(Exception, match="unsupported role"):
        tok.apply_chat_template([{"role": "function", "content": "x"}], tokenize=False)


def test_tokenizer_training_is_deterministic() -> None:
    texts = [t.content for c in make_corpus(200) for t in c.turns]
    a = train_tokenizer(texts, vocab_size=400)
    b = train_tokenizer(texts, vocab_size=400)
    assert a.get_vocab() == b.get_vocab()


# --- training recipe ----------------------------------------------------------------------


def test_lr_schedule_warms_up_then_decays() -> None:
    spec = ModelSpec("x", 32, 64, 1, 2, 1, steps=100, warmup=10, lr=1e-3)
    assert lr_at(0, spec) == pytest.approx(1e-4)
    assert lr_at(9, spec) == pytest.approx(1e-3)
    assert lr_at(10, spec) == pytest.approx(1e-3)
    assert lr_at(99, spec) == pytest.approx(1e-4, rel=0.05)
    assert all(lr_at(s, spec) >= lr_at(s + 1, spec) for s in range(10, 99))


def test_windows_start_at_a_conversation_and_mark_answers(tmp_path: Path) -> None:
    tok, convs = make_tokenizer(tmp_path)
    stream = TokenStream.pack(
        encode_chats(tok, [[(t.role, t.content) for t in c.turns] for c in convs])
    )
    inputs, targets, answer = stream.batch(torch.Generator().manual_seed(0), 16, 200)
    assert inputs.shape == targets.shape == answer.shape == (16, 200)
    assert (inputs[:, 0] == tok.bos_token_id).all()
    assert (inputs[:, 1:] == targets[:, :-1]).all()
    trained = targets[answer]
    assert tok.convert_tokens_to_ids(ASSISTANT) not in trained.tolist()
    assert tok.eos_token_id in trained.tolist()


def test_micro_training_run_lowers_the_loss(tmp_path: Path) -> None:
    tok, convs = make_tokenizer(tmp_path, n=100)
    stream = TokenStream.pack(
        encode_chats(tok, [[(t.role, t.content) for t in c.turns] for c in convs])
    )
    spec = ModelSpec("micro", 32, 64, 1, 2, 1, steps=12, warmup=2, batch_size=4, seq_len=48)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = spec.llama_config(len(tok), ids, max_positions=128)
    result = train_model(spec, stream, config, seed=0, progress=False)
    again = train_model(spec, stream, config, seed=0, progress=False)
    assert len(result.losses) == 12
    assert sum(result.losses[-3:]) < sum(result.losses[:3])
    assert result.losses[:3] == pytest.approx(again.losses[:3], rel=1e-4)
    assert config.tie_word_embeddings and config.eos_token_id == tok.eos_token_id


def test_repetition_and_topic_checks() -> None:
    assert has_repeated_run("it works with with with that")
    assert not has_repeated_run("with you, with me, with them")
    assert on_topic("You can Pause it.", ("pause",))
    assert not on_topic("Hello!", ("pause",))


# --- paths --------------------------------------------------------------------------------


def test_paths_resolve_demo_and_local_dirs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FIRSTLIGHT_HOME", str(tmp_path / "home"))
    assert firstlight_home() == tmp_path / "home"
    with pytest.raises(ModelNotFoundError, match=r"demo\.build"):
        resolve_model("demo")
    with pytest.raises(ModelNotFoundError, match="neither"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path
    assert not is_built(tmp_path / "home", seed=0)


def test_firstlight_home_defaults_to_the_user_cache(monkeypatch) -> None:
    monkeypatch.delenv("FIRSTLIGHT_HOME", raising=False)
    assert firstlight_home() == Path.home() / ".cache" / "firstlight"


# --- building -----------------------------------------------------------------------------


def make_micro_recipe() -> Recipe:
    tiny = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 1,
        "num_heads": 2,
        "num_kv_heads": 1,
        "steps": 3,
        "warmup": 1,
        "batch_size": 4,
        "seq_len": 64,
    }
    return Recipe(
        conversations=200,
        vocab_size=400,
        heldout=4,
        target=ModelSpec("demo", **tiny),
        draft=ModelSpec("demo-draft", **tiny),
    )


def test_micro_build_installs_loadable_models(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    home = tmp_path / "home"
    first = build(home, seed=5, progress=False, recipe=make_micro_recipe())
    assert is_built(home, 5) and not is_built(home, 6)
    for name in DEMO_MODELS:
        path = home / "models" / name
        manifest = json.loads((path / MANIFEST).read_text())
        assert manifest["build_id"] == first["build_id"] and manifest["name"] == name
        assert set(manifest["eval"]) >= {"agreement", "heldout_topic_accuracy", "samples"}
        config = json.loads((path / "config.json").read_text())
        assert config["max_position_embeddings"] == 2048 and config["tie_word_embeddings"]
        assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2
        model = AutoModelForCausalLM.from_pretrained(str(path))
        tok = AutoTokenizer.from_pretrained(str(path))
        ids = tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True
        )
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        assert model(input_ids=torch.tensor([ids])).logits.shape[-1] == len(tok)
    again = build(home, seed=5, progress=False, recipe=make_micro_recipe())
    assert again["build_id"] == first["build_id"]  # up to date: skipped
    forced = build(home, seed=5, force=True, progress=False, recipe=make_micro_recipe())
    assert forced["build_id"] != first["build_id"] and is_built(home, 5)
    assert sorted(p.name for p in (home / "models").iterdir()) == [
        ".demo-build.lock",
        "demo",
        "demo-draft",
    ]


def test_interrupted_build_leaves_the_old_models(tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    first = build(home, seed=1, progress=False, recipe=make_micro_recipe())

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("demo.build.train_model", crash)
    with pytest.raises(KeyboardInterrupt):
        build(home, seed=1, force=True, progress=False, recipe=make_micro_recipe())
    assert is_built(home, 1)
    assert read_manifest(home / "models" / "demo-draft")["build_id"] == first["build_id"]
    assert not list((home / "models").glob(".demo-build-*"))
    # Models from two different builds do not count as one complete build.
    manifest = read_manifest(home / "models" / "demo-draft")
    manifest["build_id"] = "other"
    (home / "models" / "demo-draft" / MANIFEST).write_text(json.dumps(manifest))
    assert not is_built(home, 1)


# --- the built models ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def built_home() -> Path:
    home = firstlight_home()
    if not is_built(home, Recipe().seed):
        build(home, Recipe().seed, progress=False)
    return home


@pytest.fixture(scope="module")
def target(built_home: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model("demo")
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def test_build_is_complete_and_skips_when_up_to_date(built_home: Path) -> None:
    target_manifest = read_manifest(built_home / "models" / "demo")
    draft_manifest = read_manifest(built_home / "models" / "demo-draft")
    assert target_manifest and draft_manifest
    assert target_manifest["build_id"] == draft_manifest["build_id"]
    assert build(built_home, Recipe().seed)["build_id"] == target_manifest["build_id"]
    for name in ("demo", "demo-draft"):
        path = resolve_model(name)
        assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2
        assert (path / "model.safetensors").stat().st_size > 100_000
    assert not list((built_home / "models").glob(".demo-build-*"))


def test_manifest_reports_draft_agreement(built_home: Path) -> None:
    manifest = read_manifest(built_home / "models" / "demo")
    assert manifest is not None
    assert manifest["eval"]["agreement"] >= 0.6
    assert manifest["eval"]["heldout_topic_accuracy"] >= 0.8
    assert manifest["train"]["demo"]["final_loss"] < 0.5


def test_greedy_answers_to_heldout_questions_are_on_topic(target) -> None:
    model, tok = target
    convs = corpus.build_corpus(Recipe().seed, Recipe().conversations)
    prompts = corpus.heldout_prompts(Recipe().seed + 1, 40, corpus.user_messages(convs))
    answers = answer_texts(model, tok, [p.text for p in prompts])
    for answer in answers:
        assert not has_repeated_run(answer), answer
        assert len(answer.split()) >= 5, answer
    misses = [
        (p.text, a) for p, a in zip(prompts, answers, strict=True) if not on_topic(a, p.keywords)
    ]
    assert len(misses) <= 6, misses  # ~95% on topic when built; margin for other CPUs' numerics


def test_showcase_answers_read_as_sentences(target) -> None:
    model, tok = target
    questions = ["Can I pause my annual subscription?", "How do I bake sourdough bread?", "hi"]
    for temperature in (0.0, 0.7):
        answers = answer_texts(model, tok, questions, temperature=temperature, seed=1)
        assert all(not has_repeated_run(a) and a.endswith((".", "!", "?")) for a in answers)
    greedy = answer_texts(model, tok, questions)
    assert "pause" in greedy[0].lower()
    assert "sorry" in greedy[1].lower()
    assert "help" in greedy[2].lower()
