"""Where the SLURM driver puts each process (its pure half, without SLURM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.slurm_job import plan

NODES = ["a1", "a2", "a3", "a4"]
ADDRS = {"a1": "10.0.0.1", "a2": "10.0.0.2", "a3": "10.0.0.3", "a4": "10.0.0.4"}


def _argv(p, flag: str) -> str:  # type: ignore[no-untyped-def]
    return str(p.cmd[p.cmd.index(flag) + 1])


def test_router_first_then_producers_then_consumers_one_worker_per_gpu() -> None:
    env = {"PDSERVE_PRODUCER_NODES": "1", "PDSERVE_CONSUMER_NODES": "2",
           "SLURM_GPUS_ON_NODE": "2", "PDSERVE_GRPC_PORT": "7000", "PDSERVE_HTTP_PORT": "7001",
           "PDSERVE_WORKER_ARGS": "--max-num-seqs 8"}
    places, ep = plan(env, NODES, ADDRS, "py")
    assert ep == {"grpc": "10.0.0.1:7000", "http": "http://10.0.0.1:7001"}
    assert [(p.name, p.node) for p in places] == [
        ("router", "a1"), ("worker-a2-0", "a2"), ("worker-a2-1", "a2"),
        ("worker-a3-0", "a3"), ("worker-a3-1", "a3"), ("worker-a4-0", "a4"),
        ("worker-a4-1", "a4")]
    # the ids name the node and slot, the command the role each starts in
    assert [p.cmd[3] for p in places[1:]] == ["producer"] * 2 + ["consumer"] * 4
    w = places[4]
    assert w.cmd[:4] == ("py", "-m", "deploy.cli", "consumer")
    assert _argv(w, "--device") == "cuda:1" and _argv(w, "--host") == "10.0.0.3"
    assert _argv(w, "--router") == "10.0.0.1:7000" and w.cmd[-2:] == ("--max-num-seqs", "8")


def test_cpu_nodes_get_no_device_and_ports_0_pick_free_ones(tmp_path: Path) -> None:
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("model: smollm2\npolicy: least_loaded\nengine: {kv-cache-mib: 64}\n")
    places, ep = plan({"PDSERVE_CONFIG": str(cfg)}, NODES[:3], ADDRS, "py")
    assert len(places) == 3 and all("--device" not in p.cmd for p in places)
    assert int(ep["grpc"].rsplit(":", 1)[1]) > 0 and _argv(places[0], "--policy") == \
        "least_loaded"
    assert "--kv-cache-mib=64" in places[1].cmd


def test_too_few_nodes_and_bad_numbers_name_the_variable() -> None:
    with pytest.raises(ValueError, match="PDSERVE_PRODUCER_NODES/PDSERVE_CONSUMER_NODES: 2 "
                                         r"\+ 2 nodes and the router's need 5; the job has 4"):
        plan({"PDSERVE_PRODUCER_NODES": "2", "PDSERVE_CONSUMER_NODES": "2"}, NODES, ADDRS, "py")
    with pytest.raises(ValueError, match="PDSERVE_WORKERS_PER_NODE: expected an integer"):
        plan({"PDSERVE_WORKERS_PER_NODE": "two"}, NODES, ADDRS, "py")


def test_bad_model_and_port_are_refused_before_any_step() -> None:
    with pytest.raises(ValueError, match="model: '/nonexistent'"):
        plan({"PDSERVE_MODEL": "/nonexistent"}, NODES, ADDRS, "py")
    with pytest.raises(ValueError, match="PDSERVE_GRPC_PORT: 99999 is not a port"):
        plan({"PDSERVE_GRPC_PORT": "99999"}, NODES, ADDRS, "py")


def test_colocated_nodes_follow_the_consumers_and_an_all_colocated_job_is_allowed() -> None:
    places, _ = plan({"PDSERVE_COLOCATED_NODES": "1"}, NODES, ADDRS, "py")
    assert [(p.name, p.node) for p in places] == [
        ("router", "a1"), ("worker-a2-0", "a2"), ("worker-a3-0", "a3"),
        ("worker-a4-0", "a4")]
    assert places[3].cmd[3] == "colocated"
    env = {"PDSERVE_PRODUCER_NODES": "0", "PDSERVE_CONSUMER_NODES": "0",
           "PDSERVE_COLOCATED_NODES": "2"}
    places, _ = plan(env, NODES[:3], ADDRS, "py")
    assert [p.cmd[3] for p in places[1:]] == ["colocated", "colocated"]
    with pytest.raises(ValueError, match="producers and consumers come together"):
        plan({"PDSERVE_PRODUCER_NODES": "0", "PDSERVE_COLOCATED_NODES": "1"}, NODES, ADDRS,
             "py")


@pytest.mark.parametrize("split", [(1, 1, 0), (2, 1, 1), (0, 0, 3)])
def test_the_planners_slurm_line_is_what_the_driver_reads(split: tuple[int, int, int]) -> None:
    """`pdserve plan` prints a SLURM line; its variables must place exactly the planned split."""
    from deploy.plan.planner import launch_lines

    x, y, z = split
    line = next(v for v in launch_lines({"producers": x, "consumers": y, "colocated": z},
                                        "smollm2", "round_robin") if v.startswith("SLURM: "))
    words = line.removeprefix("SLURM: ").split()
    env = dict(w.split("=", 1) for w in words if "=" in w and w.startswith("PDSERVE_"))
    n_nodes = int(next(w for w in words if w.startswith("--nodes=")).split("=")[1])
    nodes = [f"n{i}" for i in range(n_nodes)]
    places, _ = plan(env, nodes, {n: f"10.1.0.{i}" for i, n in enumerate(nodes)}, "py")
    roles = [p.cmd[3] for p in places[1:]]
    assert (roles.count("producer"), roles.count("consumer"), roles.count("colocated")) == split
    assert len({p.node for p in places}) == n_nodes  # no node left idle, none shared
