"""Tensor parallelism inside one engine (gloo on CPU): TP2/TP4 greedy tokens equal TP1's
and transformers', on Llama, Qwen2 (qkv bias) and Qwen3 (q/k norm) with 4, 2 and 1 KV heads
(1: replicated over the ranks), batched with chunked prefill and deferred output."""

from __future__ import annotations

import json
import os

import pytest
from tiny_models import PROMPTS, hf_greedy, make_tiny_model

from engine.llm import LLM
from engine.sampling_params import SamplingParams

# name -> (arch, overrides): heads 4 everywhere; KV heads 4, 2 or 1
MODELS = {
    "llama-kv2": ("llama", {}),
    "llama-kv1": ("llama", {"num_key_value_heads": 1}),
    # vocab 254: TP4 shards of 64 rows, the last one padded (62 real rows)
    "qwen2-kv4": ("qwen2", {"num_key_value_heads": 4, "vocab_size": 254}),
    "qwen3-kv2": ("qwen3", {}),
    "qwen3-kv1": ("qwen3", {"num_key_value_heads": 1}),
}
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    return {name: make_tiny_model(os.path.join(root, name), arch, seed=i, **kw)
            for i, (name, (arch, kw)) in enumerate(MODELS.items())}


def _generate(path: str, params: SamplingParams, **kw: object) -> list[list[int]]:
    # a small token budget: prompts are prefilled in chunks mixed with other requests' decodes
    with LLM(path, block_size=4, max_num_batched_tokens=16, **kw) as llm:
        return [c.token_ids for c in llm.generate(PROMPTS, params)]


# Each TP engine starts N - 1 processes: a few cases cover every split. kv2/TP2: one KV head
# per rank; kv1: replicated; kv4/TP4 with vocab 254: a padded last vocabulary shard.
@pytest.mark.parametrize("name,tp", [
    ("llama-kv2", 2), ("llama-kv1", 2), ("qwen2-kv4", 4), ("qwen3-kv2", 2), ("qwen3-kv1", 4)])
def test_greedy_tp_equals_tp1_and_transformers(tp_models, name, tp):
    path = tp_models[name]
    tp1 = _generate(path, GREEDY)
    tpn = _generate(path, GREEDY, tensor_parallel_size=tp)
    assert tpn == tp1, (name, tp)
    for prompt, toks in zip(PROMPTS, tpn, strict=True):
        assert toks == hf_greedy(path, prompt, GREEDY.max_tokens), (name, tp, prompt)


def test_seeded_sampling_tp2_equals_tp1_and_ranks_hold_their_shards(tp_models):
    path = tp_models["qwen2-kv4"]  # 4 heads of 16, 4 KV heads, hidden 64, vocab 254
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_k=20, top_p=0.9, seed=7,
                             ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.7, seed=123, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.3, min_p=0.05, ignore_eos=True,
                             repetition_penalty=1.2),  # seed drawn from the engine's seed
              SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True)]
    with LLM(path, block_size=4, max_num_batched_tokens=16) as llm:
        tp1 = [c.token_ids for c in llm.generate(PROMPTS, params)]
    with LLM(path, block_size=4, max_num_batched_tokens=16, tensor_parallel_size=2) as llm:
        tp2 = [c.token_ids for c in llm.generate(PROMPTS, params)]
        model = llm.engine.runner.model
        assert llm.engine.kv_cache.shape[-2] == 2  # [NB, L, 2, BS, Hkv / tp, D]
        # the layout names the model's 4 KV heads; rank 0's pool holds heads [0, 2)
        lay = llm.engine.layout
        assert (lay.num_kv_heads, lay.tp_size, lay.head_start, lay.head_count) == (4, 2, 0, 2)
        attn = model.layers[0].self_attn
        assert tuple(attn.qkv_proj.weight.shape) == ((2 + 2 * 2) * 16, 64)
        assert tuple(attn.qkv_proj.bias.shape) == ((2 + 2 * 2) * 16,)
        assert tuple(attn.o_proj.weight.shape) == (64, 2 * 16)
        assert tuple(model.layers[0].mlp.gate_up_proj.weight.shape) == (2 * 64, 64)
        assert tuple(model.layers[0].mlp.down_proj.weight.shape) == (64, 64)
        assert tuple(model.embed_tokens.weight.shape) == (127, 64)
        assert tuple(model.lm_head.weight.shape) == (127, 64)
    assert tp2 == tp1
    greedy = _generate(path, GREEDY)
    assert tp1 != greedy  # the sampled runs really sampled


def test_dummy_weights_are_tp1s_sliced(tp_models, tmp_path):
    import shutil

    shutil.copy(os.path.join(tp_models["qwen3-kv2"], "config.json"), tmp_path / "config.json")
    tp1 = _generate(str(tmp_path), GREEDY, load_format="dummy")
    tp2 = _generate(str(tmp_path), GREEDY, load_format="dummy", tensor_parallel_size=2)
    assert tp2 == tp1
    assert len({tuple(t) for t in tp1}) > 1  # not a degenerate constant output


def test_pdserve_generate_cli_tp2(tp_models, capsys):
    from deploy.cli import main

    path = tp_models["llama-kv1"]
    prompt = PROMPTS[0]
    outs = []
    for tp in (1, 2):
        rc = main(["generate", "--model", path, "--device", "cpu", "--dtype", "float32",
                   "--block-size", "4", "--tensor-parallel-size", str(tp),
                   "--prompt-token-ids", ",".join(map(str, prompt)), "--max-tokens", "10",
                   "--json"])
        assert rc == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    want = hf_greedy(path, prompt, 10)
    assert [o["token_ids"] for o in outs] == [want, want]
    assert all(o["prompt_token_ids"] == prompt for o in outs)


@pytest.mark.gpu
def test_gpu_tp2_greedy_equals_tp1_and_transformers(tp_models):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    path = tp_models["llama-kv2"]
    kw = dict(device="cuda", dtype="float32")
    tp1 = _generate(path, GREEDY, **kw)
    tp2 = _generate(path, GREEDY, tensor_parallel_size=2, **kw)
    assert tp2 == tp1
    for prompt, toks in zip(PROMPTS, tp2, strict=True):
        assert toks == hf_greedy(path, prompt, GREEDY.max_tokens), prompt
