"""Generates the Python gRPC code for proto/pdserve/v1/*.proto into the same folder.

    python proto/generate.py          # write
    python proto/generate.py --check  # exit 1 if the committed code differs from a fresh run

Use grpcio-tools 1.84.x so the code imports with grpcio 1.84 (the GPU machine's version).
"""

from __future__ import annotations

import argparse
import filecmp
import glob
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(HERE, "pdserve", "v1")


def generate(out_root: str) -> list[str]:
    import grpc_tools
    from grpc_tools import protoc

    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    sources = sorted(glob.glob(os.path.join(PKG, "*.proto")))
    rels = [os.path.relpath(s, HERE) for s in sources]
    args = ["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *rels]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(os.path.relpath(p, out_root)
                  for p in glob.glob(os.path.join(out_root, "pdserve", "v1", "*_pb2*.py*")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(tmp)
        if args.check:
            committed = sorted(os.path.relpath(p, HERE)
                               for p in glob.glob(os.path.join(PKG, "*_pb2*.py*")))
            stale = [f for f in files if f not in committed
                     or not filecmp.cmp(os.path.join(tmp, f), os.path.join(HERE, f),
                                        shallow=False)]
            stale += [f for f in committed if f not in files]
            if stale:
                print("generated code is stale: " + ", ".join(stale), file=sys.stderr)
                return 1
            print(f"generated code is up to date ({len(files)} files)")
            return 0
        for f in files:
            shutil.copyfile(os.path.join(tmp, f), os.path.join(HERE, f))
        print(f"wrote {len(files)} files under {PKG}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
