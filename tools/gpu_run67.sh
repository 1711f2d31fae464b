#!/usr/bin/env bash
# One lease's issue-67 rows from exports made on the development machine (carried in
# .devcarry/x67/x67.tar.xz): the 1,024 MB budget beside the plain step, timed in one process
# with peaks; the loss-scaled mixed16 512 MB step's peak; then each float32 build checked.
# The carried exports: here, 'thomas-tune export --model mobilenet_v2 --trainable all --width 1.0
# --resolution 224 --classes 1000 --batch 32 --target targets/h100_opencl.json --any-codegen
# --no-check --log LOG --out DIR' (LOG: tuning_logs/h100/mobilenet_v2-w1-r224-c1000-b32
# unpacked) plain, with '--memory-budget 1024', and with '--precision mixed16 --loss-scale
# dynamic --memory-budget 512', into x67/mnv2-all, x67/mnv2-budget, x67/mnv2-scaled512; their
# params.npz and optim_state.npz (the same in all three) once in x67/shared; then
# 'tar -cJf .devcarry/x67/x67.tar.xz x67'. Calls: park .devcarry/p1 p3, park p2 last, then this
# script (carry .devcarry/last and .devcarry/x67) with setsid, and calls that wait for r67/all.done.
cd "$(dirname "$0")/.."
TT=/tmp/tt; R=$TT/r67; mkdir -p $R
G="bash tools/gpu_tune.sh"
cp bench/memory_budget.py $R/memory_budget.py
$G setup > $R/setup.out 2>&1 || { echo "setup failed" > $R/all.done; exit 3; }
tar -C $TT -xJf .devcarry/x67/x67.tar.xz || exit 4
for d in mnv2-all mnv2-budget mnv2-scaled512; do  # one copy of the shared tensors was carried
  for f in params.npz optim_state.npz; do [ -e $TT/x67/$d/$f ] || cp $TT/x67/shared/$f $TT/x67/$d/; done
done
date > $R/unpacked
$G py $R/memory_budget.py $TT/x67/mnv2-all $TT/x67/mnv2-budget --steps 20 \
  --out $R/budget1024.json > $R/budget.out 2>&1
$G py -c "import json; from thomas_tune.benchmark.exports import device_memory; \
json.dump(device_memory('$TT/x67/mnv2-scaled512'), open('$R/scaled512_peak.json', 'w'))" \
  > $R/scaled.out 2>&1
for row in mnv2-budget mnv2-all; do  # the budgeted build first
  $G py -c "from thomas_tune.export_check import check_export; c = check_export('$TT/x67/$row'); \
print(c.ok, c.line())" > $R/check_$row.out 2>&1
done
date > $R/all.done
