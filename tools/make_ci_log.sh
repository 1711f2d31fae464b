#!/usr/bin/env bash
# Regenerate the committed tuning log that CI replays (tests/test_replay.py):
# MobileNetV2 width 0.35, 64x64, 10 classes, batch 8, all layers trainable, llvm target,
# measured on a loopback device server with key local-cpu. About 5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG=tuning_logs/local-cpu/mobilenet_v2-w0.35-r64-c10-b8
PORT=${PORT:-9290}
thomas-tune rpc tracker --port "$PORT" --duration 3600 & TRACKER=$!
# the tracker takes the first free port from $PORT on and prints it; this script needs $PORT itself
sleep 3
thomas-tune rpc server --tracker "127.0.0.1:$PORT" --key local-cpu --duration 3600 & SERVER=$!
trap 'kill $SERVER $TRACKER 2>/dev/null || true' EXIT
thomas-tune tune --model mobilenet_v2 --width 0.35 --resolution 64 --classes 10 --batch 8 \
    --target llvm --tracker "127.0.0.1:$PORT" --key local-cpu --flops-share 0.6 \
    --trials "${TRIALS:-520}" --trials-per-iter 2 --population 32 --log "$LOG"
thomas-tune replay --model mobilenet_v2 --width 0.35 --resolution 64 --classes 10 --batch 8 \
    --target llvm --log "$LOG" --min-flops-coverage 0 --min-time-coverage 0.5
