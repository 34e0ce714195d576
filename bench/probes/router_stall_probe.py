"""What a large input costs the router's event loop, part by part: the numbers
behind router/requests/tokenize_pool.py and router/http/large_body.py, on this machine.

    python bench/probes/router_stall_probe.py [--mb 1] [--out FILE.json]

- tokenize on a thread: the longest a 1 ms sleeper thread waited for the GIL while another
  thread ran ``Tokenizer.encode`` on MB of text (tokenizers holds the GIL in encode, so a
  tokenizing thread stalls the loop as if the loop tokenized);
- json.loads, parse_chat (the body into a GenerateRequest), pickling the raw body: ms per MB,
  each holding the GIL throughout;
- an idle loop's worst wake-up lateness over 3 s, the floor a busy machine sets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "proto"))

from engine.model_source import resolve_model  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from router.http.openai_request import parse_chat  # noqa: E402


def _ms(fn: object) -> float:
    t = time.perf_counter()
    fn()  # type: ignore[operator]
    return (time.perf_counter() - t) * 1000


def gil_hold_ms(tok: Tokenizer, text: str) -> tuple[float, float]:
    """(encode ms, the longest a 1 ms sleeper waited meanwhile, ms)."""
    late: list[float] = []
    done = threading.Event()

    def sleeper() -> None:
        while not done.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            late.append(time.perf_counter() - t - 0.001)

    th = threading.Thread(target=sleeper)
    th.start()
    took = _ms(lambda: tok.encode(text))
    done.set()
    th.join()
    return took, max(late) * 1000


async def idle_loop_lateness_ms(seconds: float = 3.0) -> float:
    worst = 0.0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        await asyncio.sleep(0.005)
        worst = max(worst, time.perf_counter() - t - 0.005)
    return worst * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tok = Tokenizer.from_source(resolve_model(None))
    words = "hello world, this is a test. "
    text = words * int(args.mb * 1e6 / len(words))
    raw = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
    mb = len(raw) / 1e6
    encode_ms, held_ms = gil_hold_ms(tok, text)
    body = json.loads(raw)
    out = {
        "mb": round(mb, 3), "load_avg": os.getloadavg(),
        "encode_ms": round(encode_ms, 1), "sleeper_max_wait_ms": round(held_ms, 1),
        "json_loads_ms_per_mb": round(_ms(lambda: json.loads(raw)) / mb, 1),
        "parse_chat_ms_per_mb": round(_ms(lambda: parse_chat(body)) / mb, 1),
        "pickle_dumps_ms_per_mb": round(_ms(lambda: pickle.dumps(raw)) / mb, 1),
        "idle_loop_worst_lateness_ms": round(asyncio.run(idle_loop_lateness_ms()), 1),
        "max_token_chars": tok.max_token_chars,
    }
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
