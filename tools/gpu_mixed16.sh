#!/usr/bin/env bash
# One lease of the GPU machine for the half-storage (mixed16) rows: the mixed16 step's own
# workloads of AlexNet@224 and MobileNetV2 1.0@224 tuned into their committed H100 logs
# ('tune --precision mixed16', starting from the float32 twins' records), then, on this card:
#   AlexNet all, float32 and mixed16, exported here with the logs just tuned (records checked
#     on this card), timed in one process beside PyTorch eager ('bench/memory_budget.py PLAIN
#     MIXED16 --torch');
#   MobileNetV2 all mixed16, exported here, beside the carried float32 export and PyTorch eager;
#   step checks on this card ('export_check.check_export', PyTorch float64 on its CPUs) of the
#     carried float32 and 1,024 MB budget exports and of the AlexNet exports, one after
#     another beside the tuning (their PyTorch reference needs more memory than a 23 GB
#     machine has), never beside a timing (both take $TT/r68/timing.lock).
# Carried: .devcarry/x68/x68.tar.xz, exports made on the development machine ('thomas-tune
# export --model mobilenet_v2 --trainable all --width 1.0 --resolution 224 --classes 1000
# --batch 32 --target targets/h100_opencl.json --any-codegen --no-check --log LOG --out DIR',
# LOG the committed log unpacked; DIR x68/mnv2-all, and x68/mnv2-budget with '--memory-budget
# 1024'; their params.npz and optim_state.npz once in x68/shared), and .devcarry/last.
# Calls: 'tools/gpu_tune.sh park' with each .devcarry/pK that fits beside the work tree; 'park'
# then this script with setsid, with the last part and .devcarry/last; 'tools/gpu_mixed16.sh
# unpack' with .devcarry/x68 while it tunes (the MobileNetV2 rows and checks wait for it); then
# 'tools/gpu_mixed16.sh collect' calls until $TT/r68/all.done: each brings back $TT/r68 and
# the logs tuned so far as $OUT/r68.tgz.
# CARRIED=0: no carried exports (.devcarry/x68 is not unpacked; their checks are skipped).
# TUNE_S_ALEX (default 240), TUNE_S (240): seconds each tuning may run (TUNE_S=0: no MobileNetV2
# tuning and mixed16 row; TUNE_S_ALEX=0: the carried exports' checks only); TRIALS (default 2000).
# F32_MATCH=REGEX, F32_S (default 90): before AlexNet's rows, its float32 tasks whose names match
# REGEX tuned for F32_S seconds (the job 'alexnet-w1-r224-c1000-b32' with '--match REGEX');
# NO_TUNE=1: the rows and checks from the committed logs, no tuning; ALEX=0: no AlexNet
# tuning, rows or checks (MobileNetV2's part only); CHECKS (default "mnv2-budget mnv2-all"): the
# carried exports whose steps are checked; MNV2_ROWS=0:
# MobileNetV2's mixed16 tuning only, no rows. A job on a log of another code generation than
# the tree's is not started (gpu_tune.sh): carry the committed logs before a lease. CHECK16=0: no step
# check of AlexNet's mixed16 export (a tuned one's check weighs every element near a kink
# without the build's roundings: 335 s per batch on the H100's host, and says little).
cd "$(dirname "$0")/.."
if [ "${1:-}" = unpack ]; then  # a call carrying .devcarry/x68, while the tuning runs
  tar -C /tmp/tt -xJf .devcarry/x68/x68.tar.xz || exit 4
  for d in mnv2-all mnv2-budget; do  # one copy of the shared tensors was carried
    for f in params.npz optim_state.npz; do
      [ -e /tmp/tt/x68/$d/$f ] || cp /tmp/tt/x68/shared/$f /tmp/tt/x68/$d/; done
  done
  date > /tmp/tt/x68/unpacked; exit 0
fi
if [ "${1:-}" = collect ]; then  # each later call: wait up to WAIT s (default 500) for the
  # run to end, then bring back what it has made so far (the machine can be taken back
  # between calls, and /tmp/tt with it)
  for _ in $(seq $(( ${WAIT:-500} / 10 ))); do
    [ -e /tmp/tt/r68/all.done ] && [ -e /tmp/tt/r68/checks.done ] && break; sleep 10; done
  ls -la /tmp/tt/r68; tail -n 3 /tmp/tt/r68/*.out
  [ -n "${OUT:-}" ] && tar -C /tmp/tt -czf $OUT/r68.tgz --exclude='*.so' --exclude='*.npz' \
    --exclude='*.stale' r68 logs
  exit 0
fi
{  # read whole before it runs: later calls replace the work tree
TT=/tmp/tt; R=$TT/r68; mkdir -p $R
G="bash tools/gpu_tune.sh"
cp bench/memory_budget.py $R/memory_budget.py
$G setup > $R/setup.out 2>&1 || { echo "setup failed" > $R/all.done; exit 3; }
# NO_TUNE=1: MobileNetV2's committed log unpacked now (the work tree is replaced by later calls)
[ "${NO_TUNE:-0}" = 1 ] && $G committed-log mobilenet_v2-w1-r224-c1000-b32
# tune_job JOB SECONDS [OPTIONS]: the job of tools/gpu_jobs.txt, stopped (its log flushed per record)
# after SECONDS at most
tune_job() {
  JOBS=$1 TRIALS=${TRIALS:-2000} WATCH=0 TUNE_ARGS="--trials-per-iter 16 ${3:-}" $G start \
    > $R/start_${1//:/@}.out 2>&1
  ( sleep $2; pkill -TERM -f "thomas_tune.cli tune" ) &
  local watchdog=$!
  sleep 5; flock $TT/device.lock true  # the tuning job holds it until it ends
  kill $watchdog 2>/dev/null
  date > $R/tuned_${1//:/@}
}
# check DIR NAME: the step check of an export, its result line in $R/check_NAME.out
check() {
  flock $R/timing.lock $G py -c "from thomas_tune.export_check import check_export; c = check_export('$1', \
say=print); print(c.ok, c.line())" > $R/check_$2.out 2>&1
}
( if [ "${CARRIED:-1}" != 0 ]; then
    for _ in $(seq 180); do [ -e $TT/x68/unpacked ] && break; sleep 5; done
    for c in ${CHECKS:-mnv2-budget mnv2-all}; do check $TT/x68/$c $c; done
  fi
  if [ "${TUNE_S_ALEX:-240}" != 0 ] && [ "${ALEX:-1}" != 0 ]; then
    for _ in $(seq 360); do [ -e $R/alexnet_exported ] && break; sleep 5; done
    check $TT/rows/alexnet-all alexnet-all
    [ "${CHECK16:-1}" != 0 ] && check $TT/rows/alexnet-all-mixed16 alexnet-all-mixed16
  fi
  date > $R/checks.done ) &
[ "${TUNE_S_ALEX:-240}" = 0 ] && { date > $R/all.done; exit; }  # the carried exports' checks only
if [ "${ALEX:-1}" != 0 ]; then
  if [ "${NO_TUNE:-0}" != 1 ]; then
    tune_job alexnet-w1-r224-c1000-b32:mixed16 ${TUNE_S_ALEX:-240}
    [ -n "${F32_MATCH:-}" ] && tune_job alexnet-w1-r224-c1000-b32 ${F32_S:-90} "--match $F32_MATCH"
  fi
  mkdir -p $R/alexnet_log && cp $TT/logs/alexnet-w1-r224-c1000-b32/*.json $R/alexnet_log/ 2>/dev/null
  ROWS="alexnet-all alexnet-all-mixed16" EXPORT_ONLY=1 $G rows-job > $R/alexnet_rows.out 2>&1
  cp $TT/rows/*.export.out $R/ 2>/dev/null
  date > $R/alexnet_exported
  flock $R/timing.lock $G py $R/memory_budget.py $TT/rows/alexnet-all $TT/rows/alexnet-all-mixed16 --steps 20 --torch \
    --out $R/alexnet_mixed16.json > $R/alexnet.out 2>&1
  date > $R/alexnet.done
fi
[ "${TUNE_S:-240}" = 0 ] && { date > $R/all.done; exit; }  # AlexNet's rows and the checks only
[ "${NO_TUNE:-0}" != 1 ] && tune_job mobilenet_v2-w1-r224-c1000-b32:mixed16 ${TUNE_S:-240}
mkdir -p $R/mnv2_log && cp $TT/logs/mobilenet_v2-w1-r224-c1000-b32/*.json $R/mnv2_log/ 2>/dev/null
[ "${MNV2_ROWS:-1}" = 0 ] && { date > $R/all.done; exit; }  # MobileNetV2's tuning only
C="--width 1.0 --resolution 224 --classes 1000 --batch 32 --target targets/h100_opencl.json"
# in gpu_tune.sh's environment (the installed copy under $TT/site), as the tuning and checks
$G py -m thomas_tune.cli export --model mobilenet_v2 --trainable all $C --precision mixed16 --any-codegen \
  --log $TT/logs/mobilenet_v2-w1-r224-c1000-b32 --out $TT/x68/mnv2-mixed16 \
  > $R/export_mixed16.out 2>&1
for _ in $(seq 120); do [ -e $TT/x68/unpacked ] && break; sleep 5; done
flock $R/timing.lock $G py $R/memory_budget.py $TT/x68/mnv2-all $TT/x68/mnv2-mixed16 --steps 20 --torch \
  --out $R/mixed16.json > $R/mixed16.out 2>&1
date > $R/mnv2.done
[ "${CHECK16:-1}" != 0 ] && check $TT/x68/mnv2-mixed16 mnv2-mixed16
date > $R/all.done
exit
}
