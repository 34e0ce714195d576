cd /work/main
export PATH=$PWD/.venv/bin:$PATH
for rr in a b; do for door in aio stream; do
  D=50051; RA="--frontends 2"; [ $door = stream ] && D=50052 && RA="$RA --grpc-stream-port 50052"
  d=/tmp/doorab/$door$rr
  ROUTER_ARGS="$RA" DOOR=$D BENCH_ARGS="--connections 8" ONLY="pd_hold pd_hold256" \
    WORKER_ARGS="--simulate-step-ms 10 --simulate-prefill-us-per-token 20" \
    timeout 300 bash bench/serving_path_gpu.sh $d tiny cpu 512 > $d.log 2>&1
  for f in $d/*.json; do python bench/itl_split.py $f > ${f%.json}.split.txt 2>&1; done
done; done
PYTHONPATH=$PWD/bench python bench/hold_summary.py /tmp/doorab > /tmp/doorab/summary.txt 2>&1
