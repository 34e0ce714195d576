"""Split counts that fill whole waves of a GPU's resident programs.

A split-K decode kernel's grid is (pairs) x (splits) programs, of which `slots` (programs
an SM holds at once x SMs) run at a time. When the grid ends a little past a whole number of
waves, the last wave's few programs run about as long as a full wave's while most SMs idle.
On an H100 (bench/RESULTS.md, "MLA decode splits that fill one wave", "FP8 KV decode splits
by waves"): MLA decode at batch 128 x 4,096 took 7.5 ms at 3 splits (384 programs for 264
slots) and 6.0 at 2; FP8 KV decode attention at batch 32 x 4,096 (256 pairs, ~792 slots)
0.108 ms a layer at 5 splits (1,280 programs) and 0.100 at 3 (768).
"""

from __future__ import annotations

# A program's fixed cost (its query load, its partial output's store, the merge's read of
# it) in tokens' worth of streaming: fitted to MLA decode on the H100, where one wave of
# programs against two waves of half-length ones gave 71-79 tokens at batches 32, 64 and
# 128 (bench/RESULTS.md, "MLA decode splits that fill one wave").
FIXED_TOKENS = 75


def wave_splits(pairs: int, slots: int, most: int, tokens: int,
                fixed_tokens: int = FIXED_TOKENS) -> int:
    """The split count in [1, most] with the least modelled time for `pairs` (request,
    head-group) rows of `tokens` context each: waves(s) x (tokens / s + fixed_tokens),
    waves(s) = ceil(pairs * s / slots). Ties go to fewer splits."""
    if pairs < 1 or slots < 1:
        raise ValueError(f"pairs ({pairs}) and slots ({slots}) must be >= 1")

    def cost(s: int) -> float:
        return -(-pairs * s // slots) * (max(tokens, 1) / s + fixed_tokens)

    best, best_cost = 1, cost(1)
    for s in range(2, max(1, most) + 1):
        c = cost(s)
        if c < best_cost * (1 - 1e-9):
            best, best_cost = s, c
    return best
