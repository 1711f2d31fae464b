#!/usr/bin/env bash
# Start a device server registered with a tracker.
# Usage: rpc/start_server.sh KEY [TRACKER_HOST:PORT] [TARGET]
exec thomas-tune rpc server --key "${1:?device key}" --tracker "${2:-127.0.0.1:9190}" --target "${3:-llvm}"
