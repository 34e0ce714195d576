"""A colocated worker with --tensor-parallel-size 2 in a live cluster (router, gRPC, the
worker's engine process spawning its follower rank): tokens equal transformers'."""

from __future__ import annotations

import os
import time

from cluster_client import generate, stub_for
from live_cluster import dump_logs, start_cluster
from pdserve.v1 import router_pb2
from tiny_models import PROMPTS, hf_greedy, make_tiny_model


def _byte_tokenizer(path: str) -> None:
    """A 256-token byte-level tokenizer.json: the router needs one to serve the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.save(f"{path}/tokenizer.json")


def test_colocated_tp2_worker_serves_greedy_tokens(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("tpc") / "m"), "llama")
    _byte_tokenizer(path)
    c = start_cluster(tmp_path_factory, "tpc", model=path, producers=0, consumers=0,
                      colocated=1, worker_args=("--tensor-parallel-size", "2", "--device",
                                                "cpu", "--dtype", "float32",
                                                "--block-size", "4"))
    try:
        assert len(_followers_of(path)) == 1  # the worker's rank 1
        ch, stub = stub_for(c.router_address)
        with ch:
            for p in PROMPTS[:2]:
                res = generate(stub, {"max_tokens": 10, "temperature": 0, "ignore_eos": True},
                               prompt_token_ids=router_pb2.TokenIds(ids=p))
                assert res.code is None and not res.error, (res.details, res.error,
                                                            dump_logs(c))
                assert res.token_ids == hf_greedy(path, p, 10), dump_logs(c)
    finally:
        c.stop()
    deadline = time.monotonic() + 30
    while _followers_of(path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _followers_of(path)  # stopping the worker stopped its follower


def _followers_of(model: str) -> list[int]:
    out = []
    for pid in (e for e in os.listdir("/proc") if e.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        if "engine.parallel.follower" in cmd and model in cmd:
            out.append(int(pid))
    return out
