"""Decode time per step of the embedded model, one request, in process (colocated engine),
one thread: the engine step alone, without the other processes of a cluster. Run it with
PYTHONPATH naming one tree, then another, to compare two commits' engines:
    PYTHONPATH=TREE:TREE/proto OMP_NUM_THREADS=1 python bench/probes/decode_step_probe.py
"""
import statistics, time, torch
from engine.llm import LLM
from engine.sampling_params import SamplingParams
torch.set_num_threads(1)
llm = LLM(None)
prompt = [list(range(100, 164))]
def t(n):
    s = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - s
t(4)
per = []
for _ in range(3):
    a, b = t(1), t(33)
    per.append((b - a) / 32 * 1e3)
print("decode ms/token", [round(x, 2) for x in per], "median", round(statistics.median(per), 2))
