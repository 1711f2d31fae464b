"""What TVM's OpenCL code generator costs an export, in one call or a few kernels at a time.

The generator writes, before each kernel, a prototype of every kernel of its module, so one
call over a module of n kernels takes time growing with n^2; ``opencl._chunked_build`` calls it
``opencl.CODEGEN_CHUNK`` kernels at a time. This script exports MobileNetV2 0.35@64 (5
classes, batch 8, every layer trainable) for the local OpenCL device (PoCL here), alternately
in one call (``CODEGEN_CHUNK`` past the kernel count) and in pieces of 40, ``ROUNDS`` times
each in one process, and prints each export's seconds and the generator's own seconds per
library (the OpenCL module of ``inference.so`` and ``train.so``).

    OMP_NUM_THREADS=1 TVM_NUM_THREADS=1 python bench/experiments/opencl_codegen_chunks.py
"""

from __future__ import annotations

import importlib
import statistics
import tempfile
import time

from thomas_tune import opencl
from thomas_tune.compiler.export import export
from thomas_tune.models import build, init_params

ROUNDS = 3
build_module = importlib.import_module("tvm.tirx.build")
codegen = build_module.codegen_build
spent: list[tuple[int, float]] = []


def timed_codegen(mod, target):
    t = time.perf_counter()
    out = codegen(mod, target)
    if target.kind.name == "opencl":
        spent.append((len(mod.functions), time.perf_counter() - t))
    return out


build_module.codegen_build = timed_codegen
model = build("mobilenet_v2", num_classes=5, resolution=64, width=0.35)
target = opencl.target_for(0)
times: dict[str, list[float]] = {"one call": [], "pieces of 40": []}
for _ in range(ROUNDS):
    for name, chunk in (("one call", 10 ** 6), ("pieces of 40", 40)):
        opencl.CODEGEN_CHUNK = chunk
        spent.clear()
        t = time.perf_counter()
        export(tempfile.mkdtemp(), model, init_params(model, seed=1), target, batch=8,
               trainable="all", progress=lambda *_: None, check_records=False)
        times[name].append(time.perf_counter() - t)
        gen = ", ".join(f"{n} kernels {s:.2f} s" for n, s in spent)
        print(f"{name}: export {times[name][-1]:.1f} s; OpenCL code generation: {gen}")
for name, ts in times.items():
    print(f"{name}: median export {statistics.median(ts):.1f} s over {ROUNDS}")
