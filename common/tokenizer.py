"""Tokenizers: one small protocol, a character tokenizer for the built-in tasks, and an adapter
over a local Hugging Face tokenizer directory.

Both actor and learner turn text into token ids through :class:`Tokenizer` only, so the rest of
the code never depends on which kind is in use. Ids are plain Python ints; nothing here adds BOS
or EOS implicitly: the caller that builds a sequence decides where special tokens go.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

#: Characters of the built-in tasks (digits, operators, separators, lowercase letters). The order
#: fixes the ids of a :class:`CharTokenizer` built from it; a saved tokenizer stores its alphabet,
#: so changing this constant never breaks a checkpoint that was written with an older one.
BUILTIN_ALPHABET: str = "0123456789+-=># abcdefghijklmnopqrstuvwxyz"

#: File that marks a directory as holding a :class:`CharTokenizer`.
CHAR_TOKENIZER_FILE: str = "specrl_tokenizer.json"

#: Files any one of which marks a directory as holding a Hugging Face tokenizer.
HF_TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids, plus the special ids the engines and the learner need."""

    vocab_size: int
    """Number of distinct ids; every id produced by ``encode`` is in ``[0, vocab_size)``."""
    bos_id: int
    """Id prepended to a prompt by the caller that builds model inputs."""
    eos_id: int
    """Id that ends a completion; generation stops when it is sampled."""
    pad_id: int
    """Id used to right-pad batches; never contributes to a loss."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with no BOS/EOS added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens (pad/bos/eos) are skipped, never treated as a stop."""
        ...

    def save(self, directory: str | Path) -> None:
        """Write the tokenizer into ``directory`` so that :func:`load_tokenizer` reads it back."""
        ...


class CharTokenizer:
    """One id per character of ``alphabet``, after the three special ids.

    Layout: ``0 = pad``, ``1 = bos``, ``2 = eos``, then ``alphabet[i]`` has id ``3 + i``. It is
    exact (decode(encode(s)) == s for any s over the alphabet), which keeps the reward of the
    built-in tasks free of tokenization artefacts.
    """

    NUM_SPECIAL: int = 3

    def __init__(self, alphabet: str) -> None:
        if not alphabet:
            raise ValueError("CharTokenizer needs a non-empty alphabet")
        duplicates = sorted(ch for ch, count in Counter(alphabet).items() if count > 1)
        if duplicates:
            raise ValueError(
                f"CharTokenizer alphabet has duplicate characters {duplicates!r}; "
                "each character must map to exactly one id"
            )
        self.alphabet = alphabet
        self.vocab_size = self.NUM_SPECIAL + len(alphabet)
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2  # the layout above
        self._char_to_id = {ch: self.NUM_SPECIAL + i for i, ch in enumerate(alphabet)}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for position, ch in enumerate(text):
            token_id = self._char_to_id.get(ch)
            if token_id is None:
                raise ValueError(
                    f"character {ch!r} at position {position} of {text!r} is not in the "
                    f"tokenizer alphabet {self.alphabet!r}"
                )
            ids.append(token_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Characters of ``ids``, skipping pad/bos/eos; an id outside the vocabulary is an error."""
        chars: list[str] = []
        for token_id in ids:
            token_id = int(token_id)
            if token_id < self.NUM_SPECIAL:
                if token_id < 0:
                    raise ValueError(f"token id {token_id} is negative")
                continue
            if token_id >= self.vocab_size:
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary (vocab_size={self.vocab_size})"
                )
            chars.append(self.alphabet[token_id - self.NUM_SPECIAL])
        return "".join(chars)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        payload = {
            "kind": "char",
            "alphabet": self.alphabet,
            "pad_id": self.pad_id,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "vocab_size": self.vocab_size,
        }
        (directory / CHAR_TOKENIZER_FILE).write_text(
            json.dumps(payload, ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
        )

    @classmethod
    def from_file(cls, path: str | Path) -> CharTokenizer:
        """Read a tokenizer written by :meth:`save`; checks that the stored ids match the layout."""
        path = Path(path)
        try:
            payload: Any = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from err
        if not isinstance(payload, dict) or payload.get("kind") != "char":
            raise ValueError(f"{path} does not describe a char tokenizer (expected kind 'char')")
        alphabet = payload.get("alphabet")
        if not isinstance(alphabet, str):
            raise ValueError(f"{path}: 'alphabet' must be a string, got {alphabet!r}")
        tokenizer = cls(alphabet)
        # The special ids are fixed by the class; a file that disagrees was written by something
        # else, and silently using other ids would corrupt every trained sequence.
        for key in ("pad_id", "bos_id", "eos_id", "vocab_size"):
            if key in payload and payload[key] != getattr(tokenizer, key):
                raise ValueError(
                    f"{path}: {key}={payload[key]!r} does not match the char tokenizer layout "
                    f"({key}={getattr(tokenizer, key)})"
                )
        return tokenizer

    def __repr__(self) -> str:
        return f"CharTokenizer(alphabet={self.alphabet!r})"


class HFTokenizer:
    """Adapter over a Hugging Face tokenizer stored in a local directory (never downloads).

    ``bos_id``/``eos_id``/``pad_id`` come from the tokenizer; a missing pad falls back to EOS
    (padding is masked out, so any valid id works) and a missing BOS falls back to EOS too
    (e.g. Qwen tokenizers define no BOS and use their end-of-text token as a separator).
    """

    def __init__(self, directory: str | Path) -> None:
        # Imported here so that processes using only the char tokenizer do not pay for it.
        from transformers import AutoTokenizer

        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"Hugging Face tokenizer directory {directory} does not exist")
        self.directory = directory
        self._tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        eos_id = self._tokenizer.eos_token_id
        if eos_id is None:
            raise ValueError(
                f"tokenizer in {directory} defines no EOS token; generation could never stop"
            )
        self.eos_id: int = int(eos_id)
        bos_id = self._tokenizer.bos_token_id
        self.bos_id: int = self.eos_id if bos_id is None else int(bos_id)
        pad_id = self._tokenizer.pad_token_id
        self.pad_id: int = self.eos_id if pad_id is None else int(pad_id)
        # len() counts added tokens too; `.vocab_size` of HF tokenizers excludes them.
        self.vocab_size: int = len(self._tokenizer)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped, no whitespace clean-up (exact round trip)."""
        return self._tokenizer.decode(
            [int(i) for i in ids],
            skip_special_tokens=True,
            clean_up_tokenization_spaces=False,
        )

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer carries a chat template (``apply_chat_template`` can run)."""
        return bool(getattr(self._tokenizer, "chat_template", None))

    def encode_chat(self, prompt: str, system_prompt: str = "") -> list[int]:
        """Ids of ``prompt`` as one user turn in the chat template, ready for the assistant's
        reply: exactly ``apply_chat_template(messages, add_generation_prompt=True)``, with a
        system message first when ``system_prompt`` is given. The template decides any BOS."""
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        ids: Any = self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # a BatchEncoding where return_dict defaults to True
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tokenizer.save_pretrained(str(directory))

    def __repr__(self) -> str:
        return f"HFTokenizer(directory={str(self.directory)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer stored in ``model_dir``: a :class:`CharTokenizer` if it holds
    ``CHAR_TOKENIZER_FILE``, else an :class:`HFTokenizer` if it holds a ``HF_TOKENIZER_FILES``."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"cannot load a tokenizer: directory {model_dir} does not exist")
    char_file = model_dir / CHAR_TOKENIZER_FILE
    if char_file.is_file():
        return CharTokenizer.from_file(char_file)
    if any((model_dir / name).is_file() for name in HF_TOKENIZER_FILES):
        return HFTokenizer(model_dir)
    looked_for = ", ".join((CHAR_TOKENIZER_FILE, *HF_TOKENIZER_FILES))
    raise FileNotFoundError(f"no tokenizer found in {model_dir}: looked for any of {looked_for}")


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Prompt ids as the policy sees them: BOS, then the text. Actors and the warm start share it,
    so the RL prompts match the supervised ones token for token."""
    return [tokenizer.bos_id, *tokenizer.encode(text)]
