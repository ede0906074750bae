"""Generated support-desk conversations: the demo model's whole training set.

`build_corpus(seed, n)` returns `n` conversations; the same seed always gives the same
list. A conversation is an optional system message and one to three exchanges: a support
question, small talk, or an off-topic request (answered with the fallback), followed by
topic follow-ups ("How long can I pause it for?"), thanks, goodbyes or a new question.

About one in six lists the demo's tool (`demo.tools`); most of those ask about an order and
teach the call, the tool's result and the reply that uses it. One in twenty asks for JSON in
its system message and gets the usual answer as `{"answer": "..."}`.

`heldout_prompts(seed, n, seen)` draws single questions from a separate random stream and
drops any whose text is in `seen` (the training user messages), so evaluation never asks a
question verbatim from training.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from demo import phrasing, smalltalk, tools
from demo.topic import Topic, Utterance, all_topics

SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful support assistant.",
    "You are the customer support assistant. Answer briefly and politely.",
    "Be concise.",
    "You are a friendly assistant that helps customers with their accounts.",
    "Answer the user's question.",
    "You are a helpful assistant.",
    "You help customers of an online service. Keep answers short.",
)

_LEAD_INS: tuple[str, ...] = ("Sure! ", "Of course. ", "Happy to help. ", "No problem. ")
_NO_LEAD_IN = ("Yes", "Sorry", "I'm sorry", "Welcome")

TOOL_SHARE = 0.15  # conversations that call `lookup_order` (`demo.tools`)
TOOLS_IDLE_SHARE = 0.03  # conversations with the tools listed that call none
JSON_SHARE = 0.05  # conversations whose system message asks for JSON answers
JSON_PROMPTS: tuple[str, ...] = (
    "Reply in JSON.",
    'Answer as a JSON object with the key "answer".',
    "Respond with JSON only.",
    "You are a support assistant. Output JSON.",
)

# Held-out draws use a stream no training seed reaches in practice.
_HELDOUT_SALT = 1_000_003


@dataclass(frozen=True, slots=True)
class Turn:
    role: str  # system | user | assistant | tool
    content: str


@dataclass(frozen=True, slots=True)
class Conversation:
    """Messages in order, and for each assistant message the intent it answers."""

    turns: tuple[Turn, ...]
    intents: tuple[str, ...]

    def as_chat(self) -> list[dict[str, str]]:
        """The OpenAI/transformers message list (`apply_chat_template` input)."""
        return [{"role": t.role, "content": t.content} for t in self.turns]


@dataclass(frozen=True, slots=True)
class EvalPrompt:
    """A single user question with the intent it asks about and words a good answer uses."""

    text: str
    intent: str
    keywords: tuple[str, ...]


@dataclass(slots=True)
class _Generator:
    rng: random.Random
    topics: tuple[Topic, ...]
    talk: dict[str, Utterance]

    def topic_question(self, topic: Topic) -> tuple[str, str]:
        """(user message, answer) for one topic."""
        pool = (
            [("s", x) for x in topic.subjects]
            + [("a", x) for x in topic.actions]
            + [("p", x) for x in topic.problems]
            + [("q", x) for x in topic.questions]
        )
        kind, phrase = self.rng.choice(pool)
        if kind == "s":
            core = phrasing.subject_core(self.rng, phrase)
        elif kind == "a":
            core = phrasing.action_core(self.rng, phrase)
        elif kind == "p":
            core = phrasing.problem_core(self.rng, phrase)
        else:
            core = phrasing.question_core(self.rng, phrase)
        answer = self.rng.choice(topic.answers)
        if kind in "aq" and not answer.startswith(_NO_LEAD_IN) and self.rng.random() < 0.25:
            answer = self.rng.choice(_LEAD_INS) + answer
        return phrasing.decorate(self.rng, core, topic.area), answer

    def offtopic(self) -> str:
        r = self.rng.random()
        if r < 0.4:
            core = phrasing.action_core(self.rng, smalltalk.offtopic_action(self.rng))
        elif r < 0.55:
            core = phrasing.problem_core(self.rng, smalltalk.offtopic_problem(self.rng))
        elif r < 0.7:
            core = phrasing.subject_core(self.rng, smalltalk.offtopic_subject(self.rng))
        else:
            core = smalltalk.offtopic_question(self.rng)
        return phrasing.decorate(self.rng, core, None)

    def say(self, name: str) -> tuple[str, str]:
        """(user message, answer) for a small-talk intent."""
        talk = self.talk[name]
        text = phrasing.utterance_core(self.rng, self.rng.choice(talk.messages))
        if name != "greeting":
            text = phrasing.greet(self.rng, text)
        if self.rng.random() < 0.15:
            text = text.lower().rstrip(".!?")
        return text, self.rng.choice(talk.answers)

    def exchange(self, intent: str, last: Topic | None) -> tuple[str, str, Topic | None]:
        """One (user, assistant) pair for `intent`; returns the topic now under discussion."""
        if intent == "topic":
            topic = self.rng.choice(self.topics)
            user, answer = self.topic_question(topic)
            return user, answer, topic
        if intent == "followup" and last is not None and last.followups:
            follow = self.rng.choice(last.followups)
            return self.rng.choice(follow.questions), follow.answer, last
        if intent == "fallback":
            return self.offtopic(), smalltalk.FALLBACK_ANSWER, None
        user, answer = self.say(intent)
        return user, answer, None

    def next_intent(self, previous: str, last: Topic | None) -> str:
        choices: tuple[tuple[str, float], ...]
        if previous == "topic" and last is not None and last.followups:
            choices = (
                ("followup", 0.55),
                ("thanks", 0.1),
                ("ack", 0.05),
                ("topic", 0.2),
                ("fallback", 0.1),
            )
        elif previous == "topic":
            choices = (("thanks", 0.25), ("ack", 0.05), ("topic", 0.5), ("fallback", 0.2))
        elif previous == "thanks":
            choices = (("goodbye", 0.6), ("topic", 0.4))
        elif previous == "fallback":
            choices = (("topic", 0.7), ("capabilities", 0.3))
        elif previous == "followup":
            choices = (("thanks", 0.5), ("topic", 0.5))
        else:  # greeting, capabilities, identity, how_are_you, ack
            choices = (("topic", 0.85), ("fallback", 0.15))
        names, weights = zip(*choices, strict=True)
        return self.rng.choices(names, weights)[0]

    def first_intent(self) -> str:
        names = ("topic", "fallback", "greeting", "capabilities", "identity", "how_are_you")
        return self.rng.choices(names, (0.7, 0.13, 0.08, 0.05, 0.02, 0.02))[0]

    def conversation(self) -> Conversation:
        turns: list[Turn] = []
        intents: list[str] = []
        r = self.rng.random()
        if r < TOOL_SHARE + TOOLS_IDLE_SHARE:
            # The tools header; in most of these the user asks about an order (a call), in
            # the rest something else (tools present are no reason to call one).
            turns.append(Turn("system", tools.tools_message()))
            if r < TOOL_SHARE:
                turns += [Turn(role, text) for role, text in tools.order_exchange(self.rng)]
                intents.append("order_lookup")
                if self.rng.random() < 0.3:
                    user, answer = self.say("thanks")
                    turns += [Turn("user", user), Turn("assistant", answer)]
                    intents.append("thanks")
                return Conversation(tuple(turns), tuple(intents))
        elif r < TOOL_SHARE + TOOLS_IDLE_SHARE + JSON_SHARE:
            # Asked for JSON: the usual answer as {"answer": ...} (what JSON mode needs from
            # the model: a grammar can force JSON, not tell the model when to close it).
            turns.append(Turn("system", self.rng.choice(JSON_PROMPTS)))
            intent = self.first_intent()
            user, answer, last = self.exchange(intent, None)
            turns += [Turn("user", user), Turn("assistant", json.dumps({"answer": answer}))]
            intents.append(f"{intent}:{last.name}" if last is not None else intent)
            return Conversation(tuple(turns), tuple(intents))
        if self.rng.random() < 0.25:
            turns.append(Turn("system", self.rng.choice(SYSTEM_PROMPTS)))
        extra = self.rng.choices((0, 1, 2), (0.5, 0.35, 0.15))[0]
        intent, last = self.first_intent(), None
        for i in range(extra + 1):
            if i > 0:
                intent = self.next_intent(intent, last)
            user, answer, last = self.exchange(intent, last)
            turns += [Turn("user", user), Turn("assistant", answer)]
            intents.append(f"{intent}:{last.name}" if last is not None else intent)
            if intent == "goodbye":
                break
        return Conversation(tuple(turns), tuple(intents))


def _generator(seed: int) -> _Generator:
    talk = {u.name: u for u in smalltalk.SMALL_TALK}
    return _Generator(random.Random(seed), all_topics(), talk)


def build_corpus(seed: int, size: int) -> list[Conversation]:
    """`size` conversations, a pure function of `seed`."""
    gen = _generator(seed)
    return [gen.conversation() for _ in range(size)]


def user_messages(corpus: list[Conversation]) -> set[str]:
    return {t.content for c in corpus for t in c.turns if t.role == "user"}


def heldout_prompts(seed: int, count: int, seen: set[str]) -> list[EvalPrompt]:
    """`count` single-turn questions not in `seen`: about 80% support topics, the rest small
    talk or off-topic. Deterministic given `seed` and `seen`."""
    gen = _generator(seed * 7919 + _HELDOUT_SALT)
    prompts: list[EvalPrompt] = []
    texts: set[str] = set()
    for _ in range(count * 100):
        if len(prompts) == count:
            break
        r = gen.rng.random()
        if r < 0.8:
            topic = gen.topics[len(prompts) % len(gen.topics)]
            text, _ = gen.topic_question(topic)
            prompt = EvalPrompt(text, topic.name, topic.keywords)
        elif r < 0.9:
            prompt = EvalPrompt(gen.offtopic(), "fallback", smalltalk.FALLBACK_KEYWORDS)
        else:
            talk = gen.rng.choice(smalltalk.SMALL_TALK[:2])
            text, _ = gen.say(talk.name)
            prompt = EvalPrompt(text, talk.name, talk.keywords)
        if prompt.text not in seen and prompt.text not in texts:
            texts.add(prompt.text)
            prompts.append(prompt)
    if len(prompts) < count:
        raise RuntimeError(f"could not draw {count} unseen prompts")
    return prompts


# Hand-written questions for the build's sample printout: phrasings no template produces.
SHOWCASE_PROMPTS: tuple[str, ...] = (
    "Can I pause my annual subscription?",
    "Could I get my money back for last month, please?",
    "hi",
    "what can you do?",
    "How do I bake sourdough bread?",
    "My package still hasn't arrived. What should I do?",
    "Do you sell my data to advertisers?",
    "Hello! I forgot my password and can't log in.",
)
