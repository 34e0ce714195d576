"""Overlap of KV transfer with chunked prefill: when does the last chunk land on the consumer?

    python bench/transfer_overlap_bench.py [--backend ucx] [--device cpu|cuda] [--tokens 2048]
        [--chunk 512] [--reps 5] [--tiny] [--threads 1] [--out results.json]

Goal: the last chunk of a 2k-token Llama-3-8B prompt lands within 10% of that
prompt's prefill time. Producer: this process runs a real engine (dummy weights, producer
role, chunked prefill) driven by the real ``producer.handler.ProducerHandler``, so pushes
follow the production pattern (each chunk's full blocks after its step; the rest and the
FINISH notice right after token 0). Consumer: a spawned process holds a receiver on
cuda:1 (or cpu) with scattered destination blocks and stamps ``time.monotonic_ns()``
(one clock for all processes of a host) when the transfer turns DONE.

prefill = first step's start -> token 0 read on the host; last_land = same start -> the
consumer saw DONE; overshoot = last_land / prefill - 1 (goal <= 10%). The same engine's
prefill without any transfer is measured in the same run, interleaved, to show whether
pushing slows prefill. Landed bytes are checked (sha256) against the producer's blocks.
The real worker forwards token 0 to the router before FINISH leaves (Token0SentCmd);
here that command follows at once, so the gRPC hop (~0.1 ms of ZMQ) is not included.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.kv_layout import KVLayout  # noqa: E402
from engine.llm import build_engine  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from producer.handler import ProducerHandler  # noqa: E402
from transfer import TransferConfig, make_receiver  # noqa: E402
from worker.messages import (  # noqa: E402
    DestinationCmd,
    Event,
    PrefillCmd,
    Token0SentCmd,
    TransferResultEvent,
)

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                 # Llama-3.1's frequency scaling: same cost, exercises the llama3 rope path
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=8192,
            rope_theta=10000.0)
BLOCK = 16  # tokens per KV block: Llama-3-8B bf16 blocks are 2 MiB
# Token 0 must not end the request (that cancels the transfer); greedy, no EOS stop.
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def _write_config(d: str, tiny: bool) -> str:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
           "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 1,
           "eos_token_id": 2, **(TINY if tiny else LLAMA3_8B)}
    path = os.path.join(d, "llama-3-8b-dummy" if not tiny else "llama-tiny-dummy")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def _sha(pool: torch.Tensor, blocks: list[int]) -> str:
    """Digest of the given blocks' bytes in order; equal on both sides iff the bytes landed."""
    rows = pool.index_select(0, torch.tensor(blocks, device=pool.device)).cpu()
    return hashlib.sha256(rows.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _consumer(conn: Any, layout: KVLayout, backend: str, device: str) -> None:
    torch.set_num_threads(1)  # it only fills and hashes blocks; leave the cores to the engine
    dtype = getattr(torch, layout.dtype)
    pool = torch.empty((layout.num_blocks, *layout.block_shape), dtype=dtype, device=device)
    pool.normal_()  # touched: first-touch page faults stay out of the timing
    rx = make_receiver(pool, layout, TransferConfig(backend=backend))
    conn.send(rx.address)
    while (msg := conn.recv()) is not None:
        rid, dst = msg
        pool[torch.tensor(dst, device=device)] = 7.0  # stale bytes must not pass the check
        if pool.is_cuda:
            torch.cuda.synchronize(pool.device)
        rx.expect(rid, dst)
        conn.send("ready")
        end = time.monotonic() + 120
        u = None
        while u is None and time.monotonic() < end:
            u = next((x for x in rx.poll() if x.request_id == rid), None)
            if u is None:
                time.sleep(0.0001)  # <= 0.1 ms late; the receiver's I/O thread needs the GIL
        done_ns = time.monotonic_ns()
        if u is None:
            conn.send((rid, "TIMEOUT", done_ns, ""))
            continue
        rx.release(rid)
        conn.send((rid, u.status.name, done_ns, _sha(pool, dst)))
    rx.close()


def _sync(engine: LLMEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _prefill_alone(engine: LLMEngine, rid: str, prompt: list[int]) -> float:
    engine.add_request(rid, prompt, PARAMS)
    _sync(engine)
    t0 = time.monotonic_ns()
    while not engine.step().outputs:  # direct output: the step that samples token 0 returns it
        pass
    t1 = time.monotonic_ns()  # the step read token 0 back: the forward has finished
    engine.release(rid)  # a producer request waits in TRANSFERRING holding its blocks
    return (t1 - t0) / 1e6


def _prefill_pushing(h: ProducerHandler, conn: Any, addr: str, rid: str, prompt: list[int],
                     dst: list[int], log: list[tuple[str, int, int, int]]) -> dict[str, Any]:
    engine = h.engine
    events: list[Event] = []
    h.emit = events.append
    conn.send((rid, dst))
    conn.recv()  # "ready": the consumer expects rid into dst
    # What the worker's gRPC process sends: the request, then the consumer's reservation.
    h.on_command(PrefillCmd(rid, tuple(prompt), PARAMS, time.time_ns()))
    h.on_command(DestinationCmd(rid, "bench-consumer", addr, tuple(dst)))
    del log[:]
    _sync(engine)
    t0 = time.monotonic_ns()
    steps, t1, src = 0, 0, []
    while engine.has_unfinished():  # WorkerLoop.turn, minus the command socket
        step = engine.step()
        outs = step.outputs
        steps += 1
        if outs:
            t1 = time.monotonic_ns()
            src = list(engine.requests[rid].block_ids)
        # every step, as WorkerLoop.turn: a step with no token still reports final blocks
        h.on_outputs(step, time.time_ns())
        if outs:
            h.on_command(Token0SentCmd(rid))  # the router got token 0
        h.after_step()
    while rid in h.out:  # ack, then the handler frees the blocks
        h.after_step()
        time.sleep(0.0001)
    crid, status, land_ns, digest = conn.recv()
    ev = next((e for e in events if isinstance(e, TransferResultEvent)), None)
    if crid != rid or status != "DONE" or ev is None or not ev.ok:
        raise RuntimeError(f"{rid}: transfer failed: consumer {status}, producer {ev}")
    pushes = [e for e in log if e[0] == "push"]
    fin = next(e[1] for e in log if e[0] == "finish")
    # the blocks are free now but untouched until the next request: still the sent bytes
    src_digest = _sha(engine.kv_cache, src)
    return {"prefill_ms": (t1 - t0) / 1e6, "last_land_ms": (land_ns - t0) / 1e6,
            "finish_ms": (fin - t0) / 1e6, "steps": steps, "pushes": len(pushes),
            "push_ms": [(p[1] - t0) / 1e6 for p in pushes], "push_blocks": [p[2] for p in pushes],
            # host time inside push()/finish(): what the engine loop itself pays
            "push_call_us": sum(e[3] for e in log) / 1e3,
            "blocks": len(src), "bytes": len(src) * engine.layout.block_nbytes,
            "bytes_match": digest == src_digest,
            "src_nonzero": bool(engine.kv_cache[src].ne(0).any().item())}


def _record_calls(h: ProducerHandler, log: list[tuple[str, int, int, int]]) -> None:
    """Wraps the handler's sender: each push / finish logs (kind, t_ns, blocks, call ns)."""
    tx, push, finish = h.sender, h.sender.push, h.sender.finish

    def rec_push(rid: str, peer: str, src: Any, dst: Any, deadline: float | None = None,
                 after: object | None = None) -> None:
        t = time.monotonic_ns()
        push(rid, peer, src, dst, deadline=deadline, after=after)
        log.append(("push", t, len(src), time.monotonic_ns() - t))

    def rec_finish(rid: str, notice: Any) -> None:
        t = time.monotonic_ns()
        finish(rid, notice)
        log.append(("finish", t, 0, time.monotonic_ns() - t))

    tx.push, tx.finish = rec_push, rec_finish  # type: ignore[method-assign,assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="ucx", help="transfer backend, passed through")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (engine cuda:0, consumer cuda:1)")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk token budget")
    ap.add_argument("--reps", type=int, default=5, help="measured reps (after 1 warm-up)")
    ap.add_argument("--tiny", action="store_true", help="tiny model instead of Llama-3-8B")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads with --device cpu (0: torch's default)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.device not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu or cuda, got {a.device!r}")
    if a.device == "cpu" and a.threads:
        # On a small VM, torch's intra-op threads wake slowly from idle (a tiny 2k prefill
        # took 1.2 s with 2 threads, 50 ms with 1), and any thread that wakes often (the
        # sender's) hides part of it: "alone" vs "with pushes" would compare that, not KV.
        torch.set_num_threads(a.threads)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    p_dev, c_dev = ("cpu", "cpu") if a.device == "cpu" else ("cuda:0", "cuda:1")
    nblk = -(-(a.tokens + PARAMS.max_tokens) // BLOCK)
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(EngineConfig(
            model=_write_config(tmp, a.tiny), dtype="bfloat16", device=p_dev, role="producer",
            load_format="dummy", block_size=BLOCK, num_kv_blocks=nblk + 4,
            max_model_len=a.tokens + 16, max_num_batched_tokens=a.chunk,
            # each prompt is prefilled twice (alone, then pushing): no cache hit between
            enable_prefix_caching=False))
    # Twice the blocks the prompt needs, so a random choice of them is scattered.
    c_layout = dataclasses.replace(engine.layout, num_blocks=2 * nblk)
    ctx = mp.get_context("spawn")
    conn, there = ctx.Pipe()
    child = ctx.Process(target=_consumer, args=(there, c_layout, a.backend, c_dev), daemon=True)
    child.start()
    addr = conn.recv()
    h = ProducerHandler(engine, lambda b: None, {"backend": a.backend}, lease_s=60.0)
    log: list[tuple[str, int, int, int]] = []
    _record_calls(h, log)
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_cfg.vocab_size
    alone, pushing = [], []
    n_prompt_blocks = -(-a.tokens // BLOCK)
    for i in range(a.reps + 1):  # rep 0 warms up (Triton compiles, UCX rkeys, pages)
        prompt = torch.randint(0, vocab, (a.tokens,), generator=g).tolist()
        dst = sorted(torch.randperm(c_layout.num_blocks, generator=g)[:n_prompt_blocks].tolist())
        t_alone = _prefill_alone(engine, f"a{i}", prompt)
        r = _prefill_pushing(h, conn, addr, f"p{i}", prompt, dst, log)
        if i:
            alone.append(t_alone)
            pushing.append(r)
        print(f"rep {i}{' (warm-up)' if not i else ''}: alone {t_alone:.2f} ms, with pushes "
              f"{r['prefill_ms']:.2f} ms, last land {r['last_land_ms']:.2f} ms, "
              f"{r['pushes']} pushes, bytes match {r['bytes_match']}", flush=True)
    conn.send(None)
    child.join(60)
    h.close()
    med = {k: statistics.median(r[k] for r in pushing)
           for k in ("prefill_ms", "last_land_ms", "finish_ms")}
    med["prefill_alone_ms"] = statistics.median(alone)
    # per-rep ratios, then the median: a slow rep's prefill and land move together
    ratio = statistics.median(r["last_land_ms"] / r["prefill_ms"] for r in pushing)
    overshoot = ratio - 1
    chunks = math.ceil(a.tokens / a.chunk)
    summary = {"backend": a.backend, "device": a.device, "model": "tiny" if a.tiny else
               "llama-3-8b", "tokens": a.tokens, "chunk": a.chunk, "chunks": chunks,
               "block_nbytes": engine.layout.block_nbytes, "reps": a.reps,
               "threads": a.threads if a.device == "cpu" else None, **med,
               "ratio": ratio, "overshoot": overshoot, "goal_met": overshoot <= 0.10,
               "push_slowdown": med["prefill_ms"] / med["prefill_alone_ms"] - 1,
               "all_bytes_match": all(r["bytes_match"] for r in pushing),
               "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
               "runs": pushing, "prefill_alone_runs": alone}
    print(f"\n{summary['model']} {a.tokens} tokens, chunk {a.chunk} ({chunks} chunks), "
          f"backend {a.backend}, {a.device}; medians of {a.reps}")
    for k in ("prefill_alone_ms", "prefill_ms", "finish_ms", "last_land_ms"):
        print(f"  {k:<17} {med[k]:9.2f} ms")
    print(f"  ratio land/prefill {ratio:9.3f}   overshoot {overshoot * 100:6.1f}% "
          f"(goal <= 10%: {'met' if summary['goal_met'] else 'NOT met'})   "
          f"push slowdown {summary['push_slowdown'] * 100:+.1f}%   "
          f"bytes match {summary['all_bytes_match']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
