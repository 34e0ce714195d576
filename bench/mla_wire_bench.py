"""Bytes on the wire for an MLA (latent) KV cache: one request's prompt moved producer ->
consumer through transfer/, counted by the sender (TransferStats.payload_bytes).

    python bench/mla_wire_bench.py [--backend ipc] [--out bench/results/mla_wire_cpu.json]

Shape: DeepSeek-V2-Lite (27 layers, kv_lora_rank 512 + qk_rope_head_dim 64, 16 heads of
qk 128 + 64 and v 128), bf16, block size 16. The target: a request's bytes be
prompt tokens x layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, within one block
(the last block moves whole). For comparison in the same run: what the same prompt would
move if the cache held decompressed per-head K and V (what a K/V layout of this model
stores: 16 x (192 + 128) values per token and layer). The wall time is the CPU data
plane's, one request at a time, handshake excluded (not a bandwidth claim; see
transfer_bench.py for those).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from engine.kv_layout import KVLayout  # noqa: E402
from transfer import (  # noqa: E402
    TransferConfig,
    TransferNotice,
    TransferStatus,
    make_receiver,
    make_sender,
)

LAYERS, LATENT, BLOCK = 27, 512 + 64, 16
DENSE_PER_TOKEN_LAYER = 16 * (128 + 64 + 128)  # decompressed K (nope | rope) and V per head
PROMPTS = [1, 15, 16, 17, 1000, 4096]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="ipc")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    blocks = -(-max(PROMPTS) // BLOCK)
    lay = KVLayout("deepseek-v2-lite", "bfloat16", BLOCK, LAYERS,
                   **KVLayout.kv_shape("mla", 16, LATENT), num_blocks=blocks)
    src = torch.randn(blocks, *lay.block_shape).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    cfg = TransferConfig(backend=args.backend, peer_timeout_s=5.0, transfer_timeout_s=60.0)
    rows = []
    with make_receiver(dst, lay, cfg) as rx, make_sender(src, lay, cfg) as tx:
        tx.connect(rx.address, timeout=20)
        for i, n in enumerate(PROMPTS):
            rid = f"r{i}"
            nb = -(-n // BLOCK)
            before = tx.stats().payload_bytes
            t0 = time.perf_counter()
            rx.expect(rid, list(range(nb)))
            tx.push(rid, rx.address, list(range(nb)), list(range(nb)))
            tx.finish(rid, TransferNotice(rid, 0, False, n))
            assert rx.wait(rid, 60).status == TransferStatus.DONE
            assert tx.wait(rid, 60).status == TransferStatus.DONE
            dt = time.perf_counter() - t0
            tx.release(rid)
            rx.release(rid)
            moved = tx.stats().payload_bytes - before
            assert torch.equal(dst[:nb], src[:nb]), "the latent landed unchanged"
            want = nb * BLOCK * LAYERS * LATENT * 2  # tokens rounded up to a whole block
            assert moved == want, (n, moved, want)
            rows.append({"prompt_tokens": n, "blocks": nb, "payload_bytes": moved,
                         "formula_bytes": n * LAYERS * LATENT * 2,
                         "dense_kv_bytes": nb * BLOCK * LAYERS * DENSE_PER_TOKEN_LAYER * 2,
                         "seconds": round(dt, 6)})
            print(json.dumps(rows[-1]))
    out = {"command": "python bench/mla_wire_bench.py " + " ".join(sys.argv[1:]),
           "backend": args.backend, "layout": {"layers": LAYERS, "latent": LATENT,
                                               "block_size": BLOCK, "dtype": "bfloat16"},
           "fingerprint": lay.fingerprint(), "requests": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
