import pytest
from plan_profiles import make_profile

from deploy.plan.sim_worker import EngineLimits
from deploy.plan.simulator import Arrival, Simulation, Split, simulate


def _one(profile, split, prompt, out, limits=None):
    sim = Simulation(profile, split, limits)
    (req,) = sim.run([Arrival(0.0, prompt, out)])
    return sim, req


def test_colocated_request_costs_its_prefill_then_one_decode_step_per_token():
    p = make_profile()
    _, req = _one(p, Split(0, 0, 1), 256, 3)
    t0 = p.prefill_ms(256) / 1e3
    t1 = t0 + p.decode_ms(1, 257) / 1e3
    t2 = t1 + p.decode_ms(1, 258) / 1e3
    assert list(req.token_times) == pytest.approx([t0, t1, t2])


def test_long_prompt_is_prefilled_in_budget_sized_chunks():
    p = make_profile()
    _, req = _one(p, Split(0, 0, 1), 1024, 1, EngineLimits(max_num_batched_tokens=512))
    assert list(req.token_times) == pytest.approx([2 * p.prefill_ms(512) / 1e3])


def test_disaggregated_request_waits_for_its_kv_then_decodes_on_the_consumer():
    p = make_profile(gbps=1.0)
    sim, req = _one(p, Split(1, 1, 0), 256, 2)
    t0 = p.prefill_ms(256) / 1e3
    land = t0 + p.transfer_ms(256) / 1e3
    assert req.token_times[0] == pytest.approx(t0)  # token 0 straight from the producer
    assert req.landed_at == pytest.approx(land)
    assert req.token_times[1] == pytest.approx(land + p.decode_ms(1, 257) / 1e3)
    prod, cons = sim.workers
    assert prod.free == prod.total_blocks and cons.free == cons.total_blocks


def test_chunk_pushes_overlap_the_remaining_prefill():
    p = make_profile(gbps=1.0)
    _, req = _one(p, Split(1, 1, 0), 1024, 1, EngineLimits(max_num_batched_tokens=512))
    # the first chunk's KV moved while the second chunk ran, so only the last one is exposed
    t0 = 2 * p.prefill_ms(512) / 1e3
    assert req.landed_at == pytest.approx(max(t0, p.prefill_ms(512) / 1e3
                                              + p.transfer_ms(512) / 1e3)
                                          + p.transfer_ms(512) / 1e3)


def test_full_kv_pool_preempts_and_every_request_still_finishes():
    p = make_profile(kv_tokens=16 * 40)  # 40 blocks
    arrivals = [Arrival(0.0, 100, 200) for _ in range(4)]  # 4 x 19 blocks at the end
    sim = Simulation(p, Split(0, 0, 1))
    reqs = sim.run(arrivals)
    assert sim.workers[0].preemptions > 0
    assert all(len(r.token_times) == 200 for r in reqs)
    assert sim.workers[0].free == 40


def test_consumer_reservation_waits_for_blocks():
    p = make_profile(kv_tokens=16 * 20)  # 20 blocks: one 200-token prompt (13) at a time
    arrivals = [Arrival(0.0, 200, 64), Arrival(0.0, 200, 64)]
    sim = Simulation(p, Split(1, 1, 0))
    first, second = sim.run(arrivals)
    assert first.landed_at is not None and second.landed_at is not None
    # the second prompt's blocks were only reserved when the first request finished
    assert second.landed_at >= first.token_times[-1]
    assert len(second.token_times) == 64


def test_prompt_larger_than_the_pool_fails_with_a_reason():
    p = make_profile(kv_tokens=160)
    m = simulate(p, Split(0, 0, 1), [Arrival(0.0, 400, 4), Arrival(0.0, 16, 4)])
    assert m["completed"] == 1 and m["failed"] == 1
    assert "exceed the KV pool" in next(iter(m["errors"]))


def test_round_robin_alternates_over_the_entry_pool():
    p = make_profile()
    sim = Simulation(p, Split(0, 0, 2), policy="round_robin")
    sim.run([Arrival(i * 10.0, 64, 2) for i in range(4)])
    assert [w.dispatched for w in sim.workers] == [2, 2]


def test_metrics_match_bench_keys_and_slos():
    p = make_profile()
    m = simulate(p, Split(0, 0, 1), [Arrival(0.0, 256, 3)], slos={"ttft": 1000.0})
    assert m["ttft_ms"]["p50"] == pytest.approx(p.prefill_ms(256))
    assert m["good_requests"] == 1 and m["completed"] == 1
    assert {"tpot_ms", "itl_ms", "e2el_ms", "request_goodput", "output_throughput"} <= set(m)


def test_bad_split_and_policy_are_named():
    with pytest.raises(ValueError, match="split"):
        Split(1, 0, 0)
    with pytest.raises(ValueError, match="--policy"):
        Simulation(make_profile(), Split(0, 0, 1), policy="random")


def _cpu(**kw):
    import dataclasses

    return dataclasses.replace(make_profile(**kw), device="cpu")


def test_on_the_cpu_deferred_output_shows_once_the_next_step_is_done():
    """Overlap scheduling on a device where launching a step computes it: a colocated
    worker's tokens reach the client one step late while another step follows at once;
    the last one as soon as nothing follows (what `pdserve bench` measures on CPU)."""
    p = _cpu()
    _, req = _one(p, Split(0, 0, 1), 256, 4)
    e0 = p.prefill_ms(256) / 1e3
    e1 = e0 + p.decode_ms(1, 257) / 1e3
    e2 = e1 + p.decode_ms(1, 258) / 1e3
    e3 = e2 + p.decode_ms(1, 259) / 1e3
    assert list(req.token_times) == pytest.approx([e1, e2, e3, e3])


def test_on_the_cpu_the_producer_never_defers_and_the_consumer_does():
    p = _cpu(gbps=1.0)
    _, req = _one(p, Split(1, 1, 0), 256, 3)
    t0 = p.prefill_ms(256) / 1e3
    land = t0 + p.transfer_ms(256) / 1e3
    e1 = land + p.decode_ms(1, 257) / 1e3
    e2 = e1 + p.decode_ms(1, 258) / 1e3
    assert list(req.token_times) == pytest.approx([t0, e2, e2])


@pytest.mark.parametrize("device", ["test", "cpu"])
@pytest.mark.parametrize("split", [Split(0, 0, 2), Split(1, 2, 0)])
def test_bundled_decode_steps_give_the_same_times_as_one_event_per_step(monkeypatch, split,
                                                                        device):
    import dataclasses
    import random

    from deploy.plan.sim_worker import SimWorker

    # tight: reservations queue behind decode blocks
    p = dataclasses.replace(make_profile(kv_tokens=16 * 300), device=device)
    rng = random.Random(1)
    t, arrivals = 0.0, []
    for _ in range(120):
        t += rng.expovariate(8.0)
        arrivals.append(Arrival(t, rng.randint(16, 700), rng.randint(1, 300)))
    bundled = Simulation(p, split).run(arrivals)
    monkeypatch.setattr(SimWorker, "MAX_BUNDLE", 1)
    stepwise = Simulation(p, split).run(arrivals)
    assert all(len(r.token_times) == r.output_len for r in bundled)
    for a, b in zip(bundled, stepwise, strict=True):
        assert list(a.token_times) == pytest.approx(list(b.token_times), rel=1e-9, abs=1e-9)


def test_sim_records_give_what_a_bench_record_of_the_same_arrivals_gives():
    from deploy.benchmark.record import RequestRecord
    from deploy.plan.simulator import records

    p = make_profile()
    reqs = Simulation(p, Split(1, 1, 0)).run([Arrival(0.0, 300, 5), Arrival(0.01, 40, 1)])
    for req, rec in zip(reqs, records(reqs), strict=True):
        plain = RequestRecord(index=req.index, prompt_len=req.prompt_len,
                              expected_output_len=req.output_len, success=True,
                              finish_reason="length", start=req.arrival,
                              end=req.token_times[-1],
                              arrivals=[(t, 1) for t in req.token_times],
                              output_tokens=req.output_len, kv_transfer_ms=rec.kv_transfer_ms)
        assert rec.to_json() == plain.to_json()
