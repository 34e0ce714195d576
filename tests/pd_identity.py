"""The identity rule on a tiny random model's live P/D cluster: greedy and seeded tokens of
every prompt equal the colocated engine's, and the consumer's pool is whole afterwards
(shared by the MoE and MLA cluster tests)."""

from __future__ import annotations

from typing import Any

from cluster_client import generate_all, stub_for, wait_for_full_kv
from live_cluster import dump_logs
from tiny_models import PROMPTS

from deploy.cluster import LocalCluster

# small blocks and chunks so the tiny prompts take several of each
ENGINE = ("--device", "cpu", "--dtype", "float32", "--block-size", "4",
          "--max-num-batched-tokens", "16", "--kv-cache-mib", "4")


def sampling(i: int, seeded: bool, seed_base: int) -> dict[str, Any]:
    if seeded:
        return dict(max_tokens=10, temperature=0.9, top_p=0.95, top_k=40, seed=seed_base + i,
                    ignore_eos=True)
    return dict(max_tokens=10, temperature=0.0, ignore_eos=True)


def colocated_tokens(path: str, seed_base: int,
                     **engine_kw: Any) -> dict[bool, list[list[int]]]:
    """{seeded: every prompt's tokens} from the in-process colocated engine (engine_kw:
    more EngineConfig fields, e.g. kv_cache_dtype)."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    refs = {}
    with LLM(path, block_size=4, max_num_batched_tokens=16, dtype="float32",
             **engine_kw) as llm:
        for seeded in (False, True):
            params = [SamplingParams(**sampling(i, seeded, seed_base))
                      for i in range(len(PROMPTS))]
            refs[seeded] = [c.token_ids for c in llm.generate(PROMPTS, params)]
    return refs


def assert_cluster_matches(c: LocalCluster, refs: dict[bool, list[list[int]]],
                           seed_base: int) -> None:
    for seeded in (False, True):
        results = generate_all(c.router_address, PROMPTS,
                               lambda i, s=seeded: sampling(i, s, seed_base))
        for i, r in enumerate(results):
            assert r.code is None and not r.error, (i, r.code, r.details, r.error,
                                                    dump_logs(c))
            assert (r.timing.producer, r.timing.consumer) == ("worker-0", "worker-1")
            assert r.token_ids == refs[seeded][i], (seeded, i)
    ch, stub = stub_for(c.router_address)
    with ch:
        wait_for_full_kv(stub, timeout=30)
