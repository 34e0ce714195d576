"""An MLA latent moves once per request into a TP consumer, whatever its TP size.

Real parts: a producer engine (TP1, or TP2 with its follower process) prefills a tiny random
DeepSeek prompt and its TP sender pushes over UCX; the consumer is a TP2 engine (rank 0
here, rank 1 a follower process, gloo) behind the consumer role's own handler, driven turn
by turn as the worker's engine loop drives it. The latent reaches consumer rank 0 only,
rank 0 copies the request's blocks to rank 1 over the TP group, and only then is the
request admitted: its 32 greedy tokens equal the single-rank engine's (rank 1's query
heads read the copied latent, so a missing copy changes them).

Bytes: each request crosses the wire once, prompt blocks x block_size x layers x
(kv_lora_rank + qk_rope_head_dim) x 4 (float32), from the one producer rank
``tp_plan.latent_source`` names (a TP2 producer's requests spread over both ranks);
consumer rank 0 receives all of it and rank 1 nothing over the network.

Under data-parallel attention each attention group's first rank receives its requests' latent
and copies it inside the group (rank 0 of the worker need not be in it).

A consumer rank that dies during the copy fails that request (an error naming the copy),
frees its blocks, takes no longer than the death takes to notice, and the worker then fails
as a whole (TPRankError), as for any dead rank.

On CPU the consumer's ranks copy over gloo; with two GPUs (``-m gpu``) the consumer's ranks
sit on cuda:0 and cuda:1 and copy over NCCL, the producer on cuda:0 (TP2: both GPUs), the
latent crossing GPU pools over UCX. With ``$OUT`` set, each run writes its bytes per
request (wire and formula) to ``$OUT/latent_tp_<case>.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tiny_deepseek import MODELS, make_tiny_deepseek
from tiny_models import PROMPTS
from xfer_helpers import cfg, until_terminal

from consumer.handler import ConsumerHandler
from engine.llm import LLM
from engine.parallel.followers import TPRankError
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from transfer import TransferNotice, TransferStatus, make_sender
from transfer.tp_endpoints import split_addresses
from transfer.tp_plan import latent_source
from transfer.tp_receiver import TPReceiver
from transfer.tp_sender import tp_sender
from worker.messages import DecodeCmd, ReservedEvent
from worker.token_batch import TokensBatchEvent, TokensEvent

BS = 4
TOKENS = 32
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
ENGINE: dict[str, Any] = dict(block_size=BS, dtype="float32", max_num_batched_tokens=16,
                              max_model_len=256)
RIDS = [f"r-{i}" for i in range(len(PROMPTS))]  # latent_source(rid, 2): 0, 1, 0, 1


def _cfg() -> Any:
    # three processes of UCX workers on a loaded 2-core host: room for a slow start
    return cfg("ucx", connect_timeout_s=30.0, peer_timeout_s=10.0, heartbeat_interval_s=1.0)


def _model(tmp_path_factory: pytest.TempPathFactory, name: str) -> str:
    version, kw = MODELS[name]
    return make_tiny_deepseek(str(tmp_path_factory.mktemp("latent") / name), version,
                              seed=5, **kw)


GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (the consumer's two ranks)")])
# where each side's ranks run: the single-rank reference, the consumer, a producer by TP
PLACES: dict[str, dict[str, Any]] = {
    "cpu": dict(ref={}, consumer={}, producer={1: {}, 2: {}}),
    "cuda": dict(ref=dict(device="cuda:0"), consumer=dict(devices=("cuda:0", "cuda:1")),
                 producer={1: dict(device="cuda:0"), 2: dict(devices=("cuda:0", "cuda:1"))}),
}


@pytest.fixture(scope="module")
def v3_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _model(tmp_path_factory, "v3")


def _refs(path: str, device: str) -> list[list[int]]:
    with LLM(path, **ENGINE, **PLACES[device]["ref"]) as llm:
        return [c.token_ids for c in llm.generate(PROMPTS, [GREEDY] * len(PROMPTS))]


class Consumer:
    """A TP consumer's engine and role handler, stepped as worker.engine_loop steps them."""

    def __init__(self, path: str, tp: int, **engine: Any) -> None:
        self.llm = LLM(path, role="consumer", tensor_parallel_size=tp, **{**ENGINE, **engine})
        self.events: list[Any] = []
        self.handler = ConsumerHandler(self.llm.engine, self.events.append,
                                       dataclasses.asdict(_cfg()))

    @property
    def rx(self) -> TPReceiver:
        assert isinstance(self.handler.receiver, TPReceiver)
        return self.handler.receiver

    def turn(self) -> None:
        h = self.handler
        if h.engine.has_unfinished():
            h.before_step(time.time_ns())
            h.on_outputs(h.engine.step(), time.time_ns())
        h.after_step()

    def reserve(self, rid: str, prompt: list[int], source_tp: int,
                group: int = -1) -> ReservedEvent:
        self.handler.on_command(DecodeCmd(rid, tuple(prompt), GREEDY, False,
                                          source_tp=source_tp, dp_rank=group))
        end = time.monotonic() + 30
        while time.monotonic() < end:
            self.turn()
            for ev in self.events:
                if isinstance(ev, ReservedEvent) and ev.rid == rid:
                    return ev
        raise AssertionError(f"{rid}: never reserved")

    def tokens(self, rid: str) -> Iterator[TokensEvent]:
        for ev in self.events:
            if isinstance(ev, TokensBatchEvent):
                yield from (t for t in ev.events() if t.rid == rid)
            elif isinstance(ev, TokensEvent) and ev.rid == rid:
                yield ev

    def decode(self, rid: str, timeout: float = 120) -> list[int]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.turn()
            got = list(self.tokens(rid))
            if got and got[-1].finish is not None:
                assert not got[-1].error, got[-1]
                return [t for ev in got for t in ev.ids]
        raise AssertionError(f"{rid}: unfinished after {timeout} s")

    def close(self) -> None:
        self.handler.close()
        self.llm.close()


class Producer:
    def __init__(self, path: str, tp: int, **engine: Any) -> None:
        self.tp = tp
        self.llm = LLM(path, role="producer", tensor_parallel_size=tp, **{**ENGINE, **engine})
        eng = self.llm.engine
        self.tx: Any = tp_sender(make_sender(eng.kv_cache, eng.layout, _cfg()), eng.layout,
                                 _cfg(), eng.runner.followers)

    def send(self, rid: str, prompt: list[int], to: ReservedEvent) -> int:
        """Prefills, pushes every block to the reservation, finishes; returns token 0."""
        eng = self.llm.engine
        eng.add_request(rid, prompt, GREEDY)
        outs: list[Any] = []
        while not outs:
            outs = eng.step().outputs
        (t0,) = outs
        src = eng.requests[rid].block_ids
        self.tx.connect(to.kv_address, timeout=40)
        self.tx.push(rid, to.kv_address, src, list(to.block_ids))
        self.tx.finish(rid, TransferNotice(rid, t0.new_token_ids[0], False, len(prompt),
                                           seed=t0.seed))
        u = until_terminal(self.tx, rid, 60)
        assert u.status == TransferStatus.DONE, u
        self.tx.release(rid)
        eng.release(rid)
        return int(t0.new_token_ids[0])

    def rank_bytes(self) -> list[int]:
        """Payload bytes each rank sent (a follower's counters reach rank 0 as it polls)."""
        self.tx.poll()
        followers = [self.tx.rank_stats[r].payload_bytes if r in self.tx.rank_stats else 0
                     for r in range(1, self.tp)]
        return [self.tx.local.stats().payload_bytes, *followers]

    def close(self) -> None:
        self.tx.close()
        self.llm.close()


def wire_bytes(prompt: list[int], engine: Any) -> int:
    """The latent of a prompt, as whole blocks: blocks x tokens x layers x row bytes."""
    cfg_ = engine.model_cfg
    blocks = -(-len(prompt) // BS)
    return blocks * BS * cfg_.num_layers * (cfg_.kv_lora_rank + cfg_.qk_rope_head_dim) * 4


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("producer_tp", [1, 2], ids=["p-tp1-d-tp2", "p-tp2-d-tp2"])
def test_latent_moves_once_and_tokens_equal_the_single_rank_engine(v3_path, producer_tp,
                                                                   device):
    path = v3_path
    refs = _refs(path, device)
    place = PLACES[device]
    assert sorted({latent_source(r, 2) for r in RIDS}) == [0, 1]  # both ranks take some
    cons = Consumer(path, 2, **place["consumer"])
    prod = None
    record: list[dict[str, Any]] = []
    try:
        prod = Producer(path, producer_tp, **place["producer"][producer_tp])
        assert cons.llm.engine.layout.kind == "mla"
        per_rank = [0] * producer_tp
        total = 0
        for rid, prompt, want in zip(RIDS, PROMPTS, refs, strict=True):
            res = cons.reserve(rid, prompt, producer_tp)
            assert len(split_addresses(res.kv_address)) == 2  # both ranks, rank 0 first
            before = cons.rx.local.stats().payload_bytes
            t0 = prod.send(rid, prompt, res)
            tokens = [t0, *cons.decode(rid)]
            assert tokens == want, (rid, tokens, want)
            nbytes = wire_bytes(prompt, cons.llm.engine)
            # the latent of the prompt's tokens, within one block
            row = nbytes // (-(-len(prompt) // BS) * BS)
            assert 0 <= nbytes - len(prompt) * row < BS * row
            wire = cons.rx.local.stats().payload_bytes - before
            assert wire == nbytes, rid
            record.append(dict(rid=rid, prompt_tokens=len(prompt), wire_bytes=wire,
                               formula_bytes=nbytes,
                               producer_rank=latent_source(rid, producer_tp)))
            per_rank[latent_source(rid, producer_tp)] += nbytes
            total += nbytes
        # consumer: rank 0 took every byte once; rank 1 none over the network (its blocks
        # came through the copy), so the worker's sum is rank 0's
        assert cons.rx.local.stats().payload_bytes == total
        cons.turn()
        assert cons.rx.rank_stats.get(1) is None or cons.rx.rank_stats[1].payload_bytes == 0
        assert cons.rx.stats().payload_bytes == total
        # producer: each request left from the one rank latent_source names
        end = time.monotonic() + 10
        while prod.rank_bytes() != per_rank and time.monotonic() < end:
            time.sleep(0.05)
        assert prod.rank_bytes() == per_rank
        assert cons.handler.kv_bytes_received == total
        acc = cons.llm.engine.block_accounting()
        assert acc.free == acc.total  # every block back (cached ones count as free)
        assert cons.rx.accounting().transfers == 0
        _record(f"{device}_p{producer_tp}_d2", cons, record, per_rank)
    finally:
        if prod is not None:
            prod.close()
        cons.close()


def _record(case: str, cons: Consumer, requests: list[dict[str, Any]],
            producer_ranks: list[int]) -> None:
    out = os.environ.get("OUT")
    if not out:
        return
    cfg_ = cons.llm.engine.model_cfg
    with open(os.path.join(out, f"latent_tp_{case}.json"), "w") as f:
        json.dump({"case": case, "command": "OUT=DIR pytest tests/transfer/test_latent_tp.py"
                   " (-m gpu for cuda)", "block_size": BS, "layers": cfg_.num_layers,
                   "latent_row": cfg_.kv_lora_rank + cfg_.qk_rope_head_dim, "dtype_bytes": 4,
                   "requests": requests, "producer_rank_bytes": producer_ranks,
                   "consumer_rank_bytes": [cons.rx.local.stats().payload_bytes,
                                           *(st.payload_bytes
                                             for st in cons.rx.rank_stats.values())]}, f,
                  indent=1)


def test_each_attention_group_copies_its_own_latent(v3_path):
    # a consumer of 4 ranks in 2 attention groups of 2 (--data-parallel-size 2): a request
    # reserved in group 1 lands on rank 2 alone, which copies it to rank 3 over the group's
    # own communicator (rank 0 only sends the two of them the copy message)
    path = v3_path
    refs = _refs(path, "cpu")
    groups = [0, 1, 1, 0]
    cons = Consumer(path, 4, data_parallel_size=2)
    prod = None
    try:
        prod = Producer(path, 1)
        addresses = split_addresses(cons.rx.address)
        want_bytes = [0, 0, 0, 0]
        for rid, prompt, want, g in zip(RIDS, PROMPTS, refs, groups, strict=True):
            res = cons.reserve(rid, prompt, 1, g)
            assert split_addresses(res.kv_address) == addresses[2 * g:2 * g + 2]
            t0 = prod.send(rid, prompt, res)
            assert [t0, *cons.decode(rid)] == want, (rid, g)
            want_bytes[2 * g] += wire_bytes(prompt, cons.llm.engine)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            cons.turn()
            got = [cons.rx.local.stats().payload_bytes,
                   *(cons.rx.rank_stats[r].payload_bytes if r in cons.rx.rank_stats else 0
                     for r in (1, 2, 3))]
            if got == want_bytes:
                break
            time.sleep(0.05)
        assert got == want_bytes  # each group's first rank took its requests; no one else
        acc = cons.llm.engine.block_accounting()
        assert acc.free == acc.total
    finally:
        if prod is not None:
            prod.close()
        cons.close()


def test_a_consumer_rank_dying_during_the_copy_fails_the_request_cleanly(tmp_path_factory):
    path = _model(tmp_path_factory, "v2")
    cons = Consumer(path, 2, tp_timeout_s=20.0)
    prod = None
    try:
        prod = Producer(path, 1)
        rid, prompt = "dies", PROMPTS[2]
        res = cons.reserve(rid, prompt, 1)
        # the latent lands on rank 0; nothing polled it yet, so no copy has started
        prod.send(rid, prompt, res)
        victim = cons.llm.engine.runner.followers.procs[0]
        os.kill(victim.pid, signal.SIGSTOP)  # held before it can read the copy
        # ... and killed while rank 0 waits in the copy's broadcast
        threading.Timer(0.5, lambda: os.kill(victim.pid, signal.SIGKILL)).start()
        t = time.monotonic()
        cons.turn()  # polls the receiver: DONE on rank 0 -> copy -> fails
        took = time.monotonic() - t
        (ev,) = list(cons.tokens(rid))
        assert ev.finish == "error" and "copying the latent from rank 0 to ranks [1]" in \
            ev.error and "rank 1" in ev.error, ev
        assert took < 15, took  # the death, not the collective's 20 s timeout
        eng = cons.llm.engine
        assert eng.state_of(rid) in (None, RequestState.FINISHED_ERROR)
        acc = eng.block_accounting()
        assert acc.free == acc.total  # the request's reserved blocks are free again
        assert cons.rx.accounting().transfers == 0
        assert cons.handler.transfers_failed == 1 and cons.handler.transfers_ok == 0
        with pytest.raises(TPRankError, match="rank 1"):  # the worker fails as a whole
            for _ in range(3):
                cons.turn()
        victim.wait(timeout=10)
    finally:
        if prod is not None:
            prod.close()
        cons.close()
