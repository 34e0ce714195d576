"""The dense model's RMSNorm and SiLU x mul hand an FP8 layer its input already quantized
(engine/quant/fp8_input.py) wherever the layer would quantize it per row itself, and the
model computes the same as with the separate quantizer: the same tokens and logprobs."""

from __future__ import annotations

import pytest
import torch

PROMPTS = [[1 + (7 * i) % 90 for i in range(40)], [5, 6, 7] * 9, [11] * 3]


def _run(make_llm, model: str, monkeypatch, fused: bool, **kw) -> tuple[list, dict[str, int]]:
    """Greedy tokens and logprobs with fusion on or off, and how often each fused kernel
    ran (counted at the kernel modules, which the kernel set imports when built)."""
    import engine.quant.fp8_input as fi
    import kernels.ref_act as ra
    import kernels.ref_norm as rn

    monkeypatch.setattr(fi, "FUSED", fused)
    calls = {"norm": 0, "act": 0}
    wrapped = []
    for mod, name, key in ((rn, "rms_norm_quant_ref", "norm"),
                           (ra, "silu_and_mul_quant_ref", "act")):
        if kw.get("device") == "cuda":
            import kernels.triton_act as ta
            import kernels.triton_norm as tn

            mod, name = {"norm": (tn, "rms_norm_quant"), "act": (ta, "silu_and_mul_quant")}[key]
        inner = getattr(mod, name)

        def count(*a, _inner=inner, _key=key, **k):
            calls[_key] += 1
            return _inner(*a, **k)

        wrapped.append((mod, name, count))
    for mod, name, count in wrapped:
        monkeypatch.setattr(mod, name, count)
    from engine.sampling_params import SamplingParams

    llm = make_llm(model, quantization="fp8", **kw)
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0, logprobs=2)
    outs = [(o.token_ids, [r.logprob for r in o.logprobs])
            for o in llm.generate(PROMPTS, params)]
    return outs, calls


def _same(a: list, b: list, tol: float) -> None:
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, x), (_, y) in zip(a, b, strict=True):
        assert max(abs(p - q) for p, q in zip(x, y, strict=True)) <= tol


def test_fused_quantization_computes_what_the_quantizer_did(make_llm, tiny_models, monkeypatch):
    """CPU: the torch references on both sides; a 40-token prefill (past the weight-only
    rows) takes the fused kernels in every layer, the decode steps (3 rows) do not."""
    fused, calls = _run(make_llm, tiny_models["llama"], monkeypatch, True, block_size=4)
    plain, none = _run(make_llm, tiny_models["llama"], monkeypatch, False, block_size=4)
    assert calls["norm"] > 0 and calls["act"] > 0, calls
    assert none == {"norm": 0, "act": 0}
    _same(fused, plain, 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_quantization_on_the_gpu(make_llm, tiny_models, monkeypatch):
    """The Triton kernels, prefill eager and decode in CUDA graphs: the same bytes reach
    the FP8 product, so the same tokens and logprobs."""
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=128)
    fused, calls = _run(make_llm, tiny_models["llama"], monkeypatch, True, **kw)
    plain, none = _run(make_llm, tiny_models["llama"], monkeypatch, False, **kw)
    assert calls["norm"] > 0 and calls["act"] > 0, calls
    assert none == {"norm": 0, "act": 0}
    _same(fused, plain, 1e-5)
