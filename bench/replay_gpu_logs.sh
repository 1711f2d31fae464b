#!/usr/bin/env bash
# Replay every committed GPU tuning log (tuning_logs/h100/<job>/ with records) with no device,
# as CI does: the model options come from the job's line in bench/gpu_jobs.txt, the target from
# bench/h100_opencl.json. Each log must compile the inference and training graphs for that
# target with its records, and its records must hold at least MIN_FLOPS (default 0.3) of the
# graphs' FLOPs. The jobs choose tasks by measured time (--time-share), so the FLOPs they cover
# are fewer than the time. No numbers are checked: the target does not run here.
#   bash bench/replay_gpu_logs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
found=0
while read -r name args; do
  log=tuning_logs/h100/$name
  [ -s "$log/database_tuning_record.json" ] || continue
  found=$((found + 1))
  # keep the options that say which graphs the log belongs to; drop the tuning options
  model_args=$(python3 - "$args" <<'PY'
import shlex, sys
words, keep, out = shlex.split(sys.argv[1]), {"--model", "--width", "--resolution", "--classes",
                                              "--batch", "--trainable"}, []
for opt, val in zip(words, words[1:]):
    if opt in keep:
        out += [opt, val]
print(" ".join(out))
PY
)
  echo "== $name: thomas-tune replay --log $log $model_args --target bench/h100_opencl.json"
  t0=$SECONDS
  if thomas-tune replay --log "$log" $model_args --target bench/h100_opencl.json --no-check \
      --min-flops-coverage "${MIN_FLOPS:-0.3}"; then
    echo "   replayed in $((SECONDS - t0)) s"
  else
    echo "   FAILED"; status=1
  fi
done < <(grep -v '^#' bench/gpu_jobs.txt | grep -v '^\s*$')
[ "$found" -gt 0 ] || { echo "no GPU tuning log with records under tuning_logs/h100/"; exit 1; }
exit $status
