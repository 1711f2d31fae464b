#!/usr/bin/env bash
# An emulated aarch64 device: the pinned TVM's aarch64 runtime in an arm64 Debian root, run by
# qemu-user, serving as a TVM device server. It stands in for a phone's CPU in the tests.
#
#   rpc/aarch64_device.sh setup                      build the root once (cached); prints its path
#   rpc/aarch64_device.sh server --tracker H:P --key K [--duration S]
#                                                    a device server under emulation
#   rpc/aarch64_device.sh opencl-root                an arm64 root with Debian's arm64 PoCL
#                                                    for an aarch64 tvm_rpc (rpc/tvm_rpc_server.sh)
#
# Needs qemu-user and mmdebstrap (apt-get install qemu-user mmdebstrap) and pip on this machine;
# export libraries for it with TVM_NDK_CC=aarch64-linux-gnu-g++ (apt-get install
# g++-aarch64-linux-gnu) and --host linux-aarch64. The root is kept under
# ${THOMAS_TUNE_CACHE:-~/.cache/thomas_tune}/aarch64-device/, keyed by the versions it holds;
# each step is bounded in time.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${THOMAS_TUNE_CACHE:-$HOME/.cache/thomas_tune}/aarch64-device"
suite=bookworm                                  # python3.11: the cp311 wheels below
mirror="${THOMAS_TUNE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PY=python3; command -v "$PY" >/dev/null || PY=python
# the wheels: TVM and tvm-ffi as pinned by the project, the rest as installed here
wheels="$("$PY" - <<'PYEOF'
from importlib.metadata import version, PackageNotFoundError
pins = {"apache-tvm": "0.27.0.post1", "apache-tvm-ffi": "0.1.14.post0"}
for name in ("numpy", "ml_dtypes", "typing_extensions", "psutil"):
    try:
        pins[name] = version(name)
    except PackageNotFoundError:
        pins[name] = None
print(" ".join(f"{k}=={v}" if v else k for k, v in pins.items()))
PYEOF
)"
tag="$(printf '%s %s' "$suite" "$wheels" | sha256sum | cut -c1-12)"
root="$cache/root-$tag"

need() {
  for tool in "$@"; do
    command -v "$tool" >/dev/null || {
      echo "error: $tool is missing; apt-get install qemu-user mmdebstrap g++-aarch64-linux-gnu" >&2
      exit 2; }
  done
}

setup() {
  need qemu-aarch64 mmdebstrap
  if [ -e "$root/.complete" ]; then echo "$root"; return 0; fi
  mkdir -p "$cache"
  exec 9>"$cache/.lock"
  flock -w 1800 9 || { echo "error: $cache/.lock held for 30 minutes" >&2; exit 1; }
  if [ -e "$root/.complete" ]; then echo "$root"; return 0; fi
  local t0=$SECONDS tmp="$root.tmp.$$"
  rm -rf "$tmp"
  trap 'rm -rf "$tmp"' EXIT
  # the arm64 packages are unpacked only (no maintainer scripts): nothing runs arm64 code here
  timeout 900 mmdebstrap --quiet --variant=extract --arch=arm64 \
    --include=python3.11-minimal,libpython3.11-stdlib,libstdc++6 "$suite" "$tmp" "$mirror" >&2
  mkdir -p "$cache/wheels"
  # shellcheck disable=SC2086
  timeout 900 "$PY" -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 \
    --platform manylinux2014_aarch64 -d "$cache/wheels" $wheels >&2
  # unpack into the root's site folder; libtvm_compiler.so is left out (runtime only)
  "$PY" - "$cache/wheels" "$tmp/usr/local/lib/python3.11/dist-packages" $wheels <<'PYEOF' >&2
import glob, os, re, sys, zipfile
folder, site, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
for spec in specs:
    name, _, ver = spec.partition("==")
    stem = re.sub(r"[-.]", "_", name)
    found = sorted(glob.glob(os.path.join(folder, f"{stem}-{ver or '*'}-*aarch64*.whl"))
                   + glob.glob(os.path.join(folder, f"{stem}-{ver or '*'}-py3-none-any.whl")))
    if not found:
        sys.exit(f"error: no aarch64 wheel of {spec} in {folder}")
    with zipfile.ZipFile(found[-1]) as z:
        z.extractall(site, [n for n in z.namelist() if not n.endswith("libtvm_compiler.so")])
PYEOF
  # the root must run TVM's runtime under emulation before it is kept
  TVM_USE_RUNTIME_LIB=1 timeout 300 qemu-aarch64 -L "$tmp" "$tmp/usr/bin/python3.11" -c \
    "import tvm, numpy; assert tvm.__version__ == '0.27.0.post1', tvm.__version__" >&2
  touch "$tmp/.complete"
  rm -rf "$root"
  mv "$tmp" "$root"
  trap - EXIT
  echo "aarch64 device root ready in $((SECONDS - t0)) s: $root" >&2
  echo "$root"
}

# An arm64 root with an OpenCL device for TVM's C++ server tvm_rpc cross-built for aarch64
# (rpc/build_tvm_rpc.sh): libstdc++ and Debian's arm64 PoCL with its ICD loader (their
# dependencies come along: LLVM, clang and binutils, which PoCL uses to compile kernels).
# vendors/pocl.icd names the root's libpocl by its path on this machine: PoCL looks for its
# kernel library relative to its own file with faccessat, a call qemu-user does not map into
# the root. PoCL links each kernel by running a linker (clang's driver looks for one on this
# machine's file system and starts it as a process of this machine, outside the emulation):
# bin/ld runs this machine's aarch64 cross linker, found through COMPILER_PATH, with the
# folder of the cross compiler's libgcc (PoCL links -lgcc -lgcc_s; the root has no gcc).
# Prints the root's path.
opencl_root() {
  need qemu-aarch64 mmdebstrap aarch64-linux-gnu-ld
  local base="$cache/opencl-$suite"
  local r="$base/root"
  if [ -e "$base/.complete" ]; then echo "$r"; return 0; fi
  mkdir -p "$cache"
  exec 9>"$cache/.lock"
  flock -w 1800 9 || { echo "error: $cache/.lock held for 30 minutes" >&2; exit 1; }
  if [ -e "$base/.complete" ]; then echo "$r"; return 0; fi
  local t0=$SECONDS
  rm -rf "$base"
  mkdir -p "$base/vendors"
  timeout 900 mmdebstrap --quiet --variant=extract --arch=arm64 \
    --include=libstdc++6,pocl-opencl-icd,ocl-icd-libopencl1,ocl-icd-opencl-dev \
    "$suite" "$r" "$mirror" >&2
  local lib
  lib="$(cd "$r" && ls usr/lib/aarch64-linux-gnu/libpocl.so.* | head -n 1)"
  echo "$r/$lib" > "$base/vendors/pocl.icd"
  need aarch64-linux-gnu-gcc
  mkdir -p "$base/bin"
  printf '#!/bin/sh\nexec %s "$@" -L%s\n' "$(command -v aarch64-linux-gnu-ld)" \
    "$(dirname "$(aarch64-linux-gnu-gcc -print-libgcc-file-name)")" > "$base/bin/ld"
  chmod +x "$base/bin/ld"
  touch "$base/.complete"
  echo "arm64 OpenCL root ready in $((SECONDS - t0)) s: $r" >&2
  echo "$r"
}

case "${1:-}" in
  setup) setup ;;
  opencl-root) opencl_root ;;
  server)
    shift
    r="$(setup | tail -n 1)"
    export TVM_USE_RUNTIME_LIB=1
    exec qemu-aarch64 -L "$r" "$r/usr/bin/python3.11" "$here/device_server.py" "$@" ;;
  *) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
