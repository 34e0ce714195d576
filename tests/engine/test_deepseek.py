"""DeepSeek-V2/V3 (MLA attention) on tiny random transformers models, CPU fp32: greedy tokens
equal transformers', logits of chunked prefill and of absorbed decode within tolerance, the
latent KV layout, config fields refused by name, dummy weights, tensor parallelism.

These configs are dense (first_k_dense_replace >= layers); the MoE layers are
engine/models/moe.py's."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from tiny_deepseek import BASE, MODELS, engine_logits, make_tiny_deepseek
from tiny_models import PROMPTS, hf_greedy

from engine.config import ModelConfig
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def ds_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek")
    return {name: make_tiny_deepseek(os.path.join(root, name), v, seed=i, **kw)
            for i, (name, (v, kw)) in enumerate(MODELS.items())}


GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("name,budget", [("v2", 16), ("v2", 512), ("v3", 16),
                                         ("v3-noninterleaved", 16)])
def test_greedy_matches_transformers(ds_models, make_llm, name, budget):
    path = ds_models[name]
    # budget 16: prompts prefill in chunks that read earlier chunks' latent from the cache,
    # mixed with other requests' decodes; 512: whole prompts, then pure decode steps
    llm = make_llm(path, block_size=4, max_num_batched_tokens=budget)
    results = llm.generate(PROMPTS, GREEDY)
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.token_ids == hf_greedy(path, prompt, GREEDY.max_tokens), (name, prompt)


@pytest.mark.parametrize("name,host", [("v2", True), ("v3", True), ("v3", False)])
def test_logits_match_transformers(ds_models, name, host):
    import transformers as tf

    path = ds_models[name]
    prompt = PROMPTS[2][:23]
    hf = tf.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].float()
    got = engine_logits(path, prompt, chunk=5, host=host)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < 2e-4 * want.abs().max().item(), err


def test_latent_layout_and_fingerprint(ds_models, make_llm, tiny_models):
    path = ds_models["v3"]
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    llm = make_llm(path, block_size=4)
    lay = llm.engine.layout
    assert (lay.kind, lay.planes, lay.num_kv_heads, lay.head_dim) == ("mla", 1, 1, 48)
    # bytes per block = layers x block_size x (kv_lora_rank + qk_rope_head_dim) x fp32
    assert lay.block_nbytes == cfg["num_hidden_layers"] * 4 * (32 + 16) * 4
    assert tuple(llm.engine.kv_cache.shape[1:]) == (2, 1, 4, 1, 48)
    dense = make_llm(tiny_models["llama"], block_size=4).engine.layout
    assert dense.kind == "kv" and dense.fingerprint() != lay.fingerprint()
    # the latent is the same on every TP rank: one head, never split
    import dataclasses
    for r in range(4):
        shard = dataclasses.replace(lay, tp_size=4, tp_rank=r)
        assert (shard.head_start, shard.head_count, shard.block_nbytes) == \
            (0, 1, lay.block_nbytes)
        assert shard.fingerprint() == lay.fingerprint()


def test_dummy_weights_from_a_config(ds_models, make_llm, tmp_path):
    import shutil

    shutil.copy(os.path.join(ds_models["v3"], "config.json"), tmp_path / "config.json")
    llm = make_llm(str(tmp_path), load_format="dummy", dtype="bfloat16", block_size=4)
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0,
                                                    ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [6, 6]
    assert all(0 <= t < BASE["vocab_size"] for o in out for t in o.token_ids)


def test_prefill_groups_bound_the_decompressed_context(ds_models, make_llm, monkeypatch):
    # a step prefilling all four prompts (budget 512) decompresses them in groups of at most
    # 20 context tokens (one longer request alone): same tokens as transformers
    import engine.models.mla as mla

    monkeypatch.setattr(mla, "PREFILL_GROUP_TOKENS", 20)
    sizes: list[tuple[int, ...]] = []
    split_of = mla._split_of

    def spy(meta, block_size):  # type: ignore[no-untyped-def]
        sp = split_of(meta, block_size)
        sizes.append(tuple(int(g.lens.sum()) for g in sp.groups))
        return sp

    monkeypatch.setattr(mla, "_split_of", spy)
    path = ds_models["v2"]
    llm = make_llm(path, block_size=4, max_num_batched_tokens=512)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for prompt, res in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        assert res.token_ids == hf_greedy(path, prompt, 8), prompt
    first = sizes[0]  # the step prefilling prompts of 11, 5, 50 and 17 tokens
    assert first == (16, 50, 17), first


def test_prefill_groups_of_one_run_of_rows_need_no_row_index():
    # rows [decode, prefill 4, prefill 3]: the prefills are rows 1-7, one run (views in, the
    # output written in place); [prefill 4, decode, prefill 3]: rows 0-3 and 5-7, gathered
    import engine.models.mla as mla
    from engine.attention import AttentionMetadata

    def split(cu: list[int], lens: list[int]) -> mla._Split:
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(cu[-1], dtype=torch.int64),
            block_tables=torch.zeros(len(lens), 4, dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), decode_only=False,
            cu_seqlens_q_host=cu, seq_lens_host=lens)
        return mla._split_of(meta, 4)

    (run,) = split([0, 1, 5, 8], [9, 4, 3]).groups
    assert run.rows is None and run.span == (1, 8)
    (gap,) = split([0, 4, 5, 8], [4, 9, 3]).groups
    assert gap.rows is not None and gap.rows.tolist() == [0, 1, 2, 3, 5, 6, 7]


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_prefill_run_in_place_equals_gathered_rows(ds_models, monkeypatch, name):
    # the same chunked prefill with every group's rows gathered and scattered back, as a
    # group whose rows have a gap is: identical logits
    import dataclasses

    import engine.models.mla as mla

    path, prompt = ds_models[name], list(range(10, 33))
    in_place = engine_logits(path, prompt, chunk=7, host=True)
    split_of, gathered = mla._split_of, []

    def gather_all(meta, block_size):  # type: ignore[no-untyped-def]
        sp = split_of(meta, block_size)
        groups = tuple(dataclasses.replace(g, rows=torch.arange(*g.span))
                       for g in sp.groups)
        gathered.extend(groups)
        return dataclasses.replace(sp, groups=groups)

    monkeypatch.setattr(mla, "_split_of", gather_all)
    assert torch.equal(engine_logits(path, prompt, chunk=7, host=True), in_place)
    assert gathered  # the prefill chunks took the gathered path


def test_prefix_cache_hits_read_the_cached_latent(ds_models, make_llm):
    # a second prompt sharing 40 tokens with the first prefills only past its cached blocks;
    # its chunk attends to the cached latent: transformers' tokens
    path = ds_models["v3"]
    llm = make_llm(path, block_size=4, max_num_batched_tokens=16)
    first, second = PROMPTS[2], PROMPTS[2][:40] + [7, 8, 9]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm.generate([first], params)
    got = llm.generate([second], params)[0].token_ids
    assert llm.engine.prefix_cache_stats().hit_tokens == 40
    assert got == hf_greedy(path, second, 12)


def _hf_cfg(version: str, **kw: Any) -> dict[str, Any]:
    cfg = {**BASE, "architectures": [f"Deepseek{version.upper()}ForCausalLM"],
           "q_lora_rank": None, "rope_theta": 10000.0}
    cfg.update(kw)
    return cfg


def test_config_reads_deepseek_fields():
    v3 = ModelConfig.from_hf(_hf_cfg("v3", q_lora_rank=24, n_group=4, topk_group=2,
                                     routed_scaling_factor=2.5, first_k_dense_replace=1,
                                     n_shared_experts=1, num_hidden_layers=4))
    assert v3.arch == "deepseek_v3" and v3.is_mla and v3.rope_interleave
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_nope_head_dim, v3.qk_rope_head_dim,
            v3.v_head_dim) == (24, 32, 16, 16, 24)
    m = v3.moe
    assert m is not None and m.layers == (1, 2, 3)
    assert (m.scoring_func, m.score_bias, m.n_group, m.topk_group, m.renormalize) == \
        ("sigmoid", True, 4, 2, True)  # noaux_tc; transformers' V3 default renormalizes
    assert (m.routed_scaling_factor, m.n_shared_experts, m.shared_intermediate_size,
            m.router_fp32) == (2.5, 1, 32, True)
    v2 = ModelConfig.from_hf(_hf_cfg("v2", first_k_dense_replace=1, num_hidden_layers=4,
                                     n_group=4, topk_group=2))
    assert v2.q_lora_rank is None and v2.moe is not None
    assert v2.moe.layers == (1, 2, 3)
    # greedy ignores the groups; softmax, no renormalization, no bias
    assert (v2.moe.n_group, v2.moe.scoring_func, v2.moe.renormalize, v2.moe.score_bias) == \
        (None, "softmax", False, False)
    grouped = ModelConfig.from_hf(_hf_cfg("v2", topk_method="group_limited_greedy",
                                          n_group=4, topk_group=2, first_k_dense_replace=1))
    assert grouped.moe is not None and (grouped.moe.n_group, grouped.moe.topk_group) == (4, 2)
    dense = ModelConfig.from_hf(_hf_cfg("v2"))  # first_k_dense_replace 2 of 2 layers
    assert dense.moe is None or dense.moe.layers == ()
    llama = ModelConfig.from_hf({**BASE, "architectures": ["LlamaForCausalLM"]})
    assert not llama.is_mla and llama.moe is None


@pytest.mark.parametrize("version,field,value", [
    ("v2", "norm_topk_prob", True),  # transformers' V2 router never renormalizes
    ("v2", "topk_method", "noaux_tc"),
    ("v2", "scoring_func", "sigmoid"),
    ("v3", "topk_method", "greedy"),
    ("v3", "scoring_func", "softmax"),
    ("v3", "attention_bias", True),
    ("v2", "n_group", 3),  # does not divide 8 experts
    ("v2", "topk_group", 5),
    ("v2", "moe_layer_freq", 2),  # transformers ignores it, DeepSeek's code does not
    ("v2", "num_experts_per_tok", 9),
    ("v2", "kv_lora_rank", 0),
    ("v3", "qk_rope_head_dim", 7),
    ("v3", "rope_scaling", {"type": "linear", "factor": 2.0}),
])
def test_config_refuses_unimplemented_values_by_name(version, field, value):
    kw: dict[str, Any] = {field: value}
    if field in ("topk_group", "n_group"):
        kw.setdefault("n_group", 4)
        kw.update(topk_method="group_limited_greedy", topk_group=kw.get("topk_group", 2))
    with pytest.raises(ValueError, match=rf"^(model: )?{field}\b"):
        ModelConfig.from_hf(_hf_cfg(version, **kw))


# the released configs' fields (values as published), minus what only sizes the model
V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], hidden_size=2048, intermediate_size=10944,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, vocab_size=102400,
    max_position_embeddings=163840, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1, moe_layer_freq=1,
    n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
    topk_method="greedy", scoring_func="softmax", norm_topk_prob=False,
    routed_scaling_factor=1.0, moe_intermediate_size=1408, aux_loss_alpha=0.001, seq_aux=True,
    ep_size=1, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000, attention_bias=False,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                  "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                  "type": "yarn"})
V3 = dict(
    V2_LITE, architectures=["DeepseekV3ForCausalLM"], hidden_size=7168,
    intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
    num_key_value_heads=128, vocab_size=129280, q_lora_rank=1536, first_k_dense_replace=3,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
    topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
    routed_scaling_factor=2.5, moe_intermediate_size=2048, num_nextn_predict_layers=1,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                  "type": "yarn"})


def test_released_configs():
    import math

    lite = ModelConfig.from_hf(V2_LITE)
    assert lite.moe is not None and lite.moe.layers == tuple(range(1, 27))
    assert (lite.moe.top_k, lite.moe.n_group, lite.moe.shared_intermediate_size) == \
        (6, None, 2 * 1408)
    assert lite.kv_lora_rank + lite.qk_rope_head_dim == 576 and lite.q_lora_rank is None
    v3 = ModelConfig.from_hf(V3)
    assert v3.moe is not None and v3.moe.layers == tuple(range(3, 61))
    assert (v3.moe.n_group, v3.moe.topk_group, v3.moe.score_bias) == (8, 4, True)
    from engine.rope import rope_attention_factor, softmax_mscale
    scaling = dict(v3.rope_scaling or ())
    assert rope_attention_factor(scaling) == 1.0  # mscale == mscale_all_dim
    assert softmax_mscale(scaling) == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    # the published V3 checkpoint is block-wise fp8 (tests/engine/test_fp8_moe.py loads
    # one); other methods are refused by name, not loaded as garbage
    fp8 = ModelConfig.from_hf({**V3, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}}).quant
    assert fp8 is not None and (fp8.weight, fp8.block) == ("block", (128, 128))
    with pytest.raises(ValueError, match="^quantization_config.quant_method: "):
        ModelConfig.from_hf({**V3, "quantization_config": {"quant_method": "awq"}})


def test_hidden_act_is_refused_by_name():
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf(_hf_cfg("v3", hidden_act="gelu"))


def test_tensor_parallel_2_equals_tp1_and_transformers(ds_models):
    from engine.llm import LLM

    path = ds_models["v3"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run(**kw: object) -> list[list[int]]:
        with LLM(path, block_size=4, max_num_batched_tokens=16, **kw) as llm:
            return [c.token_ids for c in llm.generate(PROMPTS, params)]

    tp2 = run(tensor_parallel_size=2)
    for prompt, toks in zip(PROMPTS, tp2, strict=True):
        assert toks == hf_greedy(path, prompt, params.max_tokens), prompt


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["v2", "v3"])
def test_cuda_triton_and_graphs_equal_transformers(ds_models, name):
    # On the GPU: Triton latent store, rope, MLA decode (split-K, inside CUDA graphs) and
    # fused MoE; fp32, so greedy tokens equal transformers' run on the CPU
    from engine.llm import LLM

    path = ds_models[name]
    with LLM(path, device="cuda", dtype="float32", block_size=16,
             max_num_batched_tokens=32) as llm:
        results = llm.generate(PROMPTS, GREEDY)
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_replays
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.token_ids == hf_greedy(path, prompt, GREEDY.max_tokens), (name, prompt)


# The small-batch decode fusions, off by default until timed on a GPU (bench/RESULTS.md)
FUSIONS = (("engine.models.moe", "ROUTER_ROUTE_FUSED", True),
           ("engine.models.moe", "ROUTER_PRENORM", True),
           ("engine.models.mla", "FUSED_LATENT_ABSORB", True),
           ("engine.models.mla", "FUSED_UP_MERGE", True),
           ("kernels.triton_moe", "DOWN_SUM_MAX_TOKENS", 1),
           ("kernels.triton_moe", "GATE_UP_GEMV_MAX_TOKENS", 1),
           ("engine.models.moe", "NEXT_NORM_FUSED", True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["v2", "v3"])
def test_cuda_decode_fusions_equal_transformers(ds_models, name, monkeypatch):
    """All of them on, inside CUDA graphs: each prompt alone (batch 1, where gate/up is the
    GEMV and down and sum are one kernel) and all together; the 50-token prompt's context
    splits, so the merge runs inside the W_UV product. fp32: greedy tokens equal
    transformers'."""
    import importlib

    from engine.llm import LLM

    for module, name_, value in FUSIONS:
        monkeypatch.setattr(importlib.import_module(module), name_, value)
    path = ds_models[name]
    with LLM(path, device="cuda", dtype="float32", block_size=16,
             max_num_batched_tokens=32) as llm:
        alone = [llm.generate([p], GREEDY)[0] for p in PROMPTS]
        together = llm.generate(PROMPTS, GREEDY)
        assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_replays
    for prompt, a, b in zip(PROMPTS, alone, together, strict=True):
        assert a.token_ids == b.token_ids == hf_greedy(path, prompt, GREEDY.max_tokens), (
            name, prompt)


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_stacked_weights_equal_the_separate_projections(ds_models, name, monkeypatch):
    """finish_load's stacks (shared experts among the routed ones, q and kv_a as one GEMM)
    give the logits the separate modules give, through chunked prefill and a decode."""
    from tiny_deepseek import engine_logits

    from engine.models.mla import MLAAttention
    from engine.models.moe import SparseMoeBlock

    prompt = PROMPTS[1][:11]
    stacked: list[str] = []
    fold, fuse = SparseMoeBlock.finish_load, MLAAttention.finish_load

    def fold_and_note(self: SparseMoeBlock) -> None:
        fold(self)
        if self.folded_shared:
            stacked.append("shared")

    def fuse_and_note(self: MLAAttention) -> None:
        fuse(self)
        if self.fused_a is not None:
            stacked.append("qkv_a")

    monkeypatch.setattr(SparseMoeBlock, "finish_load", fold_and_note)
    monkeypatch.setattr(MLAAttention, "finish_load", fuse_and_note)
    got = engine_logits(ds_models[name], prompt, chunk=4, host=True)
    assert stacked.count("shared") == 1 and stacked.count("qkv_a") == 2, stacked
    monkeypatch.setattr(SparseMoeBlock, "finish_load", lambda self: None)
    monkeypatch.setattr(MLAAttention, "finish_load", lambda self: None)
    want = engine_logits(ds_models[name], prompt, chunk=4, host=True)
    err = (got - want).abs().max().item()
    assert err < 1e-5 * want.abs().max().item(), err
