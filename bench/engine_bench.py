"""CPU prefill and decode throughput of the pdserve engine against HF transformers, same run.

    .venv/bin/python bench/engine_bench.py [--model smollm2] [--out bench/results/engine_cpu.json]

Both run the same model in the same dtype (--dtype, float32 by default) with the same thread
count on the same token ids.
Prefill tok/s = batch * prompt_len / time of a 1-token generation. Decode tok/s =
batch * (n - 1) / (time of an n-token generation - time of a 1-token generation).
Each number is the median of --repeats runs after a warm-up run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from engine.llm import LLM
from engine.model_source import resolve_model
from engine.sampling_params import SamplingParams


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch * 1000 + length)
    return [torch.randint(100, vocab - 100, (length,), generator=g).tolist()
            for _ in range(batch)]


def bench_pdserve(llm: LLM, prompts: list[list[int]], n: int) -> float:
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return _median_time(lambda: llm.generate(prompts, p), ARGS.repeats)


def bench_hf(model: torch.nn.Module, prompts: list[list[int]], n: int) -> float:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def run() -> None:
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)

    return _median_time(run, ARGS.repeats)


def main() -> None:
    torch.set_num_threads(ARGS.threads)
    path = resolve_model(ARGS.model)
    dtype = getattr(torch, ARGS.dtype)
    import transformers as tf

    if path.endswith(".gguf"):
        hf = tf.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
    else:
        hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    hf.eval()
    vocab = hf.config.vocab_size
    # no prefix cache: each repeat resends the same prompts (a hit is no prefill to time)
    llm = LLM(ARGS.model, dtype=ARGS.dtype, max_num_batched_tokens=8 * ARGS.prompt_len,
              max_num_seqs=64, kv_cache_bytes=1 << 30, enable_prefix_caching=False)
    rows = []
    for batch in (1, 8):
        pre = _prompts(batch, ARGS.prompt_len, vocab)
        dec = _prompts(batch, ARGS.decode_prompt_len, vocab)
        row: dict[str, object] = {"batch": batch}
        for name, fn, model in (("pdserve", bench_pdserve, llm), ("hf", bench_hf, hf)):
            t_pre = fn(model, pre, 1)  # type: ignore[operator]
            t_one = fn(model, dec, 1)  # type: ignore[operator]
            t_all = fn(model, dec, ARGS.decode_tokens)  # type: ignore[operator]
            row[f"{name}_prefill_tok_s"] = batch * ARGS.prompt_len / t_pre
            row[f"{name}_decode_tok_s"] = batch * (ARGS.decode_tokens - 1) / (t_all - t_one)
        row["prefill_ratio"] = row["pdserve_prefill_tok_s"] / row["hf_prefill_tok_s"]  # type: ignore[operator]
        row["decode_ratio"] = row["pdserve_decode_tok_s"] / row["hf_decode_tok_s"]  # type: ignore[operator]
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"model": ARGS.model or "smollm2", "dtype": ARGS.dtype, "threads": ARGS.threads,
              "prompt_len": ARGS.prompt_len, "decode_prompt_len": ARGS.decode_prompt_len,
              "decode_tokens": ARGS.decode_tokens, "torch": torch.__version__,
              "transformers": tf.__version__, "cpu": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "rows": rows}
    os.makedirs(os.path.dirname(ARGS.out), exist_ok=True)
    with open(ARGS.out, "w") as f:
        json.dump(result, f, indent=2)
    print("| batch | pdserve prefill tok/s | HF prefill tok/s | ratio | pdserve decode tok/s "
          "| HF decode tok/s | ratio |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['pdserve_prefill_tok_s']:.0f} | {r['hf_prefill_tok_s']:.0f} "
              f"| {r['prefill_ratio']:.2f}x | {r['pdserve_decode_tok_s']:.1f} "
              f"| {r['hf_decode_tok_s']:.1f} | {r['decode_ratio']:.2f}x |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default="bench/results/engine_cpu.json")
    ARGS = ap.parse_args()
    main()
