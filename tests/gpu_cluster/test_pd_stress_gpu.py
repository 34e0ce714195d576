"""A 1P1D cluster on two GPUs under a KV pool small enough to force preemption and block
reuse: every request's tokens still equal the colocated engine's (float32, greedy).

GPU-only. With two GPUs the producer and consumer get one each (KV crosses GPU0 -> GPU1);
with one, both share it (KV still crosses between two processes' pools, through a CUDA
IPC mapping), so a one-GPU machine checks the same preemption and reuse paths. The CPU
suites cover them with CPU pools.
"""

from __future__ import annotations

import json
import os
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from cluster_client import generate, stub_for, wait_for_full_kv
from live_cluster import dump_logs, start_cluster
from pdserve.v1 import router_pb2
from tiny_models import make_tiny_model

from deploy.benchmark.dummy_model import _tokenizer_json
from engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEVICES = ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cuda:0", "cuda:0")

# 2 layers x (K, V) x 2 KV heads x 16 dims x 4 bytes x 16 tokens = 8 KiB a block: 48 blocks
# hold 768 tokens, while 24 requests of up to ~400 tokens each want several times that.
# The outputs are long so that the pressure does not hang on the two processes' relative
# speed: with 32 tokens a request's decode (32 steps) barely outlasted the producer's
# prefill of all 24 (~30 chunks of 128), and on a loaded GPU (the suite's -n 4) the
# consumer kept up and never preempted. At 96 each decode lasts three times the arrivals,
# so the running requests' growth passes the pool whatever the timing.
BLOCKS = "48"
N_REQUESTS = 24
MAX_TOKENS = 96


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(20, 300))]
            for _ in range(N_REQUESTS)]


def _preemptions(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(v.split()[-1]) for v in lines
               if v.startswith("pdserve_worker_preemptions") and not v.startswith("#"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = make_tiny_model(str(tmp_path_factory.mktemp("m") / "tiny"), "llama")
    # the router resolves the model as an HF directory with a tokenizer (one token per id)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(_tokenizer_json(256), f)
    return path


def test_1p1d_with_preemption_and_block_reuse_matches_colocated(
        tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> None:
    from engine.llm import LLM

    prompts = _prompts()
    ref = LLM(model_dir, device="cuda:0", dtype="float32", max_num_batched_tokens=128)
    want = ref.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
                                  for _ in prompts])
    del ref
    args = ("--dtype", "float32", "--num-kv-blocks", BLOCKS, "--max-num-batched-tokens", "128",
            "--max-model-len", "512")
    c = start_cluster(tmp_path_factory, "gpu1p1d", model=model_dir, worker_args=args,
                      devices=DEVICES, threads=2)
    try:
        ch, stub = stub_for(c.router_address)
        with ch, ThreadPoolExecutor(N_REQUESTS) as pool:
            futs = [pool.submit(generate, stub, dict(max_tokens=MAX_TOKENS, temperature=0.0),
                                timeout=300, prompt_token_ids=router_pb2.TokenIds(ids=p))
                    for p in prompts]
            results = [f.result() for f in futs]
            for i, (r, w) in enumerate(zip(results, want, strict=True)):
                assert r.code is None and r.error == "", (i, r.code, r.details, r.error,
                                                          dump_logs(c))
                assert r.token_ids == w.token_ids, i
            wait_for_full_kv(stub, timeout=60)
        # the point of the small pool: the engines really preempted and reused blocks
        assert sum(_preemptions(p) for p in c.metrics_ports.values()) > 0
    finally:
        c.stop()
