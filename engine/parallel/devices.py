"""The device of each tensor-parallel rank, checked against what the host has."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.parallel.group import host_staged
from engine.parallel.shards import FLAG


def rank_devices(config: EngineConfig) -> list[str]:
    """config.devices (one per rank) or, by default, consecutive devices from
    config.device: cuda:k -> cuda:k .. cuda:k+N-1; CPU ranks all use the CPU."""
    n = config.tensor_parallel_size
    if config.devices is not None:
        if n > len(config.devices):
            raise ValueError(f"{FLAG}: {n} ranks but --devices lists {len(config.devices)}")
        devices = list(config.devices[:n])
    elif config.device == "cpu":
        devices = ["cpu"] * n
    else:
        first = int(config.device.split(":")[1]) if ":" in config.device else 0
        devices = [f"cuda:{first + r}" for r in range(n)]
    cuda = [d for d in devices if d.startswith("cuda")]
    if cuda:
        import torch

        have = torch.cuda.device_count()
        idx = [int(d.split(":")[1]) if ":" in d else 0 for d in cuda]
        if max(idx) >= have:
            raise ValueError(f"{FLAG}: {n} ranks need devices {devices}, this host has "
                             f"{have} CUDA device(s)")
        if len(set(idx)) != len(idx) and not host_staged(config.extra):
            raise ValueError(f"{FLAG}: ranks must have distinct devices, got {devices}")
    if len({d == "cpu" for d in devices}) > 1:
        raise ValueError(f"--devices: mixes CPU and CUDA ranks: {devices}")
    return devices
