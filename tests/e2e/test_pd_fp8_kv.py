"""--kv-cache-dtype fp8 served disaggregated: a live cluster (router, gRPC workers, engine
processes, UCX transfers) whose workers all run float8 KV pools gives each request the
colocated float8 engine's tokens, greedy and seeded, 1P1D and with a tensor-parallel
consumer (whose follower rank takes rank 0's scales). The flag reaches every worker through
`pdserve launch`'s engine flags."""

from __future__ import annotations

import pytest
from live_cluster import start_cluster
from pd_identity import ENGINE, assert_cluster_matches, colocated_tokens
from tiny_models import byte_tokenizer, make_tiny_model

SEED = 1300


@pytest.mark.parametrize("consumer_tp", [1, 2], ids=["1p1d", "d-tp2"])
def test_fp8_kv_pd_tokens_equal_colocated_fp8(tmp_path_factory, consumer_tp):
    path = make_tiny_model(str(tmp_path_factory.mktemp("fp8") / "llama"), "llama", seed=3)
    byte_tokenizer(path)
    refs = colocated_tokens(path, SEED, kv_cache_dtype="fp8")
    c = start_cluster(tmp_path_factory, f"pd-fp8-{consumer_tp}", model=path,
                      producers=1, consumers=1, transfer_backend="ucx",
                      worker_args=(*ENGINE, "--kv-cache-dtype", "fp8",
                                   "--tensor-parallel-size", str(consumer_tp)),
                      producer_args=("--tensor-parallel-size", "1"))
    try:
        status = {w.worker_id: w for w in c.status(30).workers}
        assert status["worker-1"].tp_size == consumer_tp
        assert_cluster_matches(c, refs, SEED)
    finally:
        c.stop()
