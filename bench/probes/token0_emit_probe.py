"""Where a producer step's token 0s spend the time between their read-back and their emit,
in one process (no cluster): a producer engine (the tiny dummy model, its tokenizer, on
CPU) and its role handler, as the worker loop drives them (``engine.step()``, then
``on_outputs``), with a prefill step of --per-step prompts at a time. Per step, from the
read-back (the outputs' ``sampled_ns``): the end of ``LLMEngine._process`` (every request's
``_update``), the step's return (its result), the first and the last emit, and the flush
that sends them together; and each ``_update`` alone. Since session 44 the handler emits
and flushes from the engine's ``on_read`` hook, inside ``engine.step()``: the emits and the
flush then come before the step's return (before, after it). --waiting keeps that many more
requests queued behind each step (whether any of it grows with the waiting queue).

    python bench/probes/token0_emit_probe.py [--per-step 16] [--steps 40] [--waiting 240]

The same stage in a running cluster is bench/itl_split.py's "sampled -> engine emitted"
(bench/RESULTS.md, session 43), where the processes around it add their share.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

from deploy.benchmark.dummy_model import write_dummy_model
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from producer.handler import ProducerHandler
from worker.messages import Event, PrefillCmd
from worker.outbox import EventOutbox


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-step", type=int, default=16, help="prompts a prefill step takes")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--waiting", type=int, default=0, help="requests queued behind a step")
    args = ap.parse_args()
    model = write_dummy_model(tempfile.mkdtemp(prefix="t0probe-"), "tiny")
    engine = LLM(model, role="producer", load_format="dummy", device="cpu",
                 max_num_batched_tokens=args.per_step * args.prompt_len,
                 max_num_seqs=4096, num_kv_blocks=1 << 16).engine
    emits: list[int] = []
    flushes: list[int] = []

    class Sink:  # the events link's writer, as EventOutbox sees it: the time of the send
        def send_multipart(self, parts: list[bytes]) -> None:
            flushes.append(time.time_ns())

        def flush(self) -> None:
            pass

    outbox = EventOutbox(Sink())

    def emit(ev: Event) -> None:  # encoded as the engine process's outbox does
        outbox.emit(ev)
        emits.append(time.time_ns())

    handler = ProducerHandler(engine, emit, {"backend": "fake"}, lease_s=3600.0)
    handler.flush_events = outbox.flush
    updates: list[float] = []
    processed: list[int] = []
    update, process = LLMEngine._update, LLMEngine._process

    def timed_update(self: LLMEngine, *a: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return update(self, *a)
        finally:
            updates.append((time.perf_counter_ns() - t) / 1e3)

    def timed_process(self: LLMEngine, *a: Any) -> Any:
        try:
            return process(self, *a)
        finally:
            processed.append(time.time_ns())

    LLMEngine._update = timed_update  # type: ignore[method-assign]
    LLMEngine._process = timed_process  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    n = 0

    def submit(k: int) -> None:
        nonlocal n
        for _ in range(k):
            prompt = tuple(1 + (n * 7 + j) % 500 for j in range(args.prompt_len))
            handler.on_command(PrefillCmd(f"r{n}", prompt, params, time.time_ns()))
            n += 1

    submit(args.waiting)
    rows: list[tuple[float, ...]] = []
    for _ in range(args.steps):
        submit(args.per_step)
        emits.clear(), flushes.clear(), processed.clear()
        step = engine.step()
        returned = time.time_ns()
        handler.on_outputs(step, returned)
        outbox.flush()  # the rest of the turn's events, as the loop's end does
        sampled = [o.sampled_ns for o in step.outputs if o.new_token_ids]
        if len(sampled) != args.per_step or not flushes:
            continue  # a step that did not take a whole batch of prompts
        rows.append(tuple((t - sampled[0]) / 1e3 for t in
                          (processed[-1], returned, emits[0], emits[-1], flushes[0])))
    if not rows:
        raise SystemExit("no step took a whole batch of prompts")
    names = ("requests updated", "step returned", "first emit", "last emit", "flush")
    print(f"{len(rows)} steps of {args.per_step} token 0s, {args.waiting} waiting; "
          "µs after the read-back, median (min-max):")
    for i, name in enumerate(names):
        col = [r[i] for r in rows]
        print(f"  {name:17s} {statistics.median(col):7.0f} ({min(col):.0f}-{max(col):.0f})")
    print(f"  one _update: median {statistics.median(updates):.1f} µs, "
          f"mean {statistics.mean(updates):.1f}")


if __name__ == "__main__":
    main()
