"""A mixture-of-experts model served disaggregated: a live cluster (router, gRPC workers,
engine processes, UCX transfers) with a tensor-parallel producer (experts split over its two
ranks) and a TP1 consumer gives each request the colocated TP1 engine's tokens, greedy and
seeded. The colocated engine's tokens equal transformers' (tests/engine/test_moe_models.py).
"""

from __future__ import annotations

from cluster_client import generate_all, stub_for, wait_for_full_kv
from live_cluster import dump_logs, start_cluster
from tiny_models import PROMPTS, byte_tokenizer, make_tiny_model

from engine.llm import LLM
from engine.sampling_params import SamplingParams

ENGINE = ("--device", "cpu", "--dtype", "float32", "--block-size", "4",
          "--max-num-batched-tokens", "16", "--kv-cache-mib", "4")


def _sampling(i: int, seeded: bool) -> dict:
    if seeded:
        return dict(max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=700 + i,
                    ignore_eos=True)
    return dict(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_moe_p_tp2_d_tp1_tokens_equal_colocated(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("moe") / "qwen3_moe"), "qwen3_moe",
                           seed=3)
    byte_tokenizer(path)
    refs = {}
    with LLM(path, block_size=4, max_num_batched_tokens=16, dtype="float32") as llm:
        for seeded in (False, True):
            params = [SamplingParams(**_sampling(i, seeded)) for i in range(len(PROMPTS))]
            refs[seeded] = [c.token_ids for c in llm.generate(PROMPTS, params)]
    c = start_cluster(tmp_path_factory, "pd-moe", model=path, producers=1, consumers=1,
                      transfer_backend="ucx", worker_args=ENGINE,
                      producer_args=("--tensor-parallel-size", "2"))
    try:
        for seeded in (False, True):
            results = generate_all(c.router_address, PROMPTS, lambda i, s=seeded: _sampling(i, s))
            for i, r in enumerate(results):
                assert r.code is None and not r.error, (i, r.code, r.details, r.error,
                                                        dump_logs(c))
                assert (r.timing.producer, r.timing.consumer) == ("producer-0", "consumer-0")
                assert r.token_ids == refs[seeded][i], (seeded, i)
        ch, stub = stub_for(c.router_address)
        with ch:
            wait_for_full_kv(stub, timeout=30)
    finally:
        c.stop()
