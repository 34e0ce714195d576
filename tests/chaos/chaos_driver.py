"""Steady load against a live cluster while a driver injects faults; the invariants checked
afterwards, and the record written (tests/chaos/test_chaos.py, bench/chaos_soak.py).

Faults, one every ``fault_every_s`` (kind in turn, target at random among the workers
whose role has no other member down, so the cluster can always recover):

- ``sigkill``: the worker's process group is killed; the driver restarts it a few seconds
  later (what ``pdserve launch`` does with backoff).
- ``sigstop``: the group is stopped past the router's heartbeat deadline, then continued.
- ``hostile``: junk at a consumer's KV port: a lone 0xc1 byte, random bytes, truncated
  and mistyped msgpack, a valid-looking kind with bad fields, an oversized frame.
- with a NetHub (every worker in its own network namespace): ``rate_limit``,
  ``partition`` and ``link_down`` (tests/chaos/link_faults.py), each undone after its
  outage.

Every request is one of a few fixed (prompt, sampling) cases whose tokens the colocated
engine computed in-process beforehand, so every completed request, migrated, retried or
untouched, is checked token for token.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
from chaos.hostile import hostile_frames, kv_address
from chaos.link_faults import LINK_KINDS, inject_link
from netns_hosts import NetHub
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

from deploy.cluster import LocalCluster

OK = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
# cheapest to recover from first, so even a short run on a slow machine sees every kind
FAULT_KINDS = ("hostile", "sigstop", "sigkill")
# with a NetHub: link faults woven in, still cheapest first
NET_FAULT_KINDS = ("hostile", "rate_limit", "sigstop", "partition", "link_down", "sigkill")
PROMPTS = ("Tell me about the sea.", "List three colours and why you like them.",
           "Explain how a bicycle works.", "Write a short poem about winter mornings.")
# greedy, and seeded with penalties (the randomness is a pure function of (seed, position))
SAMPLINGS: tuple[dict[str, Any], ...] = (
    dict(max_tokens=16, temperature=0.0, ignore_eos=True),
    dict(max_tokens=20, temperature=0.9, top_p=0.95, seed=77, frequency_penalty=0.3,
         min_tokens=12),
)


@dataclass(frozen=True)
class Case:
    prompt_ids: list[int]
    sampling: dict[str, Any]
    ref_ids: list[int]  # what the colocated engine generates
    ref_finish: int


def reference_cases(llm: Any) -> list[Case]:
    """Every (prompt, sampling) pair, generated once by an in-process colocated engine."""
    from engine.sampling_params import SamplingParams

    pairs = [(llm.tokenizer.encode_chat([{"role": "user", "content": p}]), s)
             for p in PROMPTS for s in SAMPLINGS]
    # one batch: each request's tokens do not depend on its neighbours (the identity rule)
    refs = llm.generate([ids for ids, _ in pairs], [SamplingParams(**s) for _, s in pairs])
    return [Case(ids, s, ref.token_ids, {"stop": OK[0], "length": OK[1]}[ref.finish_reason])
            for (ids, s), ref in zip(pairs, refs, strict=True)]


@dataclass
class Outcome:
    rid: str
    case: int
    started: float  # monotonic
    ended: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    finish: int = 0
    error: str = ""
    code: str = ""  # the RPC's status when the call itself failed

    @property
    def ok(self) -> bool:
        return not self.code and self.finish in OK and not self.error


@dataclass
class Fault:
    kind: str
    target: str
    at: float
    outage_s: float = 0.0  # how long it lasts (sigkill: until the restart)
    undone_at: float = 0.0
    detail: str = ""
    workers: tuple[str, ...] = ()  # every worker it touches (a partition: both sides)


class ChaosRun:
    def __init__(self, cluster: LocalCluster, cases: list[Case], *, seed: int,
                 clients: int = 4, deadline_s: float = 90.0, fault_every_s: float = 8.0,
                 outage_s: tuple[float, float] = (3.0, 5.0), hub: NetHub | None = None,
                 kinds: tuple[str, ...] | None = None) -> None:
        self.cluster = cluster
        self.cases = cases
        self.rng = random.Random(seed)
        self.seed = seed
        self.clients = clients
        self.deadline_s = deadline_s
        self.fault_every_s = fault_every_s
        self.outage_s = outage_s
        self.outcomes: list[Outcome] = []
        self.faults: list[Fault] = []
        self.unexpected_exits: list[str] = []  # workers that died without the driver
        self.hub = hub
        self.kinds = kinds or (NET_FAULT_KINDS if hub is not None else FAULT_KINDS)
        if hub is None and set(self.kinds) & set(LINK_KINDS):
            raise ValueError("kinds: link faults need a NetHub (hub=)")
        self._down: dict[int, Fault] = {}  # id(fault) -> a fault in effect now
        self._undos: dict[int, Callable[[], None]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._n = 0
        self.workers = [n for n in cluster.procs if n != "router"]

    # -- load ------------------------------------------------------------------------------

    def _client(self, idx: int) -> None:
        rng = random.Random(self.seed * 1000 + idx)
        with grpc.insecure_channel(self.cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            while not self._stop.is_set():
                with self._lock:
                    self._n += 1
                    rid = f"chaos-{idx}-{self._n}"
                k = rng.randrange(len(self.cases))
                case = self.cases[k]
                o = Outcome(rid, k, time.monotonic())
                with self._lock:
                    self.outcomes.append(o)
                req = router_pb2.GenerateRequest(
                    request_id=rid, prompt_token_ids=router_pb2.TokenIds(ids=case.prompt_ids),
                    sampling=common_pb2.SamplingParams(**case.sampling))
                try:
                    for msg in stub.Generate(req, timeout=self.deadline_s):
                        o.token_ids += list(msg.token_ids)
                        if msg.finish_reason:
                            o.finish, o.error = msg.finish_reason, msg.error
                except grpc.RpcError as e:
                    o.code, o.error = e.code().name, e.details() or ""
                    if e.code() in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.RESOURCE_EXHAUSTED):
                        time.sleep(0.5)  # refused at once (no workers / full): back off
                o.ended = time.monotonic()

    # -- faults ----------------------------------------------------------------------------

    def _targets(self, roles: tuple[str, ...], whole: bool = True) -> list[str]:
        """Healthy workers of these roles; with ``whole``, only of roles with nobody down
        or not yet back, so taking one away leaves the cluster able to serve."""
        try:
            healthy = {w.worker_id for w in self.cluster.status(timeout=5).workers
                       if w.healthy}
        except grpc.RpcError:
            return []
        busy = {w for f in self._down.values() for w in f.workers}
        up = [n for n in self.workers if n in healthy and n not in busy]
        role = self.cluster.started_as  # the driver changes no role
        down_roles = {role[n] for n in self.workers if n not in up} if whole else set()
        return [n for n in up if role[n] in roles and role[n] not in down_roles]

    def _inject(self, kind: str) -> Fault | None:
        now = time.monotonic()
        if kind == "hostile":
            names = self._targets(("consumer",), whole=False)
            if not names:
                return None
            target = self.rng.choice(names)
            f = Fault(kind, target, now)
            f.detail = hostile_frames(kv_address(self.cluster, target), self.rng)
            f.undone_at = time.monotonic()
            return f
        if kind in LINK_KINDS:
            assert self.hub is not None
            got = inject_link(kind, self.hub, self.rng, self._targets,
                              lambda roles: self._targets(roles, whole=False))
            if got is None:
                return None
            _, workers, detail, undo = got
            f = Fault(kind, "+".join(workers), now, outage_s=self.rng.uniform(*self.outage_s),
                      detail=detail, workers=workers)
            self._down[id(f)], self._undos[id(f)] = f, undo
            return f
        names = self._targets(("producer", "consumer"))
        if not names:
            return None
        target = self.rng.choice(names)
        pid = self.cluster.procs[target].pid
        f = Fault(kind, target, now, outage_s=self.rng.uniform(*self.outage_s),
                  workers=(target,))
        if kind == "sigkill":
            self.cluster.kill(target)  # the whole group, and waits for it
        else:
            os.killpg(pid, signal.SIGSTOP)
        self._down[id(f)] = f
        return f

    def _undo(self, f: Fault) -> None:
        if f.kind == "sigkill":
            self.cluster.respawn(f.target)
        elif f.kind == "sigstop":
            os.killpg(self.cluster.procs[f.target].pid, signal.SIGCONT)
        else:
            self._undos.pop(id(f))()
        f.undone_at = time.monotonic()
        self._down.pop(id(f), None)

    def _check_exits(self) -> None:
        killed = {f.target for f in self._down.values() if f.kind == "sigkill"}
        for n in self.workers:
            p = self.cluster.procs[n]
            if p.poll() is not None and n not in killed:
                why = self.cluster.exit_reason(n)
                self.unexpected_exits.append(why)
                self.cluster.respawn(n)  # keep going; the invariant reports it

    def _driver(self, duration_s: float) -> None:
        end = time.monotonic() + duration_s
        next_fault = time.monotonic() + min(self.fault_every_s, 5.0)
        turn = 0
        while time.monotonic() < end:
            now = time.monotonic()
            for d in list(self._down.values()):
                if now - d.at >= d.outage_s:
                    self._undo(d)
            self._check_exits()
            if now >= next_fault:
                f = self._inject(self.kinds[turn % len(self.kinds)])
                if f is None:  # its role is not whole yet: the same kind again soon
                    next_fault = now + 1.0
                    continue
                turn += 1
                self.faults.append(f)
                next_fault = now + self.fault_every_s * self.rng.uniform(0.7, 1.3)
            time.sleep(0.1)

    # -- the run ---------------------------------------------------------------------------

    def run(self, duration_s: float) -> None:
        threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                   for i in range(self.clients)]
        for t in threads:
            t.start()
        try:
            self._driver(duration_s)
        finally:
            self._stop.set()
            for f in list(self._down.values()):
                self._undo(f)
            for t in threads:
                t.join(self.deadline_s + 30)

    def quiesce(self, timeout_s: float = 120.0) -> dict[str, int]:
        """Waits until every worker is registered and healthy and holds no KV block;
        returns the blocks each worker still holds then (all 0 when quiescent), or raises
        when a worker never came back."""
        self._check_exits()
        end = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            while True:
                ws = list(stub.ClusterStatus(router_pb2.ClusterStatusRequest(),
                                             timeout=10).workers)
                names = {w.worker_id for w in ws if w.healthy}
                whole = all(w.load.kv_blocks_free == w.load.kv_blocks_total > 0
                            and w.load.transfers_in_flight == 0 for w in ws)
                if names >= set(self.workers) and whole:
                    return {w.worker_id: 0 for w in ws}
                if time.monotonic() > end:
                    if names >= set(self.workers):
                        return {w.worker_id: w.load.kv_blocks_total - w.load.kv_blocks_free
                                for w in ws}
                    raise AssertionError(
                        "not quiescent: " + "; ".join(
                            f"{w.worker_id} healthy={w.healthy} free="
                            f"{w.load.kv_blocks_free}/{w.load.kv_blocks_total} "
                            f"transfers={w.load.transfers_in_flight}" for w in ws)
                        + f"; missing {sorted(set(self.workers) - names)}")
                time.sleep(0.5)

    # -- invariants and the record ---------------------------------------------------------

    def violations(self) -> list[str]:
        """Every broken invariant, one line each (empty: all hold)."""
        bad = []
        for o in self.outcomes:
            case = self.cases[o.case]
            took = o.ended - o.started
            if not o.ended:
                bad.append(f"{o.rid}: never ended")
            elif o.code == "DEADLINE_EXCEEDED" or took > self.deadline_s + 5:
                bad.append(f"{o.rid}: not ended within its {self.deadline_s:g} s deadline "
                           f"({took:.1f} s)")
            elif o.ok:
                if o.token_ids != case.ref_ids or o.finish != case.ref_finish:
                    bad.append(f"{o.rid}: tokens differ from the colocated engine's "
                               f"(case {o.case}): {o.token_ids} != {case.ref_ids}")
            elif not o.error:
                bad.append(f"{o.rid}: ended without tokens or an error "
                           f"(finish={o.finish}, code={o.code or '-'}): lost silently")
        bad += [f"worker died without a fault: {w}" for w in self.unexpected_exits]
        return bad

    def record(self, leaked_blocks: dict[str, int]) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for f in self.faults:
            kinds[f.kind] = kinds.get(f.kind, 0) + 1
        reasons: dict[str, int] = {}
        for o in self.outcomes:
            if not o.ok:
                key = reason_key(o.code or "", o.error)
                reasons[key] = reasons.get(key, 0) + 1
        hit = [o for o in self.outcomes if any(o.started < f.at < o.ended for f in self.faults)]
        recovery = sorted(self._recovery_s(f) for f in self.faults if f.kind != "hostile")
        log = router_log(self.cluster)
        net = ("" if self.hub is None else
               f"each worker its own network namespace on bridge {self.hub.bridge}, UCX on "
               f"TCP; partitions by {'nftables' if self.hub.has_nft else 'ip route prohibit'}")
        return {
            "seed": self.seed,
            "network": net or "every process in the host's namespace",
            "requests_sent": len(self.outcomes),
            "requests_ok": sum(o.ok for o in self.outcomes),
            "faults_injected": kinds,
            "requests_in_flight_at_a_fault": len(hit),
            "recovered": sum(o.ok for o in hit),
            "migrations": log.count("; migrating after "),
            "prefill_retries": len(re.findall(r"; retrying \(attempt", log)),
            "failed": sum(not o.ok for o in self.outcomes),
            "failed_by_reason": reasons,
            "leaked_blocks": leaked_blocks,
            "recovery_s_p50": percentile(recovery, 50),
            "recovery_s_p99": percentile(recovery, 99),
            "violations": self.violations(),
            "faults": [asdict(f) for f in self.faults],
        }

    def _recovery_s(self, f: Fault) -> float:
        """From the fault until every request in flight at that moment had ended."""
        ends = [o.ended for o in self.outcomes if o.started < f.at and o.ended >= f.at]
        return max(ends, default=f.at) - f.at


def router_log(cluster: LocalCluster) -> str:
    try:
        with open(cluster.log_paths["router"], errors="replace") as f:
            return f.read()
    except (KeyError, OSError):
        return ""


def reason_key(code: str, error: str) -> str:
    """A failure's reason without request ids and numbers, to count alike ones together."""
    text = f"{code}: {error}" if code else error
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    return text[:160]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return round(sorted(xs)[i], 3)
