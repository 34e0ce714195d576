"""The typed load report: it crosses the worker's codec unchanged, a malformed one is refused
naming its field, and what a real router hears in heartbeats and what a real /metrics page
shows are the record's own numbers (each field a distinct value, so a crossed wire shows)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import pytest
from pdserve.v1 import common_pb2
from tiny_models import PROMPTS, make_tiny_model

from consumer.colocated import ColocatedHandler
from engine.llm import LLM
from engine.model_source import resolve_model
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.config import RouterConfig
from router.server import RouterServer
from worker import messages as m
from worker.load_report import (
    ConsumerLoad,
    DPRankLoad,
    HeldRow,
    LoadReport,
    PrefixCacheLoad,
    ProducerLoad,
    StepCounters,
    TransferLoad,
)
from worker.loop_watch import load_pb
from worker.messages import ReadyInfo
from worker.metrics_server import MetricsServer, ServingCounters, WorkerMetrics
from worker.registration import Registration

BASE = LoadReport(
    waiting=3, running=5, kv_blocks_free=70, kv_blocks_total=96, transfers_in_flight=2,
    kv_exhausted_by_orphans=True, preemptions=7,
    dp_ranks=(DPRankLoad(1, 2, 40, 48), DPRankLoad(2, 3, 30, 48)),
    prefix_cache=PrefixCacheLoad(True, 1000, 640, 11, 9, 13, 4),
    transfer=TransferLoad(orphan_blocks=17, transfers_ok=19, transfers_failed=23, aborts=29,
                          kv_malformed_messages=31, kv_rejected_handshakes=37),
    requests=(HeldRow("r-old", "TRANSFERRING", 12.345, 1.5, 6),
              HeldRow("r-new", "PREFILLING", 0.25, 0.125, 2)),
    requests_held=41,
    steps=StepCounters(steps=43, rows=47, tokens=53, seconds=0.75, gap_seconds=0.125,
                       gaps=42))
PRODUCER = dataclasses.replace(BASE, producer=ProducerLoad(lease_expiries=59,
                                                           kv_bytes_sent=61 << 20))
CONSUMER = dataclasses.replace(BASE, consumer=ConsumerLoad(recomputed=67,
                                                           kv_bytes_received=71 << 20,
                                                           reservation_queue_full=73,
                                                           local_prefills=79))
SERVING = ServingCounters(output_batches=83, output_messages=89, kv_event_batches=97,
                          kv_event_snapshots=101, kv_events_dropped_pending=103)


@pytest.mark.parametrize("report", [LoadReport(0, 0, 0, 0), BASE, PRODUCER, CONSUMER],
                         ids=["bare", "base", "producer", "consumer"])
def test_the_report_round_trips_through_the_worker_codec(report: LoadReport) -> None:
    got = m.decode(m.encode(m.StatsEvent(report)))
    assert isinstance(got, m.StatsEvent) and got.load == report
    assert type(got.load.dp_ranks) is tuple and type(got.load.requests) is tuple


def _index(cls: type, name: str) -> int:
    return [f.name for f in dataclasses.fields(cls)].index(name)


def _stats(edit: Any) -> bytes:
    """PRODUCER's StatsEvent as sent, with one part of its field list changed by ``edit``."""
    kind, load = msgpack.unpackb(m.encode(m.StatsEvent(PRODUCER)), raw=False)
    edit(load)
    out: bytes = msgpack.packb([kind, load], use_bin_type=True)
    return out


def _set(path: list[int], value: object) -> Any:
    def edit(fields: list[Any]) -> None:
        for i in path[:-1]:
            fields = fields[i]
        fields[path[-1]] = value
    return edit


def _at(name: str) -> int:
    return _index(LoadReport, name)


@pytest.mark.parametrize(("edit", "names"), [
    (_set([_at("waiting")], "3"), "stats.load.waiting: expected an integer, got str"),
    (_set([_at("kv_exhausted_by_orphans")], 1), "stats.load.kv_exhausted_by_orphans"),
    (_set([_at("dp_ranks"), 1, _index(DPRankLoad, "kv_blocks_free")], -0.5),
     "stats.load.dp_ranks[1].kv_blocks_free"),
    (_set([_at("dp_ranks")], {"0": 1}), "stats.load.dp_ranks: expected a list"),
    (_set([_at("prefix_cache"), _index(PrefixCacheLoad, "hit_tokens")], None),
     "stats.load.prefix_cache.hit_tokens"),
    (_set([_at("transfer"), _index(TransferLoad, "aborts")], "29"),
     "stats.load.transfer.aborts"),
    (_set([_at("producer")], "59"), "stats.load.producer: expected a list of fields"),
    (_set([_at("producer"), _index(ProducerLoad, "kv_bytes_sent")], 1.5),
     "stats.load.producer.kv_bytes_sent"),
    (_set([_at("requests"), _index(HeldRow, "age_s")], "old"),
     "stats.load.requests: expected its age_s column as packed float64 bytes"),
    (_set([_at("steps"), _index(StepCounters, "seconds")], True), "stats.load.steps.seconds"),
    (lambda load: load.__delitem__(slice(2, None)), "stats.load.kv_blocks_free: missing field"),
])
def test_a_malformed_report_is_refused_naming_its_field(edit: Any, names: str) -> None:
    with pytest.raises(m.MessageError) as e:
        m.decode(_stats(edit))
    assert str(e.value).startswith(names), str(e.value)


# ---- what the heartbeat and /metrics carry ------------------------------------------------

INFO = ReadyInfo("smollm2", "fp", 256, kv_address="tcp://127.0.0.1:1", tp_size=2, dp_size=2)


def _pb_dict(load: common_pb2.WorkerLoad) -> dict[str, object]:
    return {"waiting": load.waiting, "running": load.running,
            "kv_blocks_free": load.kv_blocks_free, "kv_blocks_total": load.kv_blocks_total,
            "transfers_in_flight": load.transfers_in_flight,
            "kv_exhausted_by_orphans": load.kv_exhausted_by_orphans,
            "dp_ranks": [(d.waiting, d.running, d.kv_blocks_free, d.kv_blocks_total)
                         for d in load.dp_ranks]}


def _record_dict(r: LoadReport) -> dict[str, object]:
    return {"waiting": r.waiting, "running": r.running, "kv_blocks_free": r.kv_blocks_free,
            "kv_blocks_total": r.kv_blocks_total, "transfers_in_flight": r.transfers_in_flight,
            "kv_exhausted_by_orphans": r.kv_exhausted_by_orphans,
            "dp_ranks": [(d.waiting, d.running, d.kv_blocks_free, d.kv_blocks_total)
                         for d in r.dp_ranks]}


def test_load_pb_of_no_report_yet_is_an_empty_load() -> None:
    assert load_pb(None) == common_pb2.WorkerLoad()


def test_a_real_router_hears_the_report_in_heartbeats() -> None:
    async def main() -> None:
        server = RouterServer(RouterConfig(grpc_port=0, heartbeat_interval_s=0.1),
                              tokenizer=Tokenizer.from_source(resolve_model(None)))
        await server.start()
        report = [LoadReport(0, 0, 0, 0)]
        reg = Registration(server.address, "producer-0", "producer", "127.0.0.1:1", INFO,
                           lambda: report[0])
        task = asyncio.create_task(reg.run())
        try:
            registry = server.registry
            assert registry is not None
            end = time.monotonic() + 10
            while registry.get("producer-0") is None:  # registered with the empty report
                assert time.monotonic() < end, "the worker never registered"
                await asyncio.sleep(0.05)
            report[0] = PRODUCER  # from here on only a heartbeat can bring it
            while (w := registry.get("producer-0")) is None or w.load.running == 0:
                assert time.monotonic() < end, "no heartbeat reached the router"
                await asyncio.sleep(0.05)
            assert _pb_dict(w.load) == _record_dict(PRODUCER)
            assert _pb_dict(load_pb(PRODUCER)) == _record_dict(PRODUCER)
        finally:
            task.cancel()
            await reg.close()
            await server.stop(0)

    asyncio.run(main())


def _fetch(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return str(r.read().decode())


def _samples(text: str, worker: str, role: str) -> dict[str, float]:
    out = {}
    for name, labels, value in re.findall(r"^(pdserve_worker_\w+)\{([^}]*)\} (\S+)$", text,
                                          re.M):
        # the gRPC process's own per-RPC counter and transfer histogram are not the report's
        if name.endswith("_created") or name.startswith(("pdserve_worker_requests",
                                                         "pdserve_worker_kv_transfer_seconds")):
            continue
        assert f'worker="{worker}"' in labels and f'role="{role}"' in labels, labels
        out[name] = float(value)
    return out


# metric -> the record's number it must show
COMMON = {
    "pdserve_worker_queue_depth": BASE.waiting,
    "pdserve_worker_running_requests": BASE.running,
    "pdserve_worker_kv_blocks_total": BASE.kv_blocks_total,
    "pdserve_worker_kv_blocks_free": BASE.kv_blocks_free,
    "pdserve_worker_kv_blocks_used": BASE.kv_blocks_total - BASE.kv_blocks_free,
    "pdserve_worker_kv_transfers_in_flight": BASE.transfers_in_flight,
    "pdserve_worker_kv_exhausted_by_orphans": 1.0,
    "pdserve_worker_prefix_cache_blocks": BASE.prefix_cache.blocks,
    "pdserve_worker_prefix_cache_evictable_blocks": BASE.prefix_cache.evictable_blocks,
    "pdserve_worker_prefix_cache_queried_tokens_total": BASE.prefix_cache.queried_tokens,
    "pdserve_worker_prefix_cache_hit_tokens_total": BASE.prefix_cache.hit_tokens,
    "pdserve_worker_prefix_cache_evicted_blocks_total": BASE.prefix_cache.evicted_blocks,
    "pdserve_worker_preemptions_total": BASE.preemptions,
    "pdserve_worker_kv_orphan_blocks": 17,
    "pdserve_worker_kv_transfers_ok_total": 19,
    "pdserve_worker_kv_transfers_failed_total": 23,
    "pdserve_worker_aborts_total": 29,
    "pdserve_worker_kv_malformed_messages_total": 31,
    "pdserve_worker_kv_rejected_handshakes_total": 37,
    "pdserve_worker_engine_steps_total": 43,
    "pdserve_worker_engine_step_rows_total": 47,
    "pdserve_worker_engine_step_tokens_total": 53,
    "pdserve_worker_engine_step_seconds_total": 0.75,
    "pdserve_worker_engine_step_gap_seconds_total": 0.125,
    "pdserve_worker_engine_step_gaps_total": 42,
    "pdserve_worker_output_batches_total": 83,
    "pdserve_worker_output_messages_total": 89,
    "pdserve_worker_kv_event_batches_total": 97,
    "pdserve_worker_kv_event_snapshots_total": 101,
    "pdserve_worker_kv_events_dropped_pending_total": 103,
}
ONLY_PRODUCER = {"pdserve_worker_lease_expiries_total": 59,
                 "pdserve_worker_kv_transfer_sent_bytes_total": 61 << 20}
ONLY_CONSUMER = {"pdserve_worker_consumer_recomputed_total": 67,
                 "pdserve_worker_kv_transfer_received_bytes_total": 71 << 20,
                 "pdserve_worker_reservation_queue_full_total": 73,
                 "pdserve_worker_consumer_local_prefills_total": 79}


@pytest.mark.parametrize(("role", "report", "want"), [
    ("producer", PRODUCER, {**COMMON, **ONLY_PRODUCER}),
    ("consumer", CONSUMER, {**COMMON, **ONLY_CONSUMER}),
])
def test_a_real_metrics_server_shows_the_report(role: str, report: LoadReport,
                                                want: dict[str, float]) -> None:
    """Every worker family and no other: a role's own counters appear on that role only."""
    async def main() -> tuple[str, str]:
        metrics = WorkerMetrics(f"{role}-0", role, lambda: report, lambda: SERVING)
        server = MetricsServer(metrics)
        port = await server.start("127.0.0.1", 0)
        try:
            return (await asyncio.to_thread(_fetch, port, "/metrics"),
                    await asyncio.to_thread(_fetch, port, "/debug/requests"))
        finally:
            await server.stop()

    text, held = asyncio.run(main())
    got = _samples(text, f"{role}-0", role)
    assert got == pytest.approx({k: float(v) for k, v in want.items()})
    assert json.loads(held) == {
        "requests": [{"request_id": "r-old", "state": "TRANSFERRING", "age_s": 12.345,
                      "state_age_s": 1.5, "blocks": 6},
                     {"request_id": "r-new", "state": "PREFILLING", "age_s": 0.25,
                      "state_age_s": 0.125, "blocks": 2}],
        "total": 41, "kv_blocks_total": 96, "kv_blocks_free": 70}


def test_before_the_first_report_metrics_show_only_the_serving_counters() -> None:
    text = WorkerMetrics("w", "consumer", lambda: None, lambda: SERVING).render().decode()
    got = _samples(text, "w", "consumer")
    serving = ("pdserve_worker_output", "pdserve_worker_kv_event")
    assert set(got) == {k for k in COMMON if k.startswith(serving)}
    assert WorkerMetrics("w", "consumer", lambda: None).held_requests() == {
        "requests": [], "total": 0, "kv_blocks_total": 0, "kv_blocks_free": 0}


def test_a_data_parallel_engine_reports_each_group(tmp_path: Path) -> None:
    """A real DP engine (two attention groups over gloo, CPU): the handler's report carries
    each group's queues and pool, summing to its totals, and the heartbeat carries them."""
    path = make_tiny_model(str(tmp_path / "qwen3_moe"), "qwen3_moe", seed=4)
    with LLM(path, tensor_parallel_size=2, data_parallel_size=2, num_kv_blocks=24,
             block_size=4, max_num_batched_tokens=16) as llm:
        eng = llm.engine
        for i, p in enumerate(PROMPTS[:2]):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=4, temperature=0), dp_rank=1)
        eng.step()
        report = ColocatedHandler(eng, lambda ev: None).load()
        assert report.dp_ranks == tuple(
            DPRankLoad(d["waiting"], d["running"], d["kv_blocks_free"], d["kv_blocks_total"])
            for d in eng.scheduler.loads())
        (g0, g1) = report.dp_ranks
        assert g0 == DPRankLoad(0, 0, 24, 24) and g1.running >= 1 and g1.kv_blocks_free < 24
        assert (report.kv_blocks_free, report.kv_blocks_total) == (24 + g1.kv_blocks_free, 48)
        assert _pb_dict(load_pb(report))["dp_ranks"] == [
            (d.waiting, d.running, d.kv_blocks_free, d.kv_blocks_total) for d in (g0, g1)]
        while eng.has_unfinished():
            eng.step()
