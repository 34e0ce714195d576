"""One description of a cluster (`pdserve launch --config cluster.yaml`, and the SLURM
script): the model, workers per role, devices, ports, engine flags and policies. Unknown keys
and bad values are errors naming the key, before anything starts.

    model: smollm2                  # or an HF directory / .gguf file
    host: 127.0.0.1
    workers: {producers: 1, consumers: 1, colocated: 0}
    devices: [cuda:0, cuda:1]       # cycled over producers, consumers, colocated
    ports: {grpc: 50051, http: 8000}  # 0: a free port; http -1: off
    policy: round_robin
    transfer_backend: ucx
    threads: 0                      # torch threads per worker (0: cores / workers)
    engine: {max-num-seqs: 32, kv-cache-mib: 256}   # engine flags, for every worker
    worker_args: []                 # any other worker flags, verbatim
    log_dir: /var/log/pdserve
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, NoReturn

import yaml

from deploy.engine_args import add_engine_args
from transfer.types import BACKENDS

POLICIES = ("round_robin", "least_loaded", "power_of_two", "cache_aware")
TOP_KEYS = ("model", "host", "workers", "devices", "ports", "policy", "transfer_backend",
            "threads", "engine", "worker_args", "log_dir")


@dataclass(frozen=True)
class ClusterConfig:
    """The file's settings as launch flags (argparse dest -> value), only those it sets."""
    values: dict[str, Any]


class _Raising(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def _engine_parser() -> _Raising:
    p = _Raising(add_help=False)
    add_engine_args(p)
    return p


def _int(key: str, v: object, low: int, high: int = 1 << 31) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise ValueError(f"{key}: expected an integer in {low}..{high}, got {v!r}")
    return v


def _str(key: str, v: object, choices: tuple[str, ...] = ()) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"{key}: expected a non-empty string, got {v!r}")
    if choices and v not in choices:
        raise ValueError(f"{key}: {v!r} is not one of {', '.join(choices)}")
    return v


def _mapping(key: str, v: object, allowed: tuple[str, ...] | None) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError(f"{key}: expected a mapping, got {v!r}")
    for k in v:
        if allowed is not None and k not in allowed:
            raise ValueError(f"{key}.{k}: unknown key (known: {', '.join(allowed)})")
    return v


def engine_flags(engine: dict[str, Any]) -> tuple[str, ...]:
    """`engine:` as worker flags, each checked by the engine's own flag parser."""
    parser = _engine_parser()
    known = {a.dest.replace("_", "-"): a for a in parser._actions}
    flags: list[str] = []
    for k, v in engine.items():
        name = str(k).replace("_", "-")
        if name not in known:
            raise ValueError(f"engine.{k}: unknown engine flag "
                             f"(known: {', '.join(sorted(known))})")
        if name == "model" or name == "device":
            raise ValueError(f"engine.{k}: set it with the top-level "
                             f"{'model' if name == 'model' else 'devices'} key")
        if isinstance(v, (dict, list)) or v is None:
            raise ValueError(f"engine.{k}: expected a single value, got {v!r}")
        flag = [f"--{name}={v}"]
        try:
            parser.parse_args(flag)
        except ValueError as e:
            raise ValueError(f"engine.{k}: {e}") from None
        flags += flag
    return tuple(flags)


def parse_cluster_config(doc: object) -> ClusterConfig:
    top = _mapping("(top level)", doc if doc is not None else {}, TOP_KEYS)
    out: dict[str, Any] = {}
    if "model" in top:
        out["model"] = _str("model", top["model"])
    if "host" in top:
        out["host"] = _str("host", top["host"])
    if "workers" in top:
        w = _mapping("workers", top["workers"], ("producers", "consumers", "colocated"))
        for role, n in w.items():
            out[role] = _int(f"workers.{role}", n, 0, 1024)
    if "devices" in top:
        d = top["devices"]
        items = d.split(",") if isinstance(d, str) else d
        if not isinstance(items, list):
            raise ValueError(f"devices: expected a list or a comma-separated string, got {d!r}")
        out["devices"] = ",".join(_str(f"devices[{i}]", x).strip() for i, x in enumerate(items))
    if "ports" in top:
        p = _mapping("ports", top["ports"], ("grpc", "http"))
        if "grpc" in p:
            out["grpc_port"] = _int("ports.grpc", p["grpc"], 0, 65535)
        if "http" in p:
            out["http_port"] = _int("ports.http", p["http"], -1, 65535)
    if "policy" in top:
        out["policy"] = _str("policy", top["policy"], POLICIES)
    if "transfer_backend" in top:
        out["transfer_backend"] = _str("transfer_backend", top["transfer_backend"], BACKENDS)
    if "threads" in top:
        out["threads"] = _int("threads", top["threads"], 0, 4096)
    args: list[str] = []
    if "engine" in top:
        args += engine_flags(_mapping("engine", top["engine"], None))
    if "worker_args" in top:
        wa = top["worker_args"]
        if not isinstance(wa, list) or not all(isinstance(x, str) for x in wa):
            raise ValueError(f"worker_args: expected a list of strings, got {wa!r}")
        args += wa
    if args:
        out["worker_arg"] = args
    if "log_dir" in top:
        out["log_dir"] = _str("log_dir", top["log_dir"])
    return ClusterConfig(out)


def load_cluster_config(path: str) -> ClusterConfig:
    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"config: cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config: {path} is not YAML: {e}") from None
    return parse_cluster_config(doc)


def apply_config(args: argparse.Namespace, defaults: dict[str, Any],
                 config: ClusterConfig) -> None:
    """The file's values, where the command line left a flag at its default (flags win)."""
    for dest, value in config.values.items():
        if dest == "worker_arg":
            args.worker_arg = [*value, *args.worker_arg]
        elif getattr(args, dest) == defaults[dest]:
            setattr(args, dest, value)
