"""An MLA (latent) KV pool through the real transfer layer: a producer engine prefills a
DeepSeek prompt, its latent blocks move over a network backend into a consumer engine's
reserved blocks, and the consumer's tokens equal a colocated run's. The bytes on the wire
are the latent's: prompt blocks x layers x block_size x (kv_lora_rank + qk_rope_head_dim)
x dtype size. A dense peer and an MLA peer never pair."""

from __future__ import annotations

import pytest
from tiny_deepseek import make_tiny_deepseek
from tiny_models import PROMPTS
from xfer_helpers import cfg

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from transfer import HandshakeError, TransferStatus, make_receiver, make_sender
from transfer.types import TransferNotice

PARAMS = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)]


@pytest.fixture(scope="module")
def v2_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_deepseek(str(tmp_path_factory.mktemp("mla") / "v2"), "v2",
                              q_lora_rank=None)


@pytest.mark.parametrize("backend", ["ipc", "fake"])
def test_latent_blocks_move_and_decode_equals_colocated(v2_path, backend):
    prompt = PROMPTS[2]  # 50 tokens: 13 blocks of 4, the last one partial
    with LLM(v2_path, block_size=4) as colo, \
            LLM(v2_path, block_size=4, role="producer", max_num_batched_tokens=16) as p, \
            LLM(v2_path, block_size=4, role="consumer") as c:
        prod, cons = p.engine, c.engine
        assert prod.layout.kind == cons.layout.kind == "mla"
        with make_receiver(cons.kv_cache, cons.layout, cfg(backend)) as rx, \
                make_sender(prod.kv_cache, prod.layout, cfg(backend)) as tx:
            tx.connect(rx.address, timeout=10)
            for i, params in enumerate(PARAMS):
                rid = f"r{i}"
                want = colo.generate([prompt], params)[0].token_ids
                prod.add_request(rid, prompt, params)
                outs = []
                while not outs:
                    outs = prod.step().outputs
                (t0,) = outs
                src = prod.requests[rid].block_ids
                dst = cons.reserve(len(prompt))
                assert dst is not None and len(dst) == len(src) == 13
                rx.expect(rid, dst)
                tx.push(rid, rx.address, src, dst)
                tx.finish(rid, TransferNotice(rid, t0.new_token_ids[0], False, len(prompt),
                                              seed=t0.seed))
                assert rx.wait(rid, 20).status == TransferStatus.DONE
                assert tx.wait(rid, 20).status == TransferStatus.DONE
                tx.release(rid)
                rx.release(rid)
                prod.release(rid)
                cons.add_prefilled(rid, prompt, params, dst, t0.new_token_ids[0])
                tokens = list(t0.new_token_ids)
                while cons.has_unfinished():
                    for o in cons.step().outputs:
                        tokens += o.new_token_ids
                assert tokens == want, params
            # 13 blocks x 2 layers x 4 tokens x (32 + 16) latent values x 4 bytes, twice
            per_request = 13 * 2 * 4 * (32 + 16) * 4
            assert prod.layout.block_nbytes * 13 == per_request
            assert tx.stats().payload_bytes == 2 * per_request


def test_dense_and_mla_peers_never_pair(v2_path, tiny_models_dir):
    with LLM(v2_path, block_size=4, role="consumer") as c, \
            LLM(tiny_models_dir, block_size=4, role="producer") as p:
        with make_receiver(c.engine.kv_cache, c.engine.layout, cfg("ipc")) as rx, \
                make_sender(p.engine.kv_cache, p.engine.layout, cfg("ipc")) as tx, \
                pytest.raises(HandshakeError, match="planes: 1 != 2"):
            tx.connect(rx.address, timeout=10)


@pytest.fixture(scope="module")
def tiny_models_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_models import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("dense") / "llama"), "llama")


def test_layout_kind_is_part_of_the_fingerprint():
    from engine.kv_layout import KVLayout

    same = dict(model="m", dtype="bfloat16", block_size=16, num_layers=4, num_blocks=8)
    mla = KVLayout(**same, **KVLayout.kv_shape("mla", 16, 576))
    kv = KVLayout(**same, num_kv_heads=1, head_dim=576)  # K/V of one 576-wide head
    assert (mla.kind, kv.kind) == ("mla", "kv")
    assert mla.fingerprint() != kv.fingerprint()
    assert mla.describe_mismatch(kv) == "planes: 1 != 2"
    assert mla.block_nbytes * 2 == kv.block_nbytes == 4 * 2 * 16 * 576 * 2
    with pytest.raises(ValueError, match="^num_kv_heads: an MLA latent is one head"):
        KVLayout(**same, num_kv_heads=2, head_dim=576, planes=1)
    with pytest.raises(ValueError, match="^planes: "):
        KVLayout(**same, num_kv_heads=1, head_dim=576, planes=3)


def test_tp_plans_of_a_latent_layout():
    # One "head", the same bytes on every rank of either side: it moves once per request,
    # from the producer rank latent_source names to the consumer's first rank, which copies
    # it to its other ranks (tests/transfer/test_latent_tp.py); the dense plans of one KV
    # head (replicated K/V heads, each consumer rank taking its own copy) are unchanged
    from transfer.tp_plan import latent_source, part_between, plan

    for src_tp, dst_tp in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4)]:
        for source in range(src_tp):
            assert [(p.src_rank, p.dst_rank, p.num_heads)
                    for p in plan(src_tp, dst_tp, 1, True, source)] == [(source, 0, 1)]
        # a connection: any producer rank may send the first consumer rank a latent
        assert all(part_between(s, 0, src_tp, dst_tp, 1, True) is not None
                   for s in range(src_tp))
        assert all(part_between(s, c, src_tp, dst_tp, 1, True) is None
                   for s in range(src_tp) for c in range(1, dst_tp))
    assert [(p.src_rank, p.dst_rank) for p in plan(1, 2, 1)] == [(0, 0), (0, 1)]
    assert [(p.src_rank, p.dst_rank) for p in plan(2, 2, 1)] == [(0, 0), (1, 1)]
    # the sending rank is a function of the request id that spreads requests over ranks
    ids = [f"req-{i}" for i in range(64)]
    assert [latent_source(r, 2) for r in ids] == [latent_source(r, 2) for r in ids]
    for tp in (2, 4):
        counts = [sum(latent_source(r, tp) == k for r in ids) for k in range(tp)]
        assert min(counts) >= 64 // tp // 2, counts
    with pytest.raises(ValueError, match="^source: producer rank 2 outside"):
        plan(2, 2, 1, True, 2)
    with pytest.raises(ValueError, match="^num_kv_heads: a latent is one head"):
        plan(2, 2, 2, True, 0)
    with pytest.raises(ValueError, match="^producer tp_size"):
        latent_source("r", 0)
