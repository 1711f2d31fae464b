#!/usr/bin/env bash
# Fill .devcarry/ (ignored by git) with what the GPU machine of the device tool lacks, in carries
# that fit beside the work tree under the tool's 64 MiB: the pinned TVM wheel's tree in PART-sized
# parts, .devcarry/p1, p2, ... (each parked in /tmp there by 'tools/gpu_tune.sh park'), then
# .devcarry/last: the cp312 wheels, the OpenCL headers and the list of parts (every part is
# parked first; .devcarry/last rides beside the work tree).
#   bash tools/gpu_prepare.sh            -> .devcarry/p1 .. pN, .devcarry/last
# PART (default 24m, split -b): small enough that a part fits beside the work tree with its
# packed GPU tuning logs under the 64 MiB; a park call costs a few seconds.
# Then, with the device tool (one command each, from the repository root):
#   carry [.devcarry/p1]: bash tools/gpu_tune.sh park      (and so on for each pK)
#   carry [.devcarry/last]: bash tools/gpu_tune.sh start   (setup + tracker + servers + tuners)
#   no carry:             bash tools/gpu_tune.sh status       (progress; tuning logs -> $OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=$(python3 -c "import tvm, os; print(os.path.dirname(os.path.dirname(tvm.__file__)))")
rm -rf .devcarry/p[0-9]* .devcarry/last .devcarry/work/tvm.part.*
mkdir -p .devcarry/last .devcarry/work
if ! [ -s .devcarry/work/tvm.tar.xz ]; then
  (cd "$SITE" && tar --exclude=__pycache__ -cf - tvm apache_tvm-0.27.0.post1.dist-info) \
    | xz -6 -T0 > .devcarry/work/tvm.tar.xz
fi
split -b ${PART:-24m} .devcarry/work/tvm.tar.xz .devcarry/work/tvm.part.
(cd .devcarry/work && ls tvm.part.*) > .devcarry/last/tvm.parts
parts=($(cat .devcarry/last/tvm.parts))
for i in $(seq 1 ${#parts[@]}); do
  mkdir -p .devcarry/p$i && mv .devcarry/work/${parts[$((i - 1))]} .devcarry/p$i/
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .devcarry/last \
  apache-tvm-ffi==0.1.14.post0 xgboost-cpu==3.4.1 tornado==6.6.1 2>/dev/null
tar -C /usr/include -cJf .devcarry/last/cl-headers.tar.xz CL
du -sh .devcarry/p* .devcarry/last
