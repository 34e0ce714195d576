"""DeepSeek (MLA latent cache + MoE) served disaggregated: a live cluster (router, gRPC
workers, engine processes, UCX transfers), 1P1D and with a tensor-parallel producer or
consumer (heads and experts split over two ranks, the latent whole on each), gives each
request the colocated TP1 engine's tokens, greedy and seeded. The colocated engine's tokens equal
transformers' (tests/engine/test_deepseek.py)."""

from __future__ import annotations

import pytest
from cluster_client import generate_all, stub_for, wait_for_full_kv
from live_cluster import dump_logs, start_cluster
from tiny_deepseek import MODELS, make_tiny_deepseek
from tiny_models import PROMPTS, byte_tokenizer

from engine.llm import LLM
from engine.sampling_params import SamplingParams

ENGINE = ("--device", "cpu", "--dtype", "float32", "--block-size", "4",
          "--max-num-batched-tokens", "16", "--kv-cache-mib", "4")


def _sampling(i: int, seeded: bool) -> dict:
    if seeded:
        return dict(max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=900 + i,
                    ignore_eos=True)
    return dict(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("producer_tp,consumer_tp", [(1, 1), (2, 1), (1, 2)],
                         ids=["1p1d", "p-tp2-d-tp1", "p-tp1-d-tp2"])
def test_mla_pd_tokens_equal_colocated(tmp_path_factory, producer_tp, consumer_tp):
    version, kw = MODELS["v3"]
    path = make_tiny_deepseek(str(tmp_path_factory.mktemp("mla") / "v3"), version, seed=5, **kw)
    byte_tokenizer(path)
    refs = {}
    with LLM(path, block_size=4, max_num_batched_tokens=16, dtype="float32") as llm:
        for seeded in (False, True):
            params = [SamplingParams(**_sampling(i, seeded)) for i in range(len(PROMPTS))]
            refs[seeded] = [c.token_ids for c in llm.generate(PROMPTS, params)]
    c = start_cluster(tmp_path_factory, f"pd-mla-{producer_tp}-{consumer_tp}", model=path,
                      producers=1, consumers=1, transfer_backend="ucx",
                      # every worker's TP is the consumer's; the producer's flag comes later
                      worker_args=(*ENGINE, "--tensor-parallel-size", str(consumer_tp)),
                      producer_args=("--tensor-parallel-size", str(producer_tp)))
    try:
        status = {w.worker_id: w for w in c.status(30).workers}
        assert (status["producer-0"].tp_size, status["consumer-0"].tp_size) == \
            (producer_tp, consumer_tp)
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
