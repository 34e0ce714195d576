"""No client can stall the router. While one client streams, another sends a
12 MB chat body and 20 x 1 MB bodies: the stream completes with the tokens it would have
had, /health keeps answering within 100 ms, and no worker is dropped (a stalled loop used
to miss the workers' heartbeats and drop both)."""

from __future__ import annotations

import http.client
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from live_cluster import WORKER_ARGS, dump_logs, start_cluster

from deploy.cluster import LocalCluster

pytestmark = pytest.mark.slow
STREAM = {"model": None, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
          "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory, "abuse", http_port=0,
                      worker_args=(*WORKER_ARGS, "--max-model-len", "2048"),
                      router_args=("--heartbeat-timeout", "3"))
    yield c
    c.stop()


def post(port: int, body: bytes, path: str = "/v1/completions", timeout: float = 120
         ) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def stream_text(port: int) -> tuple[int, str]:
    body = json.dumps({k: v for k, v in STREAM.items() if v is not None}).encode()
    status, raw = post(port, body)
    text = []
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            text.append(json.loads(line[6:])["choices"][0]["text"])
    return status, "".join(text)


def p95(xs: list[float]) -> float:
    return sorted(xs)[int(len(xs) * 0.95)]


def chat_body(mb: float) -> bytes:
    words = "hello world, this is a test. "
    content = words * int(mb * 1e6 / len(words))
    return json.dumps({"messages": [{"role": "user", "content": content}],
                       "max_tokens": 4}).encode()


def test_huge_bodies_stall_nothing(cluster: LocalCluster) -> None:
    port = cluster.http_port
    status, want = stream_text(port)  # the tokens this stream has with no one abusing
    assert status == 200 and want
    workers_before = {w.worker_id for w in cluster.status().workers}
    big, small = chat_body(12), chat_body(1)
    health: list[float] = []
    answers: list[tuple[int, bytes]] = []
    got: list[tuple[int, str]] = []
    stop = threading.Event()

    def poll_health() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        while not stop.is_set():
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            r = conn.getresponse()
            r.read()
            health.append(time.perf_counter() - t0)
            assert r.status == 200, r.status
            time.sleep(0.02)
        conn.close()

    def abuse() -> None:
        answers.append(post(port, big, "/v1/chat/completions"))
        hammer = [threading.Thread(target=lambda: answers.append(
            post(port, small, "/v1/chat/completions"))) for _ in range(20)]
        for t in hammer:
            t.start()
        for t in hammer:
            t.join()

    threads = [threading.Thread(target=poll_health),
               threading.Thread(target=lambda: got.append(stream_text(port))),
               threading.Thread(target=abuse)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    threads[2].join(180)
    threads[1].join(180)
    stop.set()
    threads[0].join(30)
    elapsed = time.monotonic() - t0
    logs = dump_logs(cluster)
    assert got == [(200, want)], (got, want)
    assert len(answers) == 21
    for status, body in answers:
        # cannot fit max_model_len: refused without tokenizing it all (or 429 if the
        # bounded pool was full), never a 500 and never a hang
        assert status in (400, 429), (status, body[:300])
        if status == 400:
            assert b"max_model_len" in body, body[:300]
    assert len(health) >= 10, (len(health), elapsed)
    # /health answers within 100 ms (p95; before, the loop was held 2.5-7.5 s by one body).
    # The max allows one poll to meet the OS scheduler on a shared 2-core machine: with the
    # cluster's six processes and the clients on it, a runnable process can wait 100+ ms
    # for a core, abuse or not (an idle asyncio loop measured 40 ms there at load 13).
    assert p95(health) < 0.1 and max(health) < 0.5, (sorted(health)[-5:], elapsed)
    assert {w.worker_id for w in cluster.status().workers} == workers_before
    assert "stopped heartbeating" not in logs and "no heartbeat" not in logs, logs[-3000:]
    if os.environ.get("PDSERVE_TEST_VERBOSE"):
        print(f"health max {max(health) * 1000:.1f} ms over {len(health)} polls")


def test_a_large_prompt_that_may_fit_is_tokenized_off_the_loop(cluster: LocalCluster) -> None:
    """~40 K characters could be 500 tokens (81 characters is the longest token), so the
    bound cannot refuse it: it is tokenized in a pool process, then refused by the real
    count, with /health answering."""
    port = cluster.http_port
    prompt = "lorem ipsum dolor sit amet " * 1500
    health: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/health")
            conn.getresponse().read()
            conn.close()
            health.append(time.perf_counter() - t0)
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        results: list[Any] = [post(port, json.dumps({"prompt": prompt, "max_tokens": 2})
                                   .encode()) for _ in range(3)]
        while len(health) < 25:  # enough polls for a p95
            time.sleep(0.05)
    finally:
        done.set()
        poller.join(30)
    for status, body in results:
        # the real count refused it (the bound says "at least"): it was tokenized
        assert status == 400 and re.search(rb"prompt: \d+ tokens, max_model_len is", body), \
            (status, body[:300])
    assert len(health) >= 20 and p95(health) < 0.1 and max(health) < 0.5, sorted(health)[-5:]
