"""Routing and the MoE block against transformers' own modules (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import kernels_for
from engine.config import MoEConfig
from engine.models.moe import (
    MoE,
    SparseMoeBlock,
    full_param_to_local,
    parse_expert_name,
    select_experts,
)

KERNELS = kernels_for(torch.device("cpu"))


def _router_case(name: str, **cfg_kw: object):  # type: ignore[no-untyped-def]
    """An HF router module with random weights, and our select_experts' arguments."""
    import transformers as tf

    base = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                num_hidden_layers=1, vocab_size=64, intermediate_size=48)
    base.update(cfg_kw)
    if name == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        cfg = tf.Qwen3MoeConfig(**base)
        return Qwen3MoeTopKRouter(cfg), dict(renormalize=cfg.norm_topk_prob)
    if name == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

        return MixtralTopKRouter(tf.MixtralConfig(**base)), dict(renormalize=True)
    if name == "deepseek_v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        cfg = tf.DeepseekV2Config(**base)
        grouped = cfg.topk_method == "group_limited_greedy"
        return DeepseekV2TopkRouter(cfg), dict(
            renormalize=False, routed_scaling_factor=cfg.routed_scaling_factor,
            n_group=cfg.n_group if grouped else None,
            topk_group=cfg.topk_group if grouped else None)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = tf.DeepseekV3Config(**base)
    r = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        r.e_score_correction_bias.normal_(0, 0.5)
    return r, dict(scoring_func="sigmoid", renormalize=cfg.norm_topk_prob,
                   n_group=cfg.n_group, topk_group=cfg.topk_group,
                   routed_scaling_factor=cfg.routed_scaling_factor,
                   e_score_correction_bias=r.e_score_correction_bias)


CASES = [
    ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)),
    ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=False)),
    ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    ("deepseek_v2", dict(n_routed_experts=16, num_experts_per_tok=3, topk_method="greedy",
                         routed_scaling_factor=1.5)),
    ("deepseek_v2", dict(n_routed_experts=16, num_experts_per_tok=3,
                         topk_method="group_limited_greedy", n_group=4, topk_group=2,
                         routed_scaling_factor=16.0)),
    ("deepseek_v3", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                         norm_topk_prob=True, routed_scaling_factor=2.5)),
    ("deepseek_v3", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                         norm_topk_prob=False, routed_scaling_factor=1.0)),
]


def _as_sets(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    """Per token, expert -> weight (top-k order is not part of the contract)."""
    return [dict(zip(i.tolist(), w.tolist(), strict=True)) for w, i in zip(weights, ids,
                                                                            strict=True)]


@pytest.mark.parametrize("name,kw", CASES)
def test_select_experts_matches_transformers(name, kw):
    torch.manual_seed(0)
    router, args = _router_case(name, **kw)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        x = torch.randn(40, 32)
        _, hf_w, hf_ids = router(x)
        logits = torch.nn.functional.linear(x, router.weight.float())
        top_k = hf_ids.shape[1]
        w, ids = select_experts(logits, top_k, **args)
    assert w.dtype == torch.float32 and w.shape == ids.shape == hf_ids.shape
    ours, theirs = _as_sets(w, ids), _as_sets(hf_w.float(), hf_ids)
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() == b.keys()
        for e in a:
            assert a[e] == pytest.approx(b[e], rel=1e-6, abs=1e-7)


def test_grouped_topk_never_picks_outside_the_chosen_groups():
    torch.manual_seed(1)
    logits = torch.randn(64, 16)
    bias = torch.randn(16)
    _, ids = select_experts(logits, 4, scoring_func="sigmoid", renormalize=True, n_group=4,
                            topk_group=1, e_score_correction_bias=bias)
    # one group of four experts eligible: all four picks share it
    assert ((ids // 4) == (ids[:, :1] // 4)).all()


def test_select_experts_refuses_an_unknown_scoring_func():
    with pytest.raises(ValueError, match="scoring_func"):
        select_experts(torch.zeros(2, 4), 2, scoring_func="tanh", renormalize=False)


def test_moe_config_names_bad_fields():
    with pytest.raises(ValueError, match="n_group"):
        MoEConfig(num_experts=10, top_k=2, intermediate_size=8, layers=(0,),
                  renormalize=True, n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="scoring_func"):
        MoEConfig(num_experts=8, top_k=2, intermediate_size=8, layers=(0,),
                  renormalize=True, scoring_func="tanh")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEConfig(num_experts=4, top_k=5, intermediate_size=8, layers=(0,), renormalize=True)


def test_expert_names_parse():
    e = parse_expert_name("model.layers.3.mlp.experts.17.up_proj.weight")
    assert e is not None and (e.block, e.expert, e.proj) == ("model.layers.3.mlp", 17, "up")
    e = parse_expert_name("model.layers.0.block_sparse_moe.experts.2.w2.weight")
    assert e is not None and (e.expert, e.proj) == (2, "down")
    e = parse_expert_name("model.layers.0.mlp.experts.gate_up_proj")
    assert e is not None and (e.expert, e.proj) == (-1, "gate_up")
    assert parse_expert_name("model.layers.0.mlp.gate.weight") is None
    assert parse_expert_name("model.layers.0.mlp.shared_experts.up_proj.weight") is None


def _hf_qwen3_block(num_experts: int = 8, top_k: int = 2):  # type: ignore[no-untyped-def]
    import transformers as tf
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = tf.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=num_experts,
                            num_experts_per_tok=top_k, norm_topk_prob=True,
                            num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(2)
    hf = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    return hf


def _load_from_hf(block: SparseMoeBlock, hf) -> None:  # type: ignore[no-untyped-def]
    """HF's in-memory stacked experts, split into per-expert tensors as checkpoints hold
    them (exercising the per-expert path), plus the router."""
    inter = hf.experts.gate_up_proj.shape[1] // 2
    for j in range(hf.experts.gate_up_proj.shape[0]):
        block.experts.load_expert(j, "gate", hf.experts.gate_up_proj[j, :inter])
        block.experts.load_expert(j, "up", hf.experts.gate_up_proj[j, inter:])
        block.experts.load_expert(j, "down", hf.experts.down_proj[j])
    with torch.no_grad():
        block.gate.weight.copy_(hf.gate.weight)


def _moe_cfg(num_experts: int = 8, top_k: int = 2) -> MoEConfig:
    return MoEConfig(num_experts=num_experts, top_k=top_k, intermediate_size=24, layers=(0,),
                     renormalize=True)


def test_block_matches_transformers():
    hf = _hf_qwen3_block()
    block = SparseMoeBlock(_moe_cfg(), 32, KERNELS, None)
    _load_from_hf(block, hf)
    x = torch.randn(1, 9, 32)
    with torch.no_grad():
        torch.testing.assert_close(block(x[0]), hf(x)[0], rtol=1e-5, atol=1e-5)


def test_expert_shards_sum_to_the_whole():
    """Two ranks' partial outputs (each its half of the experts) add up to one rank's."""
    hf = _hf_qwen3_block()
    whole = SparseMoeBlock(_moe_cfg(), 32, KERNELS, None)
    _load_from_hf(whole, hf)
    x = torch.randn(11, 32)
    parts = []
    for rank in range(2):
        part = SparseMoeBlock(_moe_cfg(), 32, KERNELS, None, rank=rank, size=2)
        _load_from_hf(part, hf)  # drops the other rank's experts
        assert part.experts.w13.shape[0] == 4
        with torch.no_grad():
            parts.append(part(x))
    with torch.no_grad():
        ref = whole(x)
    assert not torch.allclose(parts[0], ref, atol=1e-3)  # each rank alone is partial
    torch.testing.assert_close(parts[0] + parts[1], ref, rtol=1e-5, atol=1e-5)


def test_stacked_checkpoint_tensors_load_too():
    hf = _hf_qwen3_block()
    block = SparseMoeBlock(_moe_cfg(), 32, KERNELS, None, rank=1, size=2)
    assert block.experts.load_expert(-1, "gate_up", hf.experts.gate_up_proj)
    assert block.experts.load_expert(-1, "down", hf.experts.down_proj)
    torch.testing.assert_close(block.experts.w13.data, hf.experts.gate_up_proj.data[4:])
    assert not block.experts.load_expert(0, "down", hf.experts.down_proj[0])  # rank 0's


def test_experts_must_divide_over_ranks():
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        MoE(6, 32, 24, KERNELS, rank=0, size=4)


def test_full_param_to_local_takes_the_rank_slice():
    full = torch.arange(8 * 6 * 4, dtype=torch.float32).view(8, 6, 4)
    assert torch.equal(full_param_to_local("layers.0.mlp.experts.w13", full, 1, 2), full[4:])
    sh = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)  # [2I, H], I = 4
    got = full_param_to_local("mlp.shared_experts.gate_up_proj.weight", sh, 1, 2)
    assert torch.equal(got, torch.cat([sh[2:4], sh[6:8]]))


def _hf_deepseek_block(arch: str, **kw: object):  # type: ignore[no-untyped-def]
    """transformers' DeepSeek MoE block (router, routed and shared experts), random, and
    the config dict a checkpoint's config.json would hold."""
    import transformers as tf

    base: dict[str, object] = dict(hidden_size=32, moe_intermediate_size=24,
                                   intermediate_size=64, num_attention_heads=4,
                                   num_hidden_layers=3, first_k_dense_replace=1,
                                   n_routed_experts=16, n_shared_experts=2,
                                   num_experts_per_tok=4)
    base.update(kw)
    if arch == "deepseek_v2":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

        cfg = tf.DeepseekV2Config(**base)
        hf = DeepseekV2Moe(cfg)
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        cfg = tf.DeepseekV3Config(**base)
        hf = DeepseekV3MoE(cfg)
    torch.manual_seed(4)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        if arch == "deepseek_v3":
            hf.gate.e_score_correction_bias.normal_(0, 0.3)
    return hf.eval(), cfg.to_dict()


def _deepseek_block_from(moe: MoEConfig, sd: dict, arch: str, rank: int,
                         size: int) -> SparseMoeBlock:
    """Rank `rank` of `size`'s block, loaded from transformers' block state dict `sd`."""
    block = SparseMoeBlock(moe, 32, KERNELS, None, rank=rank, size=size)
    block.experts.load_expert(-1, "gate_up", sd["experts.gate_up_proj"])
    block.experts.load_expert(-1, "down", sd["experts.down_proj"])
    assert block.shared_experts is not None
    for proj in ("gate", "up", "down"):
        block.shared_experts.load(proj, sd[f"shared_experts.{proj}_proj.weight"])
    with torch.no_grad():
        block.gate.weight.copy_(sd["gate.weight"])
        if arch == "deepseek_v3":
            block.gate.e_score_correction_bias.copy_(sd["gate.e_score_correction_bias"])
    return block


@pytest.mark.parametrize("arch,kw", [
    ("deepseek_v2", dict(topk_method="greedy", routed_scaling_factor=1.0)),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                         routed_scaling_factor=16.0)),
    ("deepseek_v3", dict(n_group=4, topk_group=2, routed_scaling_factor=2.5,
                         norm_topk_prob=True)),
])
@pytest.mark.parametrize("tp,fold", [(1, False), (1, True), (2, False), (2, True)])
def test_deepseek_block_matches_transformers(arch, kw, tp, fold):
    """The block the MLA family builds from a DeepSeek config (moe_config_from_hf), loaded
    from transformers' stacked experts, equals transformers' block; under TP the ranks'
    parts (routed experts and shared-expert columns) sum to it. fold: finish_load stacks
    the shared experts after the routed ones (one rank only; under TP it keeps them)."""
    from engine.config import moe_config_from_hf

    hf, cfg = _hf_deepseek_block(arch, **kw)
    moe = moe_config_from_hf(cfg, arch)
    assert moe is not None and moe.layers == (1, 2) and moe.n_shared_experts == 2
    sd = hf.state_dict()
    x = torch.randn(13, 32)
    total = torch.zeros(13, 32)
    for rank in range(tp):
        block = _deepseek_block_from(moe, sd, arch, rank, tp)
        if fold:
            block.finish_load()
            folded = tp == 1
            assert block.folded_shared == (2 if folded else 0)
            assert (block.shared_experts is None) == folded
            assert block.experts.w13.shape[0] == 16 // tp + block.folded_shared
            weights, ids = block.route(x)
            assert ids.shape[1] == 4 + block.folded_shared
        total += block(x)
    with torch.no_grad():
        ref = hf(x.unsqueeze(0))[0]
    torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_folded_shared_experts_as_dense_gemms_from_min_tokens(arch, monkeypatch):
    """From SHARED_DENSE_MIN_TOKENS tokens the folded shared experts run as dense GEMMs on
    their rows of the stack (routing leaves them out); below it they stay in the fused
    kernel. Both equal transformers' block."""
    import engine.models.moe as moe_mod
    from engine.config import moe_config_from_hf

    hf, cfg = _hf_deepseek_block(arch)
    moe = moe_config_from_hf(cfg, arch)
    assert moe is not None
    sd = hf.state_dict()
    block = _deepseek_block_from(moe, sd, arch, 0, 1)
    block.finish_load()
    assert block.folded_shared == 2
    seen = []
    real = block.experts.forward
    monkeypatch.setattr(block.experts, "forward",
                        lambda x, w, ids: seen.append(ids.shape[1]) or real(x, w, ids))
    monkeypatch.setattr(moe_mod, "SHARED_DENSE_MIN_TOKENS", 8)
    for n, routed_cols in ((13, 4), (5, 4 + 2)):  # 13 >= 8: dense; 5: folded
        x = torch.randn(n, 32)
        seen.clear()
        out = block(x)
        assert seen == [routed_cols]
        with torch.no_grad():
            ref = hf(x.unsqueeze(0))[0]
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch,field,value", [
    ("deepseek_v2", "topk_method", "noaux_tc"),
    ("deepseek_v2", "norm_topk_prob", True),
    ("deepseek_v3", "scoring_func", "softmax"),
    ("deepseek_v3", "topk_method", "group_limited_greedy"),
    ("deepseek_v3", "moe_layer_freq", 2),
])
def test_deepseek_fields_not_implemented_are_refused_by_name(arch, field, value):
    from engine.config import moe_config_from_hf

    _, cfg = _hf_deepseek_block(arch)
    cfg[field] = value
    with pytest.raises(ValueError, match=field):
        moe_config_from_hf(cfg, arch)


def test_qwen3_moe_block_in_bf16_rounds_weights_as_transformers():
    """Qwen3-MoE rounds its top-k weights to the model dtype; the block does the same."""
    hf = _hf_qwen3_block().to(torch.bfloat16)
    cfg = MoEConfig(num_experts=8, top_k=2, intermediate_size=24, layers=(0,),
                    renormalize=True, weights_in_model_dtype=True)
    block = SparseMoeBlock(cfg, 32, KERNELS, None).to(torch.bfloat16)
    _load_from_hf(block, hf)
    x = torch.randn(5, 32).to(torch.bfloat16)
    w, _ = block.route(x)
    assert torch.equal(w, w.to(torch.bfloat16).float())
    with torch.no_grad():
        out, ref = block(x).float(), hf(x.unsqueeze(0))[0].float()
    assert float((out - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_shared_down_as_one_gemm_is_hfs_weight(arch, monkeypatch):
    """SHARED_DOWN_ONE_GEMM: the shared experts' down projections run as one GEMM on the
    weight HF holds ([H, S * I], rebuilt bit for bit from the stack's rows), and the block
    still equals transformers' (float32); off, the batched form does."""
    import engine.models.moe as moe_mod
    import engine.models.moe_prefill as mp
    from engine.config import moe_config_from_hf

    hf, cfg = _hf_deepseek_block(arch)
    moe = moe_config_from_hf(cfg, arch)
    assert moe is not None
    block = _deepseek_block_from(moe, hf.state_dict(), arch, 0, 1)
    block.finish_load()
    monkeypatch.setattr(moe_mod, "SHARED_DENSE_MIN_TOKENS", 8)
    x = torch.randn(13, 32)
    with torch.no_grad():
        ref = hf(x.unsqueeze(0))[0]
    calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(1) or real_bmm(*a, **k))
    for on in (False, True):
        monkeypatch.setattr(mp, "SHARED_DOWN_ONE_GEMM", on)
        calls.clear()
        torch.testing.assert_close(block(x), ref, rtol=1e-5, atol=1e-5)
        assert calls == ([] if on else [1])
    assert torch.equal(mp._shared_down(block), hf.shared_experts.down_proj.weight)


def test_router_weight_in_16_bits_only_where_exact():
    """ROUTER_MM_MIN_TOKENS takes a 16-bit copy of the float32 router weight only where it
    converts exactly (a bf16 checkpoint's router), and off CUDA keeps the float32 GEMM."""
    import engine.models.moe_prefill as mp

    class Block:
        pass

    exact = torch.randn(8, 32).to(torch.bfloat16).float()
    assert torch.equal(mp._router_weight(Block(), exact, torch.bfloat16).float(), exact)
    inexact = exact + 1e-4
    assert mp._router_weight(Block(), inexact, torch.bfloat16) is None
    x = torch.randn(40, 32).to(torch.bfloat16)
    old = mp.ROUTER_MM_MIN_TOKENS
    try:
        mp.ROUTER_MM_MIN_TOKENS = 16
        got = mp.router_logits_fp32(Block(), x, exact)  # CPU: the float32 GEMM
    finally:
        mp.ROUTER_MM_MIN_TOKENS = old
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.nn.functional.linear(x.float(), exact))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_router_logits_on_tensor_cores_match_the_float32_gemm(monkeypatch):
    """On CUDA, a prefill's router logits from the bf16 GEMM with float32 output equal the
    float32 GEMM's within float32 summation order, and route the same experts."""
    import engine.models.moe_prefill as mp

    class Block:
        pass

    gen = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(64, 2048, device="cuda", generator=gen).to(torch.bfloat16).float()
    x = torch.randn(4096, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), w)
    monkeypatch.setattr(mp, "ROUTER_MM_MIN_TOKENS", 1024)
    got = mp.router_logits_fp32(Block(), x, w)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    top_got, top_want = got.topk(6).indices, want.topk(6).indices
    assert (top_got == top_want).float().mean() > 0.999
