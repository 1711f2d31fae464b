#!/usr/bin/env bash
# The README's test command: the whole suite (real tracker/servers on 127.0.0.1, real kernels),
# one pytest worker per core (pytest-xdist), each test file on one worker so that its
# module-scoped fixtures are made once, save the few files split by test; the costliest units
# first (tests/conftest.py); exports shared across tests and workers (tests/build_cache.py).
set -uo pipefail
cd "$(dirname "$0")/.."
# One thread per worker for the CPU thread pools of the tests' own processes (PyTorch's OpenMP,
# TVM's CPU runtime): with one worker per core, pools of one thread per core in every worker
# oversubscribe the cores and slow both workers (docs/journal/suite.md). PoCL, the device
# under test, keeps its own threads.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TVM_NUM_THREADS="${TVM_NUM_THREADS:-1}"
# The phone's own server for tests/test_tvm_rpc.py: TVM's C++ RPC server tvm_rpc with TVM's own
# OpenCL runtime, built by rpc/build_tvm_rpc.sh (docs/android.md). Where the variables name no
# build, the archives in ../shared/tvm_rpc/ are unpacked once per archive (by its checksum)
# under ~/.cache/thomas_tune/tvm_rpc; without them those tests skip (fail under
# THOMAS_TUNE_REQUIRE_TVM_RPC=1, as in CI).
unpack_tvm_rpc() {  # ARCH VARIABLE
  local archive="../shared/tvm_rpc/tvm_rpc-$1.tar.xz" dir sum
  [ -z "${!2:-}" ] && [ -f "$archive" ] || return 0
  sum=$(sha256sum "$archive" | cut -c1-16)
  dir="${XDG_CACHE_HOME:-$HOME/.cache}/thomas_tune/tvm_rpc/$1-$sum"
  if ! [ -x "$dir/tvm_rpc" ]; then
    rm -rf "$dir.tmp" && mkdir -p "$dir.tmp" && tar -C "$dir.tmp" -xJf "$archive" \
      && rm -rf "$dir" && mv "$dir.tmp" "$dir" || { echo "error: cannot unpack $archive" >&2; exit 2; }
  fi
  export "$2=$dir"
  echo "tvm_rpc ($1): $dir"
}
unpack_tvm_rpc x86_64 THOMAS_TUNE_TVM_RPC
unpack_tvm_rpc aarch64 THOMAS_TUNE_TVM_RPC_AARCH64
python3 -m pytest -q -p no:cacheprovider -n auto --dist loadgroup --no-loadscope-reorder \
  --durations=10 tests "$@"
rc=$?
# pytest's 5 means "no test collected": that is a failure here, not a pass.
exit $rc
