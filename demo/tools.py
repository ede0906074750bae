"""The demo model's tool-use skill: one tool, `lookup_order`, and the conversations that
teach it (a question about an order → a call; the tool's answer → a reply that uses it).

The text here is exactly what the chat template renders (`demo.tokenizer.CHAT_TEMPLATE`):
the tools as a leading system message, one JSON object per line after `Tools:`, and a call
as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes/Qwen form that
`app.openai.tools` parses). A test renders both ways and compares them.
"""

from __future__ import annotations

import json
import random
from typing import Any

LOOKUP_ORDER: dict[str, Any] = {
    "name": "lookup_order",
    "description": "Look up the status of an order by its id.",
    "parameters": {
        "type": "object",
        "properties": {"order_id": {"type": "string", "description": "The order id, e.g. A1234"}},
        "required": ["order_id"],
    },
}
TOOLS: tuple[dict[str, Any], ...] = (LOOKUP_ORDER,)

_ASKS = (
    "Where is my order {id}?",
    "Can you check the status of order {id}?",
    "What's happening with my order {id}?",
    "Has order {id} shipped yet?",
    "Please track order {id} for me.",
    "I placed order {id} last week. Where is it?",
    "Any news on order {id}?",
    "Could you look up order {id}, please?",
    "When will order {id} arrive?",
    "Status of order {id}?",
)
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_REPLIES = {
    "shipped": "Your order {id} has shipped and should arrive on {day}.",
    "processing": "Your order {id} is still being prepared. It should ship by {day}.",
    "delivered": "Your order {id} was delivered on {day}. Let me know if anything is missing.",
}


def tools_message(tools: tuple[dict[str, Any], ...] = TOOLS) -> str:
    """The system message the template writes for `tools` (function objects)."""
    return "Tools:" + "".join("\n" + json.dumps(t) for t in tools)


def call_text(name: str, arguments: dict[str, Any]) -> str:
    return (
        '<tool_call>{"name": '
        + json.dumps(name)
        + ', "arguments": '
        + json.dumps(arguments)
        + "}</tool_call>"
    )


def order_id(rng: random.Random) -> str:
    return rng.choice("ABCDEFGHKMNPRSTWXZ") + str(rng.randrange(1000, 10000))


def order_exchange(rng: random.Random) -> list[tuple[str, str]]:
    """(role, content) turns: the question, the call, the tool's result, the reply."""
    oid = order_id(rng)
    status = rng.choice(tuple(_REPLIES))
    day = rng.choice(_DAYS)
    result = json.dumps({"order_id": oid, "status": status, "eta": day})
    return [
        ("user", rng.choice(_ASKS).format(id=oid)),
        ("assistant", call_text("lookup_order", {"order_id": oid})),
        ("tool", result),
        ("assistant", _REPLIES[status].format(id=oid, day=day)),
    ]
