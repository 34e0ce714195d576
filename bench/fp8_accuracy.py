"""FP8 at load (--quantization fp8) against the same model in bf16: greedy tokens and
perplexity on the embedded SmolLM2-135M-Instruct (or --model).

  * greedy: 16 chat prompts, 32 new tokens each (EOS ignored), batched; the share of the
    16 x 32 positions whose token equals bf16's (a divergence also counts the positions
    after it), and the mean length of the common prefix;
  * teacher-forced: each prompt followed by bf16's 32 tokens in one prefill, and the share
    of those positions where the model's own argmax is bf16's token (no divergence carries
    over, so one near-tie costs one position, not the rest of the answer);
  * perplexity of a fixed English text (one prefill, so FP8 x FP8 with activations
    quantized per token on a GPU, simulated on CPU), FP8 relative to bf16.

    python bench/fp8_accuracy.py --device cpu --out bench/results/fp8_accuracy_cpu.json
    python bench/fp8_accuracy.py --device cpu --act-group 64 \
        --out bench/results/fp8_accuracy_cpu_group64.json
    python bench/fp8_accuracy.py --device cpu --weight-scales amax  # the earlier scales
    python3 bench/fp8_accuracy.py --device cuda [--fast-accum off] --out ...  # cuBLAS's FP8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain gravity in one sentence.", "List three colors.",
    "How do plants make food?", "Give me a tip for learning to cook.",
    "What is 12 times 7?", "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?", "Name a famous painter and one of their works.",
    "What does a computer's CPU do?", "Suggest a name for a small bakery.",
    "How many legs does a spider have?", "Write one sentence about autumn.",
    "What is the boiling point of water at sea level?", "Tell me a fun fact about octopuses.",
]
TEXT = (
    "The river starts high in the mountains, where snow melts in the spring and runs down "
    "through narrow valleys. Small streams join it as it falls, and by the time it reaches "
    "the first town it is wide enough for boats. People have lived along its banks for "
    "thousands of years. They fished in its waters, watered their fields with it, and used "
    "it to carry goods from one place to another. In the summer, children swim near the "
    "shallow edges, while farmers watch the level of the water and hope for rain. When the "
    "autumn storms arrive, the river grows fast and brown, and the old stone bridges are "
    "tested once again. Engineers now measure its flow every hour, and their numbers help "
    "the towns downstream prepare for floods. Still, most people who live there think of "
    "the river not as data but as a neighbour: a constant presence that shapes their days, "
    "their work and the stories they tell their grandchildren. In the evening, the light "
    "on the water turns gold, and the sound of the current is the last thing many of them "
    "hear before they fall asleep."
)


def prompt_logits(model, ids: list[int], device: torch.device, dtype: torch.dtype
                  ) -> torch.Tensor:
    """[len(ids), V] float32 logits of one prefill of `ids` through the engine's model."""
    from engine.attention import AttentionMetadata

    cfg = model.cfg
    bs = 16
    nb = -(-len(ids) // bs)
    kv = torch.zeros(nb, cfg.num_layers, 2, bs, model.shard.num_kv_heads, cfg.head_dim,
                     dtype=dtype, device=device)
    n = len(ids)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        block_tables=torch.arange(nb, dtype=torch.int32, device=device)[None],
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device), decode_only=False,
        max_seq_len=n, cu_seqlens_q_host=[0, n], seq_lens_host=[n])
    with torch.inference_mode():
        h = model(torch.tensor(ids, device=device), torch.arange(n, device=device), kv, meta)
        return model.compute_logits(h).float()


def teacher_forced(model, prompt: list[int], ref: list[int], device: torch.device,
                   dtype: torch.dtype) -> int:
    """How many of `ref` (a continuation of `prompt`) the model's argmax picks when each
    position is given the reference's own prefix (one prefill of prompt + ref)."""
    logits = prompt_logits(model, prompt + ref, device, dtype)
    picks = logits[len(prompt) - 1:-1].argmax(dim=-1).tolist()
    return sum(a == b for a, b in zip(picks, ref, strict=True))


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    target = torch.tensor(ids[1:], device=logits.device)
    nll = torch.nn.functional.cross_entropy(logits[:-1], target)
    return math.exp(float(nll))


def run(model: str | None, device: str, dtype: str, max_tokens: int = 32) -> dict:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out: dict = {"model": model or "smollm2", "device": device, "dtype": dtype,
                 "prompts": len(PROMPTS), "max_tokens": max_tokens}
    tokens: dict = {}
    ppl, forced = {}, {}
    for quant in (None, "fp8"):
        t0 = time.perf_counter()
        with LLM(model, device=device, dtype=dtype, quantization=quant,
                 max_num_batched_tokens=1024, block_size=16) as llm:
            res = llm.generate(PROMPTS, params, chat=True)
            tokens[quant] = [r.token_ids for r in res]
            ids = llm.tokenizer.encode(TEXT)
            m = llm.engine.runner.model
            forced[quant] = [
                teacher_forced(m, llm.encode(q, chat=True), ref, torch.device(device),
                               getattr(torch, dtype))
                for q, ref in zip(PROMPTS, tokens[None], strict=True)]
            logits = prompt_logits(m, ids, torch.device(device), getattr(torch, dtype))
            ppl[quant] = perplexity(logits, ids)
        out[f"{quant or 'bf16'}_s"] = round(time.perf_counter() - t0, 1)
    same = sum(a == b for x, y in zip(tokens[None], tokens["fp8"], strict=True)
               for a, b in zip(x, y, strict=True))
    prefix = []
    for x, y in zip(tokens[None], tokens["fp8"], strict=True):
        k = next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        prefix.append(k)
    out.update(
        greedy_match=round(same / (len(PROMPTS) * max_tokens), 4),
        mean_common_prefix=round(sum(prefix) / len(prefix), 2),
        teacher_forced_match=round(sum(forced["fp8"]) / (len(PROMPTS) * max_tokens), 4),
        teacher_forced_match_bf16_itself=round(
            sum(forced[None]) / (len(PROMPTS) * max_tokens), 4),
        text_tokens=len(ids), ppl_bf16=round(ppl[None], 4), ppl_fp8=round(ppl["fp8"], 4),
        ppl_ratio=round(ppl["fp8"] / ppl[None], 4))
    return out


def dtype_baseline(model: str | None, device: str, max_tokens: int = 32) -> dict:
    """No FP8: float32 against bf16 greedy tokens, the agreement rounding alone leaves."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    tokens = {}
    for dtype in ("float32", "bfloat16"):
        with LLM(model, device=device, dtype=dtype, max_num_batched_tokens=1024) as llm:
            tokens[dtype] = [r.token_ids for r in llm.generate(PROMPTS, params, chat=True)]
    same = sum(a == b for x, y in zip(tokens["float32"], tokens["bfloat16"], strict=True)
               for a, b in zip(x, y, strict=True))
    return {"model": model or "smollm2", "device": device,
            "bf16_vs_float32_greedy_match": round(same / (len(PROMPTS) * max_tokens), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--act-group", type=int, default=None,
                    help="engine/quant/fp8_linear.ACT_GROUP for this run (0: a scale per row)")
    ap.add_argument("--weight-only-max-rows", type=int, default=None,
                    help="engine/quant/fp8_linear.WEIGHT_ONLY_MAX_ROWS for this run (a large "
                         "value: activations never quantized)")
    ap.add_argument("--weight-scales", choices=("mse", "amax"), default=None,
                    help="engine/quant/scheme.AT_LOAD.weight_scales for this run (default: "
                         "the engine's, error-minimising 'mse')")
    ap.add_argument("--fast-accum", choices=("on", "off"), default=None,
                    help="kernels/triton_fp8_gemm.FAST_ACCUM for this run (cuBLAS's FP8 "
                         "accumulation without float32 promotion; GPU only; default: the "
                         "engine's)")
    ap.add_argument("--dtype-baseline", action="store_true",
                    help="no FP8: greedy agreement of float32 and bf16 only")
    ap.add_argument("--out", default="bench/results/fp8_accuracy_cpu.json")
    args = ap.parse_args()
    import dataclasses

    import engine.quant.fp8_linear as fl
    import engine.quant.scheme as sch
    import kernels.triton_fp8_gemm as fg

    if args.act_group is not None:
        fl.ACT_GROUP = args.act_group
    if args.weight_only_max_rows is not None:
        fl.WEIGHT_ONLY_MAX_ROWS = args.weight_only_max_rows
    if args.weight_scales is not None:
        sch.AT_LOAD = dataclasses.replace(sch.AT_LOAD, weight_scales=args.weight_scales)
        sch.AT_LOAD_SCHEMES["fp8"] = sch.AT_LOAD  # what the engine's load reads
    if args.fast_accum is not None:
        fg.FAST_ACCUM = args.fast_accum == "on"
    if args.dtype_baseline:
        result = dtype_baseline(args.model, args.device)
    else:
        result = run(args.model, args.device, args.dtype)
    result["weight_scales"] = sch.AT_LOAD.weight_scales
    result["act_group"] = fl.ACT_GROUP
    result["weight_only_max_rows"] = fl.WEIGHT_ONLY_MAX_ROWS
    result["fast_accum"] = fg.FAST_ACCUM
    result["torch"] = torch.__version__
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
