"""Where a bench point's ITL tail comes from: the first gap (token 0 -> token 1, the P/D
handoff: the producer's notice, the consumer admitting the request, its first step) or the
decode steps after it; and which output positions the gaps above p99 sit at (a stall late
in long outputs, after the burst, is the engine's or the host's, not the handoff's).

Where the records carry the server's handoff stamps (gRPC backend, P/D), the first gap is
split further, per request, into: token 0 sent by the router -> the consumer held the KV
and admitted the request (``kv_ready_ms``: the transfer, the producer's notice, the
admission); -> its first decode step launched (``first_step_wait_ms``: the consumer's step
boundary); and the rest of the gap (that step and the deferred read of its token, the
consumer -> router -> client path). p50 and p99 of each part are over the requests; the
parts of one percentile need not add up to the gap's.

Where they also carry the KV-ready part's stamps, a further line ("KV ready") splits
``kv_ready_ms`` per request: -> the producer's KV sender put the final notice on the
wire (``notice_sent_ms``: the handler, then the sender's queue behind the request's pushes
and its I/O thread; negative where the router sent token 0 after that, the sign kept;
records of before session 30 stamped the hand-over to the sender instead); -> the
consumer's receiver read it (``notice_wire_ms``: the wire, the receiver's I/O thread
getting to it); -> the receiver knew
every KV block had landed (``kv_copy_ms``: the copies still running, for the planes where
the consumer pulls; the last bytes, where the producer pushes); -> the consumer admitted
the request (``kv_poll_ms``: the wait for its engine loop's next poll of the receiver,
after each step and before a paced launch). The slowest 1% of ``kv_ready_ms`` are shown
by their parts' means. Where the records carry ``dest_after_token0_ms`` (the router sent
the consumer's reservation to the producer that long after token 0 was sampled), the line
ends with how many requests' destinations came after token 0, and how late: the producer
pushes and sends its final notice only once the destination is in.

Where they carry the hold's stamps, the first-token hold (producer sampled token 0 -> the
router sent it) is split the same way: -> the producer's gRPC process handed it to the
router's stream (``hold_producer_ms``; where the records carry ``hold_engine_ms``, in two:
-> the producer's engine process emitted it, -> its gRPC process handed it on), and the
rest (that stream, the router's loop).
Where token 0 came on the producer's Outputs stream, the rest splits again: -> that
stream's writer took it (``hold_writer_ms``), -> the router read it (``hold_wire_ms``), ->
the router sent it (``hold_router_ms``); and the slowest 1% of holds are shown by their
parts' means, since the parts' own p99s may come from different requests.

    python bench/itl_split.py RESULT.json [...]   # `pdserve bench --result-json` files
"""

from __future__ import annotations

import json
import sys

import numpy as np

# kv_ready_ms's parts as the records name them (deploy/benchmark/record.py), and here
KV_READY_PARTS = ("notice_sent_ms", "notice_wire_ms", "kv_copy_ms", "kv_poll_ms")
KV_READY_NAMES = ("token 0 sent -> notice sent", "-> notice seen", "-> KV done",
                  "-> admitted")


def split(path: str) -> list[str]:
    doc = json.load(open(path))
    lines = []
    for cfg in doc["configs"]:
        for p in cfg["points"]:
            recs = [r for r in p["requests"] if r.get("itl_ms")]
            if not recs:
                continue
            first = np.array([r["itl_ms"][0] for r in recs])
            rest = np.concatenate([r["itl_ms"][1:] for r in recs])
            every = np.concatenate([r["itl_ms"] for r in recs])
            tpot = np.median([r["tpot_ms"] for r in recs if r.get("tpot_ms")])
            p99, p99_rest = np.percentile(every, 99), np.percentile(rest, 99)
            pos = np.concatenate([np.arange(len(r["itl_ms"])) for r in recs])
            end = int(pos.max()) + 1
            edges = [e for e in (0, 1, 8, 128, 512) if e < end] + [end]
            counts = np.histogram(pos[every > p99], bins=edges)[0]
            share = ", ".join(f"{lo}-{hi - 1}: {c / max(counts.sum(), 1):.0%}"
                              for lo, hi, c in zip(edges, edges[1:], counts, strict=False))
            lines.append(
                f"{path} c={p['concurrency']}: TPOT p50 {tpot:.2f} ms; ITL p99 {p99:.1f} "
                f"({p99 / tpot:.2f}x), without the first gap {p99_rest:.1f} "
                f"({p99_rest / tpot:.2f}x); first gap p50 {np.median(first):.1f} "
                f"p99 {np.percentile(first, 99):.1f}; gaps above p99 by output position: "
                f"{share}")
            handoff = [r for r in recs if r.get("kv_ready_ms") is not None
                       and r.get("first_step_wait_ms") is not None]
            if handoff:
                lines.append("  first gap, " + handoff_line(handoff))
            parted = [r for r in handoff if all(r.get(k) is not None for k in KV_READY_PARTS)]
            if parted:
                lines.append("  KV ready, " + kv_ready_line(parted))
            held = [r for r in p["requests"] if r.get("hold_ms") is not None
                    and r.get("hold_producer_ms") is not None]
            if held:
                lines.append("  hold, " + hold_line(held))
    return lines


def handoff_line(recs: list[dict]) -> str:
    """The first gap's parts over records that carry the handoff stamps (module docstring)."""
    gap = np.array([r["itl_ms"][0] for r in recs])
    ready = np.array([r["kv_ready_ms"] for r in recs])
    wait = np.array([r["first_step_wait_ms"] for r in recs])
    parts = {"whole": gap, "token 0 sent -> KV ready": ready,
             "-> first step": wait, "first step -> token 1 at the client": gap - ready - wait}
    return "; ".join(f"{name} p50 {np.median(v):.1f} p99 {np.percentile(v, 99):.1f}"
                     for name, v in parts.items()) + f" ms ({len(recs)} requests)"


def kv_ready_line(recs: list[dict]) -> str:
    """The KV-ready part of the first gap in its parts (module docstring)."""
    ready = np.array([r["kv_ready_ms"] for r in recs])
    parts = {"whole": ready}
    for name, key in zip(KV_READY_NAMES, KV_READY_PARTS, strict=True):
        parts[name] = np.array([r[key] for r in recs])
    line = "; ".join(f"{name} p50 {np.median(v):.2f} p99 {np.percentile(v, 99):.2f}"
                     for name, v in parts.items()) + f" ms ({len(recs)} requests)"
    slow = ready >= np.percentile(ready, 99)
    tail = ", ".join(f"{name} {v[slow].mean():.2f}" for name, v in parts.items())
    line += f"; slowest 1% ({int(slow.sum())}), mean ms: {tail}"
    late = np.array([r.get("dest_after_token0_ms") for r in recs
                     if r.get("dest_after_token0_ms") is not None])
    if late.size:  # a destination after token 0 holds the notice back: how often, how long
        after = late[late > 0]
        line += (f"; destination after token 0 for {after.size} of {late.size}"
                 + (f", by p50 {np.median(after):.2f} p99 {np.percentile(after, 99):.2f} ms"
                    if after.size else ""))
        # how late: a destination sent before token 0 was sampled is not late at all (its
        # negative lead would pull the mean below zero)
        tail_late = [max(0.0, r.get("dest_after_token0_ms") or 0.0)
                     for r, s in zip(recs, slow, strict=True) if s]
        line += f" (the slowest 1%: {np.mean(tail_late):.2f} ms mean)"
    return line


def hold_line(recs: list[dict]) -> str:
    """The first-token hold's parts (module docstring)."""
    hold = np.array([r["hold_ms"] for r in recs])
    prod = np.array([r["hold_producer_ms"] for r in recs])
    parts = {"whole": hold}
    if all(r.get("hold_engine_ms") is not None for r in recs):
        # the producer's half in two: its engine process's emit, then the hop to its gRPC one
        engine = np.array([r["hold_engine_ms"] for r in recs])
        parts["sampled -> engine emitted"] = engine
        parts["-> producer sent"] = prod - engine
    else:
        parts["sampled -> producer sent"] = prod
    if all(r.get(k) is not None for r in recs
           for k in ("hold_writer_ms", "hold_wire_ms", "hold_router_ms")):
        parts["-> writer took"] = np.array([r["hold_writer_ms"] for r in recs])
        parts["-> router read"] = np.array([r["hold_wire_ms"] for r in recs])
        parts["-> router sent"] = np.array([r["hold_router_ms"] for r in recs])
    else:
        parts["-> router sent"] = hold - prod
    line = "; ".join(f"{name} p50 {np.median(v):.2f} p99 {np.percentile(v, 99):.2f}"
                     for name, v in parts.items()) + f" ms ({len(recs)} requests)"
    slow = hold >= np.percentile(hold, 99)
    tail = ", ".join(f"{name} {v[slow].mean():.2f}" for name, v in parts.items())
    return line + f"; slowest 1% ({int(slow.sum())}), mean ms: {tail}"


if __name__ == "__main__":
    for f in sys.argv[1:]:
        print("\n".join(split(f)))
