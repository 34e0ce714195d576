"""Reads the folded stacks bench/probes/cpu_sampler/sitecustomize.py wrote: per process,
the functions with the most samples, self (the leaf) and inclusive (anywhere on the stack).

    python bench/probes/cpu_sample_report.py DIR [--top 25] [--match consumer]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("dir")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--match", default="", help="only processes whose command line has this")
    args = ap.parse_args()
    for path in sorted(glob.glob(os.path.join(args.dir, "*.folded"))):
        with open(path) as f:
            cmd = f.readline().lstrip("# ").strip()
            rows = [line.rsplit(" ", 1) for line in f if line.strip()]
        if args.match not in cmd:
            continue
        total = sum(int(n) for _, n in rows)
        own: collections.Counter[str] = collections.Counter()
        incl: collections.Counter[str] = collections.Counter()
        for stack, n in rows:
            frames = stack.split(";")
            own[frames[-1]] += int(n)
            for fr in set(frames):
                incl[fr] += int(n)
        print(f"== {os.path.basename(path)}: {total} samples (1 ms of CPU each): {cmd[:150]}")
        print("   self:")
        for fr, n in own.most_common(args.top):
            print(f"   {100 * n / total:5.1f}%  {fr}")
        print("   inclusive:")
        for fr, n in incl.most_common(args.top):
            print(f"   {100 * n / total:5.1f}%  {fr}")


if __name__ == "__main__":
    main()
