"""Variants of FP8 at load against bf16 on the embedded SmolLM2-135M, the model loaded once
and its projections swapped in place: weight scales (amax / 448 or the least-squared-error
shrink, engine/quant/weight_scale.py), which layers stay bf16, and weight-only against
per-token FP8 activations. Per variant: teacher-forced agreement with bf16's greedy tokens
and with bf16's own prefill argmax, mean KL(bf16 || FP8) over those positions, and
perplexity of bench/fp8_accuracy.py's text (the same prompts, text and functions).

    python bench/fp8_accuracy_variants.py --out bench/results/fp8_accuracy_cpu_variants.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8_accuracy as fa  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/fp8_accuracy_cpu_variants.json")
    args = ap.parse_args()
    import engine.quant.fp8_linear as fl
    from engine.llm import LLM
    from engine.quant.fp8_linear import Fp8Linear
    from engine.quant.install import _targets
    from engine.quant.scheme import AT_LOAD
    from engine.quant.weight_scale import mse_channel_quantize
    from engine.sampling_params import SamplingParams
    from kernels import ref_fp8

    dev, dt = torch.device("cpu"), torch.bfloat16
    llm = LLM(None, device="cpu", dtype="bfloat16", max_num_batched_tokens=1024,
              block_size=16)
    model = llm.engine.runner.model
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ref = [r.token_ids for r in llm.generate(fa.PROMPTS, params, chat=True)]
    prompts = [llm.encode(q, chat=True) for q in fa.PROMPTS]
    ids = llm.tokenizer.encode(fa.TEXT)
    n_pos = sum(len(r) for r in ref)

    def logits_and_ppl() -> tuple[list[torch.Tensor], float]:
        per = [fa.prompt_logits(model, p + r, dev, dt)[len(p) - 1:-1]
               for p, r in zip(prompts, ref, strict=True)]
        return per, fa.perplexity(fa.prompt_logits(model, ids, dev, dt), ids)

    base, ppl0 = logits_and_ppl()
    targets = list(_targets(model))
    orig = {full: getattr(p, a) for p, a, full in targets}

    def quantized(lin: nn.Linear, rule: str) -> Fp8Linear:
        w = lin.weight.detach()
        q, s = (mse_channel_quantize(w) if rule == "mse"
                else ref_fp8.quantize_weight(w, "channel"))
        out = Fp8Linear(lin.in_features, lin.out_features, lin.bias is not None, AT_LOAD,
                        dtype=w.dtype)
        with torch.no_grad():
            out.weight.copy_(q)
            out.weight_scale.copy_(s)
        return out

    cache: dict[tuple[str, str], Fp8Linear] = {}
    results = []

    def variant(name: str, rule: str, keep: Callable[[str], bool],
                weight_only: bool = False) -> None:
        t0 = time.perf_counter()
        for p, a, full in targets:
            if not keep(full):
                if (rule, full) not in cache:
                    cache[(rule, full)] = quantized(orig[full], rule)
                setattr(p, a, cache[(rule, full)])
        saved = fl.WEIGHT_ONLY_MAX_ROWS
        fl.WEIGHT_ONLY_MAX_ROWS = 10 ** 9 if weight_only else saved
        try:
            per, ppl = logits_and_ppl()
        finally:
            fl.WEIGHT_ONLY_MAX_ROWS = saved
            for p, a, full in targets:
                setattr(p, a, orig[full])
        tf = sum(int((x.argmax(-1) == torch.tensor(r)).sum()) for x, r in zip(per, ref,
                                                                               strict=True))
        pf = sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(per, base,
                                                                           strict=True))
        kl = sum(float(torch.nn.functional.kl_div(x.log_softmax(-1), y.log_softmax(-1),
                                                  log_target=True, reduction="sum"))
                 for x, y in zip(per, base, strict=True))
        r = {"name": name, "teacher_forced_match": round(tf / n_pos, 4),
             "match_bf16_prefill_argmax": round(pf / n_pos, 4),
             "mean_kl": round(kl / n_pos, 5), "ppl": round(ppl, 4),
             "ppl_ratio": round(ppl / ppl0, 4), "s": round(time.perf_counter() - t0, 1)}
        print(json.dumps(r), flush=True)
        results.append(r)

    def none(full: str) -> bool:
        return False

    def layers(*idx: int) -> Callable[[str], bool]:
        return lambda full: full.startswith(tuple(f"layers.{i}." for i in idx))

    last = model.cfg.num_layers - 1
    variant("amax scales, all layers", "amax", none)
    variant("mse scales, all layers", "mse", none)
    variant("amax scales, weight-only", "amax", none, weight_only=True)
    variant("mse scales, weight-only", "mse", none, weight_only=True)
    variant("mse scales, first and last layer bf16 (default)", "mse", layers(0, last))
    variant("mse scales, first layer bf16", "mse", layers(0))
    variant("mse scales, last layer bf16", "mse", layers(last))
    variant("mse scales, every down_proj bf16", "mse", lambda f: f.endswith("down_proj"))
    variant("mse scales, every o_proj bf16", "mse", lambda f: f.endswith("o_proj"))
    out = {"model": "smollm2", "device": "cpu", "dtype": "bfloat16", "positions": n_pos,
           "ppl_bf16": round(ppl0, 4),
           "teacher_forced_match_bf16_itself": round(
               sum(int((x.argmax(-1) == torch.tensor(r)).sum())
                   for x, r in zip(base, ref, strict=True)) / n_pos, 4),
           "variants": results, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    llm.close()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
