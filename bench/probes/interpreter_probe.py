"""Runs a module (``-m``) or a script as ``python`` would, with the interpreter's GIL switch
interval and collector thresholds set first: an A/B of the serving processes' interpreter
settings with no product change.

Why, the switch interval: the first-token hold's worst reads on an H200 came while the
router's loop thread was off the CPU without waiting for one (bench/RESULTS.md, session 52).
If another thread of the process held the GIL then, the loop waited up to CPython's switch
interval (5 ms) for it; the engine process runs 0.2 ms for that reason already
(worker/engine_loop.py).

Why, the thresholds: the router's collections while the seeds' burst arrives are 1-11 ms
(generation 1) and 13-26 ms (full) on a 2-core VM, each one a pause of every stream. What
they walk is the live state of the requests in flight, not garbage (the router's cycles are
gone: tests/router/test_run_no_cycles.py), so rarer collections do the same work less often.

    SERVE_PY="python3 bench/probes/interpreter_probe.py --switch-us 500" \
        bash bench/serving_path_gpu.sh OUT_DIR
    python bench/probes/interpreter_probe.py --gc-thresholds 700,10,100 \
        bench/probes/gc_garbage_probe.py -m deploy.cli router ...

A process that sets its own switch interval later (an engine process) keeps its own.
"""

from __future__ import annotations

import argparse
import gc
import runpy
import sys


def _thresholds(text: str) -> tuple[int, ...]:
    try:
        parts = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not integers: {text!r}") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts):
        raise argparse.ArgumentTypeError(f"1-3 integers >= 0, got {text!r}")
    return parts


def _split(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """This probe's options; the module (-m) or None; the script or the module's arguments.
    By hand, not argparse: the target's own arguments may start with a flag."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            return argv[:i], (argv[i + 1] if i + 1 < len(argv) else ""), argv[i + 2:]
        if a in ("--switch-us", "--gc-thresholds"):
            i += 2
        elif a.startswith(("--switch-us=", "--gc-thresholds=", "-h", "--help")):
            i += 1
        else:
            break
    return argv[:i], None, argv[i:]


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="interpreter_probe.py",
        usage="%(prog)s [--switch-us US] [--gc-thresholds A,B,C] (-m MODULE | SCRIPT) [ARGS...]")
    ap.add_argument("--switch-us", type=float, default=None,
                    help="the GIL switch interval in microseconds (CPython's default: 5000)")
    ap.add_argument("--gc-thresholds", type=_thresholds, default=None,
                    help="gc.set_threshold's values, e.g. 700,10,100 (CPython's: 700,10,10)")
    own, module, target = _split(sys.argv[1:])
    args = ap.parse_args(own)
    if module == "" or (module is None and not target):
        ap.error("give -m MODULE or a script")
    if module is None and target[0].startswith("-"):
        ap.error(f"unrecognized option {target[0]}")
    if args.switch_us is not None:
        if not args.switch_us > 0:
            ap.error(f"--switch-us must be > 0, got {args.switch_us}")
        sys.setswitchinterval(args.switch_us * 1e-6)
    if args.gc_thresholds is not None:
        gc.set_threshold(*args.gc_thresholds)
    if module is not None:
        sys.argv = [module, *target]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(target)
        runpy.run_path(target[0], run_name="__main__")


if __name__ == "__main__":
    main()
