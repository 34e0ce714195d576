"""What one decode step of the embedded model does, counted, not timed (so a loaded machine
cannot blur it): aten ops dispatched and Python calls made, per step, one request in process.
Run it with PYTHONPATH naming one tree, then another, to compare two commits' engines:
    PYTHONPATH=TREE:TREE/proto python bench/probes/decode_step_counts.py [TOP]
Counts are decode steps 2-33 of a 33-token run minus a 1-token run, over 32.
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.llm import LLM
from engine.sampling_params import SamplingParams


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    top = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    torch.set_num_threads(1)
    llm = LLM(None)
    prompt = [list(range(100, 164))]

    def run(n: int) -> None:
        llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

    def ops(n: int) -> collections.Counter[str]:
        with _Ops() as m:
            run(n)
        return m.counts

    def calls(n: int) -> collections.Counter[str]:
        c: collections.Counter[str] = collections.Counter()

        def prof(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                c[f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_code.co_name}"] += 1
            elif event == "c_call":
                c[f"C:{getattr(arg, '__qualname__', arg)}"] += 1
        sys.setprofile(prof)
        try:
            run(n)
        finally:
            sys.setprofile(None)
        return c

    run(4)  # warm-up
    for name, count in (("aten ops", ops), ("Python calls", calls)):
        one, many = count(1), count(33)
        per = {k: (many[k] - one.get(k, 0)) / 32 for k in many}
        print(f"{name} per step: {sum(per.values()):.1f}")
        for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {v:8.1f} {k}")


if __name__ == "__main__":
    main()
