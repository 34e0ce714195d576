"""cache_aware placement and conditional local prefill (router/control/policy.py) on
hand-made loads and index contents (no gRPC): the longest cached prefix wins within the load
it is worth, the imbalance guard, salted requests, and the local-prefill rule."""

from __future__ import annotations

from pdserve.v1 import common_pb2, worker_pb2

from engine.prefix_hash import block_hashes, chain_root
from router.control.kv_index import KVIndex
from router.control.policy import CacheAware, LocalPrefill, place
from router.control.prefix_lookup import PrefixLookup
from router.control.registry import CONSUMER, PRODUCER, Registry, WorkerInfo

BS = 4
PROMPT = list(range(1, 101))  # 100 tokens, 25 blocks


def _cluster(salt_ok: bool = True) -> tuple[Registry, dict[str, WorkerInfo]]:
    reg = Registry(heartbeat_timeout_s=30.0)
    ws = {}
    for wid, role in (("p0", PRODUCER), ("p1", PRODUCER), ("c0", CONSUMER), ("c1", CONSUMER)):
        ws[wid] = reg.register(
            worker_id=wid, role=role, address=f"{wid}:1", kv_address="kv", model="m",
            kv_fingerprint="fp", max_model_len=4096,
            load=common_pb2.WorkerLoad(kv_blocks_total=1000, kv_blocks_free=1000),
            block_size=BS, prefix_caching=True, accepts_cache_salt=salt_ok or wid != "p1")
    return reg, ws


def _hold(idx: KVIndex, w: WorkerInfo, tokens: list[int], salt: str = "") -> None:
    hs = block_hashes(tokens, BS, chain_root("fp", "", salt))
    assert not idx.apply(w, worker_pb2.KVEventBatch(
        worker_id=w.worker_id, epoch=1,
        snapshot=worker_pb2.KVCacheSnapshot(seq=1, block_hashes=hs))).resync


def test_the_longest_cached_prefix_wins_within_its_load() -> None:
    reg, ws = _cluster()
    idx, pol = KVIndex(), CacheAware(load_tokens=16, imbalance=3)
    _hold(idx, ws["p1"], PROMPT[:80])
    _hold(idx, ws["c1"], PROMPT[:40])
    look = PrefixLookup(idx, PROMPT)
    assert (look.cached_tokens(ws["p1"]), look.cached_tokens(ws["c1"])) == (80, 40)
    slot = place(reg, pol, lookup=look)
    assert slot is not None and (slot.producer, slot.consumer) == (ws["p1"], ws["c1"])
    # p1 gets busier: 2 queued requests cost 2 * 16 tokens < the 80 it saves: still p1
    ws["p1"].load.waiting = 2
    slot = place(reg, pol, lookup=PrefixLookup(idx, PROMPT))
    assert slot is not None and slot.producer is ws["p1"]
    # 4 queued: 64 + 20 uncached > 100 uncached on p0... and the guard (4 - 0 > 3) anyway
    ws["p1"].load.waiting = 4
    slot = place(reg, pol, lookup=PrefixLookup(idx, PROMPT))
    assert slot is not None and slot.producer is ws["p0"] and pol.guarded >= 1
    # no prompt (a retry): least loaded
    ws["p1"].load.waiting = 0
    ws["p0"].load.waiting = 1
    slot = place(reg, pol)
    assert slot is not None and slot.producer is ws["p1"]


def test_a_salted_prompt_matches_only_its_salt_and_avoids_workers_that_ignore_salts() -> None:
    reg, ws = _cluster(salt_ok=False)  # p1 would ignore a salt
    idx, pol = KVIndex(), CacheAware()
    _hold(idx, ws["p0"], PROMPT, salt="a")
    _hold(idx, ws["p1"], PROMPT)
    assert PrefixLookup(idx, PROMPT, "b").cached_tokens(ws["p0"]) == 0
    assert PrefixLookup(idx, PROMPT, "a").cached_tokens(ws["p0"]) == 100
    for _ in range(4):
        slot = place(reg, pol, lookup=PrefixLookup(idx, PROMPT, "b"))
        assert slot is not None and slot.producer is ws["p0"]  # never p1
    slot = place(reg, pol, lookup=PrefixLookup(idx, PROMPT))
    assert slot is not None and slot.producer is ws["p1"]  # unsalted: p1's cached prefix


def test_local_prefill_follows_the_rule() -> None:
    reg, ws = _cluster()
    idx, pol = KVIndex(), CacheAware()
    local = LocalPrefill(max_tokens=24)
    # nothing cached anywhere: a fresh prompt is P/D, however short
    slot = place(reg, pol, lookup=PrefixLookup(idx, PROMPT[:8]), local=local)
    assert slot is not None and slot.producer is not None and slot.colocated is None
    # c1 holds 80 of 100 tokens: the 20-token tail is prefilled there
    _hold(idx, ws["c1"], PROMPT[:80])
    slot = place(reg, pol, lookup=PrefixLookup(idx, PROMPT), local=local)
    assert slot is not None and slot.colocated is ws["c1"] and slot.producer is None
    # 60 of 100: a 40-token tail is over the bound: P/D, c1 receiving only the rest
    slot = place(reg, pol, lookup=PrefixLookup(idx, PROMPT + list(range(200, 220))),
                 local=local)
    assert slot is not None and slot.colocated is None and slot.consumer is ws["c1"]
    # every producer has a queue and the consumer has room: a short prompt is prefilled
    # on the consumer
    ws["p0"].load.waiting = ws["p1"].load.waiting = 1
    fresh = list(range(500, 520))
    slot = place(reg, pol, lookup=PrefixLookup(idx, fresh), local=local)
    assert slot is not None and slot.colocated in (ws["c0"], ws["c1"])
    # ... a long one still goes to a producer (it would stall the consumer's decode batch)
    long_fresh = list(range(600, 700))
    slot = place(reg, pol, lookup=PrefixLookup(idx, long_fresh), local=local)
    assert slot is not None and slot.producer is not None and slot.colocated is None
    # ... and so does a short one when the consumer has no room for it
    for c in ("c0", "c1"):
        ws[c].load.kv_blocks_free = 1
    slot = place(reg, pol, lookup=PrefixLookup(idx, fresh), local=local)
    assert slot is not None and slot.producer is not None
    assert local.decisions == {"short_tail": 1, "producers_saturated": 1, "remote": 4}
    # -1: never
    off = LocalPrefill(max_tokens=-1)
    ws["p0"].load.waiting = ws["p1"].load.waiting = 0
    slot = place(reg, pol, lookup=PrefixLookup(idx, PROMPT), local=off)
    assert slot is not None and slot.producer is not None
    assert off.decisions["remote"] == 1
