"""How long CPython's collections pause an engine process, with and without its start-up heap
frozen out of them (gc.freeze). A tiny dummy model on CPU, 256 requests of 16 in / 400 out
stepped to the end; prints the tracked objects and each generation's longest pause.

    PYTHONPATH=$PWD:$PWD/proto python bench/probes/gc_pause_probe.py [--freeze]
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tempfile
import time

from engine.config import EngineConfig
from engine.llm import build_engine
from engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--freeze", action="store_true", help="gc.freeze() after the build")
    args = ap.parse_args()
    model = tempfile.mkdtemp()
    subprocess.run([sys.executable, "-m", "deploy.benchmark.dummy_model", model, "--preset",
                    "tiny"], check=True, capture_output=True)
    engine = build_engine(EngineConfig(model=model, load_format="dummy", device="cpu",
                                       max_model_len=2048, max_num_seqs=256))
    print("tracked objects after the build", len(gc.get_objects()))
    if args.freeze:
        gc.collect()
        gc.freeze()
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def timer(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], 1e3 * (time.perf_counter() - started[0])))

    gc.callbacks.append(timer)
    for i in range(256):
        engine.add_request(f"r{i}", prompt_token_ids=[1 + (i * 7 + j) % 300 for j in range(16)],
                           params=SamplingParams(max_tokens=400, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    for g in range(3):
        ms = [d for gen, d in pauses if gen == g]
        print(f"generation {g}: {len(ms)} collections, longest {max(ms, default=0):.1f} ms")
    t = time.perf_counter()
    gc.collect()
    print(f"a full collection now: {1e3 * (time.perf_counter() - t):.1f} ms")


if __name__ == "__main__":
    main()
