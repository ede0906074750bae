"""What the demo model knows: support topics as phrase banks plus one canonical answer.

A `Topic` describes one intent three ways, so `phrasing.py` can turn it into many distinct
user questions:

* `actions`: base-verb phrases that slot into "How do I {action}?" ("pause my annual plan");
* `problems`: clauses a user states ("my card was declined"), lower-case first word;
* `questions`: direct questions without the question mark ("how long does shipping take");
* `subjects`: what people type when they type little ("refund", "cancel subscription").

Every answer is written once (or in a few variants) and mentions at least one of the topic's
`keywords`, which the evaluation and tests use to check that an answer is on topic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class FollowUp:
    """A second-turn question that only makes sense after its topic's first answer."""

    questions: tuple[str, ...]  # complete user messages
    answer: str


@dataclass(frozen=True, slots=True)
class Topic:
    """One support intent. Invariant: at least one of actions/problems/questions is non-empty."""

    name: str
    area: str  # account | billing | subscription | shipping | device | privacy | support
    subjects: tuple[str, ...] = ()
    actions: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    questions: tuple[str, ...] = ()
    answers: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    followups: tuple[FollowUp, ...] = field(default=())

    def __post_init__(self) -> None:
        if not (self.actions or self.problems or self.questions):
            raise ValueError(f"topic {self.name!r} has no phrasing")
        if not self.answers or not self.keywords:
            raise ValueError(f"topic {self.name!r} needs answers and keywords")
        for answer in self.answers:
            if not any(k in answer.lower() for k in self.keywords):
                raise ValueError(f"topic {self.name!r}: answer lacks every keyword: {answer!r}")


@dataclass(frozen=True, slots=True)
class Utterance:
    """A conversational intent said in whole messages ("hi", "thanks", "what can you do")."""

    name: str
    messages: tuple[str, ...]  # lower-case, no final punctuation; casing is varied later
    answers: tuple[str, ...]
    keywords: tuple[str, ...]


# How the filler sentence "I have a question about ..." names each area.
AREA_NAMES: MappingProxyType[str, tuple[str, ...]] = MappingProxyType(
    {
        "account": ("my account", "signing in", "my login"),
        "billing": ("billing", "a payment", "my bill"),
        "subscription": ("my subscription", "my plan", "my membership"),
        "shipping": ("my order", "a delivery", "shipping"),
        "device": ("the app", "my devices", "the mobile app"),
        "privacy": ("my data", "privacy", "my personal information"),
        "support": ("your support", "getting help", "customer service"),
    }
)


def all_topics() -> tuple[Topic, ...]:
    """Every support topic, in a fixed order (the corpus generator depends on the order)."""
    from demo.topics_account import ACCOUNT_TOPICS
    from demo.topics_billing import BILLING_TOPICS

    return ACCOUNT_TOPICS + BILLING_TOPICS
