"""``--dataset shared-prefix``: groups of prompts sharing a system prompt (SGLang's
generated-shared-prefix workload: groups x prompts per group, a system prompt of
``system_len`` tokens per group, then a question of ``question_len`` tokens), shuffled
across groups with a seeded generator. Random token ids in ``token_range``.

The ideal hit: every prompt of a group after the first finds the group's system prompt.
"""

from __future__ import annotations

import random

from deploy.benchmark.workload import LengthRange, RequestSpec


def shared_prefix_workload(groups: int, per_group: int, system_len: int, question_len: int,
                           output_len: LengthRange, token_range: LengthRange,
                           seed: int) -> list[RequestSpec]:
    for flag, v in (("--sp-groups", groups), ("--sp-prompts-per-group", per_group),
                    ("--sp-system-len", system_len), ("--sp-question-len", question_len)):
        if v < 1:
            raise ValueError(f"{flag}: must be >= 1, got {v}")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randint(token_range.low, token_range.high) for _ in range(n)]

    systems = [tokens(system_len) for _ in range(groups)]
    order = [(g, tokens(question_len)) for g in range(groups) for _ in range(per_group)]
    rng.shuffle(order)
    seen: set[int] = set()
    specs = []
    for g, q in order:
        specs.append(RequestSpec(tuple(systems[g] + q), output_len.draw(rng),
                                 ideal_cached=system_len if g in seen else 0))
        seen.add(g)
    return specs
