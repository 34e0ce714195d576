#!/usr/bin/env bash
# alternated A/B of TPOT on simulated engines: A = 892b1d2, B = main HEAD (56b7ccf)
export PATH=/work/main/.venv/bin:$PATH
py=/work/main/.venv/bin/python
flags=(--model tiny-dummy --simulate-step-ms 10 --concurrency 256 --num-prompts 512 --input-len 64 --output-len 512 --client-procs 2)
cd /work/notes/tpotab
i=${I0:-0}
for side in $SIDES; do
  i=$((i+1)); case $side in A) tree=/work/wt-a;; B) tree=/work/wt-b;; C) tree=/work/wt-c;; esac
  $py /work/main/bench/serving_cpu_bench.py "${flags[@]}" --code-tree $tree --out /work/notes/tpotab/$i$side.json > /work/notes/tpotab/$i$side.log 2>&1
done
echo done > /work/notes/tpotab/DONE
