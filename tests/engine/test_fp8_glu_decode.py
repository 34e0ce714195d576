"""An FP8 model's graphed decode with the MLP's activation in the gate_up GEMV
(engine.quant.fp8_linear.GLU_MAX_ROWS, kernels/triton_fp8_weight_only.fp8_weight_only_glu)
gives the same tokens and the same logprobs, bit for bit, as with the separate SiLU x mul
kernel: the fused epilogue rounds gate and up as the unfused path stores them."""

from __future__ import annotations

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_fp8_decode_is_the_same_with_the_activation_fused(make_llm, tiny_models, monkeypatch):
    import engine.quant.fp8_linear as fl
    import kernels.triton_fp8_weight_only as wo
    from engine.sampling_params import SamplingParams

    calls = []
    real = wo.fp8_weight_only_glu

    def counted(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)

    monkeypatch.setattr(wo, "fp8_weight_only_glu", counted)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11] * 17]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=2)
    outs = {}
    on = fl.GLU_MAX_ROWS
    assert fl.GLU_MIN_ROWS <= 3 <= on  # the three prompts' decode takes the fused form
    for rows in (0, on):
        monkeypatch.setattr(fl, "GLU_MAX_ROWS", rows)
        calls.clear()
        llm = make_llm(tiny_models["llama"], device="cuda", dtype="bfloat16", max_num_seqs=4,
                       max_model_len=128, quantization="fp8")
        assert llm.engine.runner.graphs.use_graphs
        outs[rows] = [(o.token_ids, [r.logprob for r in o.logprobs])
                      for o in llm.generate(prompts, params)]
        # off: never called; on: only the graph of four rows (the three prompts' decode,
        # padded), from GLU_MIN_ROWS
        assert set(calls) == (set() if rows == 0 else {4}), (rows, sorted(set(calls)))
    assert all(len(toks) == 12 for toks, _ in outs[0])
    assert outs[on] == outs[0]
