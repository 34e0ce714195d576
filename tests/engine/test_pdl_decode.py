"""The graphed decode of an FP8 model with programmatic dependent launch (kernels/pdl.py)
on and off gives the same tokens: the FP8 GEMV, the norms, RoPE + KV store, decode
attention and SiLU x mul are all launched with it. The same for a DeepSeek model (MLA and
MoE layers): its latent kernel, MLA decode and merge, routing, the experts' align, gate/up,
down and sum."""

from __future__ import annotations

import pytest
import torch

needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="PDL needs a CUDA GPU of compute capability 9.0 or later")


def _decode(make_llm, model: str, **kw) -> list:
    from engine.sampling_params import SamplingParams

    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11] * 17]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=2)
    llm = make_llm(model, device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=128,
                   **kw)
    assert llm.engine.runner.graphs.use_graphs
    return [(o.token_ids, [r.logprob for r in o.logprobs])
            for o in llm.generate(prompts, params)]


@pytest.mark.gpu
@needs_sm90
def test_fp8_decode_is_the_same_with_pdl_on_and_off(make_llm, tiny_models, monkeypatch):
    import kernels.pdl as pdl

    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)
        outs[on] = _decode(make_llm, tiny_models["llama"], quantization="fp8")
    _same(outs)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("version", ["v2", "v3"])
def test_deepseek_decode_is_the_same_with_pdl_on_and_off(make_llm, tmp_path, monkeypatch,
                                                          version):
    from tiny_deepseek import MODELS, make_tiny_deepseek

    import kernels.pdl as pdl

    v, kw = MODELS[version]
    path = make_tiny_deepseek(str(tmp_path / version), v, seed=3, **kw)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)
        outs[on] = _decode(make_llm, path, block_size=16)
    _same(outs)


def _same(outs: dict) -> None:
    assert all(len(toks) == 12 for toks, _ in outs[True])
    assert [t for t, _ in outs[True]] == [t for t, _ in outs[False]]
    for (_, a), (_, b) in zip(outs[True], outs[False], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-2
