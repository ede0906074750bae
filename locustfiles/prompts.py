"""The texts the load users send: short support questions, and for the prefix-heavy user a
long shared system prompt plus a few fixed knowledge-base articles (RAG-like context).

The articles are fixed (built the same way every run), so every request that picks article
k shares the system prompt and article k as a prefix with the requests before it: a server
with prefix caching prefills that prefix once per replica and then reads it from its cache.
Each prompt (system + article + question) stays well under 2048 tokens, the demo model's
context length.
"""

from __future__ import annotations

ARTICLES = 4  # how many fixed contexts the prefix-heavy user picks from
QUESTIONS = (
    "Can I pause my annual subscription?",
    "How do I reset my password?",
    "Why was I charged twice this month?",
    "Where can I download my invoices?",
    "How do I export all of my data?",
    "Could you help me change the email on my account, please?",
)

SYSTEM_PROMPT = " ".join(
    (
        "You are the customer support assistant of an online subscription service.",
        "Answer the customer's question using the knowledge base article given with it.",
        "Keep every answer short, polite and precise; use plain sentences, no lists.",
        "If the article does not answer the question, say so and offer to open a ticket.",
        "Never ask for a full card number or a password; never promise a refund the article",
        "does not allow. Refer to settings pages by the names the article uses.",
        "Customers may write in a hurry or be upset: acknowledge the problem first, then",
        "give the steps. Times are in the customer's own time zone unless stated otherwise.",
        "Plans are Basic, Plus and Team; billing is monthly or annual; invoices are issued",
        "on the billing date and can be downloaded from the Billing page for seven years.",
    )
)

_SUBJECTS = ("subscription", "billing", "account security", "data export", "team seats")
_FACTS = (
    "Changes to the {s} take effect at the start of the next billing period.",
    "The {s} settings are on the Account page, under the section of the same name.",
    "Only the account owner can change the {s}; team members see it read-only.",
    "A confirmation email is sent to the account's address after every {s} change.",
    "Support can review {s} changes made in the last ninety days on request.",
    "Customers on the Team plan manage the {s} for every seat from the admin console.",
    "The {s} history lists each change with its date, the person who made it and why.",
    "If the {s} page shows an error, signing out and in again usually clears it.",
    "Requests about the {s} are answered within one business day by email.",
    "The mobile app shows the {s} but changes must be made on the website.",
)


def article(index: int) -> str:
    """Knowledge-base article `index` (the same text every run): about 1.8 KB, some 550
    tokens of the demo model (with the system prompt and a question: 800-900)."""
    subject = _SUBJECTS[index % len(_SUBJECTS)]
    rotation = index % len(_FACTS)
    facts = _FACTS[rotation:] + _FACTS[:rotation]
    sections = [
        f"Section {part + 1}. " + " ".join(f.format(s=subject) for f in facts[part::2])
        for part in range(2)
    ]
    title = f"Knowledge base article {100 + index}: managing your {subject}."
    return "\n".join((title, *sections, *sections[::-1]))


def rag_messages(index: int, question: str) -> list[dict[str, str]]:
    """The shared system prompt, article `index` as context, then `question`."""
    context = f"Article:\n{article(index)}\n\nQuestion: {question}"
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": context}]
