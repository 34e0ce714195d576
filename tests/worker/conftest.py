"""One live 1P1D cluster (default worker flags, metrics ports) for the worker tests that
only look at a live worker: held blocks (/debug/requests), the KV port's and the engine's
counters on /metrics, the libraries each process maps. None of them kills, stops or
reconfigures a process, and each leaves no request or block behind, so they share it
instead of starting one each (a start is 9-18 s on a 2-core machine). It also makes this
folder's helper modules importable (importlib import mode adds no test dir to sys.path)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from live_cluster import start_cluster

from deploy.cluster import LocalCluster

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="package")
def worker_1p1d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory, "worker1p1d")
    yield c
    c.stop()
