"""bench/fresh_prefill.py: the prompts moe_bench times as prefills never come from the prefix
cache, however many rounds one process runs (session 48's Mixtral A/B timed cache hits), and
a prompt that does is refused, not timed. A real engine on CPU (a tiny Qwen3-MoE)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import decode_op_count  # noqa: E402
from fresh_prefill import fresh_prompt, prefill_uncached  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.llm import build_engine  # noqa: E402

TOKENS = 64  # four 16-token blocks


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_tiny")
    decode_op_count.write_config(os.path.join(d, "config.json"), "qwen3", num_hidden_layers=2,
                                 vocab_size=32000, max_position_embeddings=1024)
    # a pool that holds every prompt of the test: nothing is evicted, so a repeat would hit
    return build_engine(EngineConfig(model=str(d), dtype="float32", device="cpu",
                                     load_format="dummy", max_num_seqs=1, max_model_len=256,
                                     max_num_batched_tokens=256, num_kv_blocks=64))


def test_fresh_prompts_differ_in_their_first_token():
    a, b = fresh_prompt(TOKENS), fresh_prompt(TOKENS)
    assert len(a) == len(b) == TOKENS
    assert a[0] != b[0] and a[1:] == b[1:]
    with pytest.raises(ValueError, match="tokens"):
        fresh_prompt(0)


def test_rounds_of_fresh_prompts_never_hit_the_cache(engine):
    # moe_bench's --prefill-variants: prefill_point's three prompts, round after round
    before = engine.blocks.cache_stats()
    for rnd in range(3):
        for r in range(3):
            prefill_uncached(engine, f"round{rnd}-{r}", fresh_prompt(TOKENS))
    after = engine.blocks.cache_stats()
    assert after.enabled and after.queried_tokens > before.queried_tokens  # the cache looked
    assert after.hit_tokens == before.hit_tokens  # ... and found none of them


def test_a_repeated_prompt_is_refused(engine):
    # the prompts session 48's rounds repeated: the second prefill of the same prompt is a hit
    prompt = fresh_prompt(TOKENS)
    prefill_uncached(engine, "first", prompt)
    with pytest.raises(RuntimeError, match="prefix cache") as e:
        prefill_uncached(engine, "again", prompt)
    assert "48 of its 64 prompt tokens" in str(e.value)  # three whole blocks; the last recomputed
