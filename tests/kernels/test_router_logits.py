"""The router-logits kernel (kernels/triton_router_logits.py) against HF's linear
(kernels.ref_moe.router_logits_ref): a float32 router over a bf16 hidden state (DeepSeek),
and a router in the model's dtype (Qwen3-MoE, Mixtral)."""

from __future__ import annotations

import pytest
import torch

from kernels.ref_moe import router_logits_ref


@pytest.mark.parametrize("t,e,h", [(1, 64, 512), (3, 20, 300), (16, 8, 256)])
def test_float32_router_on_a_bf16_hidden_state(t, e, h, gen, device):
    from kernels.triton_router_logits import router_logits

    x = torch.randn(t, h, generator=gen).to(device=device, dtype=torch.bfloat16)
    w = torch.randn(e, h, generator=gen).to(device)
    out = router_logits(x, w, torch.float32)
    assert out.dtype == torch.float32 and out.shape == (t, e)
    ref = router_logits_ref(x, w, torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    # the routing it feeds: the same experts in the same order
    assert torch.equal(out.topk(4, dim=1).indices, ref.topk(4, dim=1).indices)


def test_router_in_the_model_dtype_rounds_like_its_linear(gen, device):
    from kernels.triton_router_logits import router_logits

    x = torch.randn(2, 384, generator=gen).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(12, 384, generator=gen) * 0.05).to(device=device, dtype=torch.bfloat16)
    out = router_logits(x, w, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    ref = router_logits_ref(x.float(), w.float(), torch.float32).to(torch.bfloat16)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_no_tokens_and_bad_shapes(device):
    from kernels.triton_router_logits import router_logits

    w = torch.randn(8, 64, device=device)
    assert router_logits(torch.empty(0, 64, device=device), w, torch.float32).shape == (0, 8)
    with pytest.raises(ValueError, match="x, w: expected"):
        router_logits(torch.randn(2, 32, device=device), w, torch.float32)
