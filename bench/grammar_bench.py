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

Each structured point also reports the mask's host time per step: mask_host_ms_per_step
is the engine thread's (waiting for the mask thread's job included), and
mask_phase_ms_per_step splits it by phase with the job's own phases (``GrammarMasks.times``:
engine thread read / advance / mask / copy / join, mask thread ahead_read / ahead_advance /
ahead_mask), with how many rows each path made. ``--no-ahead`` builds every mask in the step
instead (the path before the mask thread), for comparison.

``--masks-only`` runs no model: on the CPU it drives the engine's ``GrammarMasks`` over the
same requests, each step appending a token drawn uniformly from the row's allowed set (what
a dummy-weight model at temperature 1 does), and times the host path alone by phase.
``--vocab N`` shrinks the synthetic vocabulary; ``--tokenizer smollm2`` uses the embedded
SmolLM2 BPE vocabulary (49152 ids) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from typing import Any, cast

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_bench import LLAMA3_8B  # noqa: E402
from bench.grammar_lib_bench import SCHEMA as ORDER  # noqa: E402

# An array of orders that never closes inside the timed window (at least 100 orders), so
# every timed step masks a live grammar, strings, numbers and keys alike.
SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "orders": {"type": "array", "items": ORDER, "minItems": 100}},
    "required": ["orders"], "additionalProperties": False}
VOCAB = cast(int, LLAMA3_8B["vocab_size"])
EOS = cast(int, LLAMA3_8B["eos_token_id"])
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
    phases0 = dict(masks.times)
    ahead0, in_step0 = masks.rows_ahead, masks.rows_in_step
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        windows.append((time.perf_counter() - t0) / steps * 1e3)
    masks.wait()  # the last step's ahead job still holds the matchers read below
    host_ms = (masks.host_s - host0) / (steps * repeats) * 1e3
    phases = {k: round((v - phases0[k]) / (steps * repeats) * 1e3, 3)
              for k, v in masks.times.items()}
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
        out.update(mask_host_ms_per_step=round(host_ms, 3), mask_phase_ms_per_step=phases,
                   mask_rows_ahead=masks.rows_ahead - ahead0,
                   mask_rows_in_step=masks.rows_in_step - in_step0,
                   grammars_failed=len(errors),
                   first_error=errors[0][:300] if errors else "", output_head=sample)
    return out


def masks_only(tokenizer_json: str, vocab: int, eos: int, batch: int, steps: int,
               warmup: int, threads: int | None, seed: int = 0,
               row_times: bool = False) -> dict[str, Any]:
    """The host path of ``GrammarMasks.bitmask`` for `batch` requests under SCHEMA, no
    model: per-step times (ms) by phase, after `warmup` untimed steps. row_times: compute
    the rows one by one on this thread instead, timing each, to report the slowest row per
    step (the least a step can take however many threads share its rows)."""
    import numpy as np

    from engine.grammar.compile import make_tokenizer, new_matcher
    from engine.grammar.masks import GrammarMasks, default_threads
    from engine.grammar.matcher import RequestGrammar
    from engine.request import PLACEHOLDER, Request
    from engine.sampling_params import SamplingParams

    spec = {"kind": "json_schema", "value": json.dumps(SCHEMA)}
    ll = make_tokenizer(tokenizer_json, vocab, [eos])
    masks = GrammarMasks(vocab, [eos], torch.device("cpu"), threads=threads)
    first = ll.tokenize_str("{")[0]
    params = SamplingParams(temperature=1.0, structured=spec)
    reqs = []
    for i in range(batch):
        r = Request(f"r{i}", [1, 2, 3], params, seed=i, output_token_ids=[first])
        r.grammar = RequestGrammar(new_matcher(ll, spec))
        reqs.append(r)
    rng = np.random.default_rng(seed)
    drawn = {id(r): first for r in reqs}
    slowest: list[float] = []
    if row_times:
        def one_by_one(live: list[tuple[Any, int]], ptr: int, batch: int) -> None:
            row_bytes, worst = masks.words * 4, 0.0
            for m, i in live:
                t0 = time.perf_counter()
                m.unsafe_compute_mask_ptr(ptr + i * row_bytes, row_bytes)
                worst = max(worst, time.perf_counter() - t0)
            slowest.append(worst * 1e3)
        masks._fill = one_by_one  # type: ignore[method-assign]
    totals, by_phase = [], {k: 0.0 for k in masks.times}
    for step in range(warmup + steps):
        h0, p0 = masks.host_s, dict(masks.times)
        bits = masks.bitmask(reqs, lambda r: drawn[id(r)])
        if step >= warmup:
            totals.append((masks.host_s - h0) * 1e3)
            for k in by_phase:
                by_phase[k] += masks.times[k] - p0[k]
        assert bits is not None
        allowed = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")
        for i, r in enumerate(reqs):
            ok = np.flatnonzero(allowed[i, :vocab])
            if len(ok) > 1:
                ok = ok[ok != eos]
            r.output_token_ids[-1] = drawn[id(r)]  # the previous step's, now read
            drawn[id(r)] = int(rng.choice(ok))
            r.output_token_ids.append(PLACEHOLDER)
    failed = [r.grammar.error() for r in reqs if r.grammar is not None and r.grammar.failed]
    t = np.array(totals)
    extra: dict[str, Any] = {}
    if row_times:
        w = np.array(slowest[warmup:])
        extra["slowest_row_ms_per_step"] = {
            "mean": round(float(w.mean()), 3), "p50": round(float(np.percentile(w, 50)), 3),
            "p90": round(float(np.percentile(w, 90)), 3), "max": round(float(w.max()), 3)}
    return {"batch": batch, "threads": "rows one by one" if row_times
            else threads or f"default ({default_threads()})",
            "steps": steps, "warmup": warmup,
            "host_ms_per_step": {"mean": round(float(t.mean()), 3),
                                 "p50": round(float(np.percentile(t, 50)), 3),
                                 "p90": round(float(np.percentile(t, 90)), 3),
                                 "max": round(float(t.max()), 3)},
            "phase_ms_per_step": {k: round(v / steps * 1e3, 3) for k, v in by_phase.items()},
            **extra, "grammars_failed": len(failed),
            "output_head": ll.decode_str([t for t in reqs[0].output_token_ids
                                          if t != PLACEHOLDER])[:200]}


def main_masks_only(a: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    if a.tokenizer == "smollm2":
        from bench.grammar_lib_bench import _tokenizer

        tk = _tokenizer()
        tokenizer_json, vocab, eos = tk._tk.to_str(), tk.vocab_size, min(tk.eos_token_ids)
        name = "SmolLM2 BPE, 49152 ids"
    else:
        d = tempfile.mkdtemp()
        if a.tokenizer:
            with open(os.path.join(a.tokenizer, "tokenizer.json")) as f:
                tokenizer_json = f.read()
            vocab, eos, name = a.vocab, EOS, a.tokenizer
        else:
            vocab, eos = a.vocab, a.vocab - 255
            synthetic_tokenizer(d, vocab, eos)
            with open(os.path.join(d, "tokenizer.json")) as f:
                tokenizer_json = f.read()
            name = f"synthetic byte-level BPE, {vocab} ids"
    tok_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "mode": "masks only (host path of GrammarMasks.bitmask, no model)",
        "tokenizer": name, "tokenizer_build_s": round(tok_s, 2), "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "points": []}
    threads = [int(t) if t else None for t in a.mask_threads.split(",")]
    for b in [int(b) for b in a.batches.split(",") if b]:
        runs = [(n, False) for n in threads] + ([(None, True)] if a.row_times else [])
        for n, rows in runs:
            p = masks_only(tokenizer_json, vocab, eos, b, a.steps * a.repeats, 3, n,
                           row_times=rows)
            print(json.dumps(p), flush=True)
            result["points"].append(p)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


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
    ap.add_argument("--masks-only", action="store_true",
                    help="no model: time GrammarMasks' host path on the CPU (see the doc)")
    ap.add_argument("--vocab", type=int, default=VOCAB,
                    help="--masks-only: the synthetic vocabulary's size")
    ap.add_argument("--mask-threads", default="",
                    help="--masks-only: llguidance thread counts to compare, e.g. '4,8,' "
                         "(empty: GrammarMasks' default)")
    ap.add_argument("--no-ahead", action="store_true",
                    help="build every mask in the step, none on the mask thread")
    ap.add_argument("--row-times", action="store_true",
                    help="--masks-only: one more run per batch timing each row alone")
    a = ap.parse_args()
    if a.masks_only:
        main_masks_only(a)
        return
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
        synthetic_tokenizer(cfg_dir, VOCAB, EOS)
    tok_s = time.perf_counter() - t0
    gpu = dict(dtype="bfloat16", device="cuda", gpu_memory_utilization=0.85)
    engine = build_engine(EngineConfig(
        model=cfg_dir, load_format="dummy", max_num_seqs=max(batches),
        max_model_len=a.context + a.steps * a.repeats + 64, max_num_batched_tokens=2048,
        **(dict(dtype="float32", device="cpu") if a.smoke else gpu)))
    runner: Any = engine.runner
    if a.no_ahead:
        runner.grammar_masks.ahead_enabled = False
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
        "masks_ahead": runner.grammar_masks.ahead_enabled,
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
