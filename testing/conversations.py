"""Random chat conversations for the chat bridge's checks (``common/chat_bridge.py``): text with
leading and trailing whitespace, newlines, non-ASCII characters and JSON; one or two
environment messages (``user`` or ``tool``) after each assistant reply."""

from __future__ import annotations

import random

WORDS = ["the", "Answer", "42", "x=3.5", "(ok)", "é", "→", '{"a": 1}', "tool", "\n", "  "]


def random_text(rng: random.Random, leading_space: bool = True) -> str:
    text = "".join(
        rng.choice(WORDS) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(1, 8))
    )
    return text if leading_space else text.strip() or "ok"


def random_conversation(rng: random.Random) -> list[dict]:
    messages = [{"role": "user", "content": random_text(rng)}]
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "assistant", "content": random_text(rng, leading_space=False)})
        for _ in range(rng.randint(1, 2)):  # one or two messages in one environment step
            messages.append({"role": rng.choice(["user", "tool"]), "content": random_text(rng)})
    return messages
