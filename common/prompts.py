"""How a task's prompt text becomes the ids the policy generates from: BOS and the text, or
the tokenizer's chat template (``task.chat_template``, ``task.system_prompt``). The actors use
it, and so does the draft warm-up, which must sample the prompts the actors will."""

from __future__ import annotations

from collections.abc import Callable

from common.config.modes import CHAT_TEMPLATE_MODES
from common.tokenizer import HFTokenizer, Tokenizer, encode_prompt


def prompt_encoder(
    tokenizer: Tokenizer,
    chat_template: str = "auto",
    system_prompt: str = "",
    dataset: bool = False,
) -> Callable[[str], list[int]]:
    """The function that turns a task's prompt text into the ids the policy generates from.

    ``chat_template``: ``true`` (the tokenizer must have one), ``false``, or ``auto`` (when it
    has one and the prompts come from a data set). With the template:
    :meth:`~common.tokenizer.HFTokenizer.encode_chat` (system message optional); without:
    :func:`~common.tokenizer.encode_prompt` (BOS, then the text). The actor ships the ids in the
    group, so the behaviour log-probs and the learner see the same tokens.
    """
    if chat_template not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"chat_template must be one of auto, true, false; got {chat_template!r}")
    available = isinstance(tokenizer, HFTokenizer) and tokenizer.has_chat_template
    if chat_template == "true" and not available:
        raise ValueError(
            f"task.chat_template=true, but the tokenizer {tokenizer!r} has no chat template"
        )
    if isinstance(tokenizer, HFTokenizer) and (
        chat_template == "true" or (chat_template == "auto" and dataset and available)
    ):
        hf = tokenizer
        return lambda text: hf.encode_chat(text, system_prompt)
    if system_prompt:
        raise ValueError(
            "task.system_prompt is set, but prompts are not formatted with a chat template "
            f"(task.chat_template={chat_template}, tokenizer {tokenizer!r}); a system prompt "
            "needs one"
        )
    return lambda text: encode_prompt(tokenizer, text)
