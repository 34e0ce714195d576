"""Structured output's cost per output token on one GPU: decode steps of a Llama-3-8B-shaped
model (bf16, dummy weights) with every request under a JSON schema vs the same requests
unconstrained, at batch 1 and 32.

Both arms sample with temperature 1 (seeded), so only the grammar differs: its rows leave
the graphed fused sampling head for logits + bitmask + the full sampler, and the host
advances each request's matcher and fills its mask row while the step's forward runs.
Requests are admitted with their prompt KV in place (``add_prefilled``, as a P/D consumer
does); each step is a full deferred ``LLMEngine.step()``; a point is the median over
--repeats windows of --steps steps.

The tokenizer is byte-level BPE with the model's 128256 ids, built here (no download):
the 256 bytes, every 1-3 digit number, punctuation runs and pseudo-words with and without a
leading space, then 256 special tokens (EOS 128001), so a mask row walks a trie of Llama 3's
size. ``--tokenizer DIR`` uses a real tokenizer.json instead.

    python bench/grammar_bench.py --out $OUT/grammar_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_bench import LLAMA3_8B  # noqa: E402
from bench.grammar_lib_bench import SCHEMA as ORDER  # noqa: E402

# An array of orders that never closes inside the timed window (at least 100 orders), so
# every timed step masks a live grammar, strings, numbers and keys alike.
SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "orders": {"type": "array", "items": ORDER, "minItems": 100}},
    "required": ["orders"], "additionalProperties": False}
_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
_WEIGHTS = [12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4, 2.2,
            2.0, 2.0, 1.9, 1.5, 1.0, 0.8, 0.2, 0.2, 0.1, 0.1]


def synthetic_tokenizer(path: str, vocab_size: int, eos: int) -> None:
    """Writes tokenizer.json and generation_config.json into path (see the module doc)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    n_special = 256
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    space = "Ġ"  # byte-level BPE's spelling of ' '
    vocab: dict[str, int] = {ch: i for i, ch in enumerate(alphabet)}
    rng = random.Random(0)

    def add(tok: str) -> None:
        if tok not in vocab and len(vocab) < vocab_size - n_special:
            vocab[tok] = len(vocab)

    for n in range(1000):
        add(str(n))
    punct = '{}[]":,.;!?()-_/\\\'=+*#'
    while len(vocab) < 8000:
        add("".join(rng.choice(punct) for _ in range(rng.randint(2, 4))))
    while len(vocab) < vocab_size - n_special:
        w = "".join(rng.choices(_LETTERS, _WEIGHTS, k=rng.randint(2, 10)))
        if rng.random() < 0.1:
            w = w.capitalize()
        add((space + w) if rng.random() < 0.6 else w)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    names = [f"<|reserved_special_token_{i}|>" for i in range(n_special)]
    names[eos - (vocab_size - n_special)] = "<|end_of_text|>"
    tk.add_special_tokens([AddedToken(n, special=True) for n in names])
    assert tk.get_vocab_size(with_added_tokens=True) == vocab_size
    tk.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def point(engine: Any, batch: int, context: int, steps: int, repeats: int,
          structured: dict[str, str] | None) -> dict[str, Any]:
    from engine.sampling_params import SamplingParams

    masks = engine.runner.grammar_masks
    first = engine.tokenizer.encode("{", add_special_tokens=False)[0]  # a JSON reply's start
    ids = []
    for i in range(batch):
        params = SamplingParams(max_tokens=steps * repeats + 16, ignore_eos=True,
                                temperature=1.0, seed=i, structured=structured)
        blocks = engine.reserve(context)
        assert blocks is not None, "KV pool too small"
        rid = f"{'json' if structured else 'plain'}-b{batch}-{i}"
        engine.add_prefilled(rid, [1 + (i + j) % 1000 for j in range(context)], params,
                             blocks, first_token=first)
        ids.append(rid)
    for _ in range(3):
        engine.step()
    windows = []
    host0 = masks.host_s
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        windows.append((time.perf_counter() - t0) / steps * 1e3)
    host_ms = (masks.host_s - host0) / (steps * repeats) * 1e3
    errors = [engine.requests[r].grammar.error() for r in ids
              if engine.requests[r].grammar is not None and engine.requests[r].grammar.failed]
    sample = None
    if structured:
        r = engine.requests[ids[0]]
        sample = engine.tokenizer.decode([t for t in r.output_token_ids if t >= 0])[:300]
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    out = {"batch": batch, "step_ms": round(sorted(windows)[len(windows) // 2], 3),
           "step_ms_windows": [round(w, 3) for w in windows]}
    if structured:
        out.update(mask_host_ms_per_step=round(host_ms, 3), grammars_failed=len(errors),
                   first_error=errors[0][:300] if errors else "", output_head=sample)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokenizer", default="", help="a directory with a real tokenizer.json")
    ap.add_argument("--out", default="bench/results/grammar_h200.json")
    ap.add_argument("--smoke", action="store_true",
                    help="a 2-layer model of the same vocabulary on the CPU: checks the bench runs")
    a = ap.parse_args()
    from engine.config import EngineConfig
    from engine.llm import build_engine
    from engine.sampling_params import SamplingParams

    batches = [int(b) for b in a.batches.split(",") if b]
    cfg_dir = tempfile.mkdtemp()
    model_cfg = dict(LLAMA3_8B)
    if a.smoke:
        model_cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         torch_dtype="float32")
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump(model_cfg, f)
    t0 = time.perf_counter()
    if a.tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            src = os.path.join(a.tokenizer, name)
            if os.path.isfile(src):
                with open(src, "rb") as s, open(os.path.join(cfg_dir, name), "wb") as d:
                    d.write(s.read())
    else:
        synthetic_tokenizer(cfg_dir, LLAMA3_8B["vocab_size"], LLAMA3_8B["eos_token_id"])
    tok_s = time.perf_counter() - t0
    gpu = dict(dtype="bfloat16", device="cuda", gpu_memory_utilization=0.85)
    engine = build_engine(EngineConfig(
        model=cfg_dir, load_format="dummy", max_num_seqs=max(batches),
        max_model_len=a.context + a.steps * a.repeats + 64, max_num_batched_tokens=2048,
        **(dict(dtype="float32", device="cpu") if a.smoke else gpu)))
    spec = {"kind": "json_schema", "value": json.dumps(SCHEMA)}
    t0 = time.perf_counter()
    engine.grammars.for_params(SamplingParams(structured=spec))
    first_matcher_s = time.perf_counter() - t0  # llguidance's tokenizer view + one compile
    result: dict[str, Any] = {
        "device": "cpu (smoke)" if a.smoke else torch.cuda.get_device_name(),
        "model": "2 layers, smoke" if a.smoke else "Llama-3-8B shape, dummy, bf16",
        "tokenizer": a.tokenizer or "synthetic byte-level BPE, 128256 ids",
        "context": a.context, "tokenizer_build_s": round(tok_s, 2),
        "first_matcher_s": round(first_matcher_s, 3), "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "points": []}
    for b in batches:
        plain = point(engine, b, a.context, a.steps, a.repeats, None)
        js = point(engine, b, a.context, a.steps, a.repeats, spec)
        p = {"batch": b, "plain": plain, "json_schema": js,
             "overhead_pct": round((js["step_ms"] / plain["step_ms"] - 1) * 100, 2)}
        print(json.dumps(p), flush=True)
        result["points"].append(p)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "points"}))


if __name__ == "__main__":
    main()
