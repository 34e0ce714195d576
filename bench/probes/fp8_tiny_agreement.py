"""CPU: how far greedy tokens of the tests' tiny random models agree between FP8 and the same
model with dequantized weights, free-running and teacher-forced, beside the unquantized model.

Why the GPU FP8 engine tests judge by teacher-forced agreement bounded by the float model's
(tests/engine/test_fp8_moe.py, test_fp8_checkpoints.py): on these models free-running
agreement is low whatever the kernels, because one near-tie flips a token and the rest of
the answer follows it.

    PYTHONPATH=$PWD:$PWD/proto python bench/probes/fp8_tiny_agreement.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from fp8_models import PROJ, teacher_forced_agreement, write_fp8, write_rows_dequantized  # noqa: E402
from tiny_models import PROMPTS, make_tiny_model  # noqa: E402

STEPS = 16
# the GPU tests' models: test_fp8_moe.py's WIDE Qwen3-MoE, test_fp8_checkpoints.py's BLOCKY llama
MODELS = {
    "qwen3_moe": dict(seed=8, hidden_size=256, moe_intermediate_size=256),
    "llama": dict(seed=3, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.05),
}
FORMATS = {"qwen3_moe": ("fp8_block", "ct_channel", "at_load"),
           "llama": ("fp8_block", "ct_channel", "ct_tensor_static")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    common = dict(device="cpu", dtype=args.dtype, block_size=4, max_num_seqs=8)
    work = tempfile.mkdtemp()
    rows = []
    for arch, kw in MODELS.items():
        src = make_tiny_model(os.path.join(work, arch), arch, **kw)
        for fmt in FORMATS[arch]:
            out = os.path.join(work, f"{arch}-{fmt}")
            if fmt == "at_load":
                path, qkw = src, {"quantization": "fp8"}
                deq = write_rows_dequantized(
                    src, out + "-deq", lambda n: n.endswith(".weight") and n.split(".")[-2] in PROJ)
            else:
                (path, deq), qkw = write_fp8(src, out, out + "-deq", fmt), {}
            with LLM(deq, **common) as llm:
                ref = [r.token_ids for r in llm.generate(PROMPTS, params)]
            row = {"model": arch, "format": fmt, "positions": STEPS * len(PROMPTS)}
            for name, p, extra in (("fp8", path, qkw), ("float", src, {})):
                with LLM(p, **common, **extra) as llm:
                    got = [g.token_ids for g in llm.generate(PROMPTS, params)]
                    row[f"{name}_free_running"] = sum(
                        a == b for x, y in zip(got, ref, strict=True)
                        for a, b in zip(x, y, strict=True))
                    row[f"{name}_teacher_forced"] = teacher_forced_agreement(llm, PROMPTS, ref)
            print(json.dumps(row), flush=True)
            rows.append(row)


if __name__ == "__main__":
    main()
