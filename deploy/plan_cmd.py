"""``pdserve plan``: pick a producer/consumer/colocated split from a worker profile,
``pdserve plan profile``: measure that profile on this device, and ``pdserve plan apply``:
move a running cluster to a split (deploy/plan/apply.py)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from deploy.benchmark.workload import LengthRange
from deploy.engine_args import add_engine_args, engine_config
from deploy.plan.apply import add_apply_parser
from deploy.plan.planner import (
    Slos,
    Workload,
    fewest_gpus,
    launch_lines,
    plan,
    random_lengths,
    table,
)
from deploy.plan.profile import Profile
from deploy.plan.sim_worker import EngineLimits
from deploy.plan.simulator import POLICIES


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="choose an xPyD split by simulating every one",
                       description="Simulates every split of the workers (colocated, xPyD "
                                   "and mixes) on a measured profile and ranks them.")
    p.add_argument("--profile", help="a profile from `pdserve plan profile`")
    n = p.add_mutually_exclusive_group()
    n.add_argument("--gpus", type=int, help="workers to split (one per GPU)")
    n.add_argument("--max-gpus", type=int, help="find the fewest workers meeting the SLOs")
    p.add_argument("--input-len", default="1024", help="prompt tokens: L or LOW:HIGH")
    p.add_argument("--output-len", default="128", help="output tokens: L or LOW:HIGH")
    p.add_argument("--dataset", default=None, help="ShareGPT JSON: lengths from it")
    p.add_argument("--tokenizer-model", default=None,
                   help="model whose tokenizer counts --dataset tokens (default: smollm2)")
    p.add_argument("--rate", type=float, help="requests per second (Poisson)")
    p.add_argument("--num-prompts", type=int, default=0,
                   help="requests simulated (default: 120 s of traffic, at least 200)")
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--slo-attainment", type=float, default=0.9,
                   help="share of requests that must meet both SLOs")
    p.add_argument("--policy", default="round_robin", choices=POLICIES)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--accept-untrusted-profile", action="store_true",
                   help="plan even on a profile with noisy or out-of-order points (its "
                        "ranking may be wrong)")
    p.set_defaults(func=run_plan)
    ps = p.add_subparsers(dest="plan_command")
    prof = ps.add_parser("profile", help="measure this device's worker profile")
    add_engine_args(prof)
    prof.add_argument("--out", required=True, help="profile JSON to write")
    prof.add_argument("--prefill-tokens", default="16,64,128,256,512")
    prof.add_argument("--decode-batch", default="1,4,16")
    prof.add_argument("--decode-context", default="64,512")
    prof.add_argument("--reps", type=int, default=3,
                      help="timings per point that must agree within --tolerance (their "
                           "median is the point)")
    prof.add_argument("--max-reps", type=int, default=15,
                      help="timings per point at most while they do not agree")
    prof.add_argument("--tolerance", type=float, default=0.15,
                      help="relative spread, (max - min) / median, under which timings agree")
    prof.add_argument("--threads", type=int, default=0,
                      help="torch threads (default 0: the cores this process may use, "
                           "cgroup quota and affinity included)")
    prof.add_argument("--transfer-backend", default="ucx")
    prof.set_defaults(func=run_profile)
    add_apply_parser(ps)


def _need(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) is None:
            raise ValueError(f"--{name.replace('_', '-')}: required")


def _positive(flag: str, v: float) -> float:
    if not v > 0 or math.isinf(v):
        raise ValueError(f"{flag}: must be a positive number, got {v}")
    return v


def run_plan(args: argparse.Namespace) -> int:
    _need(args, "profile", "rate", "slo_ttft_ms", "slo_tpot_ms")
    if args.gpus is None and args.max_gpus is None:
        raise ValueError("--gpus or --max-gpus: one is required")
    rate = _positive("--rate", args.rate)
    slos = Slos(_positive("--slo-ttft-ms", args.slo_ttft_ms),
                _positive("--slo-tpot-ms", args.slo_tpot_ms), args.slo_attainment)
    if not 0 < slos.attainment <= 1:
        raise ValueError(f"--slo-attainment: must be in (0, 1], got {slos.attainment}")
    profile = Profile.load(args.profile)
    untrusted = profile.trust_problems()
    if untrusted:
        listed = "; ".join(untrusted[:5]) + (f"; and {len(untrusted) - 5} more"
                                             if len(untrusted) > 5 else "")
        if not args.accept_untrusted_profile:
            raise ValueError(f"--profile: {args.profile} cannot be trusted ({listed}); measure "
                             "again on a quiet machine (or pass --accept-untrusted-profile)")
        print(f"WARNING: planning on an untrusted profile: {listed}", file=sys.stderr)
    n = args.num_prompts or max(200, int(rate * 120))
    out_len = LengthRange.parse("--output-len", args.output_len)
    if args.dataset:
        lengths = _dataset_lengths(args, n, profile)
    else:
        lengths = random_lengths(n, LengthRange.parse("--input-len", args.input_len), out_len,
                                 args.seed)
    work = Workload(rate, lengths, args.seed)
    limits = EngineLimits(args.max_num_seqs, args.max_num_batched_tokens)
    if args.gpus is not None:
        result = plan(profile, args.gpus, work, slos, limits, args.policy)
    else:
        result = fewest_gpus(profile, args.max_gpus, work, slos, limits, args.policy)
    result["launch"] = launch_lines(result["best"], profile.model, args.policy, profile)
    if "met" not in result:  # --gpus: say whether the best split meets the SLOs at all
        result["met"] = bool(result["best"]["meets_slos"])
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"profile {profile.model} on {profile.device}; {len(lengths)} requests at "
          f"{rate:g}/s; SLOs TTFT {slos.ttft_ms:g} ms, TPOT {slos.tpot_ms:g} ms "
          f"({100 * slos.attainment:g}% of requests)")
    print(table(result["candidates"]))
    if result["over_capacity"]:
        print(f"\nthe rate {rate:g}/s is past every split's capacity on {result['gpus']} "
              "workers: none keeps up")
    if not result["met"]:
        best = result["best"]
        size = (f"up to {args.max_gpus}" if args.max_gpus is not None else str(args.gpus))
        warning = (f"WARNING: no split of {size} workers meets the SLOs at {rate:g}/s: the "
                   f"best, {best['split']}, has {100 * best['slo_attainment']:.1f}% of "
                   f"requests within both (needs {100 * slos.attainment:g}%)")
        if args.gpus is not None:
            warning += "; try --max-gpus N to find how many would"
        print(f"\n{warning}")
    met = "" if result["met"] else " (does NOT meet the SLOs)"
    print(f"\nbest on {result['gpus']} workers: {result['best']['split']}{met}")
    for line in result["launch"]:
        print(f"  {line}")
    return 0


def _dataset_lengths(args: argparse.Namespace, n: int,
                     profile: Profile) -> tuple[tuple[int, int], ...]:
    from deploy.benchmark.workload import sharegpt_workload
    from engine.model_source import resolve_model
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_source(resolve_model(args.tokenizer_model))
    specs = sharegpt_workload(args.dataset, n, tok.encode, args.seed, profile.kv_capacity_tokens)
    return tuple((s.prompt_len, s.output_len) for s in specs)


def run_profile(args: argparse.Namespace) -> int:
    from deploy.cpu_threads import engine_threads, passive_omp_waits

    passive_omp_waits()  # as the workers it profiles for run; before torch's OpenMP loads
    import torch

    from deploy.plan.measure import Grid, measure_profile, parse_ints

    torch.set_num_threads(engine_threads(args.threads))
    if args.reps < 1 or args.max_reps < args.reps:
        raise ValueError(f"--reps/--max-reps: need 1 <= --reps <= --max-reps, got "
                         f"{args.reps} and {args.max_reps}")
    if not 0 < args.tolerance < 10:
        raise ValueError(f"--tolerance: must be a relative spread in (0, 10), got "
                         f"{args.tolerance}")
    grid = Grid(parse_ints("--prefill-tokens", args.prefill_tokens),
                parse_ints("--decode-batch", args.decode_batch),
                parse_ints("--decode-context", args.decode_context), args.reps,
                args.max_reps, args.tolerance)
    profile = measure_profile(engine_config(args), grid, args.transfer_backend)
    profile.save(args.out)
    print(f"wrote {args.out}")
    if profile.problems:
        print(f"WARNING: {args.out} cannot be trusted, and `pdserve plan` will refuse it:",
              file=sys.stderr)
        for line in profile.problems:
            print(f"  {line}", file=sys.stderr)
        print("measure again on a quiet machine (other load skews every point), or with "
              "more --max-reps", file=sys.stderr)
        return 1
    return 0
