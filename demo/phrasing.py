"""Turn a phrase from a topic into a user message, many ways.

A message is `opener + filler + core + closer`, where the core comes from a template for
actions ("Could I {a}, please?"), problems ("{P}. What should I do?") or direct questions,
and every part is optional. A small share of messages are typed all lower-case without a
final mark, as people do in chat. All randomness comes from the `random.Random` passed in.
"""

from __future__ import annotations

import random
import re

from demo.topic import AREA_NAMES

ACTION_TEMPLATES: tuple[str, ...] = (
    "How do I {a}?",
    "How can I {a}?",
    "How would I {a}?",
    "Can I {a}?",
    "Could I {a}?",
    "Could I {a}, please?",
    "Can I {a} please?",
    "Is it possible to {a}?",
    "Is there a way to {a}?",
    "What's the best way to {a}?",
    "What do I need to do to {a}?",
    "Where do I go to {a}?",
    "Where can I {a}?",
    "I want to {a}.",
    "I'd like to {a}.",
    "I would like to {a}, please.",
    "I need to {a}.",
    "I need to {a}. How do I do that?",
    "I'm trying to {a}.",
    "I'm trying to {a} but I can't figure out how.",
    "Please help me {a}.",
    "Can you help me {a}?",
    "Could you help me {a}?",
    "Can you tell me how to {a}?",
    "Could you explain how to {a}?",
    "Would you be able to help me {a}?",
    "Am I able to {a}?",
    "What are the steps to {a}?",
    "Tell me how to {a}.",
    "Show me how to {a}.",
    "Help me {a}.",
    "I was wondering if I can {a}.",
    "I was wondering how to {a}.",
    "Any idea how to {a}?",
    "Do you know how I can {a}?",
    "Is there any way I could {a}?",
    "I can't work out how to {a}.",
    "Is it hard to {a}?",
    "Would it be possible to {a}?",
    "What should I do to {a}?",
    "{a}",
    "{A}.",
    "{A}, please.",
    "{A}?",
)

PROBLEM_TEMPLATES: tuple[str, ...] = (
    "{P}.",
    "{P}. What should I do?",
    "{P}. Can you help?",
    "{P}. What can I do?",
    "{P}, what do I do?",
    "{P}. Please help.",
    "Help, {p}!",
    "{P} and I don't know what to do.",
    "I think {p}.",
    "{P}. Any ideas?",
    "{P}. Is there anything you can do?",
    "{P}. How do I fix this?",
    "So, {p}.",
    "Hmm, {p}.",
    "{P}. Can you look into it?",
    "Unfortunately {p}.",
    "{p}",
)

QUESTION_TEMPLATES: tuple[str, ...] = (
    "{Q}?",
    "{Q}?",
    "I was wondering, {q}?",
    "Can you tell me: {q}?",
    "Just curious, {q}?",
    "{Q}? I couldn't find it anywhere.",
    "So {q}?",
    "One more thing: {q}?",
)

SUBJECT_TEMPLATES: tuple[str, ...] = (
    "{s}",
    "{S}",
    "{S}?",
    "{S}.",
    "{S} please",
    "{S}, please.",
    "Question about {s}.",
    "Help with {s}",
    "{S} help",
    "I need help with {s}.",
    "Can you help me with {s}?",
    "I have a question about {s}.",
    "What about {s}?",
    "Info on {s}, please.",
    "Tell me about {s}.",
    "{S} question",
)

# (opener, separators it may take before the core)
_OPENERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Hi", (", ", "! ", ". ")),
    ("Hi there", (", ", "! ")),
    ("Hello", (", ", "! ", ". ")),
    ("Hey", (", ", "! ")),
    ("Hey there", (", ", "! ")),
    ("Good morning", (", ", "! ", ". ")),
    ("Good afternoon", (", ", ". ")),
    ("Good evening", (", ", ". ")),
    ("Hello team", (", ", "! ")),
    ("Hi support", (", ", "! ")),
    ("Quick question", (": ", ". ")),
    ("Excuse me", (", ",)),
    ("Sorry to bother you", (", ", ". ")),
    ("Hope you're well", (". ", "! ")),
    ("Hi, hope you can help", (". ", "! ")),
    ("Hello, I have a question", (". ", ": ")),
    ("Okay", (", ", ". ")),
    ("Um", (", ",)),
    ("Dear support", (", ",)),
)

_FILLERS: tuple[str, ...] = (
    "I have a question.",
    "This is my first time contacting you.",
    "I'm a bit confused.",
    "I couldn't find it in the help center.",
    "I looked everywhere in the settings.",
    "I'm in a bit of a hurry.",
    "A friend told me to ask here.",
    "I've been a customer for years.",
    "I'm new here.",
    "Sorry if this is a silly question.",
)

_CLOSERS: tuple[str, ...] = (
    "Thanks!",
    "Thank you.",
    "Thanks in advance.",
    "Any help is appreciated.",
    "Cheers.",
    "Thanks a lot!",
    "I appreciate it.",
    "Thank you so much!",
    "Please let me know.",
)

_I_WORD = re.compile(r"\bi\b")
_LOWER_KEEP = ("I ", "I'", "PayPal", "GDPR", "VAT")


def fix_i(text: str) -> str:
    """Capitalise the pronoun: "i can't" -> "I can't"."""
    return _I_WORD.sub("I", text)


def sentence_case(text: str) -> str:
    text = fix_i(text)
    return text[:1].upper() + text[1:]


def _after_comma(text: str) -> str:
    """Lower-case a core sentence that follows "Hi, " unless it starts with "I" or a name."""
    if text.startswith(_LOWER_KEEP):
        return text
    return text[:1].lower() + text[1:]


def action_core(rng: random.Random, action: str) -> str:
    return rng.choice(ACTION_TEMPLATES).format(a=fix_i(action), A=sentence_case(action))


def problem_core(rng: random.Random, problem: str) -> str:
    return rng.choice(PROBLEM_TEMPLATES).format(p=fix_i(problem), P=sentence_case(problem))


def question_core(rng: random.Random, question: str) -> str:
    return rng.choice(QUESTION_TEMPLATES).format(q=fix_i(question), Q=sentence_case(question))


def subject_core(rng: random.Random, subject: str) -> str:
    return rng.choice(SUBJECT_TEMPLATES).format(s=subject, S=sentence_case(subject))


def utterance_core(rng: random.Random, text: str) -> str:
    """Small talk such as "what can you do": varied case and final mark."""
    asks = text.split(" ", 1)[0] in {"what", "who", "how", "can", "are", "am", "is", "how's"}
    mark = rng.choice(("?", "?", "") if asks else ("!", ".", "", ""))
    return sentence_case(text) + mark


def greet(rng: random.Random, text: str) -> str:
    """Sometimes put a greeting before small talk: "Hello, how are you?"."""
    if rng.random() >= 0.3:
        return text
    opener, seps = rng.choice(_OPENERS[:5])
    sep = rng.choice(seps)
    return opener + sep + (_after_comma(text) if sep == ", " else text)


def decorate(rng: random.Random, core: str, area: str | None) -> str:
    """Wrap a core sentence in an optional opener, filler and closer.

    `area` names the topic area for fillers like "I have a question about billing."; pass
    None for off-topic messages, which only get area-free fillers.
    """
    parts: list[str] = []
    body = core
    if rng.random() < 0.3:
        if area is not None and rng.random() < 0.5:
            filler = f"I have a question about {rng.choice(AREA_NAMES[area])}."
        else:
            filler = rng.choice(_FILLERS)
        body = f"{filler} {core}" if rng.random() < 0.7 else f"{core} {filler}"
    if rng.random() < 0.45:
        opener, seps = rng.choice(_OPENERS)
        sep = rng.choice(seps)
        parts.append(opener + sep.rstrip())
        body = _after_comma(body) if sep in (", ", ": ") else body[:1].upper() + body[1:]
    parts.append(body)
    if rng.random() < 0.25:
        parts.append(rng.choice(_CLOSERS))
    text = " ".join(parts)
    if rng.random() < 0.12:
        text = text.lower().rstrip(".!?")
    return text
