#!/usr/bin/env bash
# Run a tvm_rpc built by rpc/build_tvm_rpc.sh on this machine, registered with a tracker.
#
#   rpc/tvm_rpc_server.sh --build DIR --tracker HOST:PORT --key KEY [--port P] [--work-dir D]
#
# DIR holds tvm_rpc and lib/ (the --out of rpc/build_tvm_rpc.sh). An x86-64 build runs as it
# is, with this machine's OpenCL (PoCL in the tests). An aarch64 build runs under qemu-user in
# an arm64 Debian root with Debian's arm64 PoCL (rpc/aarch64_device.sh opencl-root, built once
# and cached): TVM's OpenCL wrapper opens the root's libOpenCL.so, whose ICD file names the
# root's libpocl by its path on this machine (PoCL finds its kernel library next to itself,
# and qemu-user maps only some system calls into the root: faccessat is not one of them), and
# PoCL links its kernels with this machine's aarch64 cross linker (COMPILER_PATH).
#
# The server binds the first free port in [P, P+1) (default 9090), serves one session at a
# time, each in a forked process, and keeps its session files in D/.cache; a session that ends
# normally removes D. The default D is a new folder under ${TMPDIR:-/tmp} (tvm_rpc's own default,
# ./rpc of the folder it is started from, would be this project's rpc/ when started from its
# root); see docs/android.md for its session bounds.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="" tracker="" key="" port=9090 work_dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --tracker) tracker="$2"; shift 2 ;;
    --key) key="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --work-dir) work_dir="$2"; shift 2 ;;
    *) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
done
[ -n "$build" ] && [ -n "$tracker" ] && [ -n "$key" ] || {
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
build="$(cd "$build" && pwd)"
[ -x "$build/tvm_rpc" ] || { echo "error: $build/tvm_rpc is missing: run rpc/build_tvm_rpc.sh" >&2; exit 2; }
args=(server --host=127.0.0.1 "--port=$port" "--port-end=$((port + 1))" "--tracker=$tracker"
      "--key=$key")
[ -n "$work_dir" ] || work_dir="$(mktemp -d "${TMPDIR:-/tmp}/tvm_rpc-$key-XXXXXX")"
args+=("--work-dir=$work_dir")
machine="$(od -An -j18 -N2 -tu2 "$build/tvm_rpc" | tr -d ' ')"  # ELF e_machine
case "$machine" in
  62) LD_LIBRARY_PATH="$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$build/tvm_rpc" "${args[@]}" ;;
  183)
    root="$(bash "$here/aarch64_device.sh" opencl-root | tail -n 1)"
    exec qemu-aarch64 -L "$root" -E "LD_LIBRARY_PATH=$build/lib" \
      -E "OCL_ICD_VENDORS=$(dirname "$root")/vendors" -E "COMPILER_PATH=$(dirname "$root")/bin" \
      "$build/tvm_rpc" "${args[@]}" ;;
  *) echo "error: $build/tvm_rpc is neither x86-64 nor aarch64 (ELF machine $machine)" >&2; exit 2 ;;
esac
