"""Random chat conversations for the chat bridge's checks (``common/chat_bridge.py``): text with
leading and trailing whitespace, newlines, non-ASCII characters and JSON; one or two
environment messages (``user`` or ``tool``) after each assistant reply."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.tokenizer import HFTokenizer

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


HISTORY_TRIMMING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.last %}{% set content = message['content'] %}"
    "{% else %}{% set content = message['content'] | trim %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Trims a message once it is no longer the last one: each bridge alone matches its render, but
the stream an episode builds (the observation as it came) is not what the template renders."""


def history_trimming_tokenizer(directory: Path) -> HFTokenizer:
    """The ChatML fixture tokenizer (``testing/own_model.py``) with that template."""
    from common.tokenizer import HFTokenizer
    from testing.own_model import build_tokenizer

    raw = build_tokenizer(directory, chat_template=False)
    raw.chat_template = HISTORY_TRIMMING_TEMPLATE
    raw.save_pretrained(str(directory))
    return HFTokenizer(directory)
