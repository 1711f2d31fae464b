#!/usr/bin/env bash
# TVM's C++ RPC server (tvm_rpc) on an Android phone over adb: push, start, stop, status.
#
#   rpc/android_server.sh push   --build TVM_BUILD_DIR --ndk ANDROID_NDK
#   rpc/android_server.sh start  [--key galaxy-s8] [--tracker-port 9190] [--port 9090]
#   rpc/android_server.sh status
#   rpc/android_server.sh stop   [--tracker-port 9190] [--port 9090]   (the ports of start)
#
# Common options: --serial SERIAL (adb -s, for more than one phone), --dir DIR (the folder on
# the phone, default /data/local/tmp/tvm). ADB names the adb binary (default: adb).
#
# push copies tvm_rpc and the runtime libraries of a TVM build made with the Android NDK's
# CMake toolchain (rpc/build_tvm_rpc.sh --arch android-aarch64: tvm_rpc, lib/libtvm_runtime.so,
# libtvm_ffi.so, libtvm_runtime_opencl.so, libtvm_runtime_extra.so) and the NDK's
# libc++_shared.so for arm64-v8a. start makes the tracker on this machine reachable from the
# phone at 127.0.0.1 (adb reverse), the server's port reachable from here (adb forward), and
# starts tvm_rpc in the background; its output goes to DIR/tvm_rpc.log. Steps follow TVM's
# apps/cpp_rpc/README.md and the adb lines of TVM's former tests/scripts/setup-adreno-env.sh.
# Nothing here is run by the tests: no phone, no adb, no NDK on CI (docs/android.md).
set -euo pipefail

ADB=${ADB:-adb}
SERIAL="" DIR=/data/local/tmp/tvm BUILD="" NDK="${ANDROID_NDK_HOME:-${ANDROID_NDK:-}}"
KEY=galaxy-s8 TRACKER_PORT=9190 PORT=9090 HOST=127.0.0.1

die() { echo "android_server.sh: $*" >&2; exit 2; }
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

[ $# -ge 1 ] || usage 2
VERB=$1; shift
case $VERB in -h|--help|help) usage 0 ;; esac
while [ $# -gt 0 ]; do
  case $1 in
    --serial) SERIAL=$2; shift 2 ;;
    --dir) DIR=$2; shift 2 ;;
    --build) BUILD=$2; shift 2 ;;
    --ndk) NDK=$2; shift 2 ;;
    --key) KEY=$2; shift 2 ;;
    --tracker-port) TRACKER_PORT=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --host) HOST=$2; shift 2 ;;
    -h|--help) usage 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
for n in TRACKER_PORT PORT; do
  [[ ${!n} =~ ^[0-9]+$ ]] || die "--$(echo "$n" | tr 'A-Z_' 'a-z-') ${!n}: expected a port number"
done

adb_() { if [ -n "$SERIAL" ]; then "$ADB" -s "$SERIAL" "$@"; else "$ADB" "$@"; fi; }

need_phone() {
  command -v "$ADB" >/dev/null || die "$ADB not found: install the Android platform tools (adb)"
  local state
  state=$(adb_ get-state 2>&1) || die "no phone reachable with adb ($state): plug it in, allow USB debugging, or give --serial (adb devices lists them)"
  [ "$state" = device ] || die "the phone is in state '$state', not 'device'"
}

is_aarch64_elf() {  # ELF magic, then e_machine 183 (0xb7, little-endian) at byte 18
  [ "$(head -c 4 "$1" | od -An -c | tr -d ' ')" = "177ELF" ] &&
    [ "$(od -An -tu2 -j18 -N2 "$1" | tr -d ' ')" = 183 ]
}

files_to_push() {
  [ -n "$BUILD" ] || die "push needs --build: the build folder of rpc/build_tvm_rpc.sh --arch android-aarch64 (docs/android.md)"
  local f lib=$BUILD/lib
  [ -d "$lib" ] || lib=$BUILD
  for f in "$BUILD/tvm_rpc" "$lib/libtvm_runtime.so" "$lib/libtvm_ffi.so" "$lib/libtvm_runtime_opencl.so"; do
    [ -f "$f" ] || die "$f is missing: build it with rpc/build_tvm_rpc.sh --arch android-aarch64 (docs/android.md)"
    is_aarch64_elf "$f" || die "$f is not an aarch64 ELF file: build with rpc/build_tvm_rpc.sh --arch android-aarch64"
    echo "$f"
  done
  if [ -f "$lib/libtvm_runtime_extra.so" ]; then
    is_aarch64_elf "$lib/libtvm_runtime_extra.so" || die "$lib/libtvm_runtime_extra.so is not an aarch64 ELF file"
    echo "$lib/libtvm_runtime_extra.so"  # tvm.contrib.random (the tuner's input filling)
  else
    echo "android_server.sh: warning: $lib/libtvm_runtime_extra.so missing: tuning needs tvm.contrib.random.random_fill_for_measure from it" >&2
  fi
  [ -n "$NDK" ] || die "push needs --ndk (or ANDROID_NDK_HOME): libc++_shared.so comes from the NDK"
  f=$(find "$NDK/toolchains/llvm/prebuilt" -path '*aarch64-linux-android/libc++_shared.so' 2>/dev/null | head -n 1)
  [ -n "$f" ] || die "no aarch64 libc++_shared.so under $NDK/toolchains/llvm/prebuilt"
  echo "$f"
}

case $VERB in
  push)
    files=$(files_to_push)
    need_phone
    adb_ shell "mkdir -p '$DIR'"
    while IFS= read -r f; do adb_ push "$f" "$DIR/" >/dev/null; echo "pushed $(basename "$f")"; done <<< "$files"
    adb_ shell "chmod 755 '$DIR/tvm_rpc'"
    echo "on the phone in $DIR; next: rpc/android_server.sh start --key $KEY"
    ;;
  start)
    need_phone
    adb_ shell "test -x '$DIR/tvm_rpc'" || die "$DIR/tvm_rpc is not on the phone: run push first"
    if adb_ shell "test -f '$DIR/tvm_rpc.pid' && kill -0 \$(cat '$DIR/tvm_rpc.pid') 2>/dev/null"; then
      die "tvm_rpc is already running on the phone (stop it first)"
    fi
    if command -v python3 >/dev/null && python3 -c "import thomas_tune" 2>/dev/null; then
      python3 -c "import sys; from thomas_tune.rpc import probe_tracker
try: probe_tracker(('127.0.0.1', $TRACKER_PORT))
except ConnectionError as err: sys.exit(f'android_server.sh: {err}')" || exit 1
    fi
    # the phone reaches the tracker here at 127.0.0.1:TRACKER_PORT; the tracker hands out
    # 127.0.0.1:PORT (--custom-addr), which this machine reaches through the forward
    adb_ reverse "tcp:$TRACKER_PORT" "tcp:$TRACKER_PORT" >/dev/null
    adb_ forward "tcp:$PORT" "tcp:$PORT" >/dev/null
    adb_ shell "cd '$DIR' && LD_LIBRARY_PATH='$DIR' nohup ./tvm_rpc server --host=$HOST \
      --port=$PORT --port-end=$((PORT + 1)) --tracker=127.0.0.1:$TRACKER_PORT --key=$KEY \
      --custom-addr=127.0.0.1 > '$DIR/tvm_rpc.log' 2>&1 < /dev/null & echo \$! > '$DIR/tvm_rpc.pid'"
    echo "tvm_rpc started on the phone (key $KEY, port $PORT; log $DIR/tvm_rpc.log)"
    if command -v python3 >/dev/null && python3 -c "import thomas_tune" 2>/dev/null; then
      python3 - "$TRACKER_PORT" "$KEY" <<'EOF' || exit 1
import sys
from thomas_tune.rpc import wait_for_key
port, key = int(sys.argv[1]), sys.argv[2]
try:
    wait_for_key(("127.0.0.1", port), key, timeout=30)
except TimeoutError as err:
    sys.exit(f"android_server.sh: {err}; see the phone's log (status)")
print(f"registered with the tracker at 127.0.0.1:{port} under {key!r}")
EOF
    fi
    ;;
  stop)
    need_phone
    adb_ shell "test -f '$DIR/tvm_rpc.pid' && kill \$(cat '$DIR/tvm_rpc.pid') 2>/dev/null; rm -f '$DIR/tvm_rpc.pid'" || true
    adb_ forward --remove "tcp:$PORT" 2>/dev/null || true
    adb_ reverse --remove "tcp:$TRACKER_PORT" 2>/dev/null || true
    echo "stopped tvm_rpc on the phone; removed the port forwards"
    ;;
  status)
    need_phone
    for p in ro.product.model ro.board.platform ro.hardware ro.product.board; do
      echo "$p=$(adb_ shell getprop "$p" | tr -d '\r')"
    done
    platform=$(adb_ shell getprop ro.board.platform | tr -d '\r')
    hardware=$(adb_ shell getprop ro.hardware | tr -d '\r')
    case "$platform $hardware" in
      *msm8998*) echo "SoC: Snapdragon 835 (GPU Adreno 540)" ;;
      *8895*) echo "SoC: Exynos 8895 (GPU Mali-G71)" ;;
      *) echo "SoC: not one this script knows; the OpenCL device name (--target opencl:remote) tells" ;;
    esac
    if adb_ shell "test -f '$DIR/tvm_rpc.pid' && kill -0 \$(cat '$DIR/tvm_rpc.pid') 2>/dev/null"; then
      echo "tvm_rpc: running (pid $(adb_ shell cat "$DIR/tvm_rpc.pid" | tr -d '\r'))"
    else
      echo "tvm_rpc: not running"
    fi
    adb_ shell "test -f '$DIR/tvm_rpc.log' && tail -n 5 '$DIR/tvm_rpc.log'" || true
    adb_ forward --list; adb_ reverse --list
    ;;
  *) die "unknown verb $VERB: push, start, stop or status" ;;
esac
