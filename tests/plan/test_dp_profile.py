"""``pdserve plan`` with data-parallel attention workers: the profile records the layout and
counts capacity and batch per attention group; the simulator runs D groups per worker; the
planner proposes colocated splits only (P/D roles refuse the layout) and repeats the layout
in its launch line; `plan profile` measures a real DPA-TP2 worker on CPU."""

import dataclasses

import pytest
from plan_profiles import make_profile, profile_json
from tiny_models import make_tiny_model

from deploy.cli import main
from deploy.plan.planner import Slos, Workload, launch_lines, plan
from deploy.plan.profile import Profile, ProfileError
from deploy.plan.sim_worker import Chunk, SimRequest
from deploy.plan.simulator import Arrival, Simulation, Split


def _dp(profile: Profile, d: int = 2) -> Profile:
    return dataclasses.replace(profile, tp_size=d, dp_size=d)


def test_layout_round_trips_and_bad_values_are_refused_by_key():
    p = _dp(make_profile())
    again = Profile.from_json(p.to_json())
    assert (again.tp_size, again.dp_size) == (2, 2)
    assert "dp_size" not in make_profile().to_json()  # one group: the file is as before
    for key, tp, dp in (("dp_size", 2, 0), ("tp_size", True, 1), ("dp_size", 4, 3)):
        with pytest.raises(ProfileError, match=key):
            Profile.from_json({**profile_json(), "tp_size": tp, "dp_size": dp})


def test_a_worker_of_two_groups_holds_twice_the_kv_and_steps_a_groups_share():
    one, two = make_profile(kv_tokens=16 * 40), _dp(make_profile(kv_tokens=16 * 40))
    s1, s2 = Simulation(one, Split(0, 0, 1)), Simulation(two, Split(0, 0, 1))
    w1, w2 = s1.workers[0], s2.workers[0]
    assert w2.total_blocks == 2 * w1.total_blocks == 80
    assert (w2.max_seqs, w2.budget) == (2 * w1.max_seqs, 2 * w1.budget)

    def chunks(n: int, tokens: int, ctx: int = 0) -> list[Chunk]:
        return [Chunk(SimRequest(i, ctx or tokens, 5, 0.0), ctx, tokens) for i in range(n)]

    # 8 decodes over two groups cost one group's 4; so do two 100-token prompts' one
    assert w2.step_ms(chunks(8, 1, 300)) == pytest.approx(w1.step_ms(chunks(4, 1, 300)))
    assert w2.step_ms(chunks(2, 100)) == pytest.approx(w1.step_ms(chunks(1, 100)))
    # but one prompt runs on one group whole: it costs what it costs on one group
    assert w2.step_ms(chunks(1, 100)) == pytest.approx(w1.step_ms(chunks(1, 100)))
    reqs = s2.run([Arrival(0.0, 100, 30) for _ in range(8)])
    assert all(len(r.token_times) == 30 for r in reqs) and w2.free == 80


def test_planner_weighs_dp_workers_in_every_split_and_launches_their_layout():
    p = _dp(make_profile())
    result = plan(p, 3, Workload(2.0, tuple((200, 20) for _ in range(40)), 0),
                  Slos(ttft_ms=1000, tpot_ms=100))
    splits = {(c["producers"], c["consumers"], c["colocated"]) for c in result["candidates"]}
    assert (0, 0, 3) in splits and (1, 2, 0) in splits and (2, 1, 0) in splits, splits
    for c in result["candidates"]:
        line = launch_lines(c, "m", "round_robin", p)[0]
        assert "--tensor-parallel-size 2 --data-parallel-size 2" in line


def test_plan_profile_measures_a_dpa_tp2_worker(tmp_path, capsys):
    model = make_tiny_model(str(tmp_path / "moe"), "qwen3_moe", seed=4)
    out = tmp_path / "profile.json"
    rc = main(["plan", "profile", "--model", model, "--out", str(out), "--kv-cache-mib", "4",
               "--tensor-parallel-size", "2", "--data-parallel-size", "2",
               "--prefill-tokens", "8,32", "--decode-batch", "1,4",
               "--decode-context", "16,32", "--reps", "1", "--max-num-batched-tokens", "64"])
    err = capsys.readouterr().err
    p = Profile.load(str(out))
    assert rc == (1 if p.problems else 0), err
    assert (p.tp_size, p.dp_size) == (2, 2)
    assert p.decode.batch == (1, 4) and all(v > 0 for row in p.decode.ms for v in row)
    # one group's pool (each rank holds its group's whole KV): 4 MiB of 16-token blocks
    assert p.kv_capacity_tokens == (4 << 20) // p.kv_bytes_per_token // 16 * 16
