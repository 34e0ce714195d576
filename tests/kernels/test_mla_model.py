"""The DeepSeek model with every Triton kernel it uses (latent store, rope, RMSNorm,
MLA prefill, MLA decode and its per-head products, fused MoE, router logits) under the
interpreter: logits equal transformers' through
chunked prefill and an absorbed decode step. On a GPU machine the engine test
tests/engine/test_deepseek.py::test_cuda_triton_and_graphs_equal_transformers covers this
with CUDA graphs."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter run; -m gpu covers the device")
@pytest.mark.parametrize("name", ["v2", "v3"])
def test_triton_kernels_give_transformers_logits(name, tmp_path, monkeypatch):
    import transformers as tf
    from tiny_deepseek import MODELS, engine_logits, make_tiny_deepseek

    import engine.attention as att
    from engine.attention import KernelSet
    from kernels.triton_act import silu_and_mul
    from kernels.triton_decode_attention import decode_attention
    from kernels.triton_mla_decode import mla_decode
    from kernels.triton_mla_prefill import mla_prefill
    from kernels.triton_moe import fused_moe
    from kernels.triton_norm import rms_norm, rope
    from kernels.triton_prefill_attention import prefill_attention
    from kernels.triton_router_logits import router_logits
    from kernels.triton_store_kv import store_kv, store_latent

    tri = KernelSet(store_kv, prefill_attention, decode_attention, rms_norm, rope, "triton",
                    silu_and_mul, fused_moe=fused_moe, store_latent=store_latent,
                    mla_decode=mla_decode, mla_prefill=mla_prefill,
                    router_logits=router_logits)
    monkeypatch.setattr(att, "kernels_for", lambda device, force_reference=False: tri)
    version, kw = MODELS[name]
    path = make_tiny_deepseek(str(tmp_path / name), version, **kw)
    prompt = list(range(10, 23))
    hf = tf.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].float()
    for host in (True, False):
        got = engine_logits(path, prompt, chunk=5, host=host)
        err = (got - want).abs().max().item()
        assert err < 2e-4 * want.abs().max().item(), (host, err)
