"""The uncached-tail protocol between a producer and a consumer (role_harness: tiny engines,
real UCX transfer over loopback, no servers): the consumer reserves the prompt's leading
blocks from its prefix cache and says how many (Reserved.cached_blocks); the producer
prefills only what its own cache lacks and pushes only the blocks after the consumer's; the
tokens are the colocated engine's; every block comes back on every path, abort included."""

from __future__ import annotations

from role_harness import PD

from engine.llm import LLM
from engine.request_state import RequestState
from engine.sampling_params import SamplingParams
from worker.messages import AbortCmd, DestinationCmd, ReservedEvent, Token0Event

S = RequestState
UCX = {"backend": "ucx", "host": "127.0.0.1", "peer_timeout_s": 2.0,
       "transfer_timeout_s": 30.0}
BS = 4
SYSTEM = [(11 * i + 5) % 250 for i in range(40)]  # 10 full blocks
Q1 = [201, 202, 203, 204, 205, 206]  # 46 tokens: 11 full blocks + 2
Q2 = [31, 32, 33, 34, 35, 36, 37]  # 47 tokens: 12 blocks, the 11th differs from Q1's
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)


def _reserved(pd: PD, rid: str) -> ReservedEvent:
    found = pd.c.of(rid, ReservedEvent)
    assert len(found) == 1
    return found[0]


def test_only_the_blocks_the_consumer_lacks_move_and_tokens_match(tiny_llama):
    prompts, params = [SYSTEM + Q1, SYSTEM + Q2], [GREEDY, SEEDED]
    ref = LLM(tiny_llama, block_size=BS, enable_prefix_caching=False).generate(prompts, params)
    pd = PD(tiny_llama, transfer=UCX)
    try:
        nbytes = pd.producer.engine.layout.block_nbytes
        pd.submit("a", prompts[0], GREEDY, reuse_cached=True)
        pd.run(lambda: pd.finished("a") and pd.transfer("a") is not None, timeout_s=60)
        assert pd.transfer("a").ok  # type: ignore[union-attr]
        assert _reserved(pd, "a").cached_blocks == 0  # nothing cached anywhere yet
        assert pd.producer.kv_bytes_sent == pd.consumer.kv_bytes_received == 12 * nbytes
        assert pd.tokens("a") == ref[0].token_ids

        computed = pd.producer.engine.scheduler.tokens_computed
        pd.submit("b", prompts[1], SEEDED, reuse_cached=True)
        pd.run(lambda: pd.finished("b") and pd.transfer("b") is not None, timeout_s=60)
        assert pd.transfer("b").ok  # type: ignore[union-attr]
        # the consumer held SYSTEM's 10 blocks (landed for "a"): 2 of 12 move, as bytes
        assert _reserved(pd, "b").cached_blocks == 10
        assert pd.producer.kv_bytes_sent == (12 + 2) * nbytes
        assert pd.consumer.kv_bytes_received == (12 + 2) * nbytes
        # the producer's own cache held them too: it computed only Q2
        assert pd.producer.engine.scheduler.tokens_computed - computed == len(Q2)
        assert pd.p.of("b", Token0Event)[0].cached_tokens == 40
        assert pd.tokens("b") == ref[1].token_ids  # seeded: the same draws by position
        pd.run(lambda: pd.p.whole() and pd.c.whole(), timeout_s=30)
    finally:
        pd.close()


def test_abort_with_shared_cached_blocks_reserved_frees_everything(tiny_llama):
    pd = PD(tiny_llama, transfer=UCX, producer_kw={"max_num_batched_tokens": 8})
    try:
        pd.submit("warm", SYSTEM + Q1, GREEDY, reuse_cached=True)
        pd.run(lambda: pd.finished("warm") and pd.transfer("warm") is not None, timeout_s=60)
        # reserved (10 cached blocks shared with the cache), the tail pushed, the final
        # notice held back (token 0 not confirmed sent): mid-transfer
        pd.auto_token0 = False
        pd.submit("x", SYSTEM + Q2, GREEDY, reuse_cached=True)
        pd.run(lambda: pd.state(pd.c, "x") == S.WAITING_FOR_KV
               and "x" in pd.producer.out and pd.producer.out["x"].pushed == 12,
               timeout_s=60)
        assert pd.producer.out["x"].skip == 10
        assert _reserved(pd, "x").cached_blocks == 10
        shared = _reserved(pd, "x").block_ids[:10]
        assert all(pd.consumer.engine.blocks.refcount(b) == 1 for b in shared)
        # the router fans the abort out to both legs
        pd.consumer.on_command(AbortCmd("x"))
        pd.producer.on_command(AbortCmd("x"))
        pd.run(lambda: pd.p.whole() and pd.c.whole() and pd.transfer("x") is not None,
               timeout_s=60)
        assert not pd.transfer("x").ok  # type: ignore[union-attr]
        # the cached blocks stayed cached: the next request still reuses them
        pd.auto_token0 = True
        pd.submit("y", SYSTEM + Q2, GREEDY, reuse_cached=True)
        pd.run(lambda: pd.finished("y"), timeout_s=60)
        assert _reserved(pd, "y").cached_blocks == 10
        ref = LLM(tiny_llama, block_size=BS).generate([SYSTEM + Q2], GREEDY)[0]
        assert pd.tokens("y") == ref.token_ids
        pd.run(lambda: pd.p.whole() and pd.c.whole(), timeout_s=30)
    finally:
        pd.close()


def test_a_destination_claiming_every_block_cached_is_refused(tiny_llama):
    pd = PD(tiny_llama)  # the fake transfer: nothing moves here
    pd.auto_pair = False
    pd.submit("r", SYSTEM + Q1, GREEDY)
    pd.run(lambda: bool(pd.c.of("r", ReservedEvent)))
    ev = _reserved(pd, "r")
    pd.producer.on_command(DestinationCmd("r", "c0", ev.kv_address, ev.block_ids,
                                          len(ev.block_ids)))
    t = pd.transfer("r")
    assert t is not None and not t.ok and t.error.startswith("cached_blocks: 12 of 12")
    pd.consumer.on_command(AbortCmd("r"))
    pd.run(lambda: pd.p.whole() and pd.c.whole())
