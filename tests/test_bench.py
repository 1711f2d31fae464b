"""The bench verb's pieces and the OpenCL program-binary cache, on PoCL and llvm.

Cache: a second process loading the same OpenCL module creates its program from the cached
binary and compiles no OpenCL C; a damaged cache file, or one the driver refuses, falls back to
a source build and is rewritten. Each load runs in a fresh process (as a second start does).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import te

from thomas_tune import opencl

needs_opencl = pytest.mark.skipif(not opencl.available(),
                                  reason="no OpenCL device (install pocl-opencl-icd)")

CHILD = r"""
import json, sys
import numpy as np, tvm
from thomas_tune import opencl
n, seed = int(sys.argv[2]), int(sys.argv[3])
x = np.random.default_rng(seed).standard_normal(n).astype("float32")
dev = tvm.opencl(0)
lib = tvm.runtime.load_module(sys.argv[1])
a = tvm.runtime.tensor(x, dev)
c = tvm.runtime.tensor(np.empty(n, "float32"), dev)
lib["main"](a, c)
err = float(np.max(np.abs(c.numpy() - (x * 3.0 + np.exp(x * 0.25)))))
print(json.dumps({"err": err, **opencl.stats()}))
"""


def _fnv1a(data: bytes, seed: int) -> int:
    h = (14695981039346656037 ^ ((seed * 0x9E3779B97F4A7C15) & (2**64 - 1)))
    for b in data:
        h = ((h ^ b) * 1099511628211) & (2**64 - 1)
    return h


@pytest.fixture(scope="module")
def kernel_library(tmp_path_factory):
    """An exported library with one OpenCL kernel (c = 3a + exp(a / 4), 4099 floats)."""
    from thomas_tune.schedules import default_gpu_schedules
    target = opencl.target_for(0)
    a = te.placeholder((4099,), name="a")
    c = te.compute(a.shape, lambda i: a[i] * 3.0 + te.exp(a[i] * 0.25), name="c")
    mod = default_gpu_schedules(tvm.IRModule({"main": te.create_prim_func([a, c])}), target)
    path = str(tmp_path_factory.mktemp("clbin") / "kernel.so")
    tvm.compile(mod, target).export_library(path)
    return path


def _start(library, cache, rng):
    env = dict(os.environ, THOMAS_TUNE_OPENCL_CACHE=str(cache))
    proc = subprocess.run([sys.executable, "-c", CHILD, library, "4099",
                           str(int(rng.integers(1 << 30)))],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["err"] < 1e-4, out  # the kernel computes the right numbers on every path
    assert out["launches"] == 1
    return out, proc.stderr


@needs_opencl
def test_second_start_builds_nothing(kernel_library, tmp_path, rng):
    cache = tmp_path / "cache"
    first, _ = _start(kernel_library, cache, rng)
    assert (first["source_builds"], first["binary_loads"], first["binary_writes"]) == (1, 0, 1)
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".clbin"  # no temporary file left behind
    second, _ = _start(kernel_library, cache, rng)
    assert (second["source_builds"], second["binary_loads"], second["binary_rejected"]) == \
        (0, 1, 0)


@needs_opencl
@pytest.mark.parametrize("damage", ["flip", "foreign"])
def test_damaged_cache_file_falls_back_to_source(kernel_library, tmp_path, rng, damage):
    cache = tmp_path / "cache"
    _start(kernel_library, cache, rng)
    (path,) = cache.iterdir()
    data = bytearray(path.read_bytes())
    if damage == "flip":  # a flipped bit in the binary: the checksum catches it
        data[len(data) // 2] ^= 0x10
    else:  # a well-formed file whose binary the driver cannot read
        junk = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
        data = bytearray(b"TTCLBIN1" + len(junk).to_bytes(8, "little")
                         + _fnv1a(junk, 0).to_bytes(8, "little") + junk)
    path.write_bytes(bytes(data))
    out, err = _start(kernel_library, cache, rng)
    assert (out["binary_rejected"], out["source_builds"], out["binary_writes"]) == (1, 1, 1)
    assert "not used" in err and str(path) in err
    again, _ = _start(kernel_library, cache, rng)  # the rewritten file is good again
    assert (again["binary_loads"], again["source_builds"]) == (1, 0)


@needs_opencl
def test_cache_off(kernel_library, tmp_path, rng):
    out, _ = _start(kernel_library, "off", rng)
    assert (out["source_builds"], out["binary_writes"], out["binary_loads"]) == (1, 0, 0)
