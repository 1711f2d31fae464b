"""The device's peak FLOP/s and memory bandwidth, measured once per device and cached."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import numpy as np

from ..files import write_json_atomically

PEAKS_FILE = "peaks.json"


def device_description(target_kind: str, device) -> str:
    """A stable name of the device a target runs on: OpenCL device name and driver version, or
    the CPU model and thread count for ``llvm``. Used as the key of the peak cache."""
    if target_kind == "opencl":
        return f"opencl: {device.device_name} (driver {device.driver_version})"
    model = "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    threads = os.environ.get("TVM_NUM_THREADS") or str(os.cpu_count())
    return f"llvm: {model} x{threads} threads"


_FMA_CL = r"""
__kernel void tt_peak_fma(__global float* out, float a, float b, int iters) {
  float8 x0 = (float8)((float)get_global_id(0) * 1e-7f)
             + (float8)(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f) * 0.01f;
  float8 x1 = x0 + 0.1f, x2 = x0 + 0.2f, x3 = x0 + 0.3f, x4 = x0 + 0.4f, x5 = x0 + 0.5f,
         x6 = x0 + 0.6f, x7 = x0 + 0.7f;
  float8 va = (float8)(a), vb = (float8)(b);
  for (int k = 0; k < iters; ++k) {
    x0 = fma(x0, va, vb); x1 = fma(x1, va, vb); x2 = fma(x2, va, vb); x3 = fma(x3, va, vb);
    x4 = fma(x4, va, vb); x5 = fma(x5, va, vb); x6 = fma(x6, va, vb); x7 = fma(x7, va, vb);
    x0 = fma(x0, va, vb); x1 = fma(x1, va, vb); x2 = fma(x2, va, vb); x3 = fma(x3, va, vb);
    x4 = fma(x4, va, vb); x5 = fma(x5, va, vb); x6 = fma(x6, va, vb); x7 = fma(x7, va, vb);
  }
  float8 s = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7;
  out[get_global_id(0)] = s.s0 + s.s1 + s.s2 + s.s3 + s.s4 + s.s5 + s.s6 + s.s7;
}
__kernel void tt_peak_copy(__global const float4* src, __global float4* dst) {
  dst[get_global_id(0)] = src[get_global_id(0)];
}
"""


_FMA_PER_ITER = 16 * 8  # FMAs per work-item per loop iteration of tt_peak_fma (float8)


def _opencl_peak_module():
    """The two peak kernels as an "opencl" module, loaded by the sidecar (no compiler needed)."""
    import tvm_ffi
    from ..opencl import serialize

    def dt(code, bits):
        return SimpleNamespace(type_code=code, bits=bits, lanes=1)

    handle, f32, i32 = dt(3, 64), dt(2, 32), dt(0, 32)
    tags = ["blockIdx.x", "threadIdx.x"]
    fmap = {"tt_peak_fma": SimpleNamespace(name="tt_peak_fma", arg_types=[handle, f32, f32, i32],
                                           launch_param_tags=tags, arg_extra_tags=[0] * 4),
            "tt_peak_copy": SimpleNamespace(name="tt_peak_copy", arg_types=[handle, handle],
                                            launch_param_tags=tags, arg_extra_tags=[0] * 2)}
    loader = tvm_ffi.get_global_func("ffi.Module.load_from_bytes.opencl")
    return loader(serialize("cl", fmap, _FMA_CL))


def seconds_per_call(mod, name, dev, args, min_ms: float) -> float:
    """Seconds per call of ``mod[name](*args)``: best of 3 repeats of at least ``min_ms``."""
    mod[name](*args)
    dev.sync()
    res = mod.time_evaluator(name, dev, number=1, repeat=3,
                             min_repeat_ms=max(1, int(round(min_ms))))(*args)
    return float(min(res.results))


def _opencl_peaks(dev, min_ms: float) -> dict:
    import tvm
    mod = _opencl_peak_module()
    group = int(min(256, dev.max_threads_per_block))
    units = int(dev.multi_processor_count or 1)
    groups = max(64, units * 16)  # enough work-groups to fill every compute unit
    threads = groups * group
    out = tvm.runtime.tensor(np.zeros(threads, "float32"), dev)
    a, b = 0.999999, 1e-6
    iters = 64
    while True:  # grow the work until one launch takes >= 5 ms
        t = seconds_per_call(mod, "tt_peak_fma", dev, [out, a, b, iters, groups, group], min_ms)
        if t >= 5e-3 or iters >= 1 << 20:
            break
        iters *= 4 if t < 1e-3 else 2
    flops = 2.0 * _FMA_PER_ITER * iters * threads
    got = out.numpy()
    if not np.all(np.isfinite(got)):
        raise RuntimeError("peak FMA kernel produced non-finite values")
    max_alloc = 256 << 20
    n4 = max_alloc // 16  # float4 elements per buffer
    src = tvm.runtime.tensor(np.random.default_rng().standard_normal(n4 * 4, dtype="float32"),
                             dev)
    dst = tvm.runtime.tensor(np.empty(n4 * 4, "float32"), dev)
    tc = seconds_per_call(mod, "tt_peak_copy", dev, [src, dst, n4 // group, group], min_ms)
    if not np.array_equal(src.numpy()[:4096], dst.numpy()[:4096]):
        raise RuntimeError("peak copy kernel did not copy")
    return {"gflops": flops / t / 1e9, "gbytes_per_s": 2 * n4 * 16 / tc / 1e9,
            "method": f"OpenCL float8 fma() chains ({threads} work-items, {iters * _FMA_PER_ITER} "
                      f"FMA each, 2 FLOP per FMA); float4 copy of {n4 * 16 >> 20} MiB "
                      "(read + write bytes); device timer"}


def _runtime_module(exe):
    return exe.mod if hasattr(exe, "mod") and not hasattr(exe, "time_evaluator") else exe


def _llvm_peaks(target, dev, min_ms: float) -> dict:
    import tvm
    from tvm import te
    lanes, chains, depth = 16, 8, 32
    n = max(1, os.cpu_count() or 1) * 4096 * lanes
    a = te.placeholder((n,), name="a")

    def body(i):
        acc = None
        for c in range(chains):  # independent chains: the FMA units stay busy
            x = a[i] + float(c)
            for _ in range(depth):
                x = x * 0.999999 + 1e-6
            acc = x if acc is None else acc + x
        return acc

    out = te.compute((n,), body, name="out")
    # the peak of the processor, not of the target's instruction set: compile for this CPU
    try:
        cpu = tvm.target.codegen.llvm_get_system_cpu()
        host = tvm.target.Target({"kind": "llvm", "mcpu": cpu})
    except Exception:  # an LLVM without that query: the model's own target
        host = target
    sch = tvm.s_tir.Schedule(te.create_prim_func([a, out]))
    blk = sch.get_sblock("out") if hasattr(sch, "get_sblock") else sch.get_block("out")
    (i,) = sch.get_loops(blk)
    io, ii = sch.split(i, [None, lanes])
    sch.parallel(io)
    sch.vectorize(ii)
    fma = _runtime_module(tvm.compile(sch.mod, host))
    x = tvm.runtime.tensor(np.random.default_rng().random(n, dtype="float32"), dev)
    y = tvm.runtime.tensor(np.empty(n, "float32"), dev)
    reps = 1
    t = seconds_per_call(fma, "main", dev, [x, y], min_ms)
    flops = n * (chains * depth * 2 + chains) * reps
    m = 64 << 20 >> 2
    src = te.placeholder((m,), name="src")
    dst = te.compute((m,), lambda i: src[i], name="dst")
    sch = tvm.s_tir.Schedule(te.create_prim_func([src, dst]))
    blk = sch.get_sblock("dst") if hasattr(sch, "get_sblock") else sch.get_block("dst")
    (i,) = sch.get_loops(blk)
    io, ii = sch.split(i, [None, 64])
    sch.parallel(io)
    sch.vectorize(ii)
    cp = _runtime_module(tvm.compile(sch.mod, host))
    s = tvm.runtime.tensor(np.random.default_rng().standard_normal(m, dtype="float32"), dev)
    d = tvm.runtime.tensor(np.empty(m, "float32"), dev)
    tc = seconds_per_call(cp, "main", dev, [s, d], min_ms)
    return {"gflops": flops / t / 1e9, "gbytes_per_s": 2 * m * 4 / tc / 1e9,
            "method": f"TVM llvm kernel for {host.attrs.get('mcpu', 'this target')}: {chains} "
                      f"independent multiply-add chains of {depth} "
                      f"per element, {lanes}-lane vectors, all threads; copy of {m * 4 >> 20} "
                      "MiB (read + write bytes); host clock"}


def measure_peaks(target, dev, refresh: bool = False, min_ms: float = 20.0) -> dict:
    """The device's measured peak: ``{"device", "gflops" (GFLOP/s, fp32), "gbytes_per_s"
    (GB/s, 1e9 bytes, read + write of a copy), "method", "measured" (unix time), "cached"}``.

    Measured once per device (key: :func:`device_description`) and cached in
    ``<thomas_tune cache>/peaks.json`` (written atomically); ``refresh`` measures again. On
    OpenCL the kernels are OpenCL C of this module (independent ``fma()`` chains; a float4
    copy of 256 MiB) timed with device events; on ``llvm`` TVM-compiled multiply-add chains and
    a 64 MiB copy timed with the host clock. Raises RuntimeError if a kernel computes garbage.
    """
    kind = target.kind.name
    key = device_description(kind, dev)
    from ..opencl import cache_dir  # the project's cache folder
    path = os.path.join(cache_dir(), PEAKS_FILE)
    cache = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                cache = json.load(f)
        except (OSError, json.JSONDecodeError):
            cache = {}
    if key in cache and not refresh:
        return {**cache[key], "device": key, "cached": True}
    peaks = _opencl_peaks(dev, min_ms) if kind == "opencl" else _llvm_peaks(target, dev, min_ms)
    peaks["measured"] = time.time()
    cache[key] = peaks
    write_json_atomically(path, cache, sync=False)
    return {**peaks, "device": key, "cached": False}
