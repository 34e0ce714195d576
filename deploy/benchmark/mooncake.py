"""Replaying a Mooncake-format trace (``--dataset mooncake:PATH``).

The format (kvcache-ai/Mooncake's FAST'25 traces): one JSON object per line, ``timestamp``
(ms from the start), ``input_length``, ``output_length`` and ``hash_ids``, one id per
512-token block of the prompt, equal ids meaning the same block content after the same
prefix (a shared, reusable prefix). No text: each id becomes a deterministic block of token
ids here (seeded by the id), so equal ids give equal tokens and the cluster's prefix cache
sees exactly the trace's sharing.

Scaling for small machines: ``block_tokens`` tokens per trace block instead of 512 (lengths
scale by the same factor, the last block keeps its share), ``time_scale`` multiplies the
arrival times (0.1: ten times faster), ``max_requests`` keeps the first requests.

The ideal hit of each request is what an infinite cache would hold: its leading blocks whose
ids appeared (as a prefix) in an earlier request, whole blocks only.
"""

from __future__ import annotations

import json
import random
from typing import Any

from deploy.benchmark.workload import LengthRange, RequestSpec

TRACE_BLOCK = 512  # tokens per hash id in the trace format


def _field(line_no: int, row: Any, name: str) -> Any:
    if not isinstance(row, dict) or name not in row:
        raise ValueError(f"--dataset: line {line_no}: missing {name!r}")
    return row[name]


def read_trace(path: str, max_requests: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if len(rows) == max_requests:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--dataset: line {i}: not JSON ({e.msg})") from None
            ids = _field(i, row, "hash_ids")
            n_in, n_out = _field(i, row, "input_length"), _field(i, row, "output_length")
            ts = _field(i, row, "timestamp")
            if not (isinstance(ids, list) and ids and all(isinstance(h, int) for h in ids)
                    and isinstance(n_in, int) and n_in > 0 and isinstance(n_out, int)
                    and n_out >= 0 and isinstance(ts, (int, float))):
                raise ValueError(f"--dataset: line {i}: hash_ids must be a non-empty list of "
                                 "integers, input_length > 0, output_length >= 0, timestamp "
                                 "a number")
            if n_in > len(ids) * TRACE_BLOCK:
                raise ValueError(f"--dataset: line {i}: input_length {n_in} exceeds "
                                 f"{len(ids)} blocks of {TRACE_BLOCK}")
            rows.append(row)
    if not rows:
        raise ValueError(f"--dataset: {path} has no requests")
    return rows


def mooncake_workload(path: str, max_requests: int, block_tokens: int, time_scale: float,
                      token_range: LengthRange, seed: int,
                      output_len: LengthRange | None = None) -> list[RequestSpec]:
    if block_tokens < 1:
        raise ValueError(f"--trace-block-tokens: must be >= 1, got {block_tokens}")
    if not time_scale >= 0:
        raise ValueError(f"--trace-time-scale: must be >= 0, got {time_scale}")
    rows = read_trace(path, max_requests)
    blocks: dict[int, tuple[int, ...]] = {}

    def block(h: int) -> tuple[int, ...]:
        b = blocks.get(h)
        if b is None:
            rng = random.Random(f"{seed}:{h}")
            b = blocks[h] = tuple(rng.randint(token_range.low, token_range.high)
                                  for _ in range(block_tokens))
        return b

    seen: set[tuple[int, ...]] = set()  # prefixes of hash ids served so far
    out_rng = random.Random(seed)
    t0 = min(float(r["timestamp"]) for r in rows)
    specs = []
    for r in rows:
        ids: list[int] = r["hash_ids"]
        n = max(1, round(r["input_length"] * block_tokens / TRACE_BLOCK))
        prompt: list[int] = []
        for h in ids:
            prompt.extend(block(h))
        prompt = prompt[:n]
        hit = 0
        while hit < len(ids) and (hit + 1) * block_tokens <= n and tuple(ids[:hit + 1]) in seen:
            hit += 1
        for k in range(1, len(ids) + 1):
            seen.add(tuple(ids[:k]))
        out = (output_len.draw(out_rng) if output_len
               else max(1, round(r["output_length"] * block_tokens / TRACE_BLOCK)))
        specs.append(RequestSpec(tuple(prompt), out,
                                 at_s=(float(r["timestamp"]) - t0) * time_scale / 1e3,
                                 ideal_cached=hit * block_tokens))
    return specs
