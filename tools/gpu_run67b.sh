#!/usr/bin/env bash
# One lease's issue-67 rows after tuning the mixed16 step: the half-storage graph's own
# workloads tuned into the committed MobileNetV2 1.0@224 log (starting from the float32 twins'
# records, 'tune --precision mixed16'), then, on this card, in one process each (the budget's
# row first, before the tuning):
#   mixed16 export (made here from the tuned log, records checked on this card) beside the
#     float32 one and PyTorch eager ('bench/memory_budget.py PLAIN MIXED16 --torch');
#   the 1,024 MB budget's export beside the float32 one, then its check;
#   AlexNet@224 all, its mixed16 workloads tuned too, float32 beside mixed16 and PyTorch eager
#     (exported here by 'rows'); last, the budget's export checked.
# Carried: .devcarry/x68/x68.tar.xz, exports made on the development machine ('thomas-tune
# export --model mobilenet_v2 --trainable all --width 1.0 --resolution 224 --classes 1000
# --batch 32 --target targets/h100_opencl.json --any-codegen --no-check --log LOG --out DIR',
# LOG the committed log unpacked; DIR x68/mnv2-all, and x68/mnv2-budget with '--memory-budget
# 1024'; their params.npz and optim_state.npz once in x68/shared), and .devcarry/last.
# Calls: 'park' with .devcarry/p1 p3; 'park' then this script with setsid, with p2 and last;
# 'tools/gpu_run67b.sh unpack' with .devcarry/x68 while it tunes (the rows wait for it); then
# calls that wait for $TT/r68/all.done.
# TUNE_S (default 300), TUNE_S_ALEX (120): seconds each tuning may run; TRIALS (default 2000).
cd "$(dirname "$0")/.."
if [ "${1:-}" = unpack ]; then  # a call carrying .devcarry/x68, while the tuning runs
  tar -C /tmp/tt -xJf .devcarry/x68/x68.tar.xz || exit 4
  for d in mnv2-all mnv2-budget; do  # one copy of the shared tensors was carried
    for f in params.npz optim_state.npz; do
      [ -e /tmp/tt/x68/$d/$f ] || cp /tmp/tt/x68/shared/$f /tmp/tt/x68/$d/; done
  done
  date > /tmp/tt/x68/unpacked; exit 0
fi
{  # read whole before it runs: later calls replace the work tree
TT=/tmp/tt; R=$TT/r68; mkdir -p $R
G="bash tools/gpu_tune.sh"
PY="python3 -P -m thomas_tune.cli"
LOG=$TT/logs/mobilenet_v2-w1-r224-c1000-b32
cp bench/memory_budget.py $R/memory_budget.py
$G setup > $R/setup.out 2>&1 || { echo "setup failed" > $R/all.done; exit 3; }
# tune_job JOB SECONDS: the job of tools/gpu_jobs.txt, stopped (its log flushed per record)
# after SECONDS at most
tune_job() {
  JOBS=$1 TRIALS=${TRIALS:-2000} WATCH=0 TUNE_ARGS="--trials-per-iter 16" $G start \
    > $R/start_${1%%:*}.out 2>&1
  ( sleep $2; pkill -TERM -f "thomas_tune.cli tune" ) &
  local watchdog=$!
  sleep 5; flock $TT/device.lock true  # the tuning job holds it until it ends
  kill $watchdog 2>/dev/null
  date > $R/tuned_${1%%:*}
}
C="--width 1.0 --resolution 224 --classes 1000 --batch 32 --target targets/h100_opencl.json"
for _ in $(seq 120); do [ -e $TT/x68/unpacked ] && break; sleep 5; done  # 'unpack' of a later call
$G py $R/memory_budget.py $TT/x68/mnv2-all $TT/x68/mnv2-budget --steps 20 \
  --out $R/budget1024.json > $R/budget.out 2>&1
date > $R/budget.done
tune_job mobilenet_v2-w1-r224-c1000-b32:mixed16 ${TUNE_S:-300}
cp $LOG/*.json $LOG/*.jsonl $R/ 2>/dev/null
$PY export --model mobilenet_v2 --trainable all $C --precision mixed16 --any-codegen \
  --log $LOG --out $TT/x68/mnv2-mixed16 > $R/export_mixed16.out 2>&1
$G py $R/memory_budget.py $TT/x68/mnv2-all $TT/x68/mnv2-mixed16 --steps 20 --torch \
  --out $R/mixed16.json > $R/mixed16.out 2>&1
date > $R/mnv2.done
tune_job alexnet-w1-r224-c1000-b32:mixed16 ${TUNE_S_ALEX:-120}
mkdir -p $R/alexnet_log && cp $TT/logs/alexnet-w1-r224-c1000-b32/*.json* $R/alexnet_log/ 2>/dev/null
ROWS="alexnet-all alexnet-all-mixed16" EXPORT_ONLY=1 $G rows-job > $R/alexnet_rows.out 2>&1
$G py $R/memory_budget.py $TT/rows/alexnet-all $TT/rows/alexnet-all-mixed16 --steps 20 --torch \
  --out $R/alexnet_mixed16.json > $R/alexnet.out 2>&1
date > $R/alexnet.done
$G py -c "from thomas_tune.export_check import check_export; c = check_export('$TT/x68/mnv2-budget'); \
print(c.ok, c.line())" > $R/check_budget.out 2>&1
date > $R/all.done
exit
}
