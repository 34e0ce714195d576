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

Tensor parallel (``tp`` in the output): for producer x consumer TP sizes, one endpoint per
rank as a TP worker has (each on its own pool, the latent whole on each), paired by
transfer/tp_plan.py; the bytes each producer and consumer rank moved per request. The
latent leaves one producer rank (tp_plan.latent_source) for consumer rank 0 only, so the
wire total is the formula (in whole blocks) whatever the TP sizes;
"once_per_consumer_rank_bytes" is what a plan sending every consumer rank its own copy
would move (consumer TP x that).
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
from transfer.tp_plan import latent_source, parts_from, parts_to  # noqa: E402

LAYERS, LATENT, BLOCK = 27, 512 + 64, 16
DENSE_PER_TOKEN_LAYER = 16 * (128 + 64 + 128)  # decompressed K (nope | rope) and V per head
PROMPTS = [1, 15, 16, 17, 1000, 4096]
TP_PAIRS = [(1, 2), (2, 2), (2, 4), (4, 2)]  # producer x consumer ranks
TP_PROMPTS = [17, 1000]


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
    tp_rows = [r for a, b in TP_PAIRS for r in tp_pair(a, b, cfg)]
    out = {"command": "python bench/mla_wire_bench.py " + " ".join(sys.argv[1:]),
           "backend": args.backend, "layout": {"layers": LAYERS, "latent": LATENT,
                                               "block_size": BLOCK, "dtype": "bfloat16"},
           "fingerprint": lay.fingerprint(), "requests": rows, "tp": tp_rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def tp_pair(a: int, b: int, cfg: TransferConfig) -> list[dict]:
    """Producer of a ranks -> consumer of b ranks: each request's bytes per rank."""
    blocks = -(-max(TP_PROMPTS) // BLOCK)

    def layout(tp: int, rank: int) -> KVLayout:
        return KVLayout("deepseek-v2-lite", "bfloat16", BLOCK, LAYERS,
                        **KVLayout.kv_shape("mla", 16, LATENT), num_blocks=blocks,
                        tp_size=tp, tp_rank=rank)

    src = torch.randn(blocks, *layout(a, 0).block_shape).to(torch.bfloat16)
    rxs = [make_receiver(torch.zeros_like(src), layout(b, k), cfg, f"c-r{k}") for k in range(b)]
    txs = [make_sender(src.clone(), layout(a, p), cfg, f"p-r{p}") for p in range(a)]
    rows = []
    try:
        for tx in txs:  # any producer rank may send consumer rank 0 a latent
            tx.connect(rxs[0].address, timeout=20)
        for i, n in enumerate(TP_PROMPTS):
            rid, nb = f"tp{a}x{b}-{i}", -(-n // BLOCK)
            src_rank = latent_source(rid, a)
            before = [s.stats().payload_bytes for s in (*txs, *rxs)]
            expecting = [k for k in range(b) if parts_to(k, a, b, 1, True, src_rank)]
            for k in expecting:
                rxs[k].expect(rid, list(range(nb)), source_tp=a)
            for p, tx in enumerate(txs):
                for part in parts_from(p, a, b, 1, True, src_rank):
                    tx.push(rid, rxs[part.dst_rank].address, list(range(nb)), list(range(nb)))
                    tx.finish(rid, TransferNotice(rid, 0, False, n))
            for k in expecting:
                assert rxs[k].wait(rid, 60).status == TransferStatus.DONE
                rxs[k].release(rid)
            assert txs[src_rank].wait(rid, 60).status == TransferStatus.DONE
            txs[src_rank].release(rid)
            moved = [s.stats().payload_bytes - x
                     for s, x in zip((*txs, *rxs), before, strict=True)]
            want = nb * BLOCK * LAYERS * LATENT * 2
            assert sum(moved[:a]) == sum(moved[a:]) == want, (a, b, n, moved, want)
            rows.append({"producer_tp": a, "consumer_tp": b, "prompt_tokens": n,
                         "producer_rank_bytes": moved[:a], "consumer_rank_bytes": moved[a:],
                         "wire_bytes": sum(moved[a:]), "whole_blocks_bytes": want,
                         "formula_bytes": n * LAYERS * LATENT * 2,
                         "once_per_consumer_rank_bytes": b * want})
            print(json.dumps(rows[-1]))
    finally:
        for side in (*txs, *rxs):
            side.close()
    return rows


if __name__ == "__main__":
    main()
