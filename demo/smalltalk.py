"""Small talk and the fallback: what keeps the demo model fluent off the support script.

Off-topic requests are generated from wide, unrelated word banks and share the question
templates of the support topics, so the model learns to decide by the *subject* of a
question (and not by its shape) whether to answer it or to fall back politely.
"""

from __future__ import annotations

import random

from demo.topic import Utterance

SMALL_TALK: tuple[Utterance, ...] = (
    Utterance(
        name="greeting",
        messages=(
            "hi",
            "hello",
            "hey",
            "hi there",
            "hello there",
            "hey there",
            "good morning",
            "good afternoon",
            "good evening",
            "hiya",
            "greetings",
            "hello, anyone there",
            "hi, is anyone there",
        ),
        answers=("Hello! I'm the support assistant. How can I help you today?",),
        keywords=("help",),
    ),
    Utterance(
        name="capabilities",
        messages=(
            "what can you do",
            "what can you help me with",
            "what do you do",
            "how can you help me",
            "what kind of questions can i ask",
            "who are you",
            "what are you",
            "what is this",
            "how does this work",
            "can you help me",
            "i need help",
            "i have a question",
            "help",
            "i need some help with something",
            "what topics do you know about",
        ),
        answers=(
            "I'm the support assistant. I can help with your account and password, billing and "
            "invoices, refunds, subscriptions, orders and shipping, devices and the app, and your "
            "data and privacy. What would you like to know?",
        ),
        keywords=("help",),
    ),
    Utterance(
        name="thanks",
        messages=(
            "thanks",
            "thank you",
            "thanks a lot",
            "thank you so much",
            "great, thanks",
            "perfect, thank you",
            "that helps, thanks",
            "that worked",
            "ok, thanks",
            "got it, thanks",
            "awesome, thank you",
        ),
        answers=("You're welcome! Is there anything else I can help you with?",),
        keywords=("welcome",),
    ),
    Utterance(
        name="ack",
        messages=("ok", "okay", "alright", "got it", "i see", "sure", "cool", "makes sense"),
        answers=("Great! Is there anything else I can help you with?",),
        keywords=("help",),
    ),
    Utterance(
        name="goodbye",
        messages=(
            "bye",
            "goodbye",
            "that's all",
            "no, that's all",
            "nothing else",
            "no thanks, that's it",
            "see you",
            "have a nice day",
            "thanks, bye",
            "ok, thank you, goodbye",
        ),
        answers=("Thanks for reaching out. Have a great day!",),
        keywords=("day",),
    ),
    Utterance(
        name="identity",
        messages=(
            "are you a bot",
            "are you a robot",
            "are you human",
            "am i talking to a real person",
            "are you an ai",
            "is this automated",
        ),
        answers=(
            "I'm an automated support assistant. I can answer most questions right away, and if "
            "you need a person, I can connect you with our support team.",
        ),
        keywords=("assistant",),
    ),
    Utterance(
        name="how_are_you",
        messages=("how are you", "how's it going", "how are you doing today", "how are things"),
        answers=("I'm doing well, thanks for asking! How can I help you today?",),
        keywords=("help",),
    ),
)

FALLBACK_ANSWER = (
    "I'm sorry, I can't help with that. I can answer questions about your account, billing, "
    "subscriptions, orders and shipping, devices and the app, and your data and privacy. Is "
    "there something in those areas I can help with?"
)
FALLBACK_KEYWORDS: tuple[str, ...] = ("sorry", "can't help")

# Verb phrases from everyday life, deliberately far from the support topics.
_ACTION_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cook", ("pasta", "rice", "a steak", "pancakes", "a curry", "lentil soup", "salmon")),
    ("bake", ("bread", "a chocolate cake", "cookies", "an apple pie", "sourdough", "muffins")),
    ("learn", ("Spanish", "the guitar", "to swim", "chess", "calculus", "to juggle", "Japanese")),
    ("fix", ("a leaky tap", "my bike chain", "a squeaky door", "my car engine", "a flat tyre")),
    ("grow", ("tomatoes", "basil", "a lemon tree", "orchids", "potatoes on a balcony")),
    ("train", ("my dog", "for a marathon", "my puppy to sit", "my parrot to talk")),
    ("write", ("a poem about the sea", "a wedding speech", "a short story", "a cover letter")),
    ("book", ("a flight to Paris", "a table for two", "a hotel in Rome", "a train to Berlin")),
    ("paint", ("my bedroom", "a portrait", "the garden fence", "a watercolour landscape")),
    ("plan", ("a birthday party", "a trip to Iceland", "my wedding", "a camping weekend")),
    ("make", ("a paper plane", "fresh lemonade", "a bird house", "a snowman", "candles")),
    ("find", ("a good dentist", "my lost keys", "a cheap flat", "a new hobby")),
    ("buy", ("a used car", "concert tickets", "a new sofa", "fresh flowers", "a horse")),
    ("get", ("rid of ants", "better sleep", "a driving licence", "a pizza", "a sandwich")),
    ("build", ("a treehouse", "a sandcastle", "a rocket", "a shed", "a snow fort")),
    ("clean", ("my oven", "a carpet stain", "silver jewellery", "my windows")),
)

_PROBLEMS: tuple[str, ...] = (
    "my car won't start",
    "my cat is sick",
    "i lost my keys",
    "my neighbours are too loud",
    "my tomato plants are dying",
    "my sourdough won't rise",
    "i can't sleep at night",
    "my garden is full of snails",
    "my bike has a flat tyre",
    "i'm bored",
    "it's raining again",
    "my football team lost",
    "i burned the toast",
    "my washing machine is leaking",
)

_FILLS = (
    ("country", ("France", "Peru", "Canada", "Kenya", "Norway", "Japan", "Chile", "Egypt")),
    ("city", ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Denver", "Sydney", "Madrid")),
    ("thing", ("book", "movie", "song", "restaurant", "board game", "podcast", "beach")),
    ("noun", ("dinosaurs", "volcanoes", "the moon", "jazz", "pirates", "penguins", "tea")),
    ("sport", ("football", "tennis", "basketball", "cricket", "hockey", "rugby")),
)

_QUESTION_TEMPLATES: tuple[str, ...] = (
    "What is the capital of {country}?",
    "What's the weather like in {city} today?",
    "What time is it in {city}?",
    "Can you recommend a good {thing}?",
    "What's your favourite {thing}?",
    "Tell me something about {noun}.",
    "Do you like {noun}?",
    "Why do people like {noun}?",
    "Who won the {sport} match last night?",
    "How do you play {sport}?",
    "What is {a} plus {b}?",
    "How far is {city} from {city2}?",
    "Write me a song about {noun}.",
    "Tell me a joke about {noun}.",
    "Translate hello into the language of {country}.",
    "What should I eat for dinner?",
    "What is the meaning of life?",
    "Tell me a joke.",
    "Can you sing?",
    "Do you dream?",
    "Is it going to snow tomorrow?",
    "What's the best {thing} you know?",
    "What do {noun} eat?",
)


_SUBJECTS: tuple[str, ...] = (
    "pizza",
    "the weather",
    "football",
    "recipes",
    "dinosaurs",
    "jazz",
    "movies",
    "my homework",
    "stock prices",
    "gardening",
    "politics",
    "the news",
    "poetry",
    "car insurance",
    "vacation ideas",
    "quantum physics",
    "world history",
    "my essay",
    "lottery numbers",
    "a good recipe",
)


def offtopic_subject(rng: random.Random) -> str:
    return rng.choice(_SUBJECTS)


def offtopic_action(rng: random.Random) -> str:
    """A base-verb phrase outside the support domain ("bake a chocolate cake")."""
    verb, objects = rng.choice(_ACTION_GROUPS)
    return f"{verb} {rng.choice(objects)}"


def offtopic_problem(rng: random.Random) -> str:
    return rng.choice(_PROBLEMS)


def offtopic_question(rng: random.Random) -> str:
    """A complete off-topic question with its slots filled."""
    values = {key: rng.choice(options) for key, options in _FILLS}
    values["city2"] = rng.choice(_FILLS[1][1])
    values["a"] = str(rng.randint(2, 99))
    values["b"] = str(rng.randint(2, 99))
    return rng.choice(_QUESTION_TEMPLATES).format(**values)
