"""bench/compare_noise.py: Student's t tail against known values, Welch's test, Holm's
correction, and verdicts on run JSONs shaped as `pdserve bench --result-json` writes them."""

from __future__ import annotations

import json
import random

import pytest

from bench import compare_noise as cn


@pytest.mark.parametrize("t,df,p", [(2.0, 10, 0.07339), (2.228, 10, 0.05), (1.0, 1, 0.5),
                                    (3.182, 3, 0.05), (0.0, 5, 1.0), (12.706, 1, 0.05)])
def test_two_sided_t_tail_matches_tables(t, df, p):
    assert cn.t_two_sided_p(t, df) == pytest.approx(p, abs=2e-4)


def test_welch_equal_means_and_a_clear_shift():
    assert cn.welch(10.0, 1.0, 4, 10.0, 1.0, 4) == (0.0, 1.0)
    t, p = cn.welch(10.0, 0.25, 4, 14.0, 0.25, 4)
    assert t == pytest.approx(4.0 / (0.5 / 2 ** 0.5)) and p < 1e-4


def test_holm_steps_down_and_stops_at_the_first_keep():
    # 4 tests at 0.05: thresholds 0.0125, 0.0167, 0.025, 0.05 in p order
    assert cn.holm([0.01, 0.04, 0.016, 0.3], 0.05) == [True, False, True, False]
    assert cn.holm([0.02, 0.01], 0.05) == [True, True]
    assert cn.holm([0.03, 0.03, 0.03], 0.05) == [False, False, False]


def _run(path, tpot_p50: float, tput: float) -> str:
    metrics = {"output_throughput": tput,
               "ttft_ms": {"p50": 100.0}, "tpot_ms": {"p50": tpot_p50},
               "e2el_ms": {"p50": 1000.0}}
    doc = {"configs": [{"label": "1P1D", "points": [{"label": "rate=inf", "metrics": metrics}]}]}
    path.write_text(json.dumps(doc))
    return str(path)


def test_same_code_is_within_noise_and_a_real_regression_is_worse(tmp_path):
    rng = random.Random(0)
    before = [_run(tmp_path / f"b{i}.json", 50 + rng.gauss(0, 2), 70 + rng.gauss(0, 2))
              for i in range(4)]
    same = [_run(tmp_path / f"a{i}.json", 50 + rng.gauss(0, 2), 70 + rng.gauss(0, 2))
            for i in range(4)]
    out = cn.compare(before, same, 0.05)
    assert out["worse"] == [] and {r["verdict"] for r in out["rows"]} == {"within noise"}
    slower = [_run(tmp_path / f"s{i}.json", 65 + rng.gauss(0, 2), 55 + rng.gauss(0, 2))
              for i in range(4)]
    out = cn.compare(before, slower, 0.05)
    assert out["worse"] == ["1P1D rate=inf tpot_ms_p50", "1P1D rate=inf output_throughput"]
    faster = cn.compare(slower, before, 0.05)
    assert {r["metric"]: r["verdict"] for r in faster["rows"]}["tpot_ms_p50"] == "better"


def test_the_command_line_names_what_it_lacks(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["compare_noise.py", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs before_N.json and after_N.json"):
        cn.main()
