"""The tokenizer and chat template of a model, from the same source as its weights.

Torch-free (the router imports it). Two sources:

* an HF directory: ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``,
  ``generation_config.json``);
* a GGUF file: a ``tokenizers`` BPE rebuilt from llama.cpp's ``tokenizer.ggml.*`` metadata
  (``_gguf_backend``).

Chat templates are rendered like transformers does (sandboxed jinja2, trim_blocks and
lstrip_blocks, ``raise_exception``/``strftime_now``, ``tojson``), so prompts match HF.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# ``tokenizer.ggml.pre`` -> split regex applied before byte-level mapping. Names not listed
# (``gpt2``, ``smollm``, ...) get GPT-2's byte-level regex, which is what transformers'
# GGUF conversion does and what we are tested against. NB: llama.cpp's ``smollm`` (and the
# original SmolLM2 tokenizer.json) first isolates every digit; that differs from GPT-2 only
# where whitespace precedes a digit ("\n\n1", "  1"), since the vocabulary has no
# multi-digit or space+digit tokens.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2 splits digits singly
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for
    themselves, the rest are shifted to code points 256+ in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _gguf_backend(meta: Mapping[str, Any], path: str) -> _HFTokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from llama.cpp's gpt2 vocabulary metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"model: GGUF {path} has tokenizer.ggml.model {kind!r}; only 'gpt2' "
                         "(byte-level BPE) is supported")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    alphabet = set(_byte_alphabet().values())
    spell = _byte_alphabet()
    vocab: dict[str, int] = {}
    for i, (tok, typ) in enumerate(zip(tokens, types, strict=True)):
        # Added tokens are matched on raw text, so they keep their real spelling; a regular
        # token written outside the byte alphabet is respelled byte by byte.
        if typ in (_CONTROL, _USER_DEFINED) or set(tok) <= alphabet:
            vocab[tok] = i
        else:
            vocab["".join(spell[b] for b in tok.encode("utf-8"))] = i
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tk = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = _PRE_SPLITS.get(str(meta.get("tokenizer.ggml.pre", "default")))
    if split is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL])
    tk.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B:1",
            special_tokens=[(tokens[bos], bos)],
        )
    return tk


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    return {v for v in value if isinstance(v, int)} if isinstance(value, list) else set()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # transformers' tojson keeps non-ASCII text as is (jinja's default would escape it).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated copies of chat messages; list-of-text-parts content is joined to a string."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}]: must be an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role: missing or not a non-empty string")
        if "content" not in m:
            raise ValueError(f"messages[{i}].content: missing")
        content = m["content"]
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and not m.get("tool_calls"):
            raise ValueError(f"messages[{i}].content: null is only allowed with tool_calls")
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: must be a string or a list of text parts")
        out.append({**m, "content": content})
    return out


class Tokenizer:
    """Encode/decode and chat formatting for one model (wraps a ``tokenizers.Tokenizer``)."""

    def __init__(self, backend: _HFTokenizer, *, bos_token: str | None, eos_token: str | None,
                 eos_token_ids: set[int], chat_template: str | None) -> None:
        self._tk = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None  # compiled on first use
        bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self._bos_token_id: int | None = bos_id
        eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
        self._eos_ids = frozenset(eos_token_ids | ({eos_id} if eos_id is not None else set()))

    @classmethod
    def from_source(cls, path: str) -> Tokenizer:
        """From a resolved model path (see ``engine.model_source.resolve_model``)."""
        if os.path.isdir(path):
            return cls._from_hf_dir(path)
        if os.path.isfile(path) and path.endswith(".gguf"):
            return cls._from_gguf(path)
        raise ValueError(f"model: {path} is neither an HF model directory nor a .gguf file")

    @classmethod
    def _from_gguf(cls, path: str) -> Tokenizer:
        from engine.gguf_reader import open_gguf  # torch-free: header parse only

        meta = open_gguf(path).metadata
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError(f"model: GGUF {path} carries no tokenizer (tokenizer.ggml.tokens)")

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        # End-of-turn / end-of-message tokens also end generation (llama.cpp does the same).
        eos = _ids([meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                      "tokenizer.ggml.eom_token_id") if k in meta])
        return cls(_gguf_backend(meta, path), bos_token=token("bos_token_id"),
                   eos_token=token("eos_token_id"), eos_token_ids=eos,
                   chat_template=meta.get("tokenizer.chat_template"))

    @classmethod
    def _from_hf_dir(cls, path: str) -> Tokenizer:
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise ValueError(f"model: {path} has no tokenizer.json")
        backend = _HFTokenizer.from_file(tj)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name", "template"}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = os.path.join(path, "chat_template.jinja")  # transformers >= 4.43 layout
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        eos = _ids(_read_json(os.path.join(path, "generation_config.json")).get("eos_token_id"))
        return cls(backend, bos_token=_token_text(cfg.get("bos_token")),
                   eos_token=_token_text(cfg.get("eos_token")), eos_token_ids=eos,
                   chat_template=template if isinstance(template, str) else None)

    # -- ids <-> text ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"prompt: expected a string, got {type(text).__name__}")
        return list(self._tk.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def to_json(self) -> str:
        """The backend as tokenizer.json text (what grammar libraries build their view from)."""
        return str(self._tk.to_str())

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def vocab_size(self) -> int:
        return int(self._tk.get_vocab_size(with_added_tokens=True))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """No token covers more characters of text than this: a lower bound on a text's
        token count is len(text) / this, known without tokenizing it. A vocab entry's length
        counts bytes (byte-level BPE spells each byte as one character) or characters
        (SentencePiece), and a decoded token has at most that many characters either way."""
        return max(1, max((len(t) for t in self._tk.get_vocab(with_added_tokens=True)),
                          default=1))

    # -- chat ------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for ``messages``; extra kwargs (tools, ...) reach the template."""
        checked = _check_messages(messages)
        if self.chat_template is None:
            raise ValueError("chat_template: this model has none; send a plain prompt")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=checked, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"messages: chat template rejected them: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        # The template writes any BOS itself, so no post-processor specials (as HF does).
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)
