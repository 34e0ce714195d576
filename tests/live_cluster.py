"""Starting live clusters for end-to-end tests (importable: tests/ is on pytest's path)."""

from __future__ import annotations

import os

import pytest

from deploy.cluster import ClusterSpec, LocalCluster

# Small per-step budget so prompts of a few hundred tokens really are prefilled in chunks.
WORKER_ARGS = ("--max-num-batched-tokens", "128", "--kv-cache-mib", "64")


def start_cluster(tmp_path_factory: pytest.TempPathFactory, name: str,
                  **kw: object) -> LocalCluster:
    spec = ClusterSpec(worker_args=kw.pop("worker_args", WORKER_ARGS),  # type: ignore[arg-type]
                       **kw)  # type: ignore[arg-type]
    log_dir = str(tmp_path_factory.mktemp(name))
    c = LocalCluster(spec, log_dir=log_dir)
    c.start()
    return c


def dump_logs(cluster: LocalCluster) -> str:
    out = []
    if cluster.log_dir:
        for f in sorted(os.listdir(cluster.log_dir)):
            with open(os.path.join(cluster.log_dir, f), errors="replace") as fh:
                out.append(f"--- {f}\n{fh.read()[-3000:]}")
    return "\n".join(out)
