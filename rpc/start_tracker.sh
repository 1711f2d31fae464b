#!/usr/bin/env bash
# Start TVM's RPC tracker. Usage: rpc/start_tracker.sh [HOST] [PORT]
exec thomas-tune rpc tracker --host "${1:-127.0.0.1}" --port "${2:-9190}"
