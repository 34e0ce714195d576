"""Qwen3's per-head q/k RMSNorms run inside the RoPE + KV store kernel
(engine.models.llama.FUSED_QK_NORM, kernels/triton_rope_kv.py): the engine's tokens and
logprobs are those of the separate norms, and on the GPU its greedy tokens are still
transformers'."""

from __future__ import annotations

import pytest
import torch
from tiny_models import PROMPTS, hf_greedy

from engine.sampling_params import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(make_llm, path: str, fused: bool, monkeypatch, **kw):  # type: ignore[no-untyped-def]
    import engine.models.llama as llama

    monkeypatch.setattr(llama, "FUSED_QK_NORM", fused)
    llm = make_llm(path, max_num_seqs=4, max_model_len=128, **kw)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=2)
    return [(o.token_ids, [r.logprob for r in o.logprobs])
            for o in llm.generate(PROMPTS[:3], params)]


def test_fused_qk_norm_is_the_separate_norms_on_cpu(make_llm, tiny_models, monkeypatch):
    # the reference kernels do the same operations either way: equal bit for bit
    on = _run(make_llm, tiny_models["qwen3"], True, monkeypatch, block_size=4)
    off = _run(make_llm, tiny_models["qwen3"], False, monkeypatch, block_size=4)
    assert all(len(toks) == 12 for toks, _ in on)
    assert on == off


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_qk_norm_on_the_gpu(make_llm, tiny_models, monkeypatch, dtype):
    # graphed decode and prefill graphs included (the engine's CUDA defaults)
    path = tiny_models["qwen3"]
    on = _run(make_llm, path, True, monkeypatch, device="cuda", dtype=dtype)
    off = _run(make_llm, path, False, monkeypatch, device="cuda", dtype=dtype)
    # the fused kernel sums a head's squares in two halves: float32 summation order only
    assert [t for t, _ in on] == [t for t, _ in off]
    for (_, lp_on), (_, lp_off) in zip(on, off, strict=True):
        assert max(abs(a - b) for a, b in zip(lp_on, lp_off, strict=True)) < (
            1e-4 if dtype == "float32" else 5e-2)
    if dtype == "float32":
        for prompt, (toks, _) in zip(PROMPTS[:3], on, strict=True):
            assert toks == hf_greedy(path, prompt, 12), prompt


@pytest.mark.gpu
@needs_cuda
def test_split_k_qkv_with_qk_norms_on_the_gpu(make_llm, tiny_models, monkeypatch):
    # engine.models.split_k.QK_NORM (off until timed): qkv_proj's float32 partial sums at
    # few rows, added by the RoPE + KV store kernel before the q/k norms it applies
    import engine.models.split_k as split_k

    path = tiny_models["qwen3"]
    monkeypatch.setattr(split_k, "QK_NORM", True)
    on = _run(make_llm, path, True, monkeypatch, device="cuda", dtype="float32")
    monkeypatch.setattr(split_k, "QK_NORM", False)
    off = _run(make_llm, path, True, monkeypatch, device="cuda", dtype="float32")
    assert [t for t, _ in on] == [t for t, _ in off]
    for (_, lp_on), (_, lp_off) in zip(on, off, strict=True):
        assert max(abs(a - b) for a, b in zip(lp_on, lp_off, strict=True)) < 1e-4
    for prompt, (toks, _) in zip(PROMPTS[:3], on, strict=True):
        assert toks == hf_greedy(path, prompt, 12), prompt
