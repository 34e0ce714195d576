"""Command-line flags for an engine, shared by every command that builds one."""

from __future__ import annotations

import argparse

from engine.config import DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, EngineConfig
from engine.sim_config import SimConfig


def add_engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """The engine's flags on ``p``, less those named in ``skip`` (e.g. ``"--devices"``, which
    `launch` defines with its own meaning). The dests added are recorded in
    ``p``'s default ``engine_dests`` so `launch` can pass them on (``engine_flag_args``)."""
    g = _Skipping(p.add_argument_group("engine"), skip)
    g.add_argument("--model", default=None,
                   help="'smollm2' (the embedded default), an HF model directory or a .gguf file")
    g.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="auto: bfloat16 on a GPU, float32 on CPU")
    g.add_argument("--device", default="auto",
                   help="auto (cuda when a GPU is present, else cpu), cpu, cuda, cuda:1, ...")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="'dummy' fills random weights from the model's config (benchmarks)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool size in blocks (default: from --kv-cache-mib)")
    g.add_argument("--kv-cache-mib", type=int, default=512, help="KV pool size in MiB")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto: the model's dtype; fp8: float8_e4m3fn with a K and a V scale "
                        "per layer (the checkpoint's k_scale/v_scale, else 1.0), twice the "
                        "tokens of bf16 in the same memory; producer and consumer must agree")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of GPU memory for weights, activations, graphs and KV; "
                        "the KV pool gets the rest (overrides --kv-cache-mib)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every decode (and short prefill) step runs eagerly")
    g.add_argument("--prefill-graph-max-tokens", type=int, default=256,
                   help="one request's prefill chunks of at most this many tokens (e.g. a "
                        "question after a cached prefix) replay CUDA graphs, padded to "
                        "16, 32, 64, ... tokens, wherever decode steps do; 0: never")
    g.add_argument("--no-warmup", action="store_true",
                   help="skip the start-up warm-up (CUDA): requests through every prefill "
                        "path so Triton compiles its kernels before serving; without it the "
                        "first requests on each path wait for those compiles")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="reuse the KV of prompt prefixes already computed (full blocks, "
                        "keyed by a hash chain); --no-enable-prefix-caching recomputes all")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="per-step token budget; longer prompts are prefilled in chunks")
    g.add_argument("--max-waiting", type=int, default=1024)
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks of this engine (heads, MLP and vocabulary split over them); "
                        "gloo on CPU, NCCL on CUDA")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="attention data-parallel groups within the tensor-parallel ranks "
                        "(must divide --tensor-parallel-size): each group has its own "
                        "requests and KV pool; MoE layers are expert-parallel over all ranks")
    g.add_argument("--devices", default="",
                   help="comma-separated device of each rank, e.g. cuda:2,cuda:3 (default: "
                        "consecutive devices from --device)")
    g.add_argument("--tp-timeout", type=float, default=60.0,
                   help="seconds any one collective between the ranks may take before the "
                        "engine fails (a hung rank)")
    g.add_argument("--quantization", default=None, choices=("fp8", "fp8-all"),
                   help="fp8: quantize a float checkpoint's linear layers at load (per-channel "
                        "FP8 weights, activations per token), leaving the first and last "
                        "decoder layers in the model's dtype on models of 8+ layers; fp8-all: "
                        "those too (fewer bytes per step, less accurate); FP8 checkpoints "
                        "need no flag")
    g.add_argument("--simulate-step-ms", type=float, default=None, metavar="MS",
                   help="a simulated engine (serving-plane load tests): no model; every step "
                        "takes MS ms and samples hashed token ids of the served tokenizer "
                        "(never EOS), so router and services meet GPU token rates on a CPU")
    g.add_argument("--simulate-prefill-us-per-token", type=float, default=0.0, metavar="US",
                   help="with --simulate-step-ms: microseconds each prompt token adds to its "
                        "step")
    g.add_argument("--simulate-eos-prob", type=float, default=0.0, metavar="P",
                   help="with --simulate-step-ms: chance that a token (past min_tokens) is EOS")
    g.add_argument("--simulate-prefill-launch-ms", type=float, default=0.0, metavar="MS",
                   help="with --simulate-step-ms: host time of launching a step with prompt "
                        "tokens, spent in small torch calls as a GPU host's eager prefill "
                        "launch is (the device's time runs beside it)")


    p.set_defaults(engine_dests=tuple(g.dests))


class _Skipping:
    """An argument group that leaves out the flags in ``skip`` and notes the dests it adds."""

    def __init__(self, group: argparse._ArgumentGroup, skip: tuple[str, ...]) -> None:
        self.group = group
        self.skip = skip
        self.dests: list[str] = []

    def add_argument(self, flag: str, **kw: object) -> None:
        if flag in self.skip:
            return
        action = self.group.add_argument(flag, **kw)  # type: ignore[arg-type]
        self.dests.append(action.dest)


def engine_flag_args(args: argparse.Namespace, parser_defaults: dict[str, object]
                     ) -> tuple[str, ...]:
    """The engine flags given on this command line (those not at their default), as flags
    for a worker: how `launch` hands every engine flag to the workers it starts."""
    out: list[str] = []
    for dest in getattr(args, "engine_dests", ()):
        value = getattr(args, dest)
        if value == parser_defaults.get(dest):
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            # store_true differs from its default only when True; a BooleanOptionalAction
            # flag that is on by default differs when False, and only its --no- form says so
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out.append(f"{flag}={value}")
    return tuple(out)


def engine_config(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    kw: dict = dict(
        model=args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        kv_cache_bytes=args.kv_cache_mib << 20, kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting, enforce_eager=args.enforce_eager,
        prefill_graph_max_tokens=args.prefill_graph_max_tokens,
        warmup=not args.no_warmup,
        enable_prefix_caching=args.enable_prefix_caching, quantization=args.quantization,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size, tp_timeout_s=args.tp_timeout,
        data_parallel_size=args.data_parallel_size,
        devices=tuple(d.strip() for d in args.devices.split(",") if d.strip()) or None)
    kw["simulate"] = simulate_config(args)
    kw.update(overrides)
    return EngineConfig(**kw)


def simulate_config(args: argparse.Namespace) -> SimConfig | None:
    if args.simulate_step_ms is None:
        for flag in ("prefill_us_per_token", "eos_prob", "prefill_launch_ms"):
            if getattr(args, f"simulate_{flag}"):
                raise ValueError(f"--simulate-{flag.replace('_', '-')}: needs "
                                 "--simulate-step-ms")
        return None
    return SimConfig(step_ms=args.simulate_step_ms,
                     prefill_us_per_token=args.simulate_prefill_us_per_token,
                     eos_prob=args.simulate_eos_prob,
                     prefill_launch_ms=args.simulate_prefill_launch_ms)
