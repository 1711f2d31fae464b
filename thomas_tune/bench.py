"""``thomas-tune bench``: one model, one device, side by side in one run.

Variants: the model compiled (a) with a tuning log ("tuned"), (b) with default schedules
("default"), (c) PyTorch eager on the same device class ("torch": CUDA when
``torch.cuda.is_available()``, else the CPU; skipped when torch is not installed). For each:
ms per training step and per inference pass (median wall time over ``steps`` runs on fresh
random inputs, after warm-up), images/s, and the share of the device's measured peak FLOP/s and
bandwidth. For the compiled variants also:

- kernels: every kernel (PrimFunc) of the training step timed alone with ``time_evaluator``
  (device timer on OpenCL) on random inputs of its shapes; calls per step; GFLOP/s; whether
  the tuning log has a record for its workload. Their sum x calls against the measured step
  shows the overhead between kernels. Kernel launches per step are counted by the OpenCL
  sidecar.
- start-up: a fresh process loads the export and runs one training step, twice: with an empty
  OpenCL program-binary cache (first start: programs built from source) and with the cache the
  first start wrote (second start). That process imports TVM's runtime library only
  (``TVM_USE_RUNTIME_LIB=1``), as a deployed export runs.

The tuning curve (estimated kernel time of a training step against trials) replays the tuning
log's records in file order: a workload's time is its default-schedule time (measured here)
until a record beats it, x its calls per step. Peaks are measured once per device with kernels
of this module (:func:`measure_peaks`) and cached in ``<cache>/peaks.json``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

PEAKS_FILE = "peaks.json"
GRAPH_MARKER = "bench_graph_key"  # in a bench export folder: structural hash of its graph


# ---- devices and peaks ---------------------------------------------------------------------------
def _cache_dir() -> str:
    from .opencl import _cache_dir as base
    return base()


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
  float8 x0 = (float8)((float)get_global_id(0) * 1e-7f) + (float8)(0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f) * 0.01f;
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
    from .opencl import serialize

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


def _time(mod, name, dev, args, min_ms: float) -> float:
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
        t = _time(mod, "tt_peak_fma", dev, [out, a, b, iters, groups, group], min_ms)
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
    tc = _time(mod, "tt_peak_copy", dev, [src, dst, n4 // group, group], min_ms)
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
    t = _time(fma, "main", dev, [x, y], min_ms)
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
    tc = _time(cp, "main", dev, [s, d], min_ms)
    return {"gflops": flops / t / 1e9, "gbytes_per_s": 2 * m * 4 / tc / 1e9,
            "method": f"TVM llvm kernel for {host.attrs.get('mcpu', 'this target')}: {chains} independent multiply-add chains of {depth} "
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
    path = os.path.join(_cache_dir(), PEAKS_FILE)
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
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        json.dump(cache, f, indent=1)
    os.replace(tmp, path)
    return {**peaks, "device": key, "cached": False}


# ---- the kernels of a training step ------------------------------------------------------------
@dataclass
class Kernel:
    """One PrimFunc of the training step: ``calls`` per step, FLOPs per call (TVM's estimate,
    multiply-adds count 2), ``bytes`` of its arguments per call (a lower bound of its memory
    traffic), the workload key (:func:`thomas_tune.tasks.key`), its argument shapes."""

    name: str
    calls: int
    flops: float
    bytes: int
    key: str
    args: list = field(default_factory=list)  # (shape, dtype) per parameter
    tuned: bool = False
    ms: dict = field(default_factory=dict)  # variant -> ms per call
    mod: object = field(default=None, repr=False)  # the workload (IRModule with "main")


def exported_training_module(model, tg):
    """The Relax module that :func:`thomas_tune.export.export` compiles into ``train.so`` for
    the training graph ``tg`` (``graph.training_module``): kernel names in the library come from
    fusing exactly this module."""
    from . import export as E
    from .models import spec
    shapes = {p.name: p.shape for p in spec(model).params}
    return E._with_step_functions(tg.mod, [shapes[n] for n in tg.trainable], tg.optim_state,
                                  list(tg.masks.values()))


def step_kernels(train_mod, winograd=None) -> list[Kernel]:
    """The kernels of one training step (``draw_masks`` where the module has it, then
    ``train_adjoint`` and ``optimizer``) of an unfused Relax training module
    (``graph.training_module(...).mod``, or :func:`exported_training_module`), fused as the
    build fuses it (``winograd``: the convolutions it computes in the Winograd form, as
    :func:`thomas_tune.build.winograd_choice` gives them); sorted by FLOPs per step, largest
    first."""
    import tvm
    from tvm.s_tir.analysis import estimate_tir_flops
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from .graph import ADJOINT, OPTIMIZER
    from .manifest import DRAW_MASKS
    from .tasks import callees, fuse, workload_key
    mod = fuse(train_mod, winograd)
    calls: dict[str, int] = {}
    names = {gv.name_hint for gv in mod.functions}
    for fname in (DRAW_MASKS, ADJOINT, OPTIMIZER):
        if fname not in names:
            continue
        for k, v in callees(mod[fname]).items():
            calls[k] = calls.get(k, 0) + v
    out = []
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc) or gv.name_hint not in calls:
            continue
        wmod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        try:
            flops = float(estimate_tir_flops(wmod))
        except Exception:  # int64 index math has no estimate: counted as 0
            flops = 0.0
        args, nbytes = [], 0
        for info in ArgInfo.from_prim_func(func):
            shape = tuple(int(v) for v in info.shape)
            dtype = str(info.dtype)
            args.append((shape, dtype))
            nbytes += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        out.append(Kernel(gv.name_hint, calls[gv.name_hint], flops, nbytes,
                          workload_key(func), args, mod=wmod))
    return sorted(out, key=lambda k: -k.flops * k.calls)


def mark_tuned(kernels: list[Kernel], log_path: str, target=None) -> int:
    """Set ``tuned`` on the kernels that the tuned build compiles with a record of the tuning
    log at ``log_path``: a workload with a valid record (matched by workload key, as the
    build's MetaScheduleApplyDatabase matches structurally), unless, given ``target``, its best
    record lost to the default schedule on the device (:func:`thomas_tune.build.best_records`;
    such a kernel keeps its default). Returns how many are tuned."""
    from .build import best_records
    from .tuning_log import TuningLog
    best, slower = best_records(TuningLog(log_path).database(), log_path, target)
    used = set(best) - slower
    for k in kernels:
        k.tuned = k.key in used
    return sum(k.tuned for k in kernels)


def _random_args(args, dev, rng, pool=None):
    """Device tensors of the given (shape, dtype) list: floats standard normal (views of
    ``pool``, a float32 normal sample drawn once per bench, when it is large enough), booleans
    fair coins, integers 0 or 1 (in range for every gather of the graphs: labels)."""
    import tvm
    out = []
    for shape, dtype in args:
        n = int(np.prod(shape, dtype=np.int64))
        if dtype.startswith("float"):
            if pool is not None and n <= pool.size:
                start = int(rng.integers(0, pool.size - n + 1))
                a = pool[start:start + n].reshape(shape).astype(dtype, copy=False)
            else:
                a = rng.standard_normal(shape).astype(dtype)
        elif dtype == "bool":
            a = rng.random(shape) < 0.5
        else:
            a = rng.integers(0, 2, shape).astype(dtype)
        out.append(tvm.runtime.tensor(np.array(a, dtype=dtype, order="C"), dev))
    return out


def time_kernels(library_path: str, kernels: list[Kernel], dev, variant: str,
                 min_ms: float = 1.0, seed: int = 0, progress: bool = True) -> None:
    """Time every kernel of ``kernels`` alone from the exported library ``library_path``
    (``train.so``): fresh random inputs of its argument shapes (floats normal, indices 0/1),
    one warm-up call, then the best of 3 repeats of at least ``min_ms`` ms of
    ``time_evaluator``. Stores ms per call in ``kernel.ms[variant]`` (NaN when the kernel is
    not in the library or fails, with the reason on stderr)."""
    import tvm
    from tqdm import tqdm
    lib = tvm.runtime.load_module(library_path)
    host = lib.imports[0] if lib.imports else lib
    rng = np.random.default_rng(seed)
    largest = max((int(np.prod(shape, dtype=np.int64)) for k in kernels for shape, dt in k.args
                   if dt.startswith("float")), default=0)
    pool = rng.standard_normal(2 * largest, dtype="float32") if largest else None
    for k in tqdm(kernels, desc=f"timing {variant} kernels", unit="kernel", disable=not progress,
                  leave=False):
        try:
            args = _random_args(k.args, dev, rng, pool)
            k.ms[variant] = _time(host, k.name, dev, args, min_ms) * 1e3
        except Exception as err:  # noqa: BLE001 (one kernel failing must not stop the bench)
            k.ms[variant] = math.nan
            print(f"bench: kernel {k.name} ({variant}) not timed: "
                  f"{str(err).strip().splitlines()[-1][:200]}", file=sys.stderr)


# ---- the tuning curve ------------------------------------------------------------------------
def tuning_curve(log_path: str, kernels: list[Kernel], default_variant: str = "default") -> dict:
    """Estimated kernel time of a training step (ms) against trials of the tuning log.

    Records are read in file order (the order they were measured). Each workload of the step
    starts at its default-schedule time (``kernel.ms[default_variant]``); a valid record (run
    time below 1e9 s) replaces it when faster. Estimated step = sum over kernels of calls x
    time. Records of workloads not in this step are skipped (counted). Returns ``{"trials":
    [...], "ms": [...], "skipped_records": n, "trials_to_95pct": n or None}`` where
    ``trials_to_95pct`` is the first trial count whose estimate is within 5% of the total gain
    from the final value. Raises FileNotFoundError when the log has no record file.
    """
    from .tuning_log import TuningLog
    log = TuningLog(log_path)  # a packed log is read from its unpacked copy
    by_key: dict[str, list[Kernel]] = {}
    for k in kernels:
        by_key.setdefault(k.key, []).append(k)
    with open(log.workload_path) as f:
        wl_keys = []
        for line in f:
            try:
                wl_keys.append(str(int(json.loads(line)[0])))
            except (ValueError, IndexError, TypeError):
                wl_keys.append(None)
    cur = {key: ks[0].ms.get(default_variant, math.nan) for key, ks in by_key.items()}
    calls = {key: sum(k.calls for k in ks) for key, ks in by_key.items()}

    def total():
        return sum(cur[key] * calls[key] for key in cur if math.isfinite(cur[key]))

    trials, ms, skipped = [0], [total()], 0
    with open(log.record_path) as f:
        for line in f:
            try:
                idx, rec = json.loads(line)
                key = wl_keys[idx]
                secs = [float(s) for s in rec[1]]
            except (ValueError, IndexError, TypeError):
                skipped += 1
                continue
            if key not in cur or not math.isfinite(cur[key]):
                skipped += 1  # another graph's workload, or a kernel that was not timed
                continue
            t = sum(secs) / len(secs) * 1e3 if secs else math.inf
            if t < 1e12 and (not math.isfinite(cur[key]) or t < cur[key]):
                cur[key] = t
            trials.append(trials[-1] + 1)
            ms.append(total())
    first, last = ms[0], ms[-1]
    to95 = None
    if len(ms) > 1 and first > last:
        to95 = next(n for n, v in zip(trials, ms) if v - last <= 0.05 * (first - last))
    return {"trials": trials, "ms": ms, "skipped_records": skipped, "trials_to_95pct": to95}


def plot_curve(curve: dict, path: str, title: str) -> str | None:
    """Write the tuning curve as a PNG; returns None (and says why on stderr) when matplotlib
    is not installed (``pip install 'thomas_tune[bench]'``)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed; no tuning-curve PNG (the curve is in the "
              "JSON; pip install matplotlib to plot it)", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(curve["trials"], curve["ms"], drawstyle="steps-post")
    ax.set_xlabel("trials (tuning-log records in order)")
    ax.set_ylabel("estimated kernel time per training step (ms)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- start-up ----------------------------------------------------------------------------------
_START_CHILD = r"""
import json, sys, time
t0 = time.time()
import numpy as np
import thomas_tune
from thomas_tune.runtime import Session
t1 = time.time()
s = Session(sys.argv[1])
rng = np.random.default_rng(int(sys.argv[2]))
x = rng.standard_normal(s.model.input_shape(s.batch)).astype("float32")
y = rng.integers(0, s.model.num_classes, s.batch)
t2 = time.time()
loss = s.train_step(x, y)
s.sync()
t3 = time.time()
stats = {}
if s.manifest["target"]["kind"] == "opencl":
    from thomas_tune import opencl
    stats = opencl.stats()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_step_s": t3 - t2, "end": t3,
                  "loss": loss, "opencl": stats}))
"""


def start_once(export_dir: str, cache_dir: str, seed: int = 0, timeout: float = 3600) -> dict:
    """Start a fresh Python process that loads ``export_dir`` and runs one training step (fresh
    random inputs) with the OpenCL program cache in ``cache_dir``. Returns seconds: ``total_s``
    (process start to the end of the first step), ``import_s``, ``load_s``, ``first_step_s``,
    and the sidecar's counters (``opencl``: source builds, binary loads). The process is a
    deployed runtime's: ``TVM_USE_RUNTIME_LIB=1``, TVM's runtime library without its compiler.
    Raises RuntimeError with the child's stderr when it fails."""
    env = dict(os.environ, THOMAS_TUNE_OPENCL_CACHE=cache_dir, TVM_USE_RUNTIME_LIB="1")
    cmd = [sys.executable] + (["-P"] if sys.flags.safe_path else []) + [
        "-c", _START_CHILD, os.path.abspath(export_dir), str(seed)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"start-up run failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["total_s"] = out.pop("end") - t0
    return out


def startup(export_dir: str, seed: int = 0) -> dict:
    """First and second start of an export (see :func:`start_once`): the first with an empty
    program-binary cache (a fresh temporary folder), the second with the cache it wrote.
    Returns ``{"first": {...}, "second": {...}}``. On PoCL, PoCL's own kernel cache
    (``POCL_KERNEL_CACHE``) is left as it is and may already hold the kernels."""
    with tempfile.TemporaryDirectory(prefix="thomas-tune-clcache-") as cache:
        first = start_once(export_dir, cache, seed)
        second = start_once(export_dir, cache, seed + 1)
    return {"first": first, "second": second}


# ---- steady state ------------------------------------------------------------------------------
def time_export(export_dir: str, steps: int, warmup: int = 2, seed: int = 0) -> dict:
    """ms per training step and per inference pass (median wall time of ``steps`` runs, after
    ``warmup``; a fresh random batch for every run, copied to the device before the step's
    clock starts, as :func:`time_torch` does; the step's dropout masks are drawn on the
    device inside it) of an export on this machine's device;
    kernel launches per training step on OpenCL. Returns a dict with ``train_ms``,
    ``infer_ms``, ``batch``, ``infer_batch``, ``launches_per_step`` (None off OpenCL)."""
    from .runtime import Session
    s = Session(export_dir, seed=seed)
    rng = np.random.default_rng(seed)
    opencl_kind = s.manifest["target"]["kind"] == "opencl"

    def batch(n):
        return rng.standard_normal(s.model.input_shape(n)).astype("float32")

    def labels():
        return rng.integers(0, s.model.num_classes, s.batch)

    for _ in range(warmup):
        s.train_step(batch(s.batch), labels())
        s.predict(batch(s.infer_batch))
    s.sync()
    launches = None
    if opencl_kind:
        from . import opencl
        before = opencl.stats()["launches"]
    times = []
    for _ in range(steps):
        x, y = s.upload(batch(s.batch), labels())  # on the device before the clock starts,
        s.sync()                                   # as PyTorch's batch is (time_torch)
        t0 = time.perf_counter()
        s.train_step(x, y)
        s.sync()
        times.append(time.perf_counter() - t0)
    if opencl_kind:
        launches = (opencl.stats()["launches"] - before) / steps
    itimes = []
    for _ in range(steps):
        x = batch(s.infer_batch)
        t0 = time.perf_counter()
        s.predict(x)
        itimes.append(time.perf_counter() - t0)
    return {"train_ms": float(np.median(times)) * 1e3, "infer_ms": float(np.median(itimes)) * 1e3,
            "batch": s.batch, "infer_batch": s.infer_batch, "launches_per_step": launches}


def torch_device() -> str | None:
    """``cuda`` when PyTorch sees a CUDA device, ``cpu`` when PyTorch is installed without one,
    None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return "cuda" if torch.cuda.is_available() else "cpu"


def torchvision_module(model, tensors):
    """torchvision's own network of ``model`` (MobileNetV2 and AlexNet) with its weights, in
    ``eval()`` mode, or None where torchvision is not installed or has no such network (the
    model's parameter names are torchvision's: the state dict loads as it is)."""
    try:
        import torch
        import torchvision
    except ImportError:
        return None
    if model.arch == "mobilenet_v2":
        net = torchvision.models.mobilenet_v2(num_classes=model.num_classes,
                                              width_mult=model.width)
    elif model.arch == "alexnet" and model.width == 1.0:
        net = torchvision.models.alexnet(num_classes=model.num_classes)
    else:
        return None
    state = {k: torch.tensor(np.asarray(v, "float32")) for k, v in tensors.items()}
    missing, unexpected = net.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith("num_batches_tracked") for k in missing):
        return None
    return net.eval()


def time_torch(model, tensors, trainable: list[str], optimizer, batch: int, infer_batch: int,
               steps: int, warmup: int = 2, seed: int = 0, use_torchvision: bool = True) -> dict:
    """PyTorch eager float32 (TF32 off) on :func:`torch_device`, with ``cudnn.benchmark`` off
    and on (CUDA; the faster is reported, both are kept): torchvision's network where
    torchvision has it (:func:`torchvision_module`; ``use_torchvision``), else the same
    architecture
    (:func:`thomas_tune.reference.torch_module`), batch, trainable set (others frozen) and
    optimizer (momentum SGD, SGD or Adam with the same settings). ms per training step (forward,
    cross-entropy, backward, optimizer step) and per inference pass (``eval()``, no grad):
    medians over ``steps`` runs on fresh random batches, synchronised. Raises RuntimeError when
    torch is not installed."""
    dev_name = torch_device()
    if dev_name is None:
        raise RuntimeError("torch is not installed")
    import torch
    from .reference import torch_module
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(seed)
    dev = torch.device(dev_name)
    net = torchvision_module(model, tensors) if use_torchvision else None
    impl = "torchvision" if net is not None else "thomas_tune.reference"
    net = (net if net is not None else torch_module(model, tensors)).to(dev)
    train = set(trainable)
    params = []
    for name, p in net.named_parameters():
        p.requires_grad_(name in train)
        if name in train:
            params.append(p)
    if optimizer.name == "adam":
        opt = torch.optim.Adam(params, lr=optimizer.lr, betas=tuple(optimizer.betas),
                               eps=optimizer.eps, weight_decay=optimizer.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=optimizer.lr, weight_decay=optimizer.weight_decay,
                              momentum=optimizer.momentum if optimizer.name == "momentum_sgd"
                              else 0.0)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step():
        x = torch.randn(model.input_shape(batch), generator=gen).to(dev)
        y = torch.randint(0, model.num_classes, (batch,), generator=gen).to(dev)
        sync()
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync()
        return time.perf_counter() - t0

    net.train()
    by_setting = {}
    # cudnn.benchmark picks convolution algorithms by timing them; which setting is faster
    # depends on the network: both are timed and the faster one is reported
    for bench_algos in ((False, True) if dev.type == "cuda" else (False,)):
        torch.backends.cudnn.benchmark = bench_algos
        for _ in range(warmup):
            step()
        by_setting[bench_algos] = [step() for _ in range(steps)]
    faster = min(by_setting, key=lambda k: np.median(by_setting[k]))
    torch.backends.cudnn.benchmark = faster
    times = by_setting[faster]
    net.eval()
    itimes = []
    with torch.no_grad():
        for i in range(warmup + steps):
            x = torch.randn(model.input_shape(infer_batch), generator=gen).to(dev)
            sync()
            t0 = time.perf_counter()
            net(x)
            sync()
            if i >= warmup:
                itimes.append(time.perf_counter() - t0)
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    return {"train_ms": float(np.median(times)) * 1e3, "infer_ms": float(np.median(itimes)) * 1e3,
            "batch": batch, "infer_batch": infer_batch, "launches_per_step": None,
            "device": f"torch {torch.__version__} {dev_name} ({name}), {impl}",
            "implementation": impl,
            "cudnn_benchmark": faster if dev.type == "cuda" else None,
            "train_ms_by_cudnn_benchmark": {str(k): float(np.median(v)) * 1e3
                                            for k, v in by_setting.items()}}


# ---- the whole bench -------------------------------------------------------------------------
@dataclass
class BenchConfig:
    """What to run: steps (timed runs per measurement), warm-up runs, kernels (rows of the
    kernel table; 0 skips per-kernel timing), kernel_min_ms (length of one timed repeat of a
    kernel), startup (first/second start), torch (PyTorch eager), refresh_peaks, seed, check
    (each build's loss and gradients against PyTorch before it is timed; a wrong build is not
    timed)."""

    steps: int = 20
    warmup: int = 2
    kernels: int = 12
    kernel_min_ms: float = 1.0
    startup: bool = True
    torch: bool = True
    refresh_peaks: bool = False
    seed: int = 0
    progress: bool = True
    check: bool = True


def _same_export(out_dir: str, want: dict) -> bool:
    from .export import read_manifest
    try:
        m = read_manifest(out_dir)
    except ValueError:
        return False
    return all(m.get(k) == v for k, v in want.items())


def prepare_exports(model, tensors, target, log_path: str | None, work: str, batch: int,
                    infer_batch: int, trainable: str, optimizer, say=print,
                    stock: bool = False) -> dict:
    """Export the model with default schedules (``work/default``), with ``log_path`` with the
    tuning log (``work/tuned``), and with ``stock`` with TVM's own default GPU rules instead of
    thomas_tune's (``work/stock``: what TVM gives an untuned kernel); an export already there
    with the same model, shapes, target, trainable set, optimizer, rules and tuning-log hash
    is reused. Returns variant -> folder. Raises ValueError for a tuning log with no
    records."""
    import dataclasses

    from .export import export, log_hash
    from .graph import training_module
    from .tuning_log import TuningLog
    log = TuningLog(log_path) if log_path else None
    if log is not None and not log.exists():
        raise ValueError(f"tuning log {log_path!r} has no records")
    import tvm_ffi
    tg = training_module(model, batch, trainable, optimizer)
    # the graph the export was compiled from: an export of an older graph (other gradients,
    # other fusion) has other kernels, so it is compiled again
    graph_key = str(tvm_ffi.structural_hash(exported_training_module(model, tg)))
    out = {}
    for variant, lg in (("tuned", log), ("default", None), ("stock", None)):
        if variant == "tuned" and lg is None or variant == "stock" and not stock:
            continue
        folder = os.path.join(work, variant)
        want = {"arch": model.arch, "config": model.config(), "batch": batch,
                "infer_batch": infer_batch, "target": json.loads(str(target)),
                "trainable": tg.trainable, "optimizer": dataclasses.asdict(tg.optimizer),
                "tuning_log_sha256": log_hash(lg),
                "default_rules": "stock" if variant == "stock" else "thomas_tune"}
        want["optimizer"] = json.loads(json.dumps(want["optimizer"]))
        marker = os.path.join(folder, GRAPH_MARKER)
        same_graph = os.path.exists(marker) and open(marker).read().strip() == graph_key
        if same_graph and _same_export(folder, want):
            say(f"[bench] reusing the {variant} export in {folder}")
        else:
            t0 = time.perf_counter()
            say(f"[bench] compiling the {variant} export into {folder} ...")
            export(folder, model, tensors, target, batch=batch, infer_batch=infer_batch,
                   trainable=trainable, optimizer=optimizer, log=lg,
                   progress=lambda m: say(f"[bench]   {m}"), stock_defaults=variant == "stock")
            with open(marker, "w") as f:
                f.write(graph_key + "\n")
            say(f"[bench] {variant} export done in {time.perf_counter() - t0:.0f} s")
        out[variant] = folder
    return out


def check_variants(exports: dict, seed: int, say=print) -> dict:
    """Each export's training step checked against PyTorch in float64
    (:func:`thomas_tune.step_check.check_export`, on one batch drawn from ``seed``): the
    default-schedule build first, whose errors bound the others'. Returns variant ->
    :class:`~thomas_tune.step_check.StepCheck`; says one line per variant. Without PyTorch,
    says so and returns nothing checked."""
    from .step_check import check_export
    try:
        import torch  # noqa: F401
    except ImportError:
        say("[bench] PyTorch is not installed: the builds' numbers are not checked")
        return {}
    out = {}
    order = sorted(exports, key=lambda v: v != "default")
    for variant in order:
        yard = out.get("default") if variant != "default" else None
        out[variant] = c = check_export(exports[variant], seed, yardstick=yard)
        say(f"[bench] numbers of {variant} against PyTorch float64: {c.line()}")
    if exports:  # PyTorch's own float32 step on the same batch: how far float32 rounding goes
        out["torch_float32"] = c = torch_float32_check(next(iter(exports.values())), seed)
        say(f"[bench] PyTorch's float32 step against its float64 step: {c.line()}")
    return out


def torch_float32_check(export_dir: str, seed: int):
    """PyTorch's own float32 step (TF32 off) compared with its float64 step on the batch of
    :func:`thomas_tune.step_check.check_export`: the rounding float32 alone brings to this
    network and batch (a :class:`~thomas_tune.step_check.StepCheck`, judged as an untuned
    build)."""
    import os

    from .manifest import read_manifest
    from .models import load_checkpoint
    from .step_check import batch, compare_step, torch_step
    m = read_manifest(export_dir)
    model, tensors, _ = load_checkpoint(os.path.join(export_dir, "params.npz"))
    x, y = batch(model, m["batch"], seed)
    ref = torch_step(model, tensors, m["trainable"], x, y)
    got = torch_step(model, tensors, m["trainable"], x, y, dtype="float32")
    return compare_step(*got, *ref)


def run_bench(model, tensors, target, exports: dict, cfg: BenchConfig, log_path: str | None,
              trainable: str, optimizer, say=print) -> dict:
    """Measure every variant of ``exports`` (variant -> export folder), PyTorch eager, peaks,
    kernels, start-up and the tuning curve (see the module docstring). Returns the result
    dict that :func:`format_report` prints and the ``--json`` file holds."""
    import tvm

    from .export import read_manifest
    from .graph import training_module
    from .runtime import device_for
    first = read_manifest(next(iter(exports.values())))
    batch, infer_batch = first["batch"], first["infer_batch"]
    kind = target.kind.name
    dev = device_for(kind)
    if kind == "opencl" and not dev.exist:
        raise ValueError("no OpenCL device here; see 'python -c \"import thomas_tune.opencl as o; "
                         "print(o.devices())\"'")
    tg = training_module(model, batch, trainable, optimizer)
    train_mod = exported_training_module(model, tg)
    res = {"model": {"arch": model.arch, **model.config()}, "batch": batch,
           "infer_batch": infer_batch, "trainable": trainable,
           "trainable_params": len(tg.trainable), "optimizer": tg.optimizer.name,
           "target": str(target.kind.name), "device": device_description(kind, dev),
           "tuning_log": log_path, "config": cfg.__dict__, "variants": {}}
    say(f"[bench] peak of {res['device']} ...")
    res["peaks"] = peaks = measure_peaks(target, dev, refresh=cfg.refresh_peaks)
    kernels = step_kernels(train_mod)
    step_flops = sum(k.flops * k.calls for k in kernels)
    step_bytes = sum(k.bytes * k.calls for k in kernels)
    res["step"] = {"kernels": len(kernels), "calls": sum(k.calls for k in kernels),
                   "gflop": step_flops / 1e9, "argument_gbytes": step_bytes / 1e9}
    # the tuned build may compute some convolutions in the Winograd form (its manifest lists
    # them): its own kernels
    own = {variant: list(kernels) for variant in exports}
    separate = set()
    if "tuned" in exports:
        from .winograd import Conv
        built = read_manifest(exports["tuned"]).get("winograd") or {}
        chosen = {Conv.from_dict(d) for d in built.get("training", [])}
        if chosen:
            own["tuned"] = step_kernels(train_mod, chosen)
            separate.add("tuned")
            res["step"]["winograd_convolutions"] = len(chosen)
    if log_path:  # one read of the log marks the tuned build's kernels and the common rows
        tuned_ks = own.get("tuned", kernels)
        mark_tuned([*kernels, *tuned_ks] if separate else kernels, log_path, target)
        res["step"]["tuned_kernels"] = sum(k.tuned for k in tuned_ks)
    checks = check_variants(exports, cfg.seed, say) if cfg.check else {}
    res["checks"] = {k: c.as_dict() for k, c in checks.items()}
    for variant, folder in exports.items():
        if variant in checks and not checks[variant].ok:
            say(f"[bench] {variant}: not timed, its numbers are wrong")
            continue
        say(f"[bench] timing {variant}: {cfg.steps} training steps and inference passes ...")
        r = time_export(folder, cfg.steps, cfg.warmup, cfg.seed)
        res["variants"][variant] = r
        if cfg.kernels:
            ks = own[variant]
            time_kernels(os.path.join(folder, "train.so"), ks, dev, variant,
                         cfg.kernel_min_ms, cfg.seed, cfg.progress)
            r["kernel_sum_ms"] = sum(k.ms[variant] * k.calls for k in ks
                                     if math.isfinite(k.ms[variant]))
            r["kernels_failed"] = sum(1 for k in ks if not math.isfinite(k.ms[variant]))
            if variant in separate:  # one row per workload: times of shared kernels merged
                by_key = {k.key: k for k in kernels}
                for k in ks:
                    if k.key in by_key:
                        by_key[k.key].ms[variant] = k.ms[variant]
                    else:
                        kernels.append(k)
        if cfg.startup and kind == "opencl":
            say(f"[bench] start-up of the {variant} export: first start (empty program "
                "cache), then second start ...")
            r["startup"] = startup(folder, cfg.seed)
    if cfg.torch:
        td = torch_device()
        if td is None:
            say("[bench] PyTorch is not installed: no PyTorch column")
        else:
            say(f"[bench] timing PyTorch eager on {td} ...")
            res["variants"]["torch"] = time_torch(model, tensors, tg.trainable, tg.optimizer,
                                                  batch, infer_batch, cfg.steps, cfg.warmup,
                                                  cfg.seed)
    for variant, r in res["variants"].items():
        r["train_images_per_s"] = 1e3 * r["batch"] / r["train_ms"]
        r["infer_images_per_s"] = 1e3 * r["infer_batch"] / r["infer_ms"]
        r["train_gflops"] = step_flops / r["train_ms"] / 1e6
        r["share_of_peak_flops"] = r["train_gflops"] / peaks["gflops"]
        r["share_of_peak_bandwidth"] = step_bytes / r["train_ms"] / 1e6 / peaks["gbytes_per_s"]
    if cfg.kernels:
        rows = []
        for k in kernels:
            row = {"name": k.name, "calls": k.calls, "mflop": k.flops / 1e6,
                   "mbytes": k.bytes / 1e6, "tuned": k.tuned, "workload": k.key}
            for variant, ms in k.ms.items():
                row[f"{variant}_ms"] = ms
                if math.isfinite(ms) and ms > 0:
                    row[f"{variant}_gflops"] = k.flops / ms / 1e6
                    row[f"{variant}_share_of_peak_flops"] = k.flops / ms / 1e6 / peaks["gflops"]
                    row[f"{variant}_share_of_peak_bandwidth"] = (
                        k.bytes / ms / 1e6 / peaks["gbytes_per_s"])
            rows.append(row)
        main = "tuned" if "tuned" in exports else next(iter(exports))
        rows.sort(key=lambda r: -(r.get(f"{main}_ms", 0) * r["calls"]
                                  if math.isfinite(r.get(f"{main}_ms", math.nan)) else 0))
        res["kernels"] = rows
        res["kernel_table_variant"] = main
        if log_path and "default" in exports:
            res["tuning_curve"] = tuning_curve(log_path, kernels)
    return res


def _fmt(v, spec=".1f", none="-"):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return format(v, spec)


def format_report(res: dict, top: int = 12) -> str:
    """The bench result as text tables (what ``thomas-tune bench`` prints)."""
    m = res["model"]
    lines = [f"{m['arch']} width {m['width']:g}, {m['resolution']}x{m['resolution']}, "
             f"{m['num_classes']} classes; training batch {res['batch']}, trainable "
             f"{res['trainable']} ({res['trainable_params']} tensors), {res['optimizer']}; "
             f"inference batch {res['infer_batch']}",
             f"device: {res['device']}",
             f"peak (measured{', cached' if res['peaks'].get('cached') else ''}): "
             f"{res['peaks']['gflops']:.1f} GFLOP/s, {res['peaks']['gbytes_per_s']:.1f} GB/s "
             f"({res['peaks']['method']})",
             f"training step: {res['step']['calls']} kernel calls, {res['step']['gflop']:.3f} "
             f"GFLOP, {res['step']['argument_gbytes'] * 1e3:.1f} MB of kernel arguments", ""]
    hdr = (f"{'variant':<9} {'train ms':>9} {'img/s':>8} {'infer ms':>9} {'img/s':>8} "
           f"{'%peak FLOP':>10} {'%peak BW':>9} {'launches':>8} {'kernels ms':>10} "
           f"{'1st start s':>11} {'2nd start s':>11}")
    lines.append(hdr)
    for name, c in res.get("checks", {}).items():
        if not c["ok"] and name != "torch_float32":
            worst = ", ".join(f"{n} {c['errors'][n]:.1e}" for n in c["failing"][:6])
            lines.append(f"{name:<9} WRONG, not timed: loss {c['loss']:.6f} (PyTorch "
                         f"{c['loss_ref']:.6f}); {len(c['failing'])} gradient(s) over their "
                         f"bound: {worst}")
    for name, r in res["variants"].items():
        st = r.get("startup") or {}
        lines.append(
            f"{name:<9} {r['train_ms']:>9.2f} {r['train_images_per_s']:>8.1f} "
            f"{r['infer_ms']:>9.3f} {r['infer_images_per_s']:>8.1f} "
            f"{100 * r['share_of_peak_flops']:>9.2f}% {100 * r['share_of_peak_bandwidth']:>8.2f}% "
            f"{_fmt(r.get('launches_per_step'), '.0f'):>8} {_fmt(r.get('kernel_sum_ms'), '.2f'):>10} "
            f"{_fmt(st.get('first', {}).get('total_s'), '.2f'):>11} "
            f"{_fmt(st.get('second', {}).get('total_s'), '.2f'):>11}")
    v = res["variants"]
    ratios = []
    for a, b in (("default", "tuned"), ("stock", "tuned"), ("stock", "default"),
                 ("torch", "tuned"), ("torch", "default")):
        if a in v and b in v:
            ratios.append(f"{b} vs {a}: {v[a]['train_ms'] / v[b]['train_ms']:.2f}x (training), "
                          f"{v[a]['infer_ms'] / v[b]['infer_ms']:.2f}x (inference)")
    if ratios:
        lines += ["", "speed-up (>1: the first named is faster): " + "; ".join(ratios)]
    for name, c in res.get("checks", {}).items():
        if c["ok"]:
            lines.append(f"numbers of {name}: loss {c['loss']:.6f} (PyTorch float64 "
                         f"{c['loss_ref']:.6f}), worst gradient {c['worst'][0]} "
                         f"{c['worst'][1]:.1e}")
    for name, r in v.items():
        st = r.get("startup")
        if st:
            f, s = st["first"], st["second"]
            lines.append(f"start-up of {name}: first {f['total_s']:.2f} s (import "
                         f"{f['import_s']:.2f}, load {f['load_s']:.2f}, first step "
                         f"{f['first_step_s']:.2f}; {f['opencl'].get('source_builds')} program "
                         f"builds from source), second {s['total_s']:.2f} s (first step "
                         f"{s['first_step_s']:.2f}; {s['opencl'].get('source_builds')} builds, "
                         f"{s['opencl'].get('binary_loads')} from the program cache)")
    if res.get("kernels"):
        main = res["kernel_table_variant"]
        others = [n for n in ("tuned", "default", "stock") if n in v and n != main]
        lines += ["", f"slowest kernels of the {main} training step (each timed alone on "
                  "random inputs; ms per call x calls = ms per step):"]
        h = (f"{'kernel':<44} {'calls':>5} {'ms/call':>9} {'ms/step':>8} {'GFLOP/s':>8} "
             f"{'%peak':>6} {'%BW':>6} {'tuned':>5}")
        h += "".join(f" {o + ' ms':>11}" for o in others)
        lines.append(h)
        for r in res["kernels"][:top]:
            ms = r.get(f"{main}_ms", math.nan)
            lines.append(
                f"{r['name'][:44]:<44} {r['calls']:>5} {_fmt(ms, '.4f'):>9} "
                f"{_fmt(ms * r['calls'], '.3f'):>8} {_fmt(r.get(f'{main}_gflops'), '.1f'):>8} "
                f"{_fmt(100 * r.get(f'{main}_share_of_peak_flops', math.nan), '.1f'):>6} "
                f"{_fmt(100 * r.get(f'{main}_share_of_peak_bandwidth', math.nan), '.1f'):>6} "
                f"{'yes' if r['tuned'] else 'no':>5}"
                + "".join(f" {_fmt(r.get(f'{o}_ms'), '.4f'):>11}" for o in others))
    c = res.get("tuning_curve")
    if c:
        lines += ["", f"tuning curve: {len(c['trials']) - 1} records of this step's workloads "
                  f"({c['skipped_records']} of other workloads skipped); estimated kernel time "
                  f"per step {c['ms'][0]:.2f} ms (default schedules) -> {c['ms'][-1]:.2f} ms; "
                  f"95% of the gain after {c['trials_to_95pct']} trials"]
    return "\n".join(lines)
