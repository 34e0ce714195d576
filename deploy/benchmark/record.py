"""What the client saw of one request, and the per-request latencies derived from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# kv_ready_ms's parts, in their order (RequestRecord)
KV_READY_PARTS = ("notice_sent_ms", "notice_wire_ms", "kv_copy_ms", "kv_poll_ms")


@dataclass
class RequestRecord:
    index: int  # position in the workload (same index = same prompt across configurations)
    prompt_len: int  # prompt tokens (the server's usage count when it reports one)
    expected_output_len: int  # max_tokens asked for
    success: bool = False
    error: str = ""  # why it failed ("" when it succeeded)
    finish_reason: str = ""
    start: float = 0.0  # client perf_counter() when the request was sent
    end: float = 0.0  # client perf_counter() when the stream ended
    # One entry per message that carried at least one token: (perf_counter(), tokens in it).
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    output_tokens: int = 0  # usage.completion_tokens when reported, else the tokens counted
    # From the server's timing (None when the server did not report it, e.g. colocated):
    hold_ms: float | None = None  # router sent token 0 - producer sampled it
    # its first part: the producer's gRPC process handed token 0 to the router's stream -
    # sampled (the engine -> gRPC process hop); the rest is that stream and the router
    hold_producer_ms: float | None = None
    # of which: sampled -> the producer's engine process emitted it to its gRPC process
    hold_engine_ms: float | None = None
    # ... then the producer's Outputs writer took it (None on the Prefill stream), the router
    # read it (the wire, and the router's loop reaching the read), the router sent it
    hold_writer_ms: float | None = None
    hold_wire_ms: float | None = None
    hold_router_ms: float | None = None
    # the producer's wall clock (time.time_ns) when it sampled token 0 (0: not reported):
    # places the hold on the host's timeline, beside bench/loop_stalls_report.py's stalls
    token0_sampled_ns: int = 0
    kv_transfer_ms: float | None = None  # producer's first push to the consumer's ack
    prefill_ms: float | None = None  # producer received the request -> sampled token 0
    # The P/D handoff, the first inter-token gap's server side: the router sent token 0 ->
    # the consumer held every KV block and token 0 and admitted the request (the transfer,
    # the producer's notice, the admission); then -> its first decode step was launched
    # (waiting for the consumer's step boundary). Wall clocks of one host, or synchronized.
    kv_ready_ms: float | None = None
    first_step_wait_ms: float | None = None
    # kv_ready_ms in its parts (None unless every stamp came): the router sent token 0 ->
    # the producer's KV sender put the final notice on the wire (its queue included;
    # negative where the router sent token 0 after that: the sign is kept), -> the
    # consumer's receiver read it (the wire, its I/O thread), -> it knew every KV block
    # had landed (the copies), -> the consumer admitted the request (its engine loop's
    # next poll of the receiver)
    notice_sent_ms: float | None = None
    notice_wire_ms: float | None = None
    kv_copy_ms: float | None = None
    kv_poll_ms: float | None = None
    # router sent the KV destination - producer sampled token 0: positive where the
    # consumer's reservation left the router after token 0; the producer holds the final
    # notice (notice_sent_ms) until the destination is in
    dest_after_token0_ms: float | None = None
    cached_tokens: int = 0  # usage: prompt tokens a worker's prefix cache held
    ideal_cached: int = 0  # what an infinite cache would have held (the workload's ideal)

    # -- derived, in seconds; None where undefined ------------------------------------------

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0][0] - self.start if self.arrivals else None

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def ttst(self) -> float | None:
        """Time to the message that carried the second output token."""
        seen = 0
        for t, n in self.arrivals:
            seen += n
            if seen >= 2:
                return t - self.start
        return None

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive token-bearing messages (vLLM pools these per chunk)."""
        ts = [t for t, _ in self.arrivals]
        return [b - a for a, b in zip(ts, ts[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); undefined for a single output token."""
        ttft = self.ttft
        if ttft is None or self.output_tokens <= 1:
            return None
        return (self.e2el - ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        """A compact row for the result file (milliseconds, 3 decimals)."""

        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1e3, 3)

        return {"index": self.index, "success": self.success, "error": self.error,
                "finish_reason": self.finish_reason, "prompt_len": self.prompt_len,
                "output_tokens": self.output_tokens, "ttft_ms": ms(self.ttft),
                "ttst_ms": ms(self.ttst), "tpot_ms": ms(self.tpot), "e2el_ms": ms(self.e2el),
                "hold_ms": self.hold_ms, "hold_producer_ms": self.hold_producer_ms,
                "hold_engine_ms": self.hold_engine_ms,
                "hold_writer_ms": self.hold_writer_ms, "hold_wire_ms": self.hold_wire_ms,
                "hold_router_ms": self.hold_router_ms,
                "token0_sampled_ns": self.token0_sampled_ns,
                "kv_transfer_ms": self.kv_transfer_ms,
                "prefill_ms": self.prefill_ms, "kv_ready_ms": self.kv_ready_ms,
                "first_step_wait_ms": self.first_step_wait_ms,
                "notice_sent_ms": self.notice_sent_ms, "notice_wire_ms": self.notice_wire_ms,
                "kv_copy_ms": self.kv_copy_ms, "kv_poll_ms": self.kv_poll_ms,
                "dest_after_token0_ms": self.dest_after_token0_ms,
                "cached_tokens": self.cached_tokens,
                "ideal_cached": self.ideal_cached, "itl_ms": [ms(g) for g in self.itl]}
