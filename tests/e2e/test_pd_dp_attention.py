"""P/D across attention data-parallel layouts, in live clusters (router, gRPC workers, their
engine processes and follower ranks, UCX transfers) on a tiny random DeepSeek-V3 (MLA
latent cache + MoE, experts over both ranks of a worker): producer DPA-TP2 -> consumer
DPA-TP2, TP2 -> DPA-TP2 and DPA-TP2 -> TP2.

Greedy and seeded tokens equal the colocated single-rank engine's through the router (its
concurrent requests spread over both groups of each side), and greedy tokens equal it with
every (producer group, consumer group) pair driven by hand and with every request on one
group of each side. The address a consumer gives the producer names its group's rank(s)
only. The per-rank byte counts (an idle rank moves nothing) are asserted in
tests/transfer/test_dp_endpoints.py on the same endpoints.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from live_cluster import dump_logs, start_cluster
from pd_direct import pd_request
from pd_identity import ENGINE, assert_cluster_matches, colocated_tokens
from tiny_deepseek import MODELS, make_tiny_deepseek
from tiny_models import PROMPTS, byte_tokenizer

from transfer.tp_endpoints import split_addresses

SEED = 700
GREEDY = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
LAYOUTS = {  # name: (producer groups, consumer groups); every worker has two ranks
    "p-dpa-tp2-d-dpa-tp2": (2, 2),
    "p-tp2-d-dpa-tp2": (1, 2),
    "p-dpa-tp2-d-tp2": (2, 1),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    version, kw = MODELS["v3"]
    path = make_tiny_deepseek(str(tmp_path_factory.mktemp("dpa") / "v3"), version, seed=5,
                              **kw)
    byte_tokenizer(path)
    return path, colocated_tokens(path, SEED)


def _direct(c, pairs: list[tuple[int, int]], pd: int, cd: int, tag: str) -> list:
    """Every prompt at once, prompt i on producer group pairs[i][0] and consumer group
    pairs[i][1] (None for a worker of one group)."""
    status = {w.worker_id: w for w in c.status(30).workers}
    p, cons = status["producer-0"], status["consumer-0"]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futs = [pool.submit(pd_request, p.address, cons.address, "consumer-0", f"{tag}-{i}",
                            prompt, GREEDY, 2 // pd,
                            pairs[i][0] if pd > 1 else None,
                            pairs[i][1] if cd > 1 else None)
                for i, prompt in enumerate(PROMPTS)]
        return [f.result() for f in futs]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dp_layouts_pair_and_tokens_equal_the_single_rank_engine(tmp_path_factory, model,
                                                                name):
    path, refs = model
    pd, cd = LAYOUTS[name]
    c = start_cluster(tmp_path_factory, name, model=path, producers=1, consumers=1,
                      transfer_backend="ucx",
                      worker_args=(*ENGINE, "--tensor-parallel-size", "2",
                                   "--data-parallel-size", str(cd)),
                      producer_args=("--data-parallel-size", str(pd)))
    try:
        status = {w.worker_id: w for w in c.status(30).workers}
        consumer_ranks = split_addresses(status["consumer-0"].kv_address)
        assert len(consumer_ranks) == 2
        # through the router: concurrent requests, placed on the least loaded groups
        assert_cluster_matches(c, refs, SEED)
        # by hand: every pair of groups, then every request on the last group of each side
        spread = [(i % pd, (i // pd) % cd) for i in range(len(PROMPTS))]
        one = [(pd - 1, cd - 1)] * len(PROMPTS)
        for tag, pairs in (("spread", spread), ("one", one)):
            for i, r in enumerate(_direct(c, pairs, pd, cd, tag)):
                assert not r.error and r.token_ids == refs[False][i], \
                    (tag, i, pairs[i], r.error, r.token_ids, dump_logs(c))
                # a DP consumer names its group's rank only; a TP2 one both ranks
                want = [consumer_ranks[pairs[i][1]]] if cd > 1 else consumer_ranks
                assert split_addresses(r.kv_address) == want, (tag, i, r.kv_address)
    finally:
        c.stop()
