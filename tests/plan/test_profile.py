import json

import pytest
from plan_profiles import make_profile, profile_json

from deploy.plan.profile import Profile, ProfileError


def test_round_trip_keeps_every_field(tmp_path):
    p = make_profile()
    path = tmp_path / "p.json"
    p.save(str(path))
    data = json.loads(path.read_text())
    assert data == profile_json()
    assert Profile.load(str(path)) == p


def test_prefill_interpolates_linearly_and_extrapolates_past_the_grid():
    p = make_profile(prefill_per_token_ms=0.1, prefill_fixed_ms=5.0)
    assert p.prefill_ms(256) == pytest.approx(30.6)
    assert p.prefill_ms(640) == pytest.approx(5.0 + 64.0)  # between 256 and 1024
    assert p.prefill_ms(8192) == pytest.approx(5.0 + 819.2)  # the last slope continues
    assert p.prefill_ms(1) == pytest.approx(p.prefill_ms(16))  # clamped below the grid


def test_decode_is_bilinear_inside_and_clamped_below():
    p = make_profile(decode_fixed_ms=10.0, decode_per_seq_ms=0.5)
    exact = 10.0 + 0.5 * 8 * (1 + 1024 / 8192)
    assert p.decode_ms(8, 1024) == pytest.approx(exact)
    # midway in batch (8..32) and context (128..1024): the model is bilinear, so exact
    mid = 10.0 + 0.5 * 20 * (1 + 576 / 8192)
    assert p.decode_ms(20, 576) == pytest.approx(mid)
    assert p.decode_ms(1, 1) == pytest.approx(p.decode_ms(1, 128))
    assert p.decode_ms(256, 1024) > p.decode_ms(128, 1024)


def test_transfer_time_from_bandwidth():
    p = make_profile(gbps=10.0)  # 100 kB per token
    assert p.transfer_ms(1000) == pytest.approx(10.0)  # 100 MB at 10 GB/s


@pytest.mark.parametrize("mutate, key", [
    (lambda d: d.pop("block_size"), "block_size: missing"),
    (lambda d: d.update(version=2), "version"),
    (lambda d: d["prefill"].update(ms=[1.0]), "prefill.ms"),
    (lambda d: d["prefill"].update(tokens=[16, 16, 17, 18]), "prefill.tokens"),
    (lambda d: d["decode"].update(ms=[[1.0, 2.0, 3.0]]), "decode.ms"),
    (lambda d: d["decode"]["ms"].__setitem__(1, [1.0, "x", 2.0]), "decode.ms[1]"),
    (lambda d: d.update(transfer_GBps="fast"), "transfer_GBps"),
    (lambda d: d.update(kv_capacity_tokens=0), "kv_capacity_tokens"),
    (lambda d: d.update(model=3), "model"),
])
def test_bad_files_name_the_key(mutate, key):
    d = profile_json()
    mutate(d)
    with pytest.raises(ProfileError, match=key.replace("[", r"\[").replace("]", r"\]")):
        Profile.from_json(d)


def test_unreadable_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not JSON"):
        Profile.load(str(bad))
    with pytest.raises(ProfileError, match="cannot read"):
        Profile.load(str(tmp_path / "missing.json"))


def test_a_point_is_sampled_until_its_timings_agree():
    from deploy.plan.measure import Grid, stable

    timings = iter([100.0, 30.0, 10.0, 10.4, 10.2, 99.0])
    taken = []

    def sample() -> float:
        taken.append(next(timings))
        return taken[-1]

    ms, sp = stable(sample, Grid(reps=3, max_reps=10, tolerance=0.1))
    assert len(taken) == 5 and ms == 10.2 and sp == pytest.approx(0.4 / 10.2)
    # never agreeing: stops at max_reps and reports the spread it got
    noisy = iter([1.0, 5.0] * 10)
    ms, sp = stable(lambda: next(noisy), Grid(reps=3, max_reps=6, tolerance=0.1))
    assert (ms, sp) == (5.0, pytest.approx(0.8))  # the last 3: 5, 1, 5


def test_out_of_order_and_noisy_points_are_problems():
    d = profile_json()
    d["prefill"] = {"tokens": [16, 128, 512], "ms": [50.0, 7616.0, 804.0]}  # not monotonic
    p = Profile.from_json(d)
    (why,) = p.trust_problems()
    assert why == "prefill 512 tokens takes 804.00 ms, less than 128 tokens (7616.00 ms)"
    d = profile_json()
    d["decode"]["ms"][2][1] = 1.0  # batch 32, context 1024: cheaper than batch 8 and context 128
    assert len(Profile.from_json(d).trust_problems()) == 2
    d = profile_json()
    d["prefill"]["spread"] = [0.01, 0.02, 0.6, 0.03]
    d["problems"] = ["prefill 1024 tokens: noisy (107.40 ms, spread 60%)"]
    p = Profile.from_json(d)
    assert p.trust_problems() == ["prefill 1024 tokens: noisy (107.40 ms, spread 60%)"]
    assert make_profile().trust_problems() == []


def test_spreads_round_trip(tmp_path):
    d = profile_json()
    d["prefill"]["spread"] = [0.01, 0.02, 0.03, 0.04]
    d["decode"]["spread"] = [[0.0, 0.1, 0.05]] * 4
    d["tolerance"] = 0.2
    d["problems"] = []
    p = Profile.from_json(d)
    p.save(str(tmp_path / "p.json"))
    assert json.loads((tmp_path / "p.json").read_text()) == d
    d["prefill"]["spread"] = [0.1]
    with pytest.raises(ProfileError, match="prefill.spread"):
        Profile.from_json(d)
