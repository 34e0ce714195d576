"""A producer and a consumer of two ranks in two attention data-parallel groups each
(--tensor-parallel-size 2 --data-parallel-size 2; role_harness: the roles' engine-side
code, each engine with its follower rank process, real UCX over loopback, no servers) on a
tiny Qwen3-MoE. A request named to group 1 on both sides moves its KV from the producer's
rank 1 to the consumer's rank 1 only: rank 0 of either worker (group 0, idle) sends and
receives no byte, by its transfer counters. Tokens equal the single-rank engine's. A local
prefill the router places on a group of the consumer is served there."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from role_harness import PD, Side
from tiny_models import PROMPTS, make_tiny_model

from consumer.handler import ConsumerHandler
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from transfer.tp_endpoints import split_addresses
from transfer.tp_receiver import TPReceiver
from transfer.tp_sender import TPSender
from worker.messages import DecodeCmd, PrefillCmd, ReservedEvent
from worker.token_batch import TokensEvent

UCX = {"backend": "ucx", "host": "127.0.0.1", "peer_timeout_s": 5.0,
       "transfer_timeout_s": 60.0}
DP = dict(tensor_parallel_size=2, data_parallel_size=2, block_size=4,
          max_num_batched_tokens=16)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _end_plane_probes() -> Iterator[None]:
    """UCX's plane probe child lives as long as this process: end it with the module."""
    yield
    from transfer import plane_probe

    plane_probe.close_all()


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[list[int]]]:
    path = make_tiny_model(os.path.join(tmp_path_factory.mktemp("dpr"), "moe"), "qwen3_moe",
                           seed=4)
    with LLM(path, block_size=4, max_num_batched_tokens=16) as llm:
        ref = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    return path, ref


def _whole(side: Side) -> bool:
    """Every group's pool has all its blocks back and no request is held."""
    eng = side.engine
    pools = [s.blocks.accounting() for s in eng.scheduler.slots]  # type: ignore[union-attr]
    return all(a.free == a.total for a in pools) and not eng.held_requests()


def test_kv_moves_only_between_the_named_groups_ranks(moe):
    path, ref = moe
    pd = PD(path, producer_kw=DP, consumer_kw=DP, transfer=UCX)
    try:
        tx, rx = pd.producer.sender, pd.consumer.receiver
        assert isinstance(tx, TPSender) and isinstance(rx, TPReceiver)
        wire = GREEDY
        rids = [f"g1-{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(rids, PROMPTS, strict=True):
            pd.consumer.on_command(DecodeCmd(rid, tuple(prompt), wire, False, source_tp=1,
                                             dp_rank=1))
            pd.producer.on_command(PrefillCmd(rid, tuple(prompt), wire, 0, dp_rank=1))
        pd.run(lambda: all(pd.finished(r) and pd.transfer(r) is not None for r in rids),
               timeout_s=120)
        for i, rid in enumerate(rids):
            assert pd.transfer(rid).ok, pd.transfer(rid)  # type: ignore[union-attr]
            assert pd.tokens(rid) == ref[i], rid
            (res,) = pd.c.of(rid, ReservedEvent)  # the consumer's group-1 rank alone
            assert split_addresses(res.kv_address) == split_addresses(rx.address)[1:]
            assert pd.p.engine.requests.get(rid) is None  # released after the ack
        pd.run(lambda: 1 in tx.rank_stats and 1 in rx.rank_stats and
               tx.rank_stats[1].payload_bytes == rx.rank_stats[1].payload_bytes > 0,
               timeout_s=30)
        # group 0's rank 0 on each side: no byte sent or received
        assert tx.local.stats().payload_bytes == 0
        assert rx.local.stats().payload_bytes == 0
        blocks = sum(-(-len(p) // 4) for p in PROMPTS)
        assert rx.rank_stats[1].payload_bytes == blocks * pd.c.engine.layout.block_nbytes
        pd.run(lambda: _whole(pd.p) and _whole(pd.c), timeout_s=30)
    finally:
        pd.close()
        for side in (pd.p, pd.c):
            side.engine.runner.close()


def test_a_local_prefill_is_served_on_the_group_the_router_named(moe):
    path, ref = moe
    eng = LLM(path, role="consumer", **DP).engine
    side = Side(lambda emit: ConsumerHandler(eng, emit, UCX))
    try:
        side.handler.on_command(DecodeCmd("loc", tuple(PROMPTS[0]), GREEDY, True,
                                          dp_rank=1))
        assert eng.requests["loc"].dp_rank == 1
        for _ in range(400):
            if any(e.finish for e in side.of("loc", TokensEvent)):
                break
            side.turn()
        assert [t for e in side.of("loc", TokensEvent) for t in e.ids] == ref[0]
    finally:
        side.handler.close()
        eng.runner.close()
