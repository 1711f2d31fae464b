"""What TIR's assertions (the host wrappers' argument checks) cost an export and a training step.

Exports MobileNetV2 0.35@64 (5 classes, batch 8, every layer trainable) for the local OpenCL
device (PoCL here) twice in one process: as the product builds it (``compile.BUILD_CONFIG``:
``tirx.disable_assert``) and with the checks (an empty configuration). Prints each export's
seconds, then the training step of both, alternated in 15 rounds of 5 steps on one fresh random
batch (ms per step: median and interquartile range), then the step check of both
(``export_check.check_export``: loss, every gradient and the update against PyTorch float64).

    OMP_NUM_THREADS=1 TVM_NUM_THREADS=1 python bench/experiments/host_asserts.py [OUT_DIR]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from thomas_tune import opencl
from thomas_tune.compiler import compile as C
from thomas_tune.compiler.export import export
from thomas_tune.export_check import check_export
from thomas_tune.models import build, init_params
from thomas_tune.runtime import Session

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/host-asserts"
model = build("mobilenet_v2", num_classes=5, resolution=64, width=0.35)
target = opencl.target_for(0)
product = dict(C.BUILD_CONFIG)
for name, config in (("without", product), ("with", {})):
    C.BUILD_CONFIG.clear()
    C.BUILD_CONFIG.update(config)
    t = time.time()
    export(os.path.join(out, name), model, init_params(model, seed=1), target, batch=8,
           trainable="all", progress=lambda *_: None, check_records=False)
    print(f"{name} checks: export {time.time() - t:.1f} s")
C.BUILD_CONFIG.clear()
C.BUILD_CONFIG.update(product)
rng = np.random.default_rng()
x = rng.standard_normal((8, 3, 64, 64)).astype("float32")
y = np.arange(8) % 5
sessions = {n: Session(os.path.join(out, n)).__enter__() for n in ("without", "with")}
for s in sessions.values():
    for _ in range(3):
        s.train_step(x, y)
times = {n: [] for n in sessions}
for _ in range(15):
    for n, s in sessions.items():
        t = time.perf_counter()
        for _ in range(5):
            s.train_step(x, y)
        times[n].append((time.perf_counter() - t) / 5 * 1e3)
for n, v in times.items():
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    print(f"{n} checks: {med:.2f} ms per step (IQR {q1:.2f}-{q3:.2f})")
for n in sessions:
    c = check_export(os.path.join(out, n), say=lambda *_: None)
    print(f"{n} checks: step check {c.line()}")
