#!/usr/bin/env bash
# The open issues' H200 points, in three device calls of under 10 minutes each (one H200;
# the wheels of bench/gpu_suite.sh carried in .whl, uvloop's among them):
#   bash bench/h200_open_points.sh OUT_DIR serving   # issue 22: the whole serving path
#   bash bench/h200_open_points.sh OUT_DIR kernels   # issue 27's batch-1 FP8 decode, issue 25's V2-Lite table
#   bash bench/h200_open_points.sh OUT_DIR generate  # issue 25: V2-Lite against transformers' generate
#   bash bench/h200_open_points.sh OUT_DIR hold      # issue 22's open points alone (~4 minutes)
#   bash bench/h200_open_points.sh OUT_DIR switches  # issue 25: the switches no H200 has timed
#   bash bench/h200_open_points.sh OUT_DIR tiles     # issue 25: the fused MoE kernel's decode tiles
# `serving` runs bench/serving_path_gpu.sh (P and D sharing the GPU, the hold points, the long
# outputs at c=256/512, the seeds' load, one colocated worker, the decode_bench reference) with
# two router frontends and the bench's requests over 8 connections: at c=256 one router loop
# also holds new requests' token 0 behind its streams (bench/RESULTS.md, "The events link on a
# GPU, and the hold with several frontends"). FRONTENDS=1 runs one. Each run's host.txt says
# how fast the host's CPU ran: the hold is host time.
# `hold` runs only the points issue 22 still misses on an H200 (the first-token hold at c=16 and
# c=256, the seeds' load and its ITL), as `serving` does them, with two frontends and then
# four (FRONTENDS="2" for one run), for a call with less device time left than the whole
# path needs. STALLS=1 (serving or hold) also records every serving loop's stalls and prints
# stalls.txt: whose loop was late under the slowest holds, and how (deploy/loop_stalls.py;
# its ticker perturbs the hold a little, so it is a diagnosis run, not the record).
# `hold_ab` runs the hold (two frontends) with the stall recorder twice, as it is and with
# router loops that never sleep (bench/probes/spin_site: each frontend then busy-polls a
# core): the first run's stalls say how the router's loop was late under the slowest holds
# (a late wake-up, steal on its CPU, ...), the second whether the c=16 tail goes when there
# is no wake-up to wait for (~7 minutes in all). The GIL is not a candidate: the router has
# no other thread that takes it (bench/RESULTS.md, session 53).
# `kernels` runs bench/fp8_bench.py's decode section (batches 1 and 128, FP8 weights and KV)
# and bench/moe_bench.py's V2-Lite table (batches 1-128, contexts 512 and 4096, the MoE and
# MLA kernels alone, the 4k prefill); `generate` the V2-Lite step against transformers'
# generate at batches 1 and 8 (its compile outlasted the kernels call's time once).
# `switches` times, against the defaults in the same call, what is off because only H100s
# have timed it: the MLA decode kernel's TMA form (batches 8-128 x 4,096, the kernel alone;
# on H100s -6% to +2%, bench/RESULTS.md "MLA decode with each page loaded by the copy
# engine"), and the batch-1 launch fusions of the V2-Lite step ("The launch fusions timed").
# `tiles` times the fused MoE kernel alone (V2-Lite, Qwen3-30B-A3B) and the V2-Lite step with
# the table's "default" tiles (what every H100 run read: 64-column tiles where the H200's
# are 128, bench/moe_table.py) and with 64-column per-pair tiles only, against the H200's
# own. The fused MoE kernel at batch 1 read 64% of HBM on the H200 (session 40) and 73% on
# an H100 with either table (session 50, where the H200's tiles were the faster at every
# batch): this checks the H200's side.
# All refuse a card that is not an H200: the issues' targets are H200 numbers, and other
# cards' runs belong in their own sections.
set -uo pipefail
out=${1:?OUT_DIR}; part=${2:?serving, hold, hold_ab, kernels, generate, switches or tiles}
mkdir -p "$out"
out=$(cd "$out" && pwd)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null | head -1)
echo "$gpu" > "$out/gpu.txt"
git -C "$(dirname "$0")" rev-parse HEAD > "$out/commit.txt" 2>/dev/null || true
case "$gpu" in
  *H200*) ;;
  *) echo "h200_open_points.sh: this is '${gpu:-no GPU}', not an H200" >&2; exit 3 ;;
esac
# shellcheck source=bench/device_env.sh
source "$(dirname "$0")/device_env.sh"
case $part in
  serving|hold)
    limit=570 fes=${FRONTENDS:-2}
    # hold: two frontend counts in turn (a run of its three points took ~70 s on an H100);
    # four cut c=256's tail further than two on the slow H100 hosts of session 39
    [ "$part" = hold ] && export ONLY="pd_hold pd_hold256 pd_seeds" && limit=200 \
      && fes=${FRONTENDS:-2 4}
    for fe in $fes; do
      ra="" ba="" dir="$out/serving"
      [ "$part" = hold ] && dir="$out/serving_f$fe"
      [ "$fe" -gt 1 ] && ra="--frontends $fe" ba="--connections 8"
      ROUTER_ARGS="$ra ${ROUTER_ARGS:-}" BENCH_ARGS="$ba ${BENCH_ARGS:-}" timeout $limit \
        bash bench/serving_path_gpu.sh "$dir" > "$dir.log" 2>&1
      for f in "$dir"/*.json; do
        python3 bench/itl_split.py "$f" > "${f%.json}.split.txt" 2>&1
      done
      tail -30 "$dir.log"
      [ -f "$dir/stalls.txt" ] && head -80 "$dir/stalls.txt"  # STALLS=1 (serving_path_gpu.sh)
      # after each frontend count, not only at the end: a call cut short by its time limit
      # still brings back the summary of the runs it finished
      PYTHONPATH="$PYTHONPATH:$repo/bench" python3 bench/hold_summary.py "$out" > "$out/hold_summary.txt" 2>&1
    done
    cat "$out/hold_summary.txt" ;;
  hold_ab)
    for v in as_is spin; do
      site=""
      [ $v = spin ] && site="$repo/bench/probes/spin_site"
      STALLS=1 FRONTENDS=2 SITE_DIR="$site" bash "$repo/bench/h200_open_points.sh" "$out/$v" hold > "$out/$v.log" 2>&1
      echo "== $v"
      grep -A8 "^pd_hold c=16" "$out/$v/serving_f2/stalls.txt" | head -10
      grep -A6 "^pd_hold256" "$out/$v/serving_f2/stalls.txt" | head -7
      tail -8 "$out/$v/hold_summary.txt"
    done ;;
  kernels)
    timeout 130 python3 bench/fp8_bench.py --sections decode --batches 1,128 \
      --quantization fp8-all --out "$out/fp8_decode.json" > "$out/fp8_decode.txt" 2>&1
    tail -8 "$out/fp8_decode.txt"
    timeout 330 python3 bench/moe_bench.py --shape v2lite --batches 1,8,32,128 \
      --contexts 512,4096 --repeats 2 --out "$out/v2lite.json" > "$out/v2lite.txt" 2>&1
    tail -25 "$out/v2lite.txt" ;;
  generate)
    # transformers' generate compiles for minutes on a fresh machine: a call of its own
    timeout 560 python3 bench/moe_bench.py --shape v2lite --batches 1,8 --contexts 512 \
      --hf-batches 1,8 --repeats 2 --out "$out/v2lite_generate.json" \
      > "$out/v2lite_generate.txt" 2>&1
    tail -12 "$out/v2lite_generate.txt" ;;
  switches)
    timeout 280 python3 bench/moe_bench.py --shape v2lite --batches 8,32,128 --contexts 4096 \
      --repeats 2 --kernel-variants "kernels.triton_mla_decode.FORM='tma'" \
      --out "$out/mla_tma.json" > "$out/mla_tma.txt" 2>&1
    grep mla_decode "$out/mla_tma.txt" | cut -c1-400
    d=kernels.triton_moe.DOWN_SUM_MAX_TOKENS=1 m=engine.models.moe
    timeout 260 python3 bench/moe_bench.py --shape v2lite --batches 1 --contexts 512 --repeats 2 \
      --variants "$d;$d,$m.NEXT_NORM_FUSED=True;$m.ROUTER_ROUTE_FUSED=True,$m.ROUTER_PRENORM=True" \
      --out "$out/step_switches.json" > "$out/step_switches.txt" 2>&1
    tail -12 "$out/step_switches.txt" ;;
  tiles)
    d="moe_table.NAME='default'" w="kernels.triton_moe.PER_PAIR_BLOCK_N=64"
    for shape in v2lite qwen3; do
      timeout 130 python3 bench/moe_bench.py --shape $shape --batches 1,8,32,128 --contexts 512 \
        --repeats 2 --prefill-tokens 0 --kernel-variants "$d;$w" \
        --out "$out/tiles_kernel_$shape.json" > "$out/tiles_kernel_$shape.txt" 2>&1
      grep '"kernel": "fused_moe"' "$out/tiles_kernel_$shape.txt" | cut -c1-400
    done
    timeout 220 python3 bench/moe_bench.py --shape v2lite --batches 1,8,32,128 --contexts 512 \
      --repeats 2 --prefill-tokens 0 --variants "$d;$w" --out "$out/tiles_step.json" \
      > "$out/tiles_step.txt" 2>&1
    grep -A6 best_over_defaults "$out/tiles_step.txt" | head -40 ;;
  *) echo "h200_open_points.sh: the part is serving, hold, hold_ab, kernels, generate, switches or tiles, not '$part'" >&2
     exit 2 ;;
esac
