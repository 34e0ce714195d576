"""Kernels per layer of a DeepSeek decode step, and of an eager prefill step
(bench/decode_op_count.py: the CUDA kernel set run by Triton's interpreter, aten operators
counted beside the Triton launches). At batch 1 in a CUDA graph each kernel costs a few
microseconds whatever its size; in an eager prefill each costs the host its launch path.
So these bounds fail a change that adds launches to a layer."""

from __future__ import annotations

import pytest
import torch

# kernels per layer at most: (dense first layer, MoE layer). V2 (V2-Lite's layout: q_proj,
# ungrouped softmax routing, 2 shared experts): norms 2, one GEMM for q and kv_a, the latent
# kernel (its rotated q_pe written into the absorbed query), the W_UK product (into the same
# query), MLA decode, the W_UV product (in o_proj's row order), o_proj; then the dense MLP 3,
# or the router's logits, routing 1 and the fused experts' align, gate/up, down and sum, the
# shared experts stacked among them. V3 adds the q LoRA's norm and second GEMM, and routes
# by expert groups in the same routing kernel. Up to engine.models.mla.ABSORB_KERNEL_MAX_ROWS
# rows the two per-head products are Triton kernels (_absorb_kernel, _up_kernel), past it two
# cuBLAS bmm; up to engine.models.moe.ROUTER_LOGITS_MAX_TOKENS the router's logits are one
# Triton kernel (_router_logits_kernel) in place of a float32 GEMM. Up to
# kernels.triton_moe.PER_PAIR_MAX_TOKENS tokens the experts run without the align step.
# With FUSED_LATENT_ABSORB (on by default since session 37) the latent kernel and the W_UK
# product are one launch, up to ABSORB_KERNEL_MAX_ROWS rows.
BOUNDS = {("v2", 1): (10, 12), ("v2", 3): (10, 13), ("v2", 8): (11, 14), ("v3", 1): (12, 14)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the interpreter's launches")
@pytest.mark.parametrize("version,batch", sorted(BOUNDS))
def test_decode_step_kernels_per_layer(version, batch, tmp_path):
    from bench.decode_op_count import count_decode_step, write_config

    counts = count_decode_step(write_config(str(tmp_path / "config.json"), version),
                               batch=batch)
    from engine.models.mla import ABSORB_KERNEL_MAX_ROWS, FUSED_LATENT_ABSORB
    from engine.models.moe import ROUTER_LOGITS_MAX_TOKENS
    from kernels.triton_moe import PER_PAIR_MAX_TOKENS

    dense, moe = BOUNDS[(version, batch)]
    assert counts["layer.0"].total <= dense, counts["layer.0"]
    for layer in ("layer.1", "layer.2"):
        c = counts[layer]
        assert c.total <= moe, (layer, c)
        # the shared experts run inside the fused kernel: no separate MLP, no add
        assert c.triton["_gate_up_kernel"] == 1 and "_silu_and_mul_kernel" not in c.triton
        assert "add" not in c.aten
        assert "_rope_kernel" not in c.triton
        assert c.triton["_route_kernel"] == 1 and "topk" not in c.aten
        assert "cat" not in c.aten
        if batch <= ABSORB_KERNEL_MAX_ROWS:
            # the latent kernel and the W_UK product: one launch with FUSED_LATENT_ABSORB
            fused = FUSED_LATENT_ABSORB
            assert c.triton["_latent_absorb_kernel"] == fused, c
            assert c.triton["_mla_latent_kernel"] == c.triton["_absorb_kernel"] == (not fused)
            # the W_UV product (with FUSED_UP_MERGE, the merge of a split context inside
            # it: tests/kernels/test_mla_up_merge.py counts that at a context that splits)
            assert c.triton["_up_kernel"] + c.triton["_up_merge_kernel"] == 1, c
            assert "bmm" not in c.aten
        else:
            assert c.triton["_mla_latent_kernel"] == 1
            assert c.aten["bmm"] == 2 and "_absorb_kernel" not in c.triton
        assert c.triton["_router_logits_kernel"] == (batch <= ROUTER_LOGITS_MAX_TOKENS)
        assert ("_align_kernel" in c.triton) == (batch > PER_PAIR_MAX_TOKENS)
    # the step's ends: the embedding, then the final norm and the head
    assert counts["embed"].total == 1 and counts["head"].total == 2


# kernels per MoE layer of an eager prefill at most: the decode layer's, with the two
# projections MLA's prefill adds (kv_b_proj's decompression, and gathering the request's
# latent rows: its block ids, then the rows), the align step's three launches past
# kernels.triton_moe_align.ALIGN_ONE_PROGRAM_MAX_PAIRS, the router's float32 GEMM and its
# input's cast. The torch align ops (a dozen and more, a sort among them) and the queries'
# gathers and the output's scatter of a prefill group were 34 more (bench/RESULTS.md).
PREFILL_MOE_BOUND = 18


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the interpreter's launches")
def test_prefill_step_kernels_per_layer(tmp_path, monkeypatch):
    import kernels.triton_moe_align as ma
    from bench.decode_op_count import count_prefill_step, write_config

    # a prefill's pair count on a small model: 24 tokens x 4 pairs take the prefill align
    monkeypatch.setattr(ma, "ALIGN_ONE_PROGRAM_MAX_PAIRS", 16)
    counts = count_prefill_step(write_config(str(tmp_path / "config.json"), "v2"), 24)
    for layer in ("layer.1", "layer.2"):
        c = counts[layer]
        assert c.total <= PREFILL_MOE_BOUND, (layer, c)
        assert {k: c.triton[k] for k in ("_multi_count_kernel", "_multi_scan_kernel",
                                          "_multi_place_kernel")} == dict.fromkeys(
            ("_multi_count_kernel", "_multi_scan_kernel", "_multi_place_kernel"), 1)
        # one run of rows: no gather of the queries, no scatter of the output
        assert "index_put_" not in c.aten and c.aten["index"] <= 2
        assert "sort" not in c.aten


def test_qwen3_moe_layout_counts(tmp_path):
    # the GQA cache ([layers, 2, block, kv heads, head dim] a block) and Qwen3's per-head
    # q/k norms inside the RoPE + KV store kernel: every layer is an MoE layer
    from bench.decode_op_count import count_decode_step, write_config

    counts = count_decode_step(write_config(str(tmp_path / "config.json"), "qwen3"))
    layers = [k for k in counts if k.startswith("layer.")]
    assert len(layers) == 3
    for layer in layers:
        c = counts[layer]
        assert c.triton["_rope_store_kv_kernel"] == 1 and c.triton["_decode_kernel"] == 1
        assert c.triton["_router_logits_kernel"] == c.triton["_gate_up_kernel"] == 1
        assert c.triton["_rms_norm_kernel"] == 2  # no separate q/k norm launches
