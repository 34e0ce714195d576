"""Incremental detokenization and stop-string search."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from engine.detokenizer import IncrementalDetokenizer
from engine.model_source import resolve_model
from engine.stop_strings import find_stop, partial_stop_len
from engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! Plain ASCII text with numbers 12345.",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 and 🌸🍣",
    "日本語のテキストと中文字符，한국어 mixed with English",
    "code:\n    def f(x):\n        return x ** 2  # ü\n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 ∑∫∂ and Ωmega",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_source(resolve_model(None))


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    return [detok.add(i) for i in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_valid_and_concatenate_to_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert detok.flush() == "" and detok.pending_tokens == 0


def test_split_characters_are_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("🌸🍣👨‍👩‍👧")
    assert len(ids) > 3  # the byte-level vocabulary splits these characters across tokens
    deltas = _stream(IncrementalDetokenizer(tok), ids)
    assert "" in deltas  # some token ended mid-character and was held
    assert "".join(deltas) == "🌸🍣👨‍👩‍👧"


@pytest.mark.parametrize("text", TEXTS)
def test_with_prompt_context(tok: Tokenizer, text: str) -> None:
    prompt = tok.encode("<|im_start|>user\nSay something 🌸<|im_end|>\n<|im_start|>assistant\n")
    out = tok.encode(text, add_special_tokens=False) + [2]  # ends with <|im_end|>
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(_stream(detok, out)) == tok.decode(out) == text
    keep = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
    assert "".join(_stream(keep, out)) == text + "<|im_end|>"


def test_unterminated_utf8_is_flushed_at_the_end(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🌸")
    cut = ids[:-1]  # drop the token carrying the emoji's last byte(s)
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, cut)
    assert all("\ufffd" not in d for d in deltas) and detok.pending_tokens > 0
    tail = detok.flush()
    assert tail.endswith("\ufffd")
    assert "".join(deltas) + tail == detok.text == tok.decode(cut)


def test_decodes_only_a_small_window(tok: Tokenizer) -> None:
    seen: list[int] = []

    class Counting:
        def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            seen.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode(" ".join(TEXTS) * 10)
    detok = IncrementalDetokenizer(Counting(), prompt_ids=tok.encode("x" * 100))
    _stream(detok, ids)
    assert len(ids) > 500 and max(seen) <= 12
    assert detok.text == tok.decode(ids)


def test_sentencepiece_style_leading_space() -> None:
    # Metaspace decoders drop the first token's leading space; the context window keeps
    # word boundaries right between deltas.
    vocab = {"▁Hello": 0, "▁world": 1, "!": 2, "▁": 3, "H": 4}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    t = Tokenizer(backend, bos_token=None, eos_token=None, eos_token_ids=set(),
                  chat_template=None)
    ids = [0, 1, 2, 1]
    assert "".join(_stream(IncrementalDetokenizer(t), ids)) == t.decode(ids) == "Hello world! world"
    assert "".join(_stream(IncrementalDetokenizer(t, [0]), [1, 2])) == " world!"


def test_find_stop_searches_only_what_the_delta_completes() -> None:
    assert find_stop("hello wor", 3, ["world"]) is None
    assert find_stop("hello world", 2, ["world"]) == 6  # match straddles the delta
    assert find_stop("hello world", 0, ["world"]) is None
    assert find_stop("stop here stop", 1, ["stop"]) == 10  # the old one was found earlier
    assert find_stop("abcdef", 3, ["ef", "cde", "zz"]) == 2  # earliest start wins
    assert find_stop("abc", 3, ["", "b"]) == 1
    assert find_stop("ab\n\nUser:", 5, ["\n\nUser:"]) == 2


def test_partial_stop_len() -> None:
    assert partial_stop_len("hello wo", ["world"]) == 2
    assert partial_stop_len("hello world", ["world"]) == 0  # complete: find_stop's job
    assert partial_stop_len("a\n\nUs", ["\n\nUser:", "Usa"]) == 4
    assert partial_stop_len("abc", []) == 0
