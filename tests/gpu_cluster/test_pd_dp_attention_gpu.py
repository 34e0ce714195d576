"""P/D across attention data-parallel layouts on CUDA: a tiny random DeepSeek-V3 (MLA + MoE)
served by a producer and a consumer of two ranks each, on cuda:0 and cuda:1 (NCCL between
a worker's ranks, the KV crossing between the workers' GPU pools over UCX). For DPA-TP2 ->
DPA-TP2, TP2 -> DPA-TP2 and DPA-TP2 -> TP2, greedy tokens equal the single-rank engine's on
cuda:0 through the router and with every request on the second group of each side.

GPU-only, two GPUs (NCCL refuses two ranks of one worker on one device): it skips with the
reason on one. tests/e2e/test_pd_dp_attention.py runs the same layouts on CPU (gloo).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from cluster_client import generate_all
from live_cluster import dump_logs, start_cluster
from pd_direct import pd_request
from tiny_deepseek import MODELS, make_tiny_deepseek
from tiny_models import PROMPTS, byte_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason="needs two CUDA GPUs (a worker's two ranks, one per GPU)"),
]
GREEDY = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
ENGINE = ("--dtype", "float32", "--block-size", "16", "--max-num-batched-tokens", "32",
          "--num-kv-blocks", "64", "--max-model-len", "512", "--devices", "cuda:0,cuda:1")
LAYOUTS = {"p-dpa-tp2-d-dpa-tp2": (2, 2), "p-tp2-d-dpa-tp2": (1, 2), "p-dpa-tp2-d-tp2": (2, 1)}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[int]]]:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    version, kw = MODELS["v3"]
    path = make_tiny_deepseek(str(tmp_path_factory.mktemp("dpag") / "v3"), version, seed=5,
                              **kw)
    byte_tokenizer(path)
    with LLM(path, device="cuda:0", dtype="float32", block_size=16) as llm:
        ref = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**GREEDY))]
    return path, ref


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpu_dp_layouts_pair_and_tokens_equal_the_single_rank_engine(tmp_path_factory, model,
                                                                    name):
    path, ref = model
    pd, cd = LAYOUTS[name]
    c = start_cluster(tmp_path_factory, f"gpu-{name}", model=path, producers=1, consumers=1,
                      transfer_backend="ucx",
                      worker_args=(*ENGINE, "--tensor-parallel-size", "2",
                                   "--data-parallel-size", str(cd)),
                      producer_args=("--data-parallel-size", str(pd)))
    try:
        routed = generate_all(c.router_address, PROMPTS, lambda i: GREEDY)
        for i, r in enumerate(routed):
            assert r.code is None and not r.error, (i, r.details, r.error, dump_logs(c))
            assert r.token_ids == ref[i], i
        status = {w.worker_id: w for w in c.status(30).workers}
        p, cons = status["worker-0"].address, status["worker-1"].address
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futs = [pool.submit(pd_request, p, cons, "worker-1", f"one-{i}", prompt, GREEDY,
                                2 // pd, 1 if pd > 1 else None, 1 if cd > 1 else None)
                    for i, prompt in enumerate(PROMPTS)]
            direct = [f.result() for f in futs]
        for i, r in enumerate(direct):
            assert not r.error and r.token_ids == ref[i], (i, r.error, dump_logs(c))
        out = os.environ.get("OUT")
        if out:  # the lead's record of the run
            with open(os.path.join(out, f"pd_dp_attention_gpu_{name}.json"), "w") as f:
                json.dump({"layout": name, "prompts": len(PROMPTS), "routed_equal": True,
                           "one_group_equal": True}, f)
    finally:
        c.stop()
