"""The router's settings: one frozen dataclass, each bad value a ValueError naming its flag."""

from __future__ import annotations

from dataclasses import dataclass

POLICY_NAMES = ("round_robin", "least_loaded", "power_of_two", "cache_aware")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"  # address advertised in logs/endpoints (what clients dial)
    bind_host: str | None = None  # address the gRPC server binds; None: same as host
    grpc_port: int = 50051  # 0: pick a free port (tests); start() returns the bound one
    model: str | None = None  # --model as the workers get it; None: the embedded SmolLM2
    # cache_aware: the worker with the fewest prompt tokens to compute (or, a consumer, to
    # receive) beyond what its prefix cache holds, plus its load priced in tokens
    # (router/control/policy.py CacheAware); with no cached prefix anywhere it is least_loaded
    policy: str = "cache_aware"
    cache_load_tokens: float = 512.0  # prefill tokens one queued request's worth of load costs
    cache_imbalance: float = 8.0  # load gap past which cache_aware takes the least loaded
    # cache_aware only: a consumer holding part of the prompt prefills the rest itself (no
    # producer, no transfer) when that rest is at most this many tokens; it also does when
    # every producer has a queue and it has room. -1: never (always P/D).
    local_prefill_max_tokens: int = 64
    heartbeat_interval_s: float = 1.0  # told to workers in RegisterResponse
    heartbeat_timeout_s: float = 3.0  # a worker silent this long is dropped
    # A worker whose heartbeats report its gRPC process's event loop this far behind is busy:
    # it keeps its requests and is never dropped for it, but gets no new ones; with every
    # worker that could take a request busy, new requests are refused with 429 /
    # RESOURCE_EXHAUSTED. Well over a loaded host's jitter; a loop this late streams tokens
    # seconds late. 0: off.
    busy_lag_s: float = 2.0
    # The same for an engine process whose last load report (sent between steps) is this
    # old: wedged, or in a step far longer than any normal one. Longer than --busy-lag
    # since a CPU worker's prefill step can take seconds, and requests sent to an engine in
    # a long step just wait for it. 0: off.
    busy_engine_s: float = 10.0
    cluster_token: str = ""  # shared secret for Register/Heartbeat; "" disables the check
    # Upper bounds on silence from a worker inside one request. Generous because a long
    # prompt on a CPU producer, or a consumer queueing the reservation under load, can take
    # minutes; finite so a wedged worker fails the request instead of hanging the client.
    token0_timeout_s: float = 600.0  # request sent -> first token of each leg
    token_timeout_s: float = 300.0  # between later messages of a leg
    abort_timeout_s: float = 2.0  # deadline of Worker.Abort calls (the worker may be dead)
    # While a consumer's reservation waits for blocks (backpressure), the producer holds the
    # prefilled blocks under a lease that these renewals keep alive; keep it well under the
    # workers' --lease.
    hold_interval_s: float = 1.0
    # A producer that fails before token 0 (stream error, early end, dropped) costs the
    # client nothing yet, so the request is placed again, at most this many times.
    prefill_retries: int = 2
    # A worker failing a request later (a consumer dying mid-decode, a failed KV transfer,
    # a dropped worker) moves it to another slot with the tokens already streamed, at most
    # this many times; then the client gets a clear error.
    max_migrations: int = 2
    max_tokens_limit: int = 1 << 20  # "huge" max_tokens, refused before any length check
    seed_random: bool = True  # draw a seed when the request has none (False: tests only)
    # Front door. The HTTP port is off by default so gRPC-only users and tests
    # pay nothing for aiohttp; `pdserve launch` turns it on.
    http_port: int = -1  # OpenAI-compatible HTTP; -1: off, 0: a free port
    # A second gRPC listener serving Router/Generate only, each response message framed by
    # hand on the transport (router/grpc_stream/): less router CPU per streamed token than
    # grpc.aio's write. -1: off, 0: a free port.
    grpc_stream_port: int = -1
    api_key: str = ""  # clients must send "Authorization: Bearer <key>"; "" disables the check
    tls_cert: str = ""  # PEM certificate (chain) for both front doors; "" serves plaintext
    tls_key: str = ""  # PEM private key of tls_cert
    # Backpressure: requests holding a slot (dispatched to workers) and requests waiting for
    # one; past both, new requests are refused with 429 / RESOURCE_EXHAUSTED at once, so
    # an overload costs bounded memory and the client learns when to retry.
    max_running_requests: int = 512
    max_queued_requests: int = 1024
    retry_after_s: float = 1.0  # the retry hint sent with a refusal
    # Front-door processes on the same ports (router/control/frontends.py): this one (the primary)
    # and frontends - 1 mirrors it starts. ``primary``: set only in a mirror, the primary's
    # loopback gRPC address it forwards registry calls to and watches.
    frontends: int = 1
    primary: str = ""

    def __post_init__(self) -> None:
        def bad(flag: str, why: str, value: object) -> ValueError:
            return ValueError(f"{flag}: {why}, got {value!r}")

        if not self.host:
            raise bad("--host", "must not be empty", self.host)
        if self.bind_host is not None and not self.bind_host:
            raise bad("--bind-host", "must not be empty", self.bind_host)
        if not 0 <= self.grpc_port <= 65535:
            raise bad("--grpc-port", "must be in [0, 65535]", self.grpc_port)
        if self.policy not in POLICY_NAMES:
            raise bad("--policy", f"must be one of {', '.join(POLICY_NAMES)}", self.policy)
        if not 0 <= self.cache_load_tokens < float("inf"):
            raise bad("--cache-load-tokens", "must be a number >= 0", self.cache_load_tokens)
        if not 0 <= self.cache_imbalance < float("inf"):
            raise bad("--cache-imbalance", "must be a number >= 0", self.cache_imbalance)
        if self.local_prefill_max_tokens < -1:
            raise bad("--local-prefill-max-tokens", "must be >= -1 (-1: never)",
                      self.local_prefill_max_tokens)
        if not self.heartbeat_interval_s > 0:
            raise bad("--heartbeat-interval", "must be > 0", self.heartbeat_interval_s)
        if not self.heartbeat_timeout_s > self.heartbeat_interval_s:
            raise bad("--heartbeat-timeout",
                      f"must exceed the heartbeat interval ({self.heartbeat_interval_s} s)",
                      self.heartbeat_timeout_s)
        for flag, v in (("--busy-lag", self.busy_lag_s),
                        ("--busy-engine-age", self.busy_engine_s)):
            if not v >= 0 or v == float("inf"):
                raise bad(flag, "must be a number of seconds >= 0 (0: off)", v)
        for flag, v in (("--token0-timeout", self.token0_timeout_s),
                        ("--token-timeout", self.token_timeout_s),
                        ("--abort-timeout", self.abort_timeout_s),
                        ("--hold-interval", self.hold_interval_s)):
            if not v > 0:
                raise bad(flag, "must be > 0", v)
        if self.prefill_retries < 0:
            raise bad("--prefill-retries", "must be >= 0", self.prefill_retries)
        if self.max_migrations < 0:
            raise bad("--max-migrations", "must be >= 0", self.max_migrations)
        if not -1 <= self.http_port <= 65535:
            raise bad("--http-port", "must be -1 (off) or in [0, 65535]", self.http_port)
        if not -1 <= self.grpc_stream_port <= 65535:
            raise bad("--grpc-stream-port", "must be -1 (off) or in [0, 65535]",
                      self.grpc_stream_port)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise bad("--tls-key" if self.tls_cert else "--tls-cert",
                      "--tls-cert and --tls-key go together", self.tls_key or self.tls_cert)
        if self.max_running_requests < 1:
            raise bad("--max-running-requests", "must be >= 1", self.max_running_requests)
        if self.max_queued_requests < 0:
            raise bad("--max-queued-requests", "must be >= 0", self.max_queued_requests)
        if not self.retry_after_s > 0:
            raise bad("--retry-after", "must be > 0", self.retry_after_s)
        if not 1 <= self.frontends <= 256:
            raise bad("--frontends", "must be in [1, 256]", self.frontends)
        if self.frontends > 1 and self.grpc_port == 0:
            raise bad("--frontends", "needs a fixed --grpc-port (every frontend binds it)",
                      self.frontends)
        if self.max_tokens_limit < 1:
            raise bad("--max-tokens-limit", "must be >= 1", self.max_tokens_limit)

    @property
    def listen_host(self) -> str:
        return self.bind_host if self.bind_host is not None else self.host
