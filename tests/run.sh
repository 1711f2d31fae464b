#!/usr/bin/env bash
# The README's test command: the whole suite (real tracker/servers on 127.0.0.1, real kernels),
# one pytest worker per core (pytest-xdist), each test file on one worker so that its
# module-scoped exports are built once; the costliest files first (tests/conftest.py).
set -uo pipefail
cd "$(dirname "$0")/.."
# One thread per worker for the CPU thread pools of the tests' own processes (PyTorch's OpenMP,
# TVM's CPU runtime): with one worker per core, pools of one thread per core in every worker
# oversubscribe the cores and slow both workers (docs/journal/suite.md). PoCL, the device
# under test, keeps its own threads.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TVM_NUM_THREADS="${TVM_NUM_THREADS:-1}"
python3 -m pytest -q -p no:cacheprovider -n auto --dist loadfile --no-loadscope-reorder \
  --durations=10 tests "$@"
rc=$?
# pytest's 5 means "no test collected": that is a failure here, not a pass.
exit $rc
