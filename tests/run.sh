#!/usr/bin/env bash
# The README's test command: the whole suite (real tracker/servers on 127.0.0.1, real kernels).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -q -p no:cacheprovider --durations=10 tests "$@"
rc=$?
# pytest's 5 means "no test collected": that is a failure here, not a pass.
exit $rc
