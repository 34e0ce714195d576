#!/usr/bin/env bash
# A/B of the engine process's GIL switch interval on simulated engines with a host-held prefill launch
export PATH=/work/main/.venv/bin:$PATH
W="--simulate-step-ms 10 --simulate-prefill-us-per-token 25 --simulate-prefill-launch-ms 15"
i=${I0:-0}
for side in $SIDES; do
  i=$((i+1)); tree=/work/wt-a; [ $side = B ] && tree=/work/wt-b
  o=/work/notes/gilab/$i$side; rm -rf $o; mkdir -p /work/notes/gilab
  (cd $tree && ONLY="pd_hold pd_seeds" NUM=128 WORKER_ARGS="$W" timeout 900 bash bench/serving_path_gpu.sh $o tiny cpu 512 > $o.log 2>&1)
done
echo done > /work/notes/gilab/DONE
