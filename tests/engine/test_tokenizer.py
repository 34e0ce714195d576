"""engine.tokenizer against transformers' tokenizer built from the same GGUF / HF directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers

from engine.model_source import resolve_model
from engine.tokenizer import Tokenizer

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say we've won.",
    "12345 and 3.14159, 1e-10, 2024-06-01, 1,000,000",
    "  1", "\n\n1. first\n2. second", "a  b   c    d\t\te", "   leading", "trailing   ",
    "line\r\nbreaks\r\n\r\n\n\n", "tab\tseparated\tvalues",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // dot",
    "日本語のテキストと中文字符，한국어", "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷", "Ünïcödé ß ø Ω ∑ ∫",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>plain<repo_name>x<file_sep>", "<|im_start|", "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write a haiku about 日本 and 🌸."},
    ],
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return resolve_model(None)


@pytest.fixture(scope="module")
def hf_tok(gguf_path: str):  # type: ignore[no-untyped-def]
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
    )


@pytest.fixture(scope="module")
def ours(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_source(gguf_path)


@pytest.mark.parametrize("text", CORPUS)
def test_gguf_encode_decode_match_transformers(ours: Tokenizer, hf_tok, text: str) -> None:
    ids = ours.encode(text)
    assert ids == hf_tok.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text  # byte-level: lossless
    assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_gguf_special_tokens(ours: Tokenizer, hf_tok) -> None:
    assert ours.encode("<|im_start|>") == [1]
    assert ours.eos_token_ids == frozenset({2}) and ours.bos_token_id == 1
    assert ours.vocab_size == len(hf_tok) == 49152
    assert ours.id_to_token(2) == "<|im_end|>"


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(ours: Tokenizer, hf_tok, conv, gen: bool) -> None:
    text = ours.apply_chat_template(conv, add_generation_prompt=gen)
    assert text == hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
    ref = hf_tok.apply_chat_template(conv, add_generation_prompt=gen, return_dict=False)
    assert ours.encode_chat(conv, add_generation_prompt=gen) == list(ref)


def test_hf_dir_tokenizer(hf_tok, ours: Tokenizer, tmp_path) -> None:
    hf_tok.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = Tokenizer.from_source(str(tmp_path))
    for text in CORPUS:
        assert loaded.encode(text) == ours.encode(text)
    for conv in CONVERSATIONS:
        assert loaded.apply_chat_template(conv) == ours.apply_chat_template(conv)
    assert loaded.eos_token_ids == frozenset({0, 2}) and loaded.bos_token_id == 1


def test_hf_dir_adds_bos_from_post_processor(tmp_path) -> None:
    # A Llama-3-style tokenizer.json whose post-processor prepends BOS.
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4}
    tk = Backend(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.add_special_tokens(["<s>", "</s>"])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tk.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": template}))
    t = Tokenizer.from_source(str(tmp_path))
    assert t.encode("ab") == [0, 4] and t.encode("ab", add_special_tokens=False) == [4]
    assert t.eos_token_ids == frozenset({1})
    # The template writes BOS itself; encode_chat must not add a second one.
    assert t.encode_chat([{"role": "u", "content": "ab"}]) == [0, 4, 1]


@pytest.mark.parametrize(("messages", "field"), [
    ("hi", "messages"),
    ([], "messages"),
    (["hi"], r"messages\[0\]"),
    ([{"content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user"}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": 3}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content\[0\]"),
])
def test_bad_messages(ours: Tokenizer, messages, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        ours.apply_chat_template(messages)


def test_text_parts_and_template_errors(ours: Tokenizer) -> None:
    text_parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    joined = ours.apply_chat_template([{"role": "user", "content": "ab"}])
    assert ours.apply_chat_template([{"role": "user", "content": text_parts}]) == joined
    strict = Tokenizer(ours._tk, bos_token=None, eos_token=None, eos_token_ids=set(),
                       chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(ValueError, match="messages: .*no system role"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])


def test_router_imports_are_torch_free() -> None:
    code = (
        "import sys, engine.tokenizer, engine.detokenizer, engine.stop_strings, "
        "engine.model_source\n"
        "from engine.tokenizer import Tokenizer\n"
        "from engine.model_source import resolve_model\n"
        "Tokenizer.from_source(resolve_model(None)).encode('hi')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
