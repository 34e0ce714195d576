"""On the GPU: the engine's greedy tokens with the Triton kernels equal the torch-reference
kernels' tokens on a dummy-weight Llama (the end-to-end check)."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_greedy_triton_equals_reference(tmp_path):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
           "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(0)
    # A block multiple, a non-multiple, one token, and one longer than the step's token
    # budget (chunked prefill).
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (32, 45, 1, 700)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {}
    for ref in (True, False):
        llm = LLM(str(tmp_path), load_format="dummy", device="cuda", dtype="float32",
                  max_num_batched_tokens=256, extra={"reference_kernels": ref})
        tokens[ref] = [c.token_ids for c in llm.generate(prompts, params)]
        del llm
    assert all(len(t) == 24 for t in tokens[True])
    assert tokens[False] == tokens[True]
