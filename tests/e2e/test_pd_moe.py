"""A mixture-of-experts model served disaggregated: a live cluster (router, gRPC workers,
engine processes, UCX transfers) with a tensor-parallel producer (experts split over its two
ranks) and a TP1 consumer gives each request the colocated TP1 engine's tokens, greedy and
seeded. The colocated engine's tokens equal transformers' (tests/engine/test_moe_models.py).
"""

from __future__ import annotations

from live_cluster import start_cluster
from pd_identity import ENGINE, assert_cluster_matches, colocated_tokens
from tiny_models import byte_tokenizer, make_tiny_model

SEED = 700


def test_moe_p_tp2_d_tp1_tokens_equal_colocated(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("moe") / "qwen3_moe"), "qwen3_moe",
                           seed=3)
    byte_tokenizer(path)
    refs = colocated_tokens(path, SEED)
    c = start_cluster(tmp_path_factory, "pd-moe", model=path, producers=1, consumers=1,
                      transfer_backend="ucx", worker_args=ENGINE,
                      producer_args=("--tensor-parallel-size", "2"))
    try:
        assert_cluster_matches(c, refs, SEED)
    finally:
        c.stop()
