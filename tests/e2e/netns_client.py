"""Runs inside a network namespace: sends greedy chat requests to a router, prints JSON."""

from __future__ import annotations

import json
import sys

from cluster_client import chat, generate, stub_for

if __name__ == "__main__":
    address, n = sys.argv[1], int(sys.argv[2])
    questions = json.loads(sys.argv[3])
    ch, stub = stub_for(address)
    out = []
    for q in questions:
        r = generate(stub, dict(max_tokens=n, temperature=0), timeout=120, **chat(q))
        out.append({"ids": r.token_ids, "error": r.error or r.details,
                    "producer": r.timing.producer if r.timing else "",
                    "consumer": r.timing.consumer if r.timing else ""})
    print(json.dumps(out), flush=True)
