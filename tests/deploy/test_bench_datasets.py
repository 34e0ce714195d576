"""The benchmark's prefix-sharing workloads: a Mooncake-format trace replayed with its
arrivals, scaled blocks and ideal hits (a made-up trace, then a slice of the real one when
the shared copy is there), and SGLang's shared-prefix groups."""

from __future__ import annotations

import json
import os

import pytest

from deploy.benchmark.mooncake import mooncake_workload
from deploy.benchmark.shared_prefix import shared_prefix_workload
from deploy.benchmark.workload import LengthRange

TOKENS = LengthRange(1000, 30000)
REAL = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "traces",
                    "mooncake_conversation_trace.jsonl")


def _trace(tmp_path, rows) -> str:  # type: ignore[no-untyped-def]
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(p)


def test_mooncake_blocks_arrivals_and_ideal_hits(tmp_path):
    path = _trace(tmp_path, [
        {"timestamp": 1000, "input_length": 1100, "output_length": 512, "hash_ids": [7, 8, 9]},
        {"timestamp": 3000, "input_length": 1500, "output_length": 20, "hash_ids": [7, 8, 4]},
        {"timestamp": 4000, "input_length": 600, "output_length": 5, "hash_ids": [5, 9]},
        {"timestamp": 4500, "input_length": 1024, "output_length": 5, "hash_ids": [7, 8]},
    ])
    specs = mooncake_workload(path, 10, 32, 0.5, TOKENS, seed=3)
    assert [s.prompt_len for s in specs] == [69, 94, 38, 64]  # lengths x 32/512, rounded
    assert [s.output_len for s in specs] == [32, 1, 1, 1]
    assert [s.at_s for s in specs] == [0.0, 1.0, 1.5, 1.75]  # from the first, x 0.5
    a, b, c, d = (s.prompt_ids for s in specs)
    assert a[:64] == b[:64] and a[64:69] != b[64:69]  # ids 7, 8 shared; 9 vs 4 not
    assert c[32:37] == a[64:69]  # id 9 is the same block wherever it appears
    # ideal: leading blocks seen before as a prefix, whole blocks within the prompt
    assert [s.ideal_cached for s in specs] == [0, 64, 0, 64]
    again = mooncake_workload(path, 2, 32, 0.5, TOKENS, seed=3)
    assert [s.prompt_ids for s in again] == [a, b]  # deterministic, --max-requests


def test_mooncake_bad_lines_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="line 2: missing 'hash_ids'"):
        mooncake_workload(_trace(tmp_path, [
            {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]},
            {"timestamp": 0, "input_length": 10, "output_length": 1}]), 5, 32, 1.0, TOKENS, 0)
    with pytest.raises(ValueError, match="line 1: input_length 1025 exceeds 2 blocks"):
        mooncake_workload(_trace(tmp_path, [
            {"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}]),
            5, 32, 1.0, TOKENS, 0)
    with pytest.raises(ValueError, match="^--trace-block-tokens"):
        mooncake_workload(_trace(tmp_path, [
            {"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}]),
            5, 0, 1.0, TOKENS, 0)


@pytest.mark.skipif(not os.path.exists(REAL), reason="the shared Mooncake trace copy is absent")
def test_a_slice_of_the_real_conversation_trace_shares_prefixes():
    specs = mooncake_workload(REAL, 300, 16, 0.1, TOKENS, seed=0)
    ideal = sum(s.ideal_cached for s in specs) / sum(s.prompt_len for s in specs)
    assert len(specs) == 300 and 0.05 < ideal < 0.9
    assert all(s.at_s is not None and s.at_s >= 0 for s in specs)


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    specs = shared_prefix_workload(3, 4, 40, 8, LengthRange(5, 5), TOKENS, seed=1)
    assert len(specs) == 12 and all(s.prompt_len == 48 and s.output_len == 5 for s in specs)
    systems = {s.prompt_ids[:40] for s in specs}
    assert len(systems) == 3
    assert sum(s.ideal_cached for s in specs) == (12 - 3) * 40
    firsts = set()
    for s in specs:  # the first prompt of each group has no ideal hit, the rest the system
        assert s.ideal_cached == (40 if s.prompt_ids[:40] in firsts else 0)
        firsts.add(s.prompt_ids[:40])
    with pytest.raises(ValueError, match="^--sp-groups"):
        shared_prefix_workload(0, 4, 40, 8, LengthRange(5, 5), TOKENS, seed=1)
