"""The device probed over RPC: what its OpenCL driver reports, and what it measures.

:func:`probe` opens one session on a device server of a key and reads:

* the properties TVM's own OpenCL device API answers (``src/backend/opencl/runtime/
  opencl_device_api.cc``, ``OpenCLWorkspace::GetAttr``): device name, OpenCL version, driver
  version, ``CL_DEVICE_MAX_WORK_GROUP_SIZE``, ``CL_DEVICE_LOCAL_MEM_SIZE``,
  ``CL_DEVICE_GLOBAL_MEM_SIZE``, compute units, clock. That is all TVM's C++ server ``tvm_rpc``
  (a phone's) can tell; thomas_tune's own server (``thomas-tune rpc server``) also answers
  ``thomas_tune.opencl.device_info`` (pyopencl): the extension list and
  ``CL_DEVICE_MAX_MEM_ALLOC_SIZE``. Where the largest allocation is not readable, the profile
  holds the OpenCL specification's guaranteed minimum for a full-profile device,
  max(1/4 of ``CL_DEVICE_GLOBAL_MEM_SIZE``, 128 MiB) (OpenCL 3.0 API specification, table
  "OpenCL Device Queries", ``CL_DEVICE_MAX_MEM_ALLOC_SIZE``), and says so in ``sources``;
* ``cl_khr_fp16``: from the extension list where readable, else by building a kernel with
  half arithmetic: TVM's code generator guards it with ``#ifdef cl_khr_fp16`` (or
  ``cl_amd_fp16``) and an ``#error`` otherwise, and an OpenCL C compiler defines that macro
  exactly when the device has the extension (OpenCL C specification, "Extensions"), so the
  build fails exactly on a device without it;
* launch overhead (us per launch of a kernel of one work-item), bandwidth (GB/s: bytes read
  plus bytes written by a float32 copy kernel, divided by its time), float32 throughput
  (GFLOP/s: a kernel of independent multiply-add chains, 2 FLOPs each) and compile time per
  program (s: the first launch of a program that no cache can hold, less the median of its
  later launches, each timed from the client with a device sync).

Every kernel is written in TIR, compiled by TVM for the OpenCL target and linked for the
device's host as an export is (:func:`thomas_tune.target.export_shared`), uploaded and launched
through the server's own OpenCL runtime: TVM's in ``tvm_rpc``, the sidecar in thomas_tune's
server. The kernels take buffers only (no 64-bit scalars, which TVM's runtime cannot pack:
``GetArgConvertCode`` in ``src/runtime/pack_args.h``). Each probe draws a fresh constant
into the programs it times the compile of, so neither a driver's cache nor the sidecar's
binary cache can answer them.
"""

from __future__ import annotations

import datetime
import math
import os
import secrets
import statistics
import tempfile
import time

import numpy as np

PROFILE_FORMAT = "thomas_tune.device_profile/1"
PROFILE_FILE = "device_profile.json"  # beside a tuning log's device.json, and in an export
MIB = 1 << 20
#: CL_DEVICE_MAX_MEM_ALLOC_SIZE's guaranteed minimum for a full-profile device (OpenCL 3.0)
SPEC_ALLOC_SOURCE = ("OpenCL 3.0 spec minimum for a full profile: CL_DEVICE_MAX_MEM_ALLOC_SIZE >= "
                     "max(CL_DEVICE_GLOBAL_MEM_SIZE / 4, 128 MiB); not readable through this "
                     "server's runtime")
FMA_CHAINS = 8  # independent multiply-add chains per work-item
FMA_STEPS = 256  # multiply-adds per chain


def _kernels(threads: int, copy_n: int, fma_n: int, fresh: int, nonce: float):
    """The probe's PrimFuncs by name: ``tiny`` (1 work-item), ``copy`` (float32[copy_n] ->
    float32[copy_n]), ``fma`` (float32[fma_n] -> float32[fma_n], FMA_CHAINS x FMA_STEPS
    multiply-adds per element), ``fresh{i}`` for i < ``fresh`` (the fma body on 1 work-group,
    with constants drawn from ``nonce``). ``copy_n`` and ``fma_n`` are multiples of
    ``threads``."""
    from tvm.script import tirx as T

    def make_tiny():
        @T.prim_func
        def tiny(a: T.Buffer((1,), "float32")):
            T.func_attr({"tir.is_scheduled": True, "tir.noalias": True})
            T.launch_thread("blockIdx.x", 1)
            T.launch_thread("threadIdx.x", 1)
            a[0] = a[0] + T.float32(1)
        return tiny

    def make_copy(n):
        @T.prim_func
        def copy(a: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32")):
            T.func_attr({"tir.is_scheduled": True, "tir.noalias": True})
            bx = T.launch_thread("blockIdx.x", n // threads)
            tx = T.launch_thread("threadIdx.x", threads)
            b[bx * threads + tx] = a[bx * threads + tx]
        return copy

    def make_fma(n, mul, add):
        @T.prim_func
        def fma(a: T.Buffer((n,), "float32"), b: T.Buffer((n,), "float32")):
            T.func_attr({"tir.is_scheduled": True, "tir.noalias": True})
            bx = T.launch_thread("blockIdx.x", n // threads)
            tx = T.launch_thread("threadIdx.x", threads)
            acc = T.alloc_local((FMA_CHAINS,), "float32")
            for j in T.unroll(FMA_CHAINS):
                acc[j] = a[bx * threads + tx] + T.Cast("float32", j)
            for _k in range(FMA_STEPS):
                for j in T.unroll(FMA_CHAINS):
                    acc[j] = acc[j] * T.float32(mul) + T.float32(add)
            b[bx * threads + tx] = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + \
                acc[6] + acc[7]
        return fma

    funcs = {"tiny": make_tiny(), "copy": make_copy(copy_n),
             "fma": make_fma(fma_n, 0.999, 0.001)}
    for i in range(fresh):
        funcs[f"fresh{i}"] = make_fma(threads, 0.99 + nonce * 1e-3 + i * 1e-6, nonce)
    return {k: f.with_attr("global_symbol", k) for k, f in funcs.items()}


def _half_kernel():
    """A kernel with float16 arithmetic (b = a * a + a, float16[64])."""
    from tvm.script import tirx as T

    @T.prim_func
    def half(a: T.Buffer((64,), "float16"), b: T.Buffer((64,), "float16")):
        T.func_attr({"tir.is_scheduled": True, "tir.noalias": True, "global_symbol": "half"})
        T.launch_thread("blockIdx.x", 1)
        tx = T.launch_thread("threadIdx.x", 64)
        b[tx] = a[tx] * a[tx] + a[tx]
    return half


def _device_properties(sess, dev) -> tuple[dict, dict]:
    """(properties, sources): what TVM's device API and, where the server has it,
    ``thomas_tune.opencl.device_info`` answer; ``sources`` says where each came from."""
    import json

    from . import DEVICE_INFO_FUNC
    props, sources = {}, {}
    attrs = {"device_name": "device_name", "opencl_version": "compute_version",
             "driver_version": "driver_version", "max_work_group_size": "max_threads_per_block",
             "local_memory_bytes": "max_shared_memory_per_block",
             "global_memory_bytes": "total_global_memory",
             "compute_units": "multi_processor_count", "clock_khz": "max_clock_rate"}
    for name, attr in attrs.items():
        try:
            value = getattr(dev, attr)
        except Exception:  # an attribute this runtime does not answer
            value = None
        if value is not None:
            props[name] = value if isinstance(value, str) else int(value)
            sources[name] = f"TVM device API ({attr})"
    info = None
    try:
        info = json.loads(str(sess.get_function(DEVICE_INFO_FUNC)(props.get("device_name", ""))))
    except Exception:  # TVM's own tvm_rpc: no such function
        info = None
    if info and "error" not in info:
        extra = {"extensions": "extensions", "max_alloc_bytes": "max_mem_alloc_size",
                 "opencl_c_version": "opencl_c_version", "profile": "profile",
                 "platform": "platform"}
        for name, key in extra.items():
            if info.get(key) is not None:
                props[name] = info[key]
                sources[name] = f"OpenCL driver through {DEVICE_INFO_FUNC} ({key})"
    elif info and "error" in info:
        sources["device_info_error"] = info["error"]
    if "max_alloc_bytes" not in props and "global_memory_bytes" in props:
        props["max_alloc_bytes"] = max(props["global_memory_bytes"] // 4, 128 * MIB)
        sources["max_alloc_bytes"] = SPEC_ALLOC_SOURCE
    if "extensions" in props:
        props["fp16"] = "cl_khr_fp16" in str(props["extensions"]).split()
        sources["fp16"] = "cl_khr_fp16 in the extension list"
    return props, sources


def _link(funcs: dict, target, folder: str, name: str) -> str:
    """``funcs`` (name -> PrimFunc) compiled for ``target`` and linked for its host as an
    export is; returns the library's path."""
    import tvm

    from thomas_tune.target import export_shared
    lib = tvm.compile(tvm.IRModule(funcs), target=target)
    path = os.path.join(folder, name)
    export_shared(lib, path, target)
    return path


def _timed_call(f, args, dev) -> float:
    """Seconds of one call of ``f`` from this client to the end of the device's work."""
    t0 = time.perf_counter()
    f(*args)
    dev.sync()
    return time.perf_counter() - t0


def _fp16_by_build(sess, dev, target, folder: str) -> tuple[bool, str]:
    """Whether the device builds and runs a kernel with half arithmetic, and how it was told."""
    import tvm

    from thomas_tune.kernel_signature import native_half
    try:
        with native_half():  # the device's compiler, not half storage, must take it
            path = _link({"half": _half_kernel()}, target, folder, "probe_half.so")
        sess.upload(path)
        f = sess.load_module(os.path.basename(path))["half"]
        a = tvm.runtime.tensor(np.linspace(-2, 2, 64).astype("float16"), dev)
        b = tvm.runtime.tensor(np.zeros(64, "float16"), dev)
        f(a, b)
        ok = np.allclose(b.numpy().astype("float32"), (a.numpy() * a.numpy() + a.numpy())
                         .astype("float32"), rtol=1e-2, atol=1e-2)
        return bool(ok), "a kernel with half arithmetic built and " + \
            ("computed right" if ok else "computed wrong numbers")
    except Exception as err:  # the driver refuses the program: no cl_khr_fp16
        from thomas_tune.measure.runner import error_line
        return False, ("a kernel with half arithmetic did not build: the compiler defines neither "
                       f"cl_khr_fp16 nor cl_amd_fp16 ({error_line(err, 160)})")


def _check_fma(a: np.ndarray, got: np.ndarray) -> None:
    """Raise RuntimeError unless ``got`` is the ``fma`` kernel's result for ``a`` (float64
    reference, relative tolerance 1e-4): a kernel that skipped its work would look fast."""
    acc = a.astype("float64")[:, None] + np.arange(FMA_CHAINS)
    for _ in range(FMA_STEPS):
        acc = acc * np.float32(0.999) + np.float32(0.001)
    want = acc.sum(axis=1)
    if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
        raise RuntimeError("the probe's FMA kernel returned wrong values on the device "
                           f"(largest error {float(np.abs(got - want).max()):.3g})")


def _measure(sess, dev, target, props: dict, folder: str, programs: int,
             copy_mib: float) -> dict:
    """Launch overhead, bandwidth, float32 throughput and compile time (module docstring)."""
    import tvm
    threads = max(1, min(int(props.get("max_work_group_size", 64)), 256))
    units = max(1, int(props.get("compute_units", 1)))
    copy_bytes = min(int(copy_mib * MIB), int(props.get("max_alloc_bytes", 128 * MIB)) // 2)
    copy_n = max(threads, copy_bytes // 4 // threads * threads)
    fma_n = threads * units * 64
    nonce = 0.25 + secrets.randbelow(1 << 20) / float(1 << 22)  # in [0.25, 0.5)
    funcs = _kernels(threads, copy_n, fma_n, programs, nonce)
    sess.upload(_link(funcs, target, folder, "probe.so"))
    mod = sess.load_module("probe.so")
    rng = np.random.default_rng()
    tensors = {n: tvm.runtime.tensor(rng.uniform(0.5, 1.5, n).astype("float32"), dev)
               for n in {1, threads, copy_n, fma_n}}
    outs = {n: tvm.runtime.tensor(np.zeros(n, "float32"), dev) for n in {threads, copy_n, fma_n}}

    # compile first: every fresh program is launched here for the first time
    compile_s = []
    for i in range(programs):
        f = mod[f"fresh{i}"]
        args = (tensors[threads], outs[threads])
        first = _timed_call(f, args, dev)
        later = statistics.median(_timed_call(f, args, dev) for _ in range(3))
        compile_s.append(max(first - later, 0.0))

    def per_call(name, args, number):
        mod[name](*args)  # its program built before the timing
        dev.sync()
        timer = mod.time_evaluator(name, dev, number=number, repeat=3, min_repeat_ms=50)
        return min(timer(*args).results)

    launch = per_call("tiny", (tensors[1],), 100)
    copy = per_call("copy", (tensors[copy_n], outs[copy_n]), 1)
    if not np.array_equal(outs[copy_n].numpy(), tensors[copy_n].numpy()):
        raise RuntimeError("the probe's copy kernel returned wrong values on the device")
    fma = per_call("fma", (tensors[fma_n], outs[fma_n]), 1)
    _check_fma(tensors[fma_n].numpy()[:4096], outs[fma_n].numpy()[:4096])
    return {"launch_us": launch * 1e6,
            "copy_gb_s": 2 * 4 * copy_n / copy / 1e9, "copy_bytes": 4 * copy_n,
            "fma_gflop_s": 2 * FMA_CHAINS * FMA_STEPS * fma_n / fma / 1e9,
            "compile_s": statistics.median(compile_s), "compile_s_max": max(compile_s),
            "compile_s_each": compile_s, "programs": programs}


def probe(tracker: tuple[str, int], key: str, target, programs: int = 3,
          copy_mib: float = 64.0, wait_s: float = 60.0, session_timeout_s: int = 900) -> dict:
    """The device profile of a server of ``key`` on ``tracker`` (module docstring), in one
    session of at most ``session_timeout_s`` s, waiting up to ``wait_s`` s for a free server.

    ``target``: the OpenCL target whose kernels the device runs (its host: where the server
    runs, e.g. ``linux-aarch64``); ``programs``: fresh programs timed for the compile time;
    ``copy_mib``: MiB the copy kernel reads (capped at half the largest allocation).
    Returns a dict: ``format``, ``key``, ``measured_at`` (UTC, ISO 8601), ``server``
    (``thomas_tune`` or ``tvm``), ``properties`` (``device_name``, ``opencl_version``,
    ``max_work_group_size``, ``local_memory_bytes``, ``global_memory_bytes``,
    ``max_alloc_bytes``, ``fp16``, ... in bytes), ``sources`` (where each property came
    from), ``measured`` (``launch_us`` us per launch, ``copy_gb_s`` GB/s, ``fma_gflop_s``
    GFLOP/s, ``compile_s`` / ``compile_s_max`` s per program).
    Raises TimeoutError when no server of ``key`` is free, ValueError when the server has no
    OpenCL device or cannot run code linked for the target's host."""
    from thomas_tune.rpc import DEVICE_INFO_FUNC, request_session, wait_for_key
    wait_for_key(tracker, key, timeout=wait_s)
    sess = request_session(tracker, key, session_timeout_s)
    try:
        dev = sess.device(target.kind.name, 0)
        if not dev.exist:
            raise ValueError(f"the device server of key {key!r} has no {target.kind.name} "
                             "device: start it with an OpenCL runtime (tvm_rpc built with "
                             "USE_OPENCL=ON, or thomas-tune rpc server --target opencl)")
        props, sources = _device_properties(sess, dev)
        try:
            sess.get_function(DEVICE_INFO_FUNC)
            server = "thomas_tune"
        except Exception:
            server = "tvm"
        with tempfile.TemporaryDirectory(prefix="thomas-tune-probe-") as folder:
            measured = _measure(sess, dev, target, props, folder, programs, copy_mib)
            if "fp16" not in props:
                props["fp16"], sources["fp16"] = _fp16_by_build(sess, dev, target, folder)
    finally:
        del sess
    return {"format": PROFILE_FORMAT, "key": key, "server": server,
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "target": str(target.kind.name), "properties": props, "sources": sources,
            "measured": measured}


def check_profile(profile: dict, path: str = "device profile") -> dict:
    """``profile`` if it is a device profile (:func:`probe`) with finite, positive figures;
    raises ValueError naming ``path``, the field and the fix (probe again)."""
    if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path}: not a device profile of format {PROFILE_FORMAT!r}; write "
                         "one with thomas-tune rpc probe --tracker HOST:PORT --key KEY --out "
                         f"{PROFILE_FILE}")
    for group, names in (("properties", ("max_work_group_size", "local_memory_bytes",
                                         "global_memory_bytes", "max_alloc_bytes")),
                         ("measured", ("launch_us", "copy_gb_s", "fma_gflop_s", "compile_s"))):
        for name in names:
            value = profile.get(group, {}).get(name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{path}: {group}.{name} is {value!r}, expected a finite "
                                 "number >= 0; probe the device again (thomas-tune rpc probe)")
    return profile


def read_profile(path: str) -> dict:
    """The device profile in the JSON file ``path`` (:func:`check_profile`). Raises
    ValueError naming the file and the fix."""
    from ..files import read_json
    profile = read_json(path, f"device profile {path!r}: not readable as JSON ({{err}}); write "
                              "it with thomas-tune rpc probe ... --out FILE")
    return check_profile(profile, path)
