#!/usr/bin/env bash
# The README's test command: the whole suite (real tracker/servers on 127.0.0.1, real kernels).
set -uo pipefail
cd "$(dirname "$0")/.."
# Two worker processes (pytest-xdist), each test file on one worker so that its module
# fixtures (compiled exports, trackers) are built once: the compiles of one file overlap the
# device-server waits of another.
python3 -m pytest -q -p no:cacheprovider -n "${THOMAS_TUNE_TEST_WORKERS:-2}" --dist loadfile \
  --durations=10 tests "$@"
rc=$?
# pytest's 5 means "no test collected": that is a failure here, not a pass.
exit $rc
