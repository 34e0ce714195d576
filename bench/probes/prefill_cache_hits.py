"""CPU: how many prompt tokens the prefix cache served when moe_bench timed its prefill with
fixed prompts (the form before session 49's bench/fresh_prefill.py).

moe_bench.prefill_point then timed three prompts whose first tokens were 1, 2 and 3, and
--prefill-variants called it once a round. This replays that pattern on a tiny Qwen3-MoE with
a pool of --blocks 16-token blocks (moe_bench's Mixtral run at 8 layers had 265, its V2-Lite
prefill-only runs 264) and prints the cached tokens the engine reports for each prefill:

    python bench/probes/prefill_cache_hits.py --tokens 1024 --blocks 265   # 1,008 from round 2
    python bench/probes/prefill_cache_hits.py --tokens 2048 --blocks 265   # 144
    python bench/probes/prefill_cache_hits.py --tokens 4096 --blocks 264   # 0
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

import decode_op_count  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=265)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from engine.config import EngineConfig
    from engine.llm import build_engine
    from engine.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as d:
        decode_op_count.write_config(os.path.join(d, "config.json"), "qwen3",
                                     num_hidden_layers=2, max_position_embeddings=8192,
                                     vocab_size=32000)
        engine = build_engine(EngineConfig(
            model=d, dtype="float32", device="cpu", load_format="dummy", max_num_seqs=1,
            max_model_len=args.tokens + 64, max_num_batched_tokens=max(2048, args.tokens),
            num_kv_blocks=args.blocks))
    for rnd in range(args.rounds):
        cached = []
        for r in range(3):  # prefill_point's prompts before the fix
            prompt = [1 + r] + [1 + (13 * j) % 30000 for j in range(1, args.tokens)]
            engine.add_request(f"round{rnd}-{r}", prompt, SamplingParams(max_tokens=1))
            while engine.has_unfinished():
                cached += [o.num_cached_tokens for o in engine.step().outputs]
        print(f"round {rnd}: cached prompt tokens of the three prefills {cached}", flush=True)


if __name__ == "__main__":
    main()
