"""xgrammar vs llguidance on one realistic JSON schema and the embedded SmolLM2 tokenizer
(49152 tokens): time to compile the schema, and per-token time to compute the next-token
bitmask (then advance by the token) along a valid instance, alone and for a batch of 32
matchers. CPU only; prints one JSON object (and writes it to --out).

    PYTHONPATH=$PWD /work/main/.venv/bin/python bench/grammar_lib_bench.py --out /tmp/g.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 80},
                "email": {"type": "string", "format": "email"},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "email", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
                    "unit_price": {"type": "number", "minimum": 0},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["sku", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "shipping": {
            "anyOf": [
                {"type": "object", "properties": {"method": {"const": "pickup"},
                                                  "store": {"type": "string"}},
                 "required": ["method", "store"], "additionalProperties": False},
                {"type": "object", "properties": {"method": {"const": "courier"},
                                                  "address": {"type": "string"},
                                                  "express": {"type": "boolean"}},
                 "required": ["method", "address"], "additionalProperties": False},
            ]
        },
        "notes": {"type": ["string", "null"]},
        "total": {"type": "number"},
    },
    "required": ["order_id", "customer", "items", "shipping", "total"],
    "additionalProperties": False,
}

INSTANCE = {
    "order_id": "ORD-123456",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro"},
    "items": [{"sku": "KB-01", "quantity": 2, "unit_price": 49.5, "tags": ["keyboard", "usb"]},
              {"sku": "MS-7", "quantity": 1, "unit_price": 19.99}],
    "shipping": {"method": "courier", "address": "12 Analytical St, London", "express": True},
    "notes": None,
    "total": 118.99,
}


def _tokenizer() -> Any:
    from engine.model_source import resolve_model
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_source(resolve_model("smollm2"))


def bench_llguidance(tk: Any, tokens: list[int], batch: int) -> dict[str, float]:
    import llguidance
    import numpy as np

    t0 = time.perf_counter()
    lltk = llguidance.LLTokenizer(tk._tk.to_str(), n_vocab=tk.vocab_size,
                                  eos_token=sorted(tk.eos_token_ids))
    tok_s = time.perf_counter() - t0
    schema = json.dumps(SCHEMA)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    m = llguidance.LLMatcher(lltk, grammar)
    assert not m.is_error(), m.get_error()
    compile_s = time.perf_counter() - t0
    mask = np.zeros((batch, (tk.vocab_size + 31) // 32), dtype=np.int32)
    one = []
    for t in tokens:
        a = time.perf_counter()
        m.unsafe_compute_mask_ptr(mask[0].ctypes.data, mask.shape[1] * 4)
        one.append(time.perf_counter() - a)
        assert (mask[0, t // 32] >> (t % 32)) & 1, f"token {t} masked out"
        assert m.consume_token(t), m.get_error()
    ex = llguidance.LLExecutor()
    ms = [llguidance.LLMatcher(lltk, grammar) for _ in range(batch)]
    per_step = []
    for t in tokens:
        a = time.perf_counter()
        ex.unsafe_compute_mask_ptr([(x, i) for i, x in enumerate(ms)], mask.ctypes.data,
                                   mask.shape[1] * 4, batch)
        per_step.append(time.perf_counter() - a)
        for x in ms:
            x.consume_token(t)
    return dict(tokenizer_setup_s=tok_s, compile_s=compile_s,
                mask_us_median=statistics.median(one) * 1e6, mask_us_max=max(one) * 1e6,
                batch_mask_us_median=statistics.median(per_step) * 1e6,
                batch_mask_us_max=max(per_step) * 1e6)


def bench_xgrammar(tk: Any, tokens: list[int], batch: int) -> dict[str, float]:
    import xgrammar as xgr

    vocab = tk._tk.get_vocab(with_added_tokens=True)
    encoded = [""] * tk.vocab_size
    for s, i in vocab.items():
        encoded[i] = s
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=tk.vocab_size,
                             stop_token_ids=sorted(tk.eos_token_ids))
    comp = xgr.GrammarCompiler(info, cache_enabled=False)
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(SCHEMA), strict_mode=True)
    compile_s = time.perf_counter() - t0
    m = xgr.GrammarMatcher(cg)
    mask = xgr.allocate_token_bitmask(batch, tk.vocab_size)
    one = []
    for t in tokens:
        a = time.perf_counter()
        m.fill_next_token_bitmask(mask, 0)
        one.append(time.perf_counter() - a)
        assert (int(mask[0, t // 32]) >> (t % 32)) & 1, f"token {t} masked out"
        assert m.accept_token(t)
    bm = xgr.BatchGrammarMatcher()
    ms = [xgr.GrammarMatcher(cg) for _ in range(batch)]
    per_step = []
    for t in tokens:
        a = time.perf_counter()
        bm.batch_fill_next_token_bitmask(ms, mask)
        per_step.append(time.perf_counter() - a)
        for x in ms:
            x.accept_token(t)
    return dict(tokenizer_setup_s=tok_s, compile_s=compile_s,
                mask_us_median=statistics.median(one) * 1e6, mask_us_max=max(one) * 1e6,
                batch_mask_us_median=statistics.median(per_step) * 1e6,
                batch_mask_us_max=max(per_step) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    tk = _tokenizer()
    tokens = tk.encode(json.dumps(INSTANCE), add_special_tokens=False)
    tokens.append(min(tk.eos_token_ids))
    res: dict[str, Any] = dict(schema_tokens=len(tokens), vocab=tk.vocab_size,
                               batch=a.batch)
    res["llguidance"] = bench_llguidance(tk, tokens, a.batch)
    res["xgrammar"] = bench_xgrammar(tk, tokens, a.batch)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
