#!/usr/bin/env bash
# CPU time and voluntary wake-ups of each thread of a running process over a window, from
# /proc/PID/task/*/{schedstat,status} (schedstat's run time is the scheduler's own, in ns,
# not tick-sampled). Used on a worker's gRPC process during bench/serving_cpu_bench.py:
#   bash bench/probes/thread_cpu.sh "$(pgrep -f 'deploy.cli consumer' | head -1)" 8
set -euo pipefail
pid=${1:?PID}; window=${2:-8}
snap() {
  for t in /proc/"$pid"/task/*; do
    echo "$(basename "$t") $(tr ' ' _ < "$t/comm") $(cut -d' ' -f1 "$t/schedstat")" \
         "$(awk '/^voluntary_ctxt/ {print $2}' "$t/status")"
  done | sort
}
a=$(mktemp); b=$(mktemp); trap 'rm -f "$a" "$b"' EXIT
snap > "$a"; sleep "$window"; snap > "$b"
join "$a" "$b" | awk -v w="$window" \
  '{printf "%-8s %-22s cpu_ms=%8.1f wakes/s=%7.1f\n", $1, $2, ($6-$3)/1e6, ($7-$4)/w}' \
  | sort -t= -k2 -nr
