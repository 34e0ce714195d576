import json

import pytest
from plan_profiles import make_profile, profile_json

from deploy.benchmark.workload import LengthRange
from deploy.cli import main
from deploy.plan.planner import Slos, Workload, fewest_gpus, plan, random_lengths, splits
from deploy.plan.simulator import Split


def _work(rate, prompt, output, n=160):
    return Workload(rate, random_lengths(n, LengthRange(prompt, prompt),
                                         LengthRange(output, output), 0), 0)


def _best_pd(result):
    return next(c for c in result["candidates"] if c["colocated"] == 0)


def test_every_split_of_n_workers():
    assert splits(1) == [Split(0, 0, 1)]
    assert set(splits(3)) == {Split(0, 0, 3), Split(1, 1, 1), Split(1, 2, 0), Split(2, 1, 0)}
    assert len(splits(8)) == 1 + sum(range(1, 8))


def test_prefill_bound_workload_gets_more_producers():
    # 2048-token prompts at 0.4 ms a token: a producer serves ~1.2 prompts/s
    p = make_profile(prefill_per_token_ms=0.4)
    r = plan(p, 4, _work(3.0, 2048, 4), Slos(5000, 200))
    best = _best_pd(r)
    assert (best["producers"], best["consumers"]) == (3, 1)
    assert best["keeps_up"]
    one_p = next(c for c in r["candidates"] if c["split"] == "1P3D")
    assert not one_p["keeps_up"]


def test_decode_bound_workload_gets_more_consumers():
    # long outputs from tiny prompts: the decode batch is the bottleneck
    p = make_profile(decode_fixed_ms=10.0, decode_per_seq_ms=2.0)
    r = plan(p, 4, _work(1.5, 32, 600, n=120), Slos(5000, 200))
    best = _best_pd(r)
    assert best["consumers"] > best["producers"]
    three_p = next(c for c in r["candidates"] if c["split"] == "3P1D")
    assert three_p["goodput_rps"] < best["goodput_rps"]


def test_rate_past_every_split_is_reported_as_such():
    p = make_profile(prefill_per_token_ms=0.4)
    r = plan(p, 2, _work(50.0, 2048, 4, n=200), Slos(5000, 200))
    assert r["over_capacity"]
    assert not any(c["keeps_up"] for c in r["candidates"])


def test_fewest_gpus_stops_at_the_first_size_that_meets_the_slos():
    p = make_profile(prefill_per_token_ms=0.4)  # one worker: ~1.2 prompts/s
    r = fewest_gpus(p, 4, _work(1.5, 2048, 4), Slos(5000, 1000))
    assert r["met"] and r["gpus"] == 2
    assert r["best"]["meets_slos"]


def test_cli_json_has_best_and_candidates(tmp_path, capsys):
    path = tmp_path / "p.json"
    make_profile().save(str(path))
    rc = main(["plan", "--profile", str(path), "--gpus", "2", "--input-len", "256:512",
               "--output-len", "16", "--rate", "2", "--slo-ttft-ms", "1000",
               "--slo-tpot-ms", "100", "--num-prompts", "60", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {"producers", "consumers", "colocated", "goodput_rps"} <= set(out["best"])
    assert {c["split"] for c in out["candidates"]} == {"2C", "1P1D"}
    assert out["launch"][0].startswith("pdserve launch --producers")


def test_cli_table_says_when_the_rate_is_past_capacity(tmp_path, capsys):
    path = tmp_path / "p.json"
    make_profile(prefill_per_token_ms=0.4).save(str(path))
    rc = main(["plan", "--profile", str(path), "--gpus", "1", "--input-len", "2048",
               "--output-len", "4", "--rate", "40", "--slo-ttft-ms", "1000",
               "--slo-tpot-ms", "100", "--num-prompts", "200"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "past every split's capacity" in out and "pdserve launch" in out


@pytest.mark.parametrize("argv, flag", [
    (["--gpus", "2", "--slo-ttft-ms", "1", "--slo-tpot-ms", "1"], "--rate"),
    (["--rate", "1", "--slo-ttft-ms", "1", "--slo-tpot-ms", "1"], "--gpus or --max-gpus"),
    (["--gpus", "2", "--rate", "-1", "--slo-ttft-ms", "1", "--slo-tpot-ms", "1"], "--rate"),
    (["--gpus", "2", "--rate", "1", "--slo-ttft-ms", "1", "--slo-tpot-ms", "1",
      "--input-len", "9:3"], "--input-len"),
])
def test_cli_bad_input_names_the_flag(tmp_path, capsys, argv, flag):
    path = tmp_path / "p.json"
    make_profile().save(str(path))
    assert main(["plan", "--profile", str(path), *argv]) == 2
    assert flag in capsys.readouterr().err


def test_cli_takes_lengths_from_a_sharegpt_dataset(tmp_path, capsys):
    path = tmp_path / "p.json"
    make_profile().save(str(path))
    data = [{"conversations": [{"from": "human", "value": f"Tell me about the number {i}. " * 3},
                               {"from": "gpt", "value": "It is a number. " * (2 + i)}]}
            for i in range(12)]
    ds = tmp_path / "sharegpt.json"
    ds.write_text(json.dumps(data))
    rc = main(["plan", "--profile", str(path), "--gpus", "1", "--dataset", str(ds),
               "--rate", "1", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100",
               "--num-prompts", "8", "--json"])
    assert rc == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    assert out["best"]["split"] == "1C" and out["best"]["failed"] == 0
    assert out["best"]["completed"] == 8


def test_plan_refuses_a_profile_it_cannot_trust(tmp_path, capsys):
    d = profile_json()
    d["prefill"]["ms"] = [5.0, 7616.0, 804.0, 900.0]  # busy machine: out of order
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    argv = ["plan", "--profile", str(path), "--gpus", "2", "--rate", "1",
            "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--num-prompts", "30",
            "--input-len", "256", "--output-len", "8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot be trusted" in err and "prefill 1024 tokens takes 804.00 ms" in err
    assert main([*argv, "--accept-untrusted-profile"]) == 0
    assert "WARNING: planning on an untrusted profile" in capsys.readouterr().err


def test_plan_for_n_gpus_warns_when_nothing_meets_the_slos(tmp_path, capsys):
    path = tmp_path / "p.json"
    make_profile(prefill_per_token_ms=0.4).save(str(path))
    argv = ["plan", "--profile", str(path), "--gpus", "2", "--input-len", "2048",
            "--output-len", "4", "--rate", "20", "--slo-ttft-ms", "100",
            "--slo-tpot-ms", "10", "--num-prompts", "100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "WARNING: no split of 2 workers meets the SLOs at 20/s" in out
    assert "(does NOT meet the SLOs)" in out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["met"] is False
