"""Libraries the product exports load side by side in one process without a word on stderr (no
``Warning:SystemLib symbol __tvm_ffi__library_bin get overriden``), and the demo's timing of
several training steps on the same batches."""

import subprocess
import sys
import time

from opencl_kernels import NEEDS_OPENCL

from thomas_tune.demo import time_side_by_side

# two OpenCL kernels built and exported as the tuner's builder does, then loaded and run here
LOAD_TWO = """
import numpy as np, tvm
from tvm import te
import thomas_tune
from thomas_tune.measure.builder import build_candidate, export_candidate
from thomas_tune.schedules import default_gpu_schedules
t = tvm.target.Target({"kind": "opencl"}, host={"kind": "llvm"})
libs = []
for k in (1.0, 2.0):
    a = te.placeholder((256,), name="a")
    c = te.compute((256,), lambda i: a[i] + k, name="c")
    mod = default_gpu_schedules(tvm.IRModule({"main": te.create_prim_func([a, c])}), t)
    libs.append(tvm.runtime.load_module(export_candidate(build_candidate(mod, t), t)))
dev = tvm.opencl(0)
x = np.random.default_rng(0).standard_normal(256).astype("float32")
for k, lib in zip((1.0, 2.0), libs):
    out = tvm.runtime.empty((256,), "float32", dev)
    lib["main"](tvm.runtime.tensor(x, dev), out)
    np.testing.assert_allclose(out.numpy(), x + k, rtol=1e-6)
print("ran both")
"""


@NEEDS_OPENCL
def test_two_exported_libraries_load_without_a_warning():
    proc = subprocess.run([sys.executable, "-c", LOAD_TWO], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ran both" in proc.stdout
    assert "SystemLib" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr


def test_steps_take_turns_and_report_their_own_medians():
    order = []

    def step_of(name, seconds):
        def step(x, y):
            order.append((name, x))
            time.sleep(seconds)
        return step

    batches = [(i, None) for i in range(4)]
    ms = time_side_by_side({"a": step_of("a", 0.002), "b": step_of("b", 0.02),
                            "c": step_of("c", 0.008)}, batches)
    # one untimed step each on the first batch, then every batch through all three, the first
    # of each batch rotated
    assert order[:3] == [("a", 0), ("b", 0), ("c", 0)]
    assert [n for n, _ in order[3:]] == list("abc" "bca" "cab" "abc")
    assert [x for _, x in order[3:]] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert 2 <= ms["a"] < ms["c"] < ms["b"] and ms["b"] >= 20
