#!/usr/bin/env bash
# Build TVM's C++ RPC server tvm_rpc (apps/cpp_rpc) and the runtime libraries it loads, from a
# checkout of TVM's source with its submodules, for this machine or for an aarch64 device.
#
#   rpc/build_tvm_rpc.sh --src TVM_DIR --arch x86_64|aarch64|android-aarch64 [--out DIR] [-j N]
#
#   x86_64           the host's C/C++ compiler (cc, c++)
#   aarch64          aarch64-linux-gnu-gcc/g++ (apt-get install g++-aarch64-linux-gnu)
#   android-aarch64  the Android NDK's clang through its CMake toolchain file
#                    ($ANDROID_NDK_HOME; ANDROID_PLATFORM android-28, c++_shared)
#
# Writes DIR/tvm_rpc and DIR/lib/{libtvm_runtime.so,libtvm_runtime_opencl.so,
# libtvm_runtime_extra.so,libtvm_ffi.so} (DIR defaults to TVM_DIR/build-<arch>) and prints the
# ELF kind of each. Needs CMake 3.26 or newer (tvm-ffi's CMakeLists.txt); `pip install
# "cmake>=3.26"` brings one (4.4.5 in 2026-12, which builds it). The build takes 8-9 minutes
# per architecture on 2 idle cores, 14-23 on a busy 2-core machine. The build settings go into
# DIR/config.cmake: TVM's CMakeLists.txt includes that file before it defines its options, so a
# plain `set(USE_OPENCL OFF)` there hides `-DUSE_OPENCL=ON` given on the command line
# (tvm_option keeps a variable already set).
set -euo pipefail
src="" arch="" out="" jobs=2
usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --src) src="$2"; shift 2 ;;
    --arch) arch="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -j) jobs="$2"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "error: unknown option $1" >&2; usage ;;
  esac
done
[ -n "$src" ] && [ -n "$arch" ] || usage
src="$(cd "$src" && pwd)"
for f in CMakeLists.txt cmake/config.cmake apps/cpp_rpc/rpc_server.cc \
         3rdparty/tvm-ffi/CMakeLists.txt 3rdparty/tvm-ffi/3rdparty/dlpack/include/dlpack/dlpack.h \
         3rdparty/OpenCL-Headers/CL/cl.h; do
  [ -e "$src/$f" ] || {
    echo "error: $src/$f is missing: give a TVM checkout with its submodules" \
         "(git submodule update --init --recursive)" >&2; exit 2; }
done
out="${out:-$src/build-$arch}"

# CMake: tvm-ffi asks for 3.26 or newer
CMAKE="${CMAKE:-cmake}"
cmv="$("$CMAKE" --version | head -n 1 | awk '{print $3}')"
if [ "$(printf '%s\n3.26\n' "$cmv" | sort -V | head -n 1)" != "3.26" ]; then
  echo "error: $CMAKE is CMake $cmv; tvm-ffi needs 3.26 or newer: pip install 'cmake>=3.26'" \
       "and put it first on PATH (or set CMAKE=/path/to/cmake)" >&2
  exit 2
fi

cross=()
backtrace=ON
case "$arch" in
  x86_64) ;;
  aarch64)
    command -v aarch64-linux-gnu-g++ >/dev/null || {
      echo "error: aarch64-linux-gnu-g++ is missing: apt-get install g++-aarch64-linux-gnu" >&2
      exit 2; }
    cross=(-DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64
           -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++)
    # libbacktrace is built by autoconf with --host from the compiler's -dumpmachine; for a
    # cross compiler named by its triple that is aarch64-linux-gnu and it works, but it is
    # only for stack traces in error messages: left out of cross builds.
    backtrace=OFF ;;
  android-aarch64)
    [ -n "${ANDROID_NDK_HOME:-}" ] && [ -e "$ANDROID_NDK_HOME/build/cmake/android.toolchain.cmake" ] || {
      echo "error: ANDROID_NDK_HOME must name an Android NDK" >&2; exit 2; }
    cross=(-DCMAKE_TOOLCHAIN_FILE="$ANDROID_NDK_HOME/build/cmake/android.toolchain.cmake"
           -DANDROID_ABI=arm64-v8a -DANDROID_PLATFORM=android-28 -DANDROID_STL=c++_shared)
    # the NDK's clang is generic: its target triple is in CMAKE_C_COMPILER_TARGET, which
    # tvm-ffi's libbacktrace build (autoconf, CC=CMAKE_C_COMPILER) does not pass on
    backtrace=OFF ;;
  *) echo "error: --arch must be x86_64, aarch64 or android-aarch64, not $arch" >&2; exit 2 ;;
esac

mkdir -p "$out"
cp "$src/cmake/config.cmake" "$out/config.cmake"
cat >> "$out/config.cmake" <<EOF

# set by thomas_tune's rpc/build_tvm_rpc.sh: these lines come after the defaults above
set(USE_OPENCL ON)
set(USE_CPP_RPC ON)
set(USE_RPC ON)
set(USE_LLVM OFF)
set(USE_RANDOM ON)
set(USE_LIBBACKTRACE $backtrace)
set(TVM_FFI_USE_LIBBACKTRACE $backtrace)
set(TVM_FFI_BACKTRACE_ON_SEGFAULT $backtrace)
set(USE_GTEST OFF)
set(USE_CCACHE OFF)
EOF

t0=$SECONDS
"$CMAKE" -S "$src" -B "$out" -DCMAKE_BUILD_TYPE=Release "${cross[@]}" >"$out/configure.log" 2>&1 || {
  tail -n 40 "$out/configure.log" >&2; echo "error: configure failed: $out/configure.log" >&2; exit 1; }
t1=$SECONDS
"$CMAKE" --build "$out" --target tvm_rpc -j "$jobs" >"$out/build.log" 2>&1 || {
  tail -n 40 "$out/build.log" >&2; echo "error: build failed: $out/build.log" >&2; exit 1; }
t2=$SECONDS

# what the guide pushes: the server and every library it loads
missing=0
for f in tvm_rpc lib/libtvm_runtime.so lib/libtvm_runtime_opencl.so lib/libtvm_runtime_extra.so \
         lib/libtvm_ffi.so; do
  if [ -e "$out/$f" ]; then
    printf '%-32s %9d  %s\n' "$f" "$(stat -c %s "$out/$f")" \
      "$(file -b "$out/$f" | cut -d, -f1-2)"
  else
    echo "error: $out/$f was not built" >&2; missing=1
  fi
done
echo "configure $((t1 - t0)) s, build $((t2 - t1)) s ($arch, -j $jobs): $out"
[ "$missing" = 0 ] || exit 1
