"""Qwen3-MoE and Mixtral: greedy tokens and logprobs equal transformers' (CPU, float32),
colocated and with experts split over two tensor-parallel ranks."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_models import PROMPTS, hf_greedy, make_tiny_model

from engine.config import ModelConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams

# name -> (arch, overrides); the defaults are tests/tiny_models.py's
MODELS = {
    "qwen3_moe": ("qwen3_moe", {}),  # layer 0 dense, norm_topk_prob
    # decoder_sparse_step 2: layers 1 and 3 MoE; top-k weights not renormalized
    "qwen3_moe_step2": ("qwen3_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2,
                                      "mlp_only_layers": [], "norm_topk_prob": False,
                                      "num_experts_per_tok": 3}),
    "mixtral": ("mixtral", {}),
}
N = 32
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {name: make_tiny_model(os.path.join(root, name), arch, seed=10 + i, **kw)
            for i, (name, (arch, kw)) in enumerate(MODELS.items())}


_HF: dict[str, torch.nn.Module] = {}


def _hf_logprobs(path: str, prompt: list[int], out: list[int]) -> torch.Tensor:
    """[n, vocab] log-softmax of transformers' next-token logits at each generated
    position, from one forward over prompt + output."""
    import transformers as tf

    hf = _HF.get(path)
    if hf is None:
        hf = _HF[path] = tf.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0].float()
    return logits[len(prompt) - 1:-1].log_softmax(-1)


def _check(path: str, results, prompts) -> None:  # type: ignore[no-untyped-def]
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == hf_greedy(path, prompt, N), prompt
        ref = _hf_logprobs(path, prompt, res.token_ids)
        for i, row in enumerate(res.logprobs):
            assert row.logprob == pytest.approx(float(ref[i, row.token_id]), abs=1e-4)
            for tok, lp in row.top:
                assert lp == pytest.approx(float(ref[i, tok]), abs=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_and_logprobs_match_transformers(moe_models, make_llm, name):
    path = moe_models[name]
    cfg = ModelConfig.from_dir(path).moe
    assert cfg is not None
    if name == "qwen3_moe":
        assert cfg.layers == (1, 2) and cfg.renormalize
    if name == "qwen3_moe_step2":
        assert cfg.layers == (1, 3) and not cfg.renormalize and cfg.top_k == 3
    # a small token budget: chunked prefill mixed with other requests' decodes
    llm = make_llm(path, block_size=4, max_num_batched_tokens=16)
    _check(path, llm.generate(PROMPTS, GREEDY), PROMPTS)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_tp2_splits_experts_and_matches_transformers(moe_models, name):
    path = moe_models[name]
    with LLM(path, block_size=4, max_num_batched_tokens=16, tensor_parallel_size=2) as llm:
        moe = llm.engine.runner.model.layers[1].mlp
        experts = ModelConfig.from_dir(path).moe.num_experts  # type: ignore[union-attr]
        assert moe.experts.w13.shape[0] == experts // 2  # rank 0 holds half the experts
        _check(path, llm.generate(PROMPTS, GREEDY), PROMPTS)


def test_dummy_weights_equal_at_tp1_and_tp2(moe_models, tmp_path):
    """Dummy MoE weights are TP1's draws sliced per rank: the same model at any TP size."""
    with open(os.path.join(moe_models["qwen3_moe"], "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        with LLM(str(tmp_path), load_format="dummy", block_size=4,
                 tensor_parallel_size=tp) as llm:
            outs.append([c.token_ids for c in llm.generate(PROMPTS[:2], params)])
    assert outs[0] == outs[1]
    assert len(set(outs[0][0])) > 1  # not a degenerate constant output


def test_tp_that_does_not_divide_the_experts_is_refused(moe_models, tmp_path):
    with open(os.path.join(moe_models["mixtral"], "config.json")) as f:
        cfg = json.load(f)
    cfg["num_local_experts"] = 6  # 4 heads, 2 KV heads: TP4 splits all but the experts
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="--tensor-parallel-size: 4 does not divide the "
                                         "model's 6 experts"):
        LLM(str(tmp_path), load_format="dummy", tensor_parallel_size=4)


@pytest.mark.parametrize("field,value,match", [
    ("hidden_act", "gelu", "hidden_act"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("decoder_sparse_step", 0, "decoder_sparse_step"),
])
def test_unsupported_config_values_are_refused_by_name(moe_models, field, value, match):
    with open(os.path.join(moe_models["qwen3_moe"], "config.json")) as f:
        cfg = json.load(f)
    cfg[field] = value
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(cfg)


def test_checkpoint_missing_an_expert_is_refused(moe_models, tmp_path):
    from safetensors.torch import load_file, save_file

    src = moe_models["mixtral"]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    with pytest.raises(ValueError, match="lacks weights.*layers.1.mlp.experts.w2"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True,
                   logprobs=1),
], ids=["greedy", "seeded"])
def test_producer_to_consumer_handoff_equals_colocated(moe_models, make_llm, params):
    """The identity rule on an MoE model at engine level: a producer engine prefills (in
    chunks), its KV blocks are copied into a consumer's reserved blocks, the consumer
    decodes: the colocated engine's tokens."""
    path = moe_models["qwen3_moe"]
    prompt = PROMPTS[2]  # 50 tokens: 13 blocks of 4
    ref = make_llm(path, block_size=4).generate([prompt], params)[0]
    prod = make_llm(path, block_size=4, role="producer", max_num_batched_tokens=16).engine
    cons = make_llm(path, block_size=4, role="consumer").engine
    prod.add_request("r", prompt, params)
    outs = []
    while not outs:
        outs = prod.step().outputs
    (t0,) = outs
    src = prod.requests["r"].block_ids
    dst = cons.reserve(len(prompt))
    assert dst is not None
    cons.kv_cache[dst] = prod.kv_cache[src]  # what the transfer layer does
    prod.release("r")
    cons.add_prefilled("r", prompt, params, dst, t0.new_token_ids[0], t0.new_logprobs[0])
    tokens = list(t0.new_token_ids)
    while cons.has_unfinished():
        for o in cons.step().outputs:
            tokens += o.new_token_ids
    assert tokens == ref.token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_moe_decode_graphs_equal_eager_and_transformers_on_gpu(moe_models, make_llm):
    """The fused MoE Triton kernel inside captured decode graphs: the same tokens as eager
    steps and as transformers (float32, no TF32 in the kernel)."""
    path = moe_models["qwen3_moe"]
    kw = dict(device="cuda", dtype="float32", max_num_seqs=16, max_model_len=256)
    graphed = make_llm(path, **kw)
    g = graphed.engine.runner.graphs
    assert g is not None and g.use_graphs
    out_g = graphed.generate(PROMPTS, GREEDY)
    assert g.num_replays >= N - 1
    out_e = make_llm(path, enforce_eager=True, **kw).generate(PROMPTS, GREEDY)
    for prompt, a, b in zip(PROMPTS, out_g, out_e, strict=True):
        assert a.token_ids == b.token_ids == hf_greedy(path, prompt, N)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_moe_decode_fusions_on_gpu(moe_models, make_llm, monkeypatch):
    """Router logits + routing as one launch, with the post-attention norm inside it (from
    o_proj's split-K partial sums at these rows) and, at one token, gate/up as the GEMV and
    down + sum + the next layer's norm as one (all off by default until timed): each prompt
    alone in graphs, tokens equal transformers'."""
    import engine.models.moe as moe
    import kernels.triton_moe as tm

    monkeypatch.setattr(moe, "ROUTER_ROUTE_FUSED", True)
    monkeypatch.setattr(moe, "ROUTER_PRENORM", True)
    monkeypatch.setattr(tm, "DOWN_SUM_MAX_TOKENS", 1)
    monkeypatch.setattr(tm, "GATE_UP_GEMV_MAX_TOKENS", 1)
    monkeypatch.setattr(moe, "NEXT_NORM_FUSED", True)
    path = moe_models["qwen3_moe"]
    llm = make_llm(path, device="cuda", dtype="float32", max_num_seqs=16, max_model_len=256)
    for prompt in PROMPTS:
        assert llm.generate([prompt], GREEDY)[0].token_ids == hf_greedy(path, prompt, N)


def test_a_tp_rank_reads_and_stacks_only_its_experts(moe_models):
    """Rank 1 of 2 reads nothing of experts 0-1 (an empty slice), and stacks experts 2-3
    as [w1; w3] and w2, exactly the checkpoint's tensors."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from engine.attention import kernels_for
    from engine.models.moe_model import MoeForCausalLM
    from engine.weights import _safetensors

    path = moe_models["mixtral"]  # 4 experts, intermediate 96, hidden 64
    cfg = ModelConfig.from_dir(path)
    group = SimpleNamespace(rank=1, size=2)  # construction only: no collective runs
    model = MoeForCausalLM(cfg, kernels_for(torch.device("cpu")), 64, group)  # type: ignore[arg-type]
    read = dict(_safetensors(path, model.wants))
    pre = "model.layers.0.block_sparse_moe.experts"
    assert read[f"{pre}.1.w2.weight"].numel() == 0
    assert tuple(read[f"{pre}.2.w2.weight"].shape) == (64, 96)
    used = model.load_weights(_safetensors(path, model.wants))
    assert {"layers.0.mlp.experts.w13", "layers.0.mlp.experts.w2"} <= used
    full = load_file(os.path.join(path, "model.safetensors"))
    w13 = model.layers[0].mlp.experts.w13.data
    assert torch.equal(w13[1], torch.cat([full[f"{pre}.3.w1.weight"], full[f"{pre}.3.w3.weight"]]))
    assert torch.equal(model.layers[0].mlp.experts.w2.data[0], full[f"{pre}.2.w2.weight"])


@pytest.mark.gpu
def test_gpu_tp2_moe_graphs_equal_tp1_and_transformers(moe_models):
    """Experts split over two GPUs, decode graphs captured with the MoE block's all-reduce:
    the TP1 engine's tokens, and transformers'."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    path = moe_models["qwen3_moe"]
    kw = dict(device="cuda", dtype="float32", block_size=4, max_num_seqs=8, max_model_len=128)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        with LLM(path, tensor_parallel_size=tp, **kw) as llm:
            g = llm.engine.runner.graphs
            assert g is not None and g.use_graphs
            outs.append([c.token_ids for c in llm.generate(PROMPTS, params)])
            assert g.num_replays > 0
    assert outs[0] == outs[1]
    for prompt, toks in zip(PROMPTS, outs[1], strict=True):
        assert toks == hf_greedy(path, prompt, 16)
