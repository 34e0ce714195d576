"""FP8 checkpoints under tensor parallelism (gloo on CPU): each rank reads its rows or
columns of the FP8 weight and the matching part of its scales (block scales cut in block
units); TP2 greedy tokens equal TP1's."""

from __future__ import annotations

import pytest
from fp8_models import write_fp8
from tiny_models import PROMPTS, make_tiny_model

from engine.llm import LLM
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# head_dim 128: a rank's heads are whole 128-row weight blocks; the MLP's 256 columns per
# rank are two whole 128-column blocks of down_proj
HEAD128 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=2,
               num_key_value_heads=2, head_dim=128)


def _generate(path: str, budget: int, **kw: object) -> list[list[int]]:
    with LLM(path, block_size=4, max_num_batched_tokens=budget, **kw) as llm:
        return [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("fmt,overrides,budget", [
    ("fp8_block", HEAD128, 64),  # prompts of up to 50 rows: FP8 x FP8 prefill
    ("ct_channel", {}, 16),  # weight-only steps: per-row activation scales would see
    # a rank's columns only, so TP2 would round otherwise than TP1
])
def test_fp8_tp2_equals_tp1(tmp_path, fmt, overrides, budget):
    src = make_tiny_model(str(tmp_path / "src"), "llama", seed=5, **overrides)
    fp8, _ = write_fp8(src, str(tmp_path / "fp8"), str(tmp_path / "deq"), fmt)
    tp1 = _generate(fp8, budget)
    assert _generate(fp8, budget, tensor_parallel_size=2) == tp1


def test_block_cut_inside_a_weight_block_is_refused(tmp_path):
    src = make_tiny_model(str(tmp_path / "src"), "llama", seed=5, hidden_size=128,
                          intermediate_size=256)  # heads of 32 rows: a TP2 cut at row 64
    fp8, _ = write_fp8(src, str(tmp_path / "fp8"), str(tmp_path / "deq"), "fp8_block")
    with pytest.raises(ValueError, match="weight_block_size.*--tensor-parallel-size 2"):
        LLM(fp8, block_size=4, tensor_parallel_size=2)
