"""`pdserve bench`: load a pdserve router (gRPC or OpenAI HTTP) over a sweep of concurrency
levels or Poisson rates and report vLLM-comparable serving metrics.

Targets: a running router (``--router`` / ``--base-url``), a cluster started here
(``--launch pd|colocated``), or both kinds with the same number of workers (``--compare``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any

from deploy.router_client import add_router_client_args

# The library is imported when the command runs: every `pdserve` command (the router's too)
# builds this parser, and the router must start fast.
if TYPE_CHECKING:
    from deploy.benchmark.clusters import Target
    from deploy.benchmark.load import LoadPoint
    from deploy.benchmark.sweep import SweepPlan


def add_bench_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="serving benchmark: sweep load, report TTFT/TPOT/ITL/...")
    t = p.add_argument_group("target")
    t.add_argument("--backend", default="grpc", choices=("grpc", "openai"))
    t.add_argument("--router", default="127.0.0.1:50051", help="router gRPC address")
    t.add_argument("--status-router", default=None,
                   help="where to ask the router for its workers (ClusterStatus), when --router "
                        "is its hand-framed door (--grpc-stream-port), which serves Generate "
                        "only (default: --router)")
    t.add_argument("--base-url", default=None,
                   help="OpenAI HTTP base URL, e.g. http://127.0.0.1:8000 (--backend openai)")
    add_router_client_args(t)
    t.add_argument("--connections", type=int, default=1, metavar="N",
                   help="gRPC connections the requests are dealt over in turn (default 1): a "
                        "router's frontends (--frontends) share its port by SO_REUSEPORT, "
                        "which spreads connections, so one connection reaches one frontend")
    t.add_argument("--launch", choices=("pd", "colocated"), default=None,
                   help="start a local cluster of this kind instead of using --router")
    t.add_argument("--policy", default="round_robin",
                   help="started clusters' router policy; a comma list starts one cluster "
                        "per policy (e.g. cache_aware,round_robin: compared in one run)")
    t.add_argument("--compare-prefix-caching", action="store_true",
                   help="each started cluster also once with --no-enable-prefix-caching")
    t.add_argument("--compare", action="store_true",
                   help="run the workload on a P/D cluster and a colocated cluster with the "
                        "same number of workers (both started here); print the ratios")
    t.add_argument("--producers", type=int, default=1)
    t.add_argument("--consumers", type=int, default=1)
    t.add_argument("--model", default=None, help="model of started clusters; tokenizer for "
                   "--dataset (default: the embedded SmolLM2)")
    t.add_argument("--worker-arg", action="append", default=[],
                   help="extra flag for every started worker, e.g. --worker-arg=--dtype=bfloat16")
    t.add_argument("--simulate-step-ms", type=float, default=None, metavar="MS",
                   help="started clusters run simulated engines: no model, MS per step, "
                        "hashed tokens (a serving-plane load test without GPUs)")
    t.add_argument("--simulate-prefill-us-per-token", type=float, default=0.0, metavar="US",
                   help="with --simulate-step-ms: what each prompt token adds to its step")
    t.add_argument("--router-arg", action="append", default=[],
                   help="extra flag for started routers, e.g. "
                        "--router-arg=--local-prefill-max-tokens=-1")
    t.add_argument("--producer-arg", action="append", default=[],
                   help="extra flag for started producers, e.g. --producer-arg=--defer-output")
    t.add_argument("--devices", default="",
                   help="comma list cycled over started workers in order producers, consumers, "
                        "colocated, e.g. cuda:0,cuda:1")
    t.add_argument("--gpus", type=int, default=None,
                   help="GPUs behind the target, for per-GPU throughput (default: from --devices)")
    t.add_argument("--log-dir", default=None, help="started clusters' process logs")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64, help="measured requests per point")
    w.add_argument("--warmup", type=int, default=2,
                   help="unmeasured requests sent to each target before its first point")
    w.add_argument("--input-len", default="256", help="prompt tokens: N or LOW:HIGH")
    w.add_argument("--output-len", default=None,
                   help="max tokens: N or LOW:HIGH (default 64; with --dataset, the "
                        "completion's length)")
    w.add_argument("--trace-block-tokens", type=int, default=512,
                   help="mooncake: tokens per trace block (512 in the trace; smaller scales "
                        "every prompt down by the same factor, e.g. 32 on a CPU)")
    w.add_argument("--trace-time-scale", type=float, default=1.0,
                   help="mooncake: multiplies the trace's arrival times (0.1: ten times faster)")
    w.add_argument("--max-requests", type=int, default=None,
                   help="mooncake: replay the first N requests (default: --num-prompts)")
    w.add_argument("--sp-groups", type=int, default=4, help="shared-prefix: groups")
    w.add_argument("--sp-prompts-per-group", type=int, default=8,
                   help="shared-prefix: prompts per group")
    w.add_argument("--sp-system-len", type=int, default=512,
                   help="shared-prefix: system prompt tokens (one per group)")
    w.add_argument("--sp-question-len", type=int, default=32,
                   help="shared-prefix: question tokens (one per prompt)")
    w.add_argument("--dataset", default=None, help="ShareGPT-format JSON (overrides --input-len; "
                   "--output-len applies only when given explicitly)")
    w.add_argument("--token-range", default="1000:30000",
                   help="random prompt token ids are drawn from LOW:HIGH (away from special ids)")
    w.add_argument("--max-len", type=int, default=2048, help="--dataset: skip longer pairs")
    w.add_argument("--ignore-eos", action="store_true", help="generate exactly max tokens")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    ld = p.add_argument_group("load")
    ld.add_argument("--concurrency", default=None, help="closed-loop sweep, e.g. 1,8,32")
    ld.add_argument("--rate", default=None, help="Poisson sweep in req/s, e.g. 1,2,4,inf")
    ld.add_argument("--max-concurrency", type=int, default=None, help="cap for --rate points")
    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    o.add_argument("--percentiles", default="50,90,99")
    o.add_argument("--result-json", default=None, help="write the full result here")
    o.add_argument("--markdown", default=None, help="write the markdown table here")
    o.add_argument("--plots-dir", default=None, help="write PNG plots here")
    o.add_argument("--plot-prefix", default="", help="file name prefix of the plots")
    o.add_argument("--replot", default=None, metavar="RESULT_JSON",
                   help="only redraw plots and tables from an earlier result file")
    p.set_defaults(func=run_bench)


def _floats(flag: str, text: str) -> list[float]:
    try:
        vals = [math.inf if v.strip() == "inf" else float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: expected a comma list of numbers, got {text!r}") from None
    if any(v <= 0 for v in vals):
        raise ValueError(f"{flag}: values must be > 0")
    return vals


def load_points(args: argparse.Namespace) -> list[LoadPoint]:
    from deploy.benchmark.load import LoadPoint

    points = []
    if args.concurrency:
        points += [LoadPoint(int(c), math.inf) for c in _floats("--concurrency",
                                                               args.concurrency)]
    if args.rate:
        points += [LoadPoint(args.max_concurrency, r) for r in _floats("--rate", args.rate)]
    if not points and args.dataset and args.dataset.startswith("mooncake:"):
        # a replayed trace brings its own arrivals: every request at its time, uncapped
        return [LoadPoint(args.max_concurrency, math.inf)]
    return points or [LoadPoint(1, math.inf)]


def _encoder(model: str | None) -> Any:
    from engine.model_source import resolve_model
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_source(resolve_model(model))
    return lambda text: tok.encode(text)


def build_plan(args: argparse.Namespace) -> SweepPlan:
    from deploy.benchmark.backend import SamplingChoice
    from deploy.benchmark.metrics import parse_goodput
    from deploy.benchmark.sweep import SweepPlan
    from deploy.benchmark.workload import LengthRange, random_workload, sharegpt_workload

    if args.num_prompts < 1 or args.warmup < 0:
        raise ValueError("--num-prompts: must be >= 1 (and --warmup >= 0)")
    tokens = LengthRange.parse("--token-range", args.token_range)
    out_len = LengthRange.parse("--output-len", args.output_len or "64")
    if args.dataset == "shared-prefix":
        from deploy.benchmark.shared_prefix import shared_prefix_workload

        specs = shared_prefix_workload(args.sp_groups, args.sp_prompts_per_group,
                                       args.sp_system_len, args.sp_question_len, out_len,
                                       tokens, args.seed)
        warm = random_workload(args.warmup, LengthRange(16, 16), out_len, tokens, args.seed + 1)
    elif args.dataset and args.dataset.startswith("mooncake:"):
        from deploy.benchmark.mooncake import mooncake_workload

        specs = mooncake_workload(args.dataset.removeprefix("mooncake:"),
                                  args.max_requests or args.num_prompts, args.trace_block_tokens,
                                  args.trace_time_scale, tokens, args.seed,
                                  out_len if args.output_len else None)
        warm = random_workload(args.warmup, LengthRange(16, 16), out_len, tokens, args.seed + 1)
    elif args.dataset:
        specs = sharegpt_workload(args.dataset, args.num_prompts + args.warmup,
                                  _encoder(args.model), args.seed, args.max_len,
                                  out_len if args.output_len else None)
        warm, specs = specs[:args.warmup], specs[args.warmup:]
    else:
        in_len = LengthRange.parse("--input-len", args.input_len)
        specs = random_workload(args.num_prompts, in_len, out_len, tokens, args.seed)
        # Warm-up prompts come from another seed: the measured ones stay the same however
        # many warm-ups run.
        warm = random_workload(args.warmup, in_len, out_len, tokens, args.seed + 1)
    return SweepPlan(points=load_points(args), specs=specs, warmup=warm,
                     sampling=SamplingChoice(ignore_eos=args.ignore_eos,
                                             timeout_s=args.request_timeout),
                     seed=args.seed, slos=parse_goodput(args.goodput),
                     percentiles=_floats("--percentiles", args.percentiles),
                     log_dir=args.log_dir, gpus=args.gpus)


def build_targets(args: argparse.Namespace) -> list[Target]:
    from deploy.benchmark.clusters import Target, pd_and_colocated, variants
    from deploy.cluster import ClusterSpec

    devices = tuple(d for d in args.devices.split(",") if d)
    base = ClusterSpec(model=args.model, worker_args=(*args.worker_arg, *sim_worker_args(args)),
                       producer_args=tuple(args.producer_arg),
                       router_args=tuple(args.router_arg),
                       http_port=0 if args.backend == "openai" else -1,
                       api_key=args.api_key)  # a started cluster's router takes the same key
    if args.compare:
        return pd_and_colocated(base, args.producers, args.consumers, devices)
    if args.launch:
        pd, co = pd_and_colocated(base, args.producers, args.consumers, devices)
        from router.config import POLICY_NAMES

        for name in args.policy.split(","):
            if name not in POLICY_NAMES:
                raise ValueError(f"--policy: each must be one of {', '.join(POLICY_NAMES)}, "
                                 f"got {name!r}")
        return variants(pd if args.launch == "pd" else co, args.policy.split(","),
                        args.compare_prefix_caching)
    return [Target(args.router, address=args.router, base_url=args.base_url or "")]


def sim_worker_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The workers' flags for --simulate-step-ms (checked by the workers' own parser)."""
    if args.simulate_step_ms is None:
        if args.simulate_prefill_us_per_token:
            raise ValueError("--simulate-prefill-us-per-token: needs --simulate-step-ms")
        return ()
    return (f"--simulate-step-ms={args.simulate_step_ms}",
            f"--simulate-prefill-us-per-token={args.simulate_prefill_us_per_token}")


def backend_factory(args: argparse.Namespace) -> Any:
    from deploy.benchmark.backend import Backend

    if args.connections < 1:
        raise ValueError(f"--connections: must be at least 1, got {args.connections}")
    if args.connections > 1 and args.backend != "grpc":
        raise ValueError("--connections: only with --backend grpc (the HTTP client opens "
                         "connections as its streams need them)")

    def make(target: Target) -> Backend:
        if args.backend == "grpc":
            from deploy.benchmark.grpc_backend import GrpcBackend
            from deploy.benchmark.spread_backend import SpreadBackend

            backends: list[Backend] = [
                GrpcBackend(target.address, args.api_key, args.router_ca,
                            status_address=args.status_router)
                for _ in range(args.connections)]
            return backends[0] if len(backends) == 1 else SpreadBackend(backends)
        if not target.base_url:
            raise ValueError("--backend openai: needs --base-url (or a started cluster with "
                             "an HTTP port)")
        from deploy.benchmark.openai_backend import OpenAIBackend

        return OpenAIBackend(target.base_url, status_address=target.address or None,
                             api_key=args.api_key, router_ca=args.router_ca)

    return make


def emit(doc: dict[str, Any], args: argparse.Namespace) -> None:
    from deploy.benchmark.report import markdown_table, ratio_table

    table = markdown_table(doc["configs"])
    print(table)
    if doc.get("comparison"):
        c = doc["comparison"]
        print()
        print(ratio_table(c["numerator"], c["denominator"], c["rows"]))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.plots_dir:
        try:
            from deploy.benchmark.plots import write_plots

            for path in write_plots(doc, args.plots_dir, args.plot_prefix):
                print(f"plot: {path}", file=sys.stderr)
        except ImportError:
            print("--plots-dir: matplotlib is not installed; no plots written", file=sys.stderr)


def run_bench(args: argparse.Namespace) -> int:
    if args.replot:
        with open(args.replot) as f:
            emit(json.load(f), args)
        return 0
    from deploy.benchmark.report import ratios
    from deploy.benchmark.sweep import run_sweep

    make_backend = backend_factory(args)  # its flags checked before any cluster starts
    plan = build_plan(args)
    targets = build_targets(args)
    doc: dict[str, Any] = {
        "tool": "pdserve bench", "format": 1, "command": ["pdserve", *_redacted(sys.argv[1:])],
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "args": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")},
        "workload": {"num_prompts": len(plan.specs), "warmup": len(plan.warmup),
                     "input_len": args.dataset or args.input_len,
                     "output_len": args.output_len, "ignore_eos": args.ignore_eos,
                     "seed": args.seed},
        "configs": []}

    def save(configs: list[dict[str, Any]]) -> None:
        doc["configs"] = configs
        if len(configs) == 2 and args.compare:
            doc["comparison"] = {"numerator": configs[0]["label"],
                                 "denominator": configs[1]["label"],
                                 "rows": ratios(configs[0], configs[1])}
        if args.result_json:  # after every target, so a later failure keeps earlier results
            os.makedirs(os.path.dirname(os.path.abspath(args.result_json)), exist_ok=True)
            with open(args.result_json, "w") as f:
                json.dump(doc, f, indent=1)

    configs = run_sweep(targets, plan, make_backend, on_target=save)
    emit(doc, args)
    failed = sum(p["metrics"]["failed"] for c in configs for p in c["points"])
    return 1 if failed else 0


def _redacted(argv: list[str]) -> list[str]:
    """The command line for the result file, without the API key (result files are shared)."""
    out = []
    hide = False
    for a in argv:
        if hide:
            out.append("***")
            hide = False
        elif a == "--api-key":
            out.append(a)
            hide = True
        elif a.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(a)
    return out
