"""Tokenizers: char layout and round trips, HF adapter on a locally built tokenizer, save/load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from common.prompts import prompt_encoder
from common.tokenizer import (
    BUILTIN_ALPHABET,
    CHAR_TOKENIZER_FILE,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    encode_prompt,
    load_tokenizer,
)
from ops.launcher import directory_has_chat_template
from testing.own_model import build_tokenizer

# ---------------------------------------------------------------------------------------------
# CharTokenizer
# ---------------------------------------------------------------------------------------------


def test_char_layout_special_ids_first() -> None:
    tokenizer = CharTokenizer("ab")
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    assert tokenizer.vocab_size == 5
    assert tokenizer.encode("ba") == [4, 3]


def test_builtin_alphabet_covers_task_characters() -> None:
    for ch in "0123456789+=> #abcxyz":
        assert ch in BUILTIN_ALPHABET
    assert len(set(BUILTIN_ALPHABET)) == len(BUILTIN_ALPHABET)


@pytest.mark.parametrize(
    "text", ["", "0", "123+45=", "4821>1284", "#### 12 ab z", BUILTIN_ALPHABET]
)
def test_char_round_trip(text: str) -> None:
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)
    assert all(3 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_char_encode_adds_no_special_tokens() -> None:
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    ids = tokenizer.encode("12")
    assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids


def test_char_decode_skips_special_ids_without_stopping() -> None:
    tokenizer = CharTokenizer("abc")
    a, b, c = tokenizer.encode("abc")
    ids = [tokenizer.bos_id, a, tokenizer.eos_id, b, tokenizer.pad_id, c, tokenizer.pad_id]
    assert tokenizer.decode(ids) == "abc"


def test_char_unknown_character_error_names_it() -> None:
    tokenizer = CharTokenizer("0123456789")
    with pytest.raises(ValueError, match=r"'x' at position 2"):
        tokenizer.encode("12x4")


def test_char_decode_rejects_out_of_vocab_id() -> None:
    tokenizer = CharTokenizer("ab")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([3, 5])
    with pytest.raises(ValueError, match="negative"):
        tokenizer.decode([-1])


@pytest.mark.parametrize("alphabet", ["abca", "0011"])
def test_char_refuses_duplicate_characters(alphabet: str) -> None:
    with pytest.raises(ValueError, match="duplicate"):
        CharTokenizer(alphabet)


def test_char_refuses_empty_alphabet() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        CharTokenizer("")


def test_char_satisfies_protocol() -> None:
    assert isinstance(CharTokenizer("ab"), Tokenizer)


def test_char_save_writes_json_and_loads_back(tmp_path: Path) -> None:
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    tokenizer.save(tmp_path / "model")
    payload = json.loads((tmp_path / "model" / CHAR_TOKENIZER_FILE).read_text())
    assert payload == {
        "kind": "char",
        "alphabet": BUILTIN_ALPHABET,
        "pad_id": 0,
        "bos_id": 1,
        "eos_id": 2,
        "vocab_size": 3 + len(BUILTIN_ALPHABET),
    }
    loaded = load_tokenizer(tmp_path / "model")
    assert isinstance(loaded, CharTokenizer)
    assert loaded.alphabet == BUILTIN_ALPHABET
    assert loaded.encode("12+3=") == tokenizer.encode("12+3=")


def test_char_load_rejects_mismatched_special_ids(tmp_path: Path) -> None:
    payload = {"kind": "char", "alphabet": "ab", "pad_id": 0, "bos_id": 1, "eos_id": 7}
    (tmp_path / CHAR_TOKENIZER_FILE).write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="eos_id=7"):
        load_tokenizer(tmp_path)


def test_char_load_rejects_wrong_kind(tmp_path: Path) -> None:
    (tmp_path / CHAR_TOKENIZER_FILE).write_text(json.dumps({"kind": "bpe", "alphabet": "ab"}))
    with pytest.raises(ValueError, match="kind 'char'"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------------------------------------
# HFTokenizer on a tokenizer trained in memory (no downloads)
# ---------------------------------------------------------------------------------------------

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "12 + 34 = 46",
    "#### 1,000",
    "hello world, hello tokenizer",
]


def _build_hf_tokenizer(directory: Path, with_pad: bool = True) -> Path:
    """Train a byte-level BPE on a few strings and save it as a HF tokenizer directory."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>"] if with_pad else ["<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(_CORPUS, trainer=trainer)
    extra = {"pad_token": "<pad>"} if with_pad else {}
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", **extra
    )
    wrapped.save_pretrained(str(directory))
    return directory


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    return _build_hf_tokenizer(tmp_path / "hf")


def test_hf_special_ids_from_tokenizer(hf_dir: Path) -> None:
    tokenizer = HFTokenizer(hf_dir)
    assert isinstance(tokenizer, Tokenizer)
    # Special tokens were registered first, in this order, by the trainer.
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    assert tokenizer.vocab_size > 256


def test_hf_pad_falls_back_to_eos(tmp_path: Path) -> None:
    tokenizer = HFTokenizer(_build_hf_tokenizer(tmp_path / "nopad", with_pad=False))
    assert tokenizer.pad_id == tokenizer.eos_id


@pytest.mark.parametrize(
    "text", ["hello world", "12 + 34 = 46", "  leading and trailing  ", "unseen wörds ✓", ""]
)
def test_hf_round_trip(hf_dir: Path, text: str) -> None:
    tokenizer = HFTokenizer(hf_dir)
    ids = tokenizer.encode(text)
    assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids
    assert tokenizer.decode(ids) == text


def test_hf_decode_skips_special_tokens(hf_dir: Path) -> None:
    tokenizer = HFTokenizer(hf_dir)
    ids = tokenizer.encode("hello world")
    wrapped = [tokenizer.bos_id, *ids, tokenizer.eos_id, tokenizer.pad_id, tokenizer.pad_id]
    assert tokenizer.decode(wrapped) == "hello world"


def test_hf_save_and_load_tokenizer(hf_dir: Path, tmp_path: Path) -> None:
    tokenizer = HFTokenizer(hf_dir)
    tokenizer.save(tmp_path / "saved")
    loaded = load_tokenizer(tmp_path / "saved")
    assert isinstance(loaded, HFTokenizer)
    assert loaded.encode("the lazy fox") == tokenizer.encode("the lazy fox")
    assert (loaded.vocab_size, loaded.bos_id, loaded.eos_id, loaded.pad_id) == (
        tokenizer.vocab_size,
        tokenizer.bos_id,
        tokenizer.eos_id,
        tokenizer.pad_id,
    )


# ---------------------------------------------------------------------------------------------
# load_tokenizer errors
# ---------------------------------------------------------------------------------------------


def test_load_tokenizer_empty_directory_lists_what_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_tokenizer(tmp_path)
    message = str(info.value)
    for name in (CHAR_TOKENIZER_FILE, "tokenizer.json", "tokenizer_config.json"):
        assert name in message


def test_load_tokenizer_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------

#: A template that writes the BOS itself (as Llama's do): specrl must not add a second one.
BOS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def _chat_dir(tmp_path: Path, kind: str) -> Path:
    directory = tmp_path / kind
    hf = build_tokenizer(directory, chat_template=kind != "plain")
    if kind == "bos":
        hf.bos_token = "<|endoftext|>"
        hf.chat_template = BOS_TEMPLATE
        hf.save_pretrained(str(directory))
    return directory


def _reference_ids(directory: Path, messages: list[dict]) -> list[int]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.mark.parametrize("kind", ["chatml", "bos"])
@pytest.mark.parametrize("system", ["", "You are a careful math tutor."])
def test_chat_template_formats_prompts_as_apply_chat_template(
    tmp_path: Path, kind: str, system: str
) -> None:
    directory = _chat_dir(tmp_path, kind)
    tokenizer = load_tokenizer(directory)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.has_chat_template
    assert directory_has_chat_template(directory)
    prompt = "Tom has 3 apples and buys 4 more. How many apples does he have?"
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    expected = _reference_ids(directory, messages)
    encode = prompt_encoder(tokenizer, "auto", system, dataset=True)
    assert encode(prompt) == expected
    assert prompt_encoder(tokenizer, "true", system, dataset=False)(prompt) == expected
    text = tokenizer.decode(expected)
    assert prompt in text and text.endswith("assistant\n" if kind == "chatml" else "] ")
    assert (system in text) if system else "system" not in text
    if kind == "bos":  # the template's one BOS, not two
        assert expected[0] == tokenizer.bos_id and expected[1] != tokenizer.bos_id


def test_chat_template_off_or_absent_sends_bos_and_raw_text(tmp_path: Path) -> None:
    chat = load_tokenizer(_chat_dir(tmp_path, "chatml"))
    plain = load_tokenizer(_chat_dir(tmp_path, "plain"))
    assert isinstance(plain, HFTokenizer) and not plain.has_chat_template
    assert not directory_has_chat_template(tmp_path / "plain")
    prompt = "Half of 9?"
    # auto: only for a data set; false: never; no template: nothing to apply.
    assert prompt_encoder(chat, "auto", dataset=False)(prompt) == encode_prompt(chat, prompt)
    assert prompt_encoder(chat, "false", dataset=True)(prompt) == encode_prompt(chat, prompt)
    assert prompt_encoder(plain, "auto", dataset=True)(prompt) == [
        plain.bos_id,
        *plain.encode(prompt),
    ]
    char = CharTokenizer(BUILTIN_ALPHABET)
    assert prompt_encoder(char, "auto", dataset=True)("12>") == encode_prompt(char, "12>")


def test_chat_template_demanded_or_system_prompt_without_one_is_an_error(tmp_path: Path) -> None:
    plain = load_tokenizer(_chat_dir(tmp_path, "plain"))
    chat = load_tokenizer(_chat_dir(tmp_path, "chatml"))
    with pytest.raises(ValueError, match="task.chat_template=true.*no chat template"):
        prompt_encoder(plain, "true", dataset=True)
    with pytest.raises(ValueError, match="task.chat_template=true.*no chat template"):
        prompt_encoder(CharTokenizer(BUILTIN_ALPHABET), "true")
    with pytest.raises(ValueError, match="task.system_prompt is set"):
        prompt_encoder(plain, "auto", "Be brief.", dataset=True)
    with pytest.raises(ValueError, match="task.system_prompt is set"):
        prompt_encoder(chat, "false", "Be brief.", dataset=True)
    with pytest.raises(ValueError, match="must be one of auto, true, false"):
        prompt_encoder(chat, "yes")
