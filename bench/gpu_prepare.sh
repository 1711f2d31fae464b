#!/usr/bin/env bash
# Fill .devcarry/ (ignored by git) with what the GPU machine of the device tool lacks, in three
# carries that fit beside the work tree under the tool's 64 MiB: parts 1 and 2 of the pinned
# TVM wheel's tree (parked in /tmp there by 'bench/gpu_tune.sh park'), then part 3 with the
# cp312 wheels, the OpenCL headers and the list of parts.
#   bash bench/gpu_prepare.sh            -> .devcarry/p1, .devcarry/p2, .devcarry/p3
# Then, with the device tool (one command each, from the repository root):
#   carry [.devcarry/p1]: bash bench/gpu_tune.sh park
#   carry [.devcarry/p2]: bash bench/gpu_tune.sh park
#   carry [.devcarry/p3]: bash bench/gpu_tune.sh start        (setup + tracker + servers + tuners)
#   no carry:             bash bench/gpu_tune.sh status       (progress; tuning logs -> $OUT)
# A later lease resumes from tuning_logs/ (the committed logs are carried in with the tree).
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=$(python3 -c "import tvm, os; print(os.path.dirname(os.path.dirname(tvm.__file__)))")
mkdir -p .devcarry/p1 .devcarry/p2 .devcarry/p3 .devcarry/work
if ! [ -s .devcarry/work/tvm.tar.xz ]; then
  (cd "$SITE" && tar --exclude=__pycache__ -cf - tvm apache_tvm-0.27.0.post1.dist-info) \
    | xz -6 -T0 > .devcarry/work/tvm.tar.xz
fi
rm -f .devcarry/p1/* .devcarry/p2/* .devcarry/p3/* .devcarry/work/tvm.part.*
split -b 24m .devcarry/work/tvm.tar.xz .devcarry/work/tvm.part.
(cd .devcarry/work && ls tvm.part.*) > .devcarry/p3/tvm.parts
mv .devcarry/work/tvm.part.aa .devcarry/p1/
mv .devcarry/work/tvm.part.ab .devcarry/p2/
mv .devcarry/work/tvm.part.ac .devcarry/p3/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .devcarry/p3 \
  apache-tvm-ffi==0.1.14.post0 xgboost-cpu==3.4.1 tornado==6.6.1 2>/dev/null
tar -C /usr/include -cJf .devcarry/p3/cl-headers.tar.xz CL
du -sh .devcarry/p1 .devcarry/p2 .devcarry/p3
