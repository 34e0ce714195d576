"""Decode time per step of the embedded model, one request, in process (colocated engine),
one thread: the engine step alone, without the other processes of a cluster. Run it with
PYTHONPATH naming one tree, then another, to compare two commits' engines:
    PYTHONPATH=TREE:TREE/proto OMP_NUM_THREADS=1 python bench/probes/decode_step_probe.py
"""

from __future__ import annotations

import statistics
import time

import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams


def main() -> None:
    torch.set_num_threads(1)
    llm = LLM(None)
    prompt = [list(range(100, 164))]

    def timed(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - start

    timed(4)  # warm-up
    per = []
    for _ in range(3):
        one, many = timed(1), timed(33)
        per.append((many - one) / 32 * 1e3)  # 32 decode steps
    print("decode ms/token", [round(x, 2) for x in per], "median",
          round(statistics.median(per), 2))


if __name__ == "__main__":
    main()
