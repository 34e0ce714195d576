"""A colocated worker with --tensor-parallel-size 2 --data-parallel-size 2 in a live cluster
(router, gRPC, the worker's engine process and its follower rank) on a tiny Qwen3-MoE:
tokens equal transformers' through the router and when a Decode names its attention group;
the heartbeat carries each group's load; a group the worker does not have is an error
naming the field, and the worker keeps serving."""

from __future__ import annotations

import time

import grpc
from cluster_client import generate, stub_for
from live_cluster import dump_logs, start_cluster
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from tiny_models import PROMPTS, byte_tokenizer, hf_greedy, make_tiny_model

N = 8


def _decode(stub: worker_pb2_grpc.WorkerStub, rid: str, ids: list[int],
            dp_rank: int | None) -> tuple[list[int], str]:
    """(token ids, error text) of one colocated Decode call straight to the worker."""
    req = worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=ids, seed=1, colocated=True,
        sampling=common_pb2.SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))
    if dp_rank is not None:
        req.dp_rank = dp_rank
    toks: list[int] = []
    err = ""
    try:
        for msg in stub.Decode(req, timeout=60):
            if msg.WhichOneof("kind") == "tokens":
                toks += msg.tokens.token_ids
                err += msg.tokens.error
    except grpc.RpcError as e:
        err += e.details() or str(e.code())
    return toks, err


def test_colocated_dpa_tp2_worker(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("dpac") / "m"), "qwen3_moe", seed=4)
    byte_tokenizer(path)
    c = start_cluster(tmp_path_factory, "dpac", model=path, producers=0, consumers=0,
                      colocated=1, worker_args=(
                          "--tensor-parallel-size", "2", "--data-parallel-size", "2",
                          "--device", "cpu", "--dtype", "float32", "--block-size", "4",
                          "--num-kv-blocks", "64"))
    try:
        want = {i: hf_greedy(path, p, N) for i, p in enumerate(PROMPTS[:3])}
        ch, stub = stub_for(c.router_address)
        with ch:
            for i, p in list(enumerate(PROMPTS))[:2]:
                res = generate(stub, {"max_tokens": N, "temperature": 0, "ignore_eos": True},
                               prompt_token_ids=router_pb2.TokenIds(ids=p))
                assert res.code is None and not res.error, (res.details, res.error,
                                                            dump_logs(c))
                assert res.token_ids == want[i], dump_logs(c)
        (w,) = c.status().workers
        with grpc.insecure_channel(w.address) as wch:
            ws = worker_pb2_grpc.WorkerStub(wch)
            for g in (1, 0):
                toks, err = _decode(ws, f"on-{g}", PROMPTS[2], g)
                assert not err and toks == want[2], (g, err, toks)
            toks, err = _decode(ws, "nowhere", PROMPTS[2], 2)
            assert "dp_rank" in err and not toks, err
            toks, err = _decode(ws, "still-serving", PROMPTS[0], None)
            assert not err and toks == want[0], err
        # per-group load in the heartbeat, as the router keeps it (once every request's
        # blocks came back: a heartbeat may still carry a report from before)
        deadline = time.monotonic() + 20
        while True:
            (w,) = c.status().workers
            ranks = list(w.load.dp_ranks)
            idle = len(ranks) == 2 and all(r.kv_blocks_free == r.kv_blocks_total
                                           and not r.running for r in ranks)
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert idle, w.load
        assert [r.kv_blocks_total for r in ranks] == [64, 64], w.load
        assert w.load.kv_blocks_total == 128
    finally:
        c.stop()
