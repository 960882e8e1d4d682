"""Token-in, token-out glue between model turns and environment messages (multi-turn episodes).

An episode is one token stream: the first prompt, then model turns and the environment's
messages in between. Sampled tokens are never decoded and re-encoded into the history; after a
model turn the next prompt is the previous ids, the sampled ids (plus end-of-turn glue when the
turn was cut by its budget, :func:`cut_turn_glue`) and the *bridge*: the chat template's text
after the assistant's end-of-turn, i.e. the environment message(s) and the generation prompt.

- :class:`ChatBridge` (a Hugging Face tokenizer with a chat template): the bridge is the text
  that rendering the conversation *with* the new environment messages adds after rendering it
  *without* them (all messages of one environment step rendered together), cut right after the
  assistant's end-of-turn token. The template's own glue is tokenised normally; the
  environment's content with ``split_special_tokens=True``, so a literal ``<|im_end|>`` in an
  observation becomes plain text tokens, never a turn boundary.
- :class:`CharBridge` (the built-in char tokenizer): the bridge is ``encode(observation)``,
  exact by construction.
- :func:`probe_bridge`: on fixed probe conversations, ``encode(full render) ==
  encode(render up to the end-of-turn) + bridge ids``; a template that rewrites history (Qwen3
  dropping earlier ``<think>`` blocks) is refused with :class:`BridgeError`, naming the template
  and the first differing token.

Observations are capped at ``max_obs_chars`` characters per message (head kept, then
``…[truncated N chars]``) and ``max_obs_tokens`` content tokens per environment step.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.tokenizer import CharTokenizer, HFTokenizer, Tokenizer

Message = dict[str, str]
Observation = str | Sequence[Mapping[str, Any]]

TRUNCATED_CHARS = "…[truncated {n} chars]"
TRUNCATED_TOKENS = "…[truncated {n} tokens]"
CHAR_TRUNCATED = "#truncated {n} chars#"
"""The char tokenizer's marker: only characters of ``BUILTIN_ALPHABET``."""

_SENTINEL = re.compile("\ue000(\\d+)\ue001")
"""Stands in for a message's content while rendering (private-use characters no tokenizer
merges with their neighbours and no template rewrites)."""


class BridgeError(ValueError):
    """A chat template the turn-by-turn bridge cannot follow exactly (refused at start)."""


class ObservationError(ValueError):
    """An observation the bridge cannot turn into tokens (not text or messages, a character
    the char tokenizer lacks): the environment answered something invalid."""


@dataclass(frozen=True)
class Bridged:
    """Ids to append, and how many characters or tokens the caps cut off (0: none)."""

    ids: list[int]
    truncated: int = 0


def sentinel(index: int) -> str:
    return f"\ue000{index}\ue001"


def truncate_text(text: str, max_chars: int, marker: str = TRUNCATED_CHARS) -> tuple[str, int]:
    """``text`` cut to its first ``max_chars`` characters with ``marker`` (``{n}``: how many
    were dropped) appended, and that count; unchanged (and 0) when it fits."""
    if len(text) <= max_chars:
        return text, 0
    dropped = len(text) - max_chars
    return text[:max_chars] + marker.format(n=dropped), dropped


def as_messages(obs: Observation, role: str) -> list[Message]:
    """An observation as chat messages: text becomes one message in ``role``; a list of
    ``{"role", "content"}`` messages (both strings) is taken as it is."""
    if isinstance(obs, str):
        return [{"role": role, "content": obs}]
    if not isinstance(obs, Sequence) or not obs:
        raise ObservationError(
            f"an observation must be text or a non-empty list of messages, got {obs!r:.80}"
        )
    out = []
    for message in obs:
        if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
            raise ObservationError(
                f"an observation message must be {{'role': str, 'content': str}}, got "
                f"{message!r:.80}"
            )
        role_, content = message["role"], message["content"]
        if not isinstance(role_, str) or not role_ or not isinstance(content, str):
            raise ObservationError(f"message role and content must be strings: {message!r:.80}")
        out.append({"role": role_, "content": content})
    return out


class CharBridge:
    """The char tokenizer's bridge: no chat template, the observation's characters as they are."""

    def __init__(self, tokenizer: CharTokenizer, max_obs_chars: int, max_obs_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_obs_chars = max_obs_chars
        self.max_obs_tokens = max_obs_tokens
        self.eot_ids = [tokenizer.eos_id]

    def first_prompt_ids(self, obs: Observation) -> Bridged:
        """BOS, then the initial observation (as ``encode_prompt`` builds single-turn prompts)."""
        bridged = self.bridge_ids(obs)
        return Bridged([self.tokenizer.bos_id, *bridged.ids], bridged.truncated)

    def bridge_ids(self, obs: Observation) -> Bridged:
        """``encode`` of the observation's text (a message list: its contents in order)."""
        contents = [m["content"] for m in as_messages(obs, "user")]
        text, dropped = "", 0
        for content in contents:
            kept, cut = truncate_text(content, self.max_obs_chars, CHAR_TRUNCATED)
            text, dropped = text + kept, dropped + cut
        try:
            ids = self.tokenizer.encode(text)
        except ValueError as err:
            raise ObservationError(str(err)) from err
        if len(ids) > self.max_obs_tokens:
            over = len(ids) - self.max_obs_tokens
            ids = ids[: self.max_obs_tokens] + self.tokenizer.encode(CHAR_TRUNCATED.format(n=over))
            dropped += over
        return Bridged(ids, dropped)


def hf_backend(tokenizer: Any) -> Any:
    """The ``transformers`` tokenizer behind ``tokenizer`` (an :class:`HFTokenizer`, or one
    already)."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer._tokenizer
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise BridgeError(f"{tokenizer!r} is not a Hugging Face tokenizer")
    return tokenizer


def template_name(backend: Any) -> str:
    """The chat template as error messages name it: the tokenizer's path and the template's hash."""
    template = str(getattr(backend, "chat_template", "") or "")
    digest = hashlib.sha256(template.encode()).hexdigest()[:12]
    where = getattr(backend, "name_or_path", "") or type(backend).__name__
    return f"{where} (template sha256 {digest})"


_SLOW_TOKENIZER_LOCK = threading.Lock()
"""Serialises a slow (Python) tokenizer's encodes, whose special-token splitting is per call
state (:class:`ChatBridge`)."""


def _fixed_rust(backend: Any, split: bool) -> Any:
    """A private copy of ``backend``'s fast (Rust) tokenizer whose special-token splitting is
    fixed to ``split``; None for a tokenizer without one."""
    rust = getattr(backend, "_tokenizer", None)
    if rust is None or not hasattr(rust, "encode_special_tokens"):
        return None
    copy = type(rust).from_str(rust.to_str())
    copy.encode_special_tokens = split
    return copy


class ChatBridge:
    """The bridge of a Hugging Face tokenizer's chat template (see the module docstring)."""

    PLACEHOLDER_USER = "Begin."

    def __init__(
        self,
        tokenizer: Any,
        *,
        obs_role: str = "user",
        max_obs_chars: int = 16384,
        max_obs_tokens: int = 512,
        system_prompt: str = "",
    ) -> None:
        self.backend = hf_backend(tokenizer)
        if not getattr(self.backend, "chat_template", None):
            raise BridgeError(f"tokenizer {template_name(self.backend)} has no chat template")
        self.name = template_name(self.backend)
        self.obs_role = obs_role
        self.max_obs_chars = max_obs_chars
        self.max_obs_tokens = max_obs_tokens
        self.system_prompt = system_prompt
        added = getattr(self.backend, "added_tokens_decoder", {}) or {}
        specials = {str(t) for t in self.backend.all_special_tokens}
        specials |= {str(t.content) for t in added.values() if getattr(t, "special", False)}
        self._specials = sorted((t for t in specials if t), key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, self._specials)) or "(?!)")
        # Two copies of the fast tokenizer, one per setting of its special-token splitting: the
        # setting is state of the tokenizer object, which the runner's threads share, so a
        # per-call toggle could run one thread's template under another's content setting (a
        # forged `<|im_end|>` becoming the real id). Without a fast tokenizer: one lock.
        self._template_rust = _fixed_rust(self.backend, split=False)
        self._content_rust = _fixed_rust(self.backend, split=True)
        self._strips_content = self._content_stripping()
        self._history = [
            *self.system_messages(),
            {"role": "user", "content": self.PLACEHOLDER_USER},
        ]
        prefix, eot_text = self.cut_after_turn([*self._history, self._placeholder_reply()])
        self._prefix = prefix
        self.eot_ids = self.encode(eot_text)

    def system_messages(self) -> list[Message]:
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    @staticmethod
    def _placeholder_reply() -> Message:
        return {"role": "assistant", "content": sentinel(0)}

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        text = self.backend.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        """Template text: special-token strings become their ids."""
        if self._template_rust is not None:
            return list(self._template_rust.encode(text, add_special_tokens=False).ids)
        with _SLOW_TOKENIZER_LOCK:
            return [int(i) for i in self.backend.encode(text, add_special_tokens=False)]

    def encode_content(self, text: str) -> list[int]:
        """Environment text: special-token strings are split into plain text tokens."""
        if self._content_rust is not None:
            return list(self._content_rust.encode(text, add_special_tokens=False).ids)
        with _SLOW_TOKENIZER_LOCK:
            out = self.backend(text, add_special_tokens=False, split_special_tokens=True)
            return [int(i) for i in out["input_ids"]]

    def cut_after_turn(self, messages: Sequence[Message]) -> tuple[str, str]:
        """The render of ``messages`` (ending with an assistant turn whose content is
        ``sentinel(0)`` or its real text) up to and including the end-of-turn token that follows
        the last assistant content, and that end-of-turn text."""
        reply = messages[-1]["content"]
        text = self.render(messages, add_generation_prompt=False)
        start = text.rfind(reply)
        if messages[-1]["role"] != "assistant" or start < 0:
            raise BridgeError(f"chat template {self.name} does not render the assistant's reply")
        end = start + len(reply)
        hits = [(text.find(s, end), s) for s in self._specials if text.find(s, end) >= 0]
        if not hits:
            raise BridgeError(
                f"chat template {self.name} puts no special end-of-turn token after the "
                "assistant's reply; the turn boundary cannot be found"
            )
        at, token = min(hits)
        cut = at + len(token)
        return text[:cut], text[end:cut]

    def first_prompt_ids(self, obs: Observation) -> Bridged:
        """The first prompt: the system prompt (if any) and the initial observation as the user
        message, rendered with the generation prompt (``encode_chat``'s text)."""
        return self._render_ids(self.system_messages(), as_messages(obs, "user"), bridge=False)

    def bridge_ids(self, obs: Observation) -> Bridged:
        """Ids that follow a model turn's end-of-turn: the observation's messages (one
        environment step, rendered together) and the generation prompt."""
        history = [*self._history, self._placeholder_reply()]
        return self._render_ids(history, as_messages(obs, self.obs_role), bridge=True)

    def _render_ids(self, fixed: list[Message], env: list[Message], bridge: bool) -> Bridged:
        """Render ``fixed`` then ``env`` (contents capped) and tokenise the text as one string,
        except that a special-token string inside an ``env`` content is tokenised as plain text
        (:meth:`encode_content`). For a bridge, only the text after the placeholder history's
        end-of-turn is kept (it starts after a special token, so it tokenises on its own)."""
        contents, dropped = self._capped_contents(env)
        shown = list(fixed)
        shown += [{"role": m["role"], "content": sentinel(i + 1)} for i, m in enumerate(env)]
        text = self.render(shown, add_generation_prompt=True)
        if bridge:
            if not text.startswith(self._prefix):
                raise BridgeError(
                    f"chat template {self.name} re-renders the history when an environment "
                    "message follows the assistant's turn; turn-by-turn ids would differ"
                )
            text = text[len(self._prefix) :]
        return Bridged(self._pieces_to_ids(text, contents), dropped)

    def _capped_contents(self, env: list[Message]) -> tuple[list[str], int]:
        """The contents of one environment step: each cut to ``max_obs_chars``, then together
        to about ``max_obs_tokens`` tokens (head kept, a marker appended); and how many
        characters and tokens were dropped."""
        contents, dropped, budget = [], 0, self.max_obs_tokens
        for message in env:
            kept, cut = truncate_text(message["content"], self.max_obs_chars)
            kept = kept.strip() if self._strips_content else kept
            ids = self.encode_content(kept)
            if len(ids) > budget:
                over = len(ids) - budget
                kept = self.backend.decode(ids[:budget]) + TRUNCATED_TOKENS.format(n=over)
                cut += over
                ids = ids[:budget]
            budget -= len(ids)
            contents.append(kept)
            dropped += cut
        return contents, dropped

    def _content_stripping(self) -> bool:
        """Whether the template strips whitespace around a message's content (Llama 3's
        ``| trim``); a template that changes content otherwise is refused."""
        padded = f" {sentinel(1)}\n"
        text = self.render([{"role": "user", "content": padded}], add_generation_prompt=True)
        if padded in text:
            return False
        if sentinel(1) in text:
            return True
        raise BridgeError(f"chat template {self.name} rewrites message content")

    def _pieces_to_ids(self, text: str, contents: list[str]) -> list[int]:
        """Ids of ``text`` with each sentinel replaced by its content: plain text runs are
        tokenised together; special-token strings inside contents as plain text."""
        runs: list[tuple[str, bool]] = []  # (text, forged special-token string)
        position = 0
        for match in _SENTINEL.finditer(text):
            index = int(match.group(1))
            if not 1 <= index <= len(contents):
                raise BridgeError(f"chat template {self.name} rendered an unknown placeholder")
            runs.append((text[position : match.start()], False))
            content, at = contents[index - 1], 0
            for forged in self._special_pattern.finditer(content):
                runs += [(content[at : forged.start()], False), (forged.group(0), True)]
                at = forged.end()
            runs.append((content[at:], False))
            position = match.end()
        runs.append((text[position:], False))
        ids: list[int] = []
        plain = ""
        for piece, forged in runs:
            if not forged:
                plain += piece
                continue
            ids += self.encode(plain) + self.encode_content(piece)
            plain = ""
        return ids + self.encode(plain)


def cut_turn_glue(bridge: ChatBridge | CharBridge, turn_length: str) -> list[int] | None:
    """After a turn cut by its token budget: ``close`` gives the end-of-turn id(s) to append as
    environment tokens (the episode goes on); ``end`` gives None (the episode stops)."""
    if turn_length == "close":
        return list(bridge.eot_ids)
    if turn_length == "end":
        return None
    raise ValueError(f"turn_length must be close or end, got {turn_length!r}")


PROBE_CONVERSATIONS: tuple[tuple[Message, ...], ...] = (
    (
        {"role": "user", "content": "What is 2 + 3? Answer with a number."},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nThe answer is 5."},
        {"role": "user", "content": "Correct. Now 7 * 6?"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "Right: 42 (forty-two)."},
    ),
    (
        {"role": "user", "content": "Look up the weather in Paris."},
        {"role": "assistant", "content": 'call weather(city="Paris")'},
        {"role": "tool", "content": '{"temp": 21, "unit": "C"}'},
        {"role": "tool", "content": '{"wind": 3}\n'},
        {"role": "assistant", "content": "It is 21 degrees with a light wind."},
        {"role": "user", "content": "Thanks!\nAnd tomorrow?"},
    ),
)
"""Conversations :func:`probe_bridge` renders in full and turn by turn: a reasoning block in an
earlier turn (templates that drop it from history fail), several turns, two consecutive tool
messages in one environment step, one ending in a newline (templates that trim a message only
once it is history fail)."""


def first_difference(bridge: ChatBridge, expected: Sequence[int], got: Sequence[int]) -> str:
    """Where two id lists part, with the tokens at that position."""
    at = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
    at = min(len(expected), len(got)) if at is None else at

    def token(ids: Sequence[int]) -> str:
        if at >= len(ids):
            return "(end)"
        return repr(bridge.backend.convert_ids_to_tokens([ids[at]])[0])

    return f"at token {at} the full render has {token(expected)}, turn by turn gives {token(got)}"


def probe_conversation(bridge: ChatBridge, conversation: Sequence[Message], label: str) -> None:
    """Check the first prompt and every bridge of ``conversation`` against full renders: each
    bridge alone (the render up to the turn's end, then the bridge's ids), and the stream as an
    episode builds it (the first prompt, then per turn the reply's ids, the end of turn and the
    bridge's ids), which a template that renders an earlier message differently once it is no
    longer the last one (trimmed, its reasoning dropped) cannot match."""
    messages = [dict(m) for m in conversation]
    first_reply = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    system = bridge.system_messages()
    full = bridge.render([*system, *messages[:first_reply]], add_generation_prompt=True)
    expected, got = bridge.encode(full), bridge.first_prompt_ids(messages[:first_reply]).ids
    if expected != got:
        raise BridgeError(
            f"chat template {bridge.name} fails the bridge probe ({label}, first prompt): "
            f"{first_difference(bridge, expected, got)}"
        )
    stream = list(got)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for turn, at in enumerate(replies):
        nxt = next((i for i in replies if i > at), len(messages))
        env = messages[at + 1 : nxt]
        if not env:
            continue
        history = [*system, *messages[: at + 1]]
        prefix, _ = bridge.cut_after_turn(history)
        full = bridge.render([*history, *env], add_generation_prompt=True)
        expected = bridge.encode(full)
        bridged = bridge.bridge_ids(env).ids
        got = bridge.encode(prefix) + bridged
        stream += [*bridge.encode(messages[at]["content"]), *bridge.eot_ids, *bridged]
        if expected != got or not full.startswith(prefix) or stream != expected:
            alone = expected == got and full.startswith(prefix)
            rewrites = (
                " (it rewrites earlier turns)" if alone or not full.startswith(prefix) else ""
            )
            raise BridgeError(
                f"chat template {bridge.name} fails the bridge probe{rewrites} ({label}, after "
                f"model turn {turn + 1}): "
                f"{first_difference(bridge, expected, stream if alone else got)}; the "
                "turn-by-turn token stream would not be what the template renders"
            )


def probe_bridge(
    bridge: ChatBridge, conversations: Sequence[Sequence[Message]] = PROBE_CONVERSATIONS
) -> None:
    """Refuse (:class:`BridgeError`) a template whose turn-by-turn ids differ from its full
    render on any of ``conversations``. The caps are lifted for the probe."""
    probe = uncapped(bridge)
    for index, conversation in enumerate(conversations):
        probe_conversation(probe, conversation, f"probe conversation {index}")


def uncapped(bridge: ChatBridge) -> ChatBridge:
    """``bridge`` with its observation caps lifted (a probe compares whole renders)."""
    return ChatBridge(
        bridge.backend,
        obs_role=bridge.obs_role,
        max_obs_chars=1 << 30,
        max_obs_tokens=1 << 30,
        system_prompt=bridge.system_prompt,
    )


def make_bridge(
    tokenizer: Tokenizer,
    *,
    obs_role: str = "user",
    max_obs_chars: int = 16384,
    max_obs_tokens: int = 512,
    system_prompt: str = "",
    check: bool = True,
) -> ChatBridge | CharBridge:
    """The bridge of ``tokenizer``: :class:`CharBridge` for the char tokenizer, else a
    :class:`ChatBridge` over its chat template, probed first when ``check``."""
    if isinstance(tokenizer, CharTokenizer):
        if system_prompt:
            raise BridgeError("a system prompt needs a chat template; the char tokenizer has none")
        return CharBridge(tokenizer, max_obs_chars, max_obs_tokens)
    bridge = ChatBridge(
        tokenizer,
        obs_role=obs_role,
        max_obs_chars=max_obs_chars,
        max_obs_tokens=max_obs_tokens,
        system_prompt=system_prompt,
    )
    if check:
        probe_bridge(bridge)
    return bridge
