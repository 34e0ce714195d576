"""The planner's simulated worker schedules with the engine's own policy: one recorded
arrival sequence replayed step by step through the engine's ``Scheduler`` (real requests,
real block manager) and through ``SimWorker`` (counters) gives the same batches, step for
step: the same requests, the same chunk starts and sizes, the same preemptions."""

from __future__ import annotations

from plan_profiles import make_profile

from deploy.plan.sim_worker import COLOCATED, EngineLimits, SimRequest, SimWorker
from engine.block_manager import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BS = 16
BLOCKS = 12  # a small pool: long prompts and growing decodes preempt
LIMITS = EngineLimits(max_num_seqs=4, max_num_batched_tokens=64)
# (step it arrives before, prompt tokens, output tokens), recorded from a bursty workload
ARRIVALS = [(0, 40, 6), (0, 17, 12), (0, 100, 3), (1, 5, 20), (2, 64, 8), (2, 16, 1),
            (3, 130, 4), (5, 33, 30), (5, 9, 9), (8, 70, 15), (9, 2, 40), (12, 48, 5),
            (12, 48, 5), (20, 150, 2), (21, 31, 25), (30, 1, 7)]
Batch = list[tuple[int, int, int]]  # (request index, start, positions)


def _engine_batches(steps: int) -> tuple[list[Batch], int]:
    sched = Scheduler(BlockManager(BLOCKS, BS), LIMITS.max_num_seqs,
                      LIMITS.max_num_batched_tokens, max_waiting=1000, max_model_len=4096)
    index: dict[str, int] = {}
    out_lens: dict[str, int] = {}
    batches, preemptions = [], 0
    for step in range(steps):
        for i, (at, prompt, outputs) in enumerate(ARRIVALS):
            if at == step:
                rid = f"r{i}"
                index[rid], out_lens[rid] = i, outputs
                sched.add(Request(rid, [(i * 7 + k) % 50 + 3 for k in range(prompt)],
                                  SamplingParams(max_tokens=outputs), seed=0))
        out = sched.schedule()
        preemptions += len(out.preempted)
        batches.append([(index[c.request.request_id], c.start, c.num_tokens)
                        for c in out.chunks])
        sched.commit(out)
        for c in out.chunks:  # the step is read: each sampling chunk got its token
            req = c.request
            if c.samples:
                req.output_token_ids.append(5)
                if len(req.output_token_ids) >= out_lens[req.request_id]:
                    sched.remove(req)
                    sched.blocks.free(req.block_ids)
                    req.block_ids = []
    return batches, preemptions


def _sim_batches(steps: int) -> tuple[list[Batch], int]:
    w = SimWorker(0, COLOCATED, make_profile(kv_tokens=BLOCKS * BS), LIMITS)
    assert w.bs == BS and w.total_blocks == BLOCKS
    batches = []
    for step in range(steps):
        for i, (at, prompt, outputs) in enumerate(ARRIVALS):
            if at == step:
                w.waiting.append(SimRequest(i, prompt, outputs, arrival=float(step)))
        chunks = w.schedule()
        batches.append([(c.req.index, c.start, c.n) for c in chunks])
        for c in chunks:  # as Simulator._step_end books a colocated worker's step
            req = c.req
            req.computed = c.start + c.n
            if req.computed == req.num_tokens:
                req.token_times.append(float(step))
                if len(req.token_times) >= req.output_len:
                    w.running.remove(req)
                    w.release(req)
                else:
                    req.num_tokens += 1
    return batches, w.preemptions


def test_the_simulated_worker_forms_the_engines_batches() -> None:
    steps = 200
    engine, engine_preempted = _engine_batches(steps)
    sim, sim_preempted = _sim_batches(steps)
    for step, (e, s) in enumerate(zip(engine, sim, strict=True)):
        assert e == s, f"step {step}: engine {e}, simulated {s}"
    assert engine_preempted == sim_preempted
    # the replay exercises what the policy decides: chunked prefill, preemption, and
    # every request served to its end within the steps replayed
    assert engine_preempted > 0
    assert any(n > 1 and start > 0 for b in engine for _, start, n in b)
    assert not engine[-1] and not sim[-1]
    served = {i for b in engine for i, _, _ in b}
    assert served == set(range(len(ARRIVALS)))
