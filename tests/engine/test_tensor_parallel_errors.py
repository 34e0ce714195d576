"""Tensor parallelism's failure modes: bad sizes are ValueErrors naming the flag before any
process starts; a follower rank that dies or hangs fails the engine, with an error naming
the rank, within a bounded time, and leaves no process behind."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest
from tiny_models import make_tiny_model

from engine.config import ModelConfig
from engine.llm import LLM
from engine.parallel.followers import TPRankError
from engine.parallel.shards import check_tp, shard_for
from engine.sampling_params import SamplingParams

BASE = ModelConfig(arch="llama", hidden_size=96, intermediate_size=192, num_layers=1,
                   num_heads=6, num_kv_heads=3, head_dim=16, vocab_size=100,
                   rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
                   tie_word_embeddings=False, attention_bias=False, qk_norm=False)


@pytest.mark.parametrize("tp,heads,kv,why", [
    (4, 6, 3, "attention heads"), (2, 6, 3, "KV heads"), (6, 6, 4, "multiple of"),
    (0, 6, 3, ">= 1")])
def test_sizes_that_cannot_split_the_model(tp, heads, kv, why):
    cfg = dataclasses.replace(BASE, num_heads=heads, num_kv_heads=kv)
    with pytest.raises(ValueError, match=f"--tensor-parallel-size.*{why}"):
        check_tp(cfg, tp)


def test_shards_cover_every_head_and_row():
    cfg = dataclasses.replace(BASE, num_heads=8, num_kv_heads=2, vocab_size=101)
    shards = [shard_for(cfg, r, 4) for r in range(4)]
    assert [s.q_start for s in shards] == [0, 2, 4, 6]
    # kv replicated: q heads 0-3 read KV head 0, q heads 4-7 KV head 1 (group of 4)
    assert [s.kv_start for s in shards] == [0, 0, 1, 1]
    assert all(s.num_kv_heads == 1 for s in shards)
    assert [s.vocab_rows for s in shards] == [26, 26, 26, 23]
    assert sum(s.inter_size for s in shards) == cfg.intermediate_size


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tperr") / "m"), "llama")


def test_engine_and_cli_reject_bad_sizes(model_dir, capsys):
    from deploy.cli import main

    with pytest.raises(ValueError, match="--tensor-parallel-size: 3 does not divide"):
        LLM(model_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="--tensor-parallel-size: 2 ranks but --devices"):
        LLM(model_dir, tensor_parallel_size=2, devices=("cpu",))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model_dir, tensor_parallel_size=0)
    rc = main(["generate", "--model", model_dir, "--device", "cpu", "--tensor-parallel-size",
               "8", "--prompt-token-ids", "1,2,3"])
    assert rc == 2
    assert "--tensor-parallel-size: 8 does not divide" in capsys.readouterr().err


def test_cluster_roles_take_tp(model_dir):
    from deploy.cli import build_parser
    from deploy.worker_cmd import spec_from_args

    for role in ("producer", "consumer"):
        for backend in ("ucx", "ipc", "nixl"):
            args = build_parser().parse_args([role, "--router", "127.0.0.1:1", "--model",
                                              model_dir, "--tensor-parallel-size", "2",
                                              "--transfer-backend", backend])
            spec = spec_from_args(args, role)
            assert (spec.engine.tensor_parallel_size, spec.engine.role) == (2, role)
            assert spec.transfer["backend"] == backend
    args = build_parser().parse_args(["colocated", "--router", "127.0.0.1:1", "--model",
                                      model_dir, "--tensor-parallel-size", "2",
                                      "--devices", "cpu,cpu", "--tp-timeout", "9"])
    cfg = spec_from_args(args, "colocated").engine
    assert (cfg.tensor_parallel_size, cfg.devices, cfg.tp_timeout_s) == (2, ("cpu", "cpu"), 9)


def _stream_until_failure(llm: LLM, act, after: int = 3) -> tuple[int, float]:
    """Streams one long request; `act()` after `after` outputs; returns (outputs seen,
    seconds from act to the error)."""
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    n, t0 = 0, None
    with pytest.raises(TPRankError) as err:
        for _ in llm.stream([[5, 6, 7, 8]], params):
            n += 1
            if n == after:
                act()
                t0 = time.monotonic()
    assert t0 is not None
    _stream_until_failure.last_error = str(err.value)  # type: ignore[attr-defined]
    return n, time.monotonic() - t0


def _gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped by its new parent counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_killing_a_follower_mid_generate_fails_the_engine(model_dir):
    llm = LLM(model_dir, block_size=4, tensor_parallel_size=2, max_model_len=512)
    procs = llm.engine.runner.followers.procs
    victim = procs[0]
    # killed from another thread while the engine steps: inside a collective or between
    n, took = _stream_until_failure(
        llm, lambda: threading.Timer(0.05, lambda: os.kill(victim.pid, signal.SIGKILL)).start())
    msg = _stream_until_failure.last_error  # type: ignore[attr-defined]
    assert "rank 1" in msg and "exited with code -9" in msg, msg
    assert took < 20, took
    assert n < 400
    for p in procs:  # the surviving ranks were stopped too
        p.wait(timeout=10)
    with pytest.raises(TPRankError):  # and the engine stays failed
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))


def test_a_hung_follower_fails_within_the_collective_timeout(model_dir):
    llm = LLM(model_dir, block_size=4, tensor_parallel_size=2, max_model_len=512,
              tp_timeout_s=3.0)
    victim = llm.engine.runner.followers.procs[0]
    n, took = _stream_until_failure(llm, lambda: os.kill(victim.pid, signal.SIGSTOP))
    msg = _stream_until_failure.last_error  # type: ignore[attr-defined]
    assert "collective failed" in msg, msg
    assert 2.0 < took < 30, took
    victim.wait(timeout=10)  # killed, not left stopped
    assert _gone(victim.pid)


RANK0 = """
import sys
from engine.llm import LLM
from engine.sampling_params import SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=512)
print("ready", *[p.pid for p in llm.engine.runner.followers.procs], flush=True)
for _ in llm.stream([[1, 2, 3]], SamplingParams(max_tokens=500, ignore_eos=True)):
    pass
print("finished", flush=True)
"""


def test_followers_exit_when_rank0_dies(model_dir):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0, model_dir], cwd=root,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert rank0.stdout is not None
        line = rank0.stdout.readline().split()
        assert line and line[0] == "ready", line
        kids = [int(x) for x in line[1:]]
        time.sleep(0.5)  # mid-generate
        assert rank0.poll() is None
    finally:
        rank0.kill()
        rank0.wait()
    deadline = time.monotonic() + 60
    while not all(_gone(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_gone(k) for k in kids), kids


def test_launch_passes_tp_to_every_worker_role(model_dir, capsys):
    from deploy.cli import build_parser, main
    from deploy.launch_cmd import spec_from_args

    args = build_parser().parse_args(["launch", "--model", model_dir, "--producers", "1",
                                      "--consumers", "2", "--tensor-parallel-size", "2",
                                      "--grpc-port", "0", "--http-port", "0"])
    spec = spec_from_args(args)
    assert (spec.producers, spec.consumers) == (1, 2)
    assert "--tensor-parallel-size=2" in spec.worker_args
    rc = main(["launch", "--model", model_dir, "--tensor-parallel-size", "0", "--grpc-port",
               "0", "--http-port", "0"])
    assert rc == 2
    assert "--tensor-parallel-size: must be >= 1" in capsys.readouterr().err
    args = build_parser().parse_args(["launch", "--model", model_dir, "--producers", "0",
                                      "--consumers", "0", "--colocated", "1",
                                      "--tensor-parallel-size", "2", "--grpc-port", "0",
                                      "--http-port", "0"])
    spec = spec_from_args(args)
    assert "--tensor-parallel-size=2" in spec.worker_args


def test_a_plan_write_to_a_reader_that_reads_nothing_times_out():
    from engine.parallel.messages import TO_FOLLOWER, SideMessage
    from engine.parallel.wire import read_frame, write_frame

    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        write_frame(w, SideMessage(bytes(range(10))), timeout_s=1.0)  # fits the pipe
        assert read_frame(r, TO_FOLLOWER) == SideMessage(bytes(range(10)))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            write_frame(w, SideMessage(bytes(4 << 20)), timeout_s=0.5)  # 4 MiB, nobody reads
        assert 0.4 < time.monotonic() - t0 < 10
    finally:
        os.close(r)
        os.close(w)
