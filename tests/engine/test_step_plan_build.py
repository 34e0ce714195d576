"""ModelRunner._plan builds a chunk's tokens, positions and slots by slices and per-block
ranges; the result equals the per-token definition (token at each position, its cache slot
block_ids[p // bs] * bs + p % bs, PLACEHOLDER inputs fixed from the previous step's row)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from engine.model_runner import ModelRunner
from engine.request import PLACEHOLDER, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk


def _per_token(chunks: list[ScheduledChunk], prev_rows: dict[int, int], bs: int):  # type: ignore[no-untyped-def]
    ids, pos, slots, fix_at, fix_from = [], [], [], [], []
    for c in chunks:
        r = c.request
        for p in range(c.start, c.start + c.num_tokens):
            tok = r.token_at(p)
            if tok == PLACEHOLDER:
                fix_at.append(len(ids))
                fix_from.append(prev_rows[id(r)])
                tok = 0
            ids.append(tok)
            pos.append(p)
            slots.append(r.block_ids[p // bs] * bs + p % bs)
    return ids, pos, slots, fix_at, fix_from


@pytest.mark.parametrize("seed", range(20))
def test_plan_equals_the_per_token_definition(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    chunks, prev_rows = [], {}
    for i in range(rng.randint(1, 6)):
        n_prompt = rng.randint(1, 70)
        outs = [rng.randint(0, 999) for _ in range(rng.randint(0, 9))]
        if outs and rng.random() < 0.5:  # deferred sample(s) not read back yet
            outs[-1] = PLACEHOLDER
        r = Request(f"r{i}", [rng.randint(0, 999) for _ in range(n_prompt)],
                    SamplingParams(), seed=0, output_token_ids=outs)
        total = n_prompt + len(outs)
        blocks = rng.sample(range(1000), -(-total // bs))
        r.block_ids = blocks
        start = rng.randint(0, total - 1)
        # a prefill chunk (maybe reaching into the outputs, as after a preemption) or one
        # decode token
        num = rng.randint(1, total - start) if rng.random() < 0.7 else 1
        chunks.append(ScheduledChunk(r, start, num, samples=start + num == total))
        prev_rows[id(r)] = rng.randint(0, 7)
    plan, _ = ModelRunner._plan(SimpleNamespace(block_size=bs), chunks, prev_rows)  # type: ignore[arg-type]
    ids, pos, slots, fix_at, fix_from = _per_token(chunks, prev_rows, bs)
    assert plan.input_ids == ids
    assert plan.positions == pos
    assert plan.slots == slots
    assert plan.fix_at == fix_at and plan.fix_from == fix_from
    assert plan.cu_seqlens_q[-1] == len(ids)
