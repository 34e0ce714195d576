"""Clusters a benchmark starts itself (``--launch``, ``--compare``), through LocalCluster.

LocalCluster gives every worker the same flags; a benchmark on a multi-GPU host needs one
device per worker, so ``DeviceCluster`` appends ``--device`` per worker (argparse keeps the
last value), cycling through the devices in start order: producers, consumers, colocated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from deploy.cluster import ClusterSpec, LocalCluster


class DeviceCluster(LocalCluster):
    def __init__(self, spec: ClusterSpec, devices: tuple[str, ...] = (),
                 log_dir: str | None = None) -> None:
        super().__init__(spec, log_dir=log_dir)
        self.devices = devices
        self._next_device = 0

    def _spawn(self, name: str, cmd: list[str]) -> None:
        if self.devices and name != "router":
            cmd = [*cmd, "--device", self.devices[self._next_device % len(self.devices)]]
            self._next_device += 1
        super()._spawn(name, cmd)

    @property
    def gpus(self) -> int:
        n = self.spec.producers + self.spec.consumers + self.spec.colocated
        used = {self.devices[i % len(self.devices)] for i in range(n)} if self.devices else set()
        return sum(1 for d in used if d.startswith("cuda"))


@dataclass(frozen=True)
class Target:
    """One configuration to benchmark: a running router, or a cluster to start."""

    label: str
    address: str = ""  # gRPC address of a running router ("" when ``spec`` is set)
    base_url: str = ""  # its OpenAI HTTP base URL, when known
    spec: ClusterSpec | None = None
    devices: tuple[str, ...] = ()

    def describe(self) -> dict[str, object]:
        if self.spec is None:
            return {"address": self.address, "base_url": self.base_url}
        s = self.spec
        return {"producers": s.producers, "consumers": s.consumers, "colocated": s.colocated,
                "model": s.model, "worker_args": list(s.worker_args),
                "producer_args": list(s.producer_args), "devices": list(self.devices)}


def pd_and_colocated(base: ClusterSpec, producers: int, consumers: int,
                     devices: tuple[str, ...] = ()) -> list[Target]:
    """A P/D cluster and a colocated one with the same number of workers."""
    pd = replace(base, producers=producers, consumers=consumers, colocated=0)
    co = replace(base, producers=0, consumers=0, colocated=producers + consumers)
    return [Target(f"{producers}P{consumers}D", spec=pd, devices=devices),
            Target(f"{producers + consumers} colocated", spec=co, devices=devices)]


def variants(target: Target, policies: list[str], no_caching_too: bool) -> list[Target]:
    """One started cluster per router policy, each also without the prefix cache when
    asked: the comparisons run one after the other on the same workload."""
    assert target.spec is not None
    out = []
    for policy in policies:
        for cached in (True, False) if no_caching_too else (True,):
            spec = replace(target.spec, policy=policy, worker_args=(
                *target.spec.worker_args, *(() if cached else ("--no-enable-prefix-caching",))))
            label = target.label + (f" {policy}" if len(policies) > 1 else "") + (
                "" if cached else " no-cache")
            out.append(Target(label, spec=spec, devices=target.devices))
    return out
