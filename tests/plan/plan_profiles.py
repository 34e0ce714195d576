"""Hand-made profiles with known shapes, for the planner's and simulator's tests."""

from __future__ import annotations

from typing import Any

from deploy.plan.profile import Profile


def profile_json(prefill_per_token_ms: float = 0.1, prefill_fixed_ms: float = 5.0,
                 decode_fixed_ms: float = 10.0, decode_per_seq_ms: float = 0.5,
                 kv_tokens: int = 200_000, gbps: float = 10.0) -> dict[str, Any]:
    tokens = [16, 256, 1024, 4096]
    batch = [1, 8, 32, 128]
    context = [128, 1024, 8192]
    return {"version": 1, "model": "hand-made", "device": "test", "block_size": 16,
            "prefill": {"tokens": tokens,
                        "ms": [prefill_fixed_ms + prefill_per_token_ms * t for t in tokens]},
            "decode": {"batch": batch, "context": context,
                       "ms": [[decode_fixed_ms + decode_per_seq_ms * b * (1 + c / 8192)
                               for c in context] for b in batch]},
            "kv_capacity_tokens": kv_tokens, "kv_bytes_per_token": 100_000,
            "transfer_GBps": gbps}


def make_profile(**kw: Any) -> Profile:
    return Profile.from_json(profile_json(**kw))
