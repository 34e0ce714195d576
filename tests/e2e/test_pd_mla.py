"""DeepSeek (MLA latent cache + MoE) served disaggregated: a live cluster (router, gRPC
workers, engine processes, UCX transfers), 1P1D and with a tensor-parallel producer,
consumer or both (heads and experts split over two ranks, the latent whole on each: it
reaches a TP consumer's first rank once, which copies it to the other), gives each
request the colocated TP1 engine's tokens, greedy and seeded. The colocated engine's tokens equal
transformers' (tests/engine/test_deepseek.py)."""

from __future__ import annotations

import pytest
from live_cluster import start_cluster
from pd_identity import ENGINE, assert_cluster_matches, colocated_tokens
from tiny_deepseek import MODELS, make_tiny_deepseek
from tiny_models import byte_tokenizer

SEED = 900


@pytest.mark.parametrize("producer_tp,consumer_tp", [(1, 1), (2, 1), (1, 2), (2, 2)],
                         ids=["1p1d", "p-tp2-d-tp1", "p-tp1-d-tp2", "p-tp2-d-tp2"])
def test_mla_pd_tokens_equal_colocated(tmp_path_factory, producer_tp, consumer_tp):
    version, kw = MODELS["v3"]
    path = make_tiny_deepseek(str(tmp_path_factory.mktemp("mla") / "v3"), version, seed=5, **kw)
    byte_tokenizer(path)
    refs = colocated_tokens(path, SEED)
    c = start_cluster(tmp_path_factory, f"pd-mla-{producer_tp}-{consumer_tp}", model=path,
                      producers=1, consumers=1, transfer_backend="ucx",
                      # every worker's TP is the consumer's; the producer's flag comes later
                      worker_args=(*ENGINE, "--tensor-parallel-size", str(consumer_tp)),
                      producer_args=("--tensor-parallel-size", str(producer_tp)))
    try:
        status = {w.worker_id: w for w in c.status(30).workers}
        assert (status["worker-0"].tp_size, status["worker-1"].tp_size) == \
            (producer_tp, consumer_tp)
        assert_cluster_matches(c, refs, SEED)
    finally:
        c.stop()
