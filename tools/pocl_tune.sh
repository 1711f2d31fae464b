#!/usr/bin/env bash
# Tune the demo's training step on this machine's PoCL device for SECONDS (default 2100), the
# way the shipped log tuning_logs/pocl-x86_64/mobilenet_v2-w0.35-r64-c5-b8 was made: a loopback
# tracker and one device server (PoCL runs each kernel on every core, so a second server would
# time the first one's load), the job of tools/pocl_jobs.txt, then SIGINT (the log keeps every
# measured trial; the same command resumes it). Then pack the log before committing it:
#   bash tools/pocl_tune.sh [SECONDS] [LOG]   (LOG default /tmp/pocl-tune/log)
#   thomas-tune log pack LOG && cp LOG/* tuning_logs/pocl-x86_64/mobilenet_v2-w0.35-r64-c5-b8/
set -uo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-2100}
LOG=${2:-/tmp/pocl-tune/log}
WORK=$(dirname "$LOG")
mkdir -p "$WORK"
thomas-tune rpc tracker --port 9290 > "$WORK/tracker.out" 2>&1 &
tracker=$!
for _ in $(seq 60); do grep -aq "listening on" "$WORK/tracker.out" && break; sleep 1; done
PORT=$(grep -ao "listening on 127.0.0.1:[0-9]*" "$WORK/tracker.out" | tail -1 | cut -d: -f2)
thomas-tune rpc server --tracker 127.0.0.1:$PORT --key pocl-local --target opencl \
  --duration $((DUR + 600)) > "$WORK/server.out" 2>&1 &
server=$!
trap 'kill $server $tracker 2>/dev/null' EXIT
job=$(grep -v '^#' tools/pocl_jobs.txt | grep -v '^\s*$' | head -1 | cut -d' ' -f2-)
# the job's options, but measured on this machine's cores: build workers as many as they are
# shellcheck disable=SC2086
timeout -s INT "$DUR" thomas-tune tune $job --build-workers "$(nproc)" \
  --tracker 127.0.0.1:$PORT --key pocl-local --log "$LOG" --stats "$WORK/stats.json" \
  --trials 20000
echo "tune exited with $? after at most $DUR s; log in $LOG"
