"""The compiled variants of a bench (tuned, default): their exports, start-up and steady state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


from .kernels import exported_training_module


GRAPH_MARKER = "bench_graph_key"  # in a bench export folder: structural hash of its graph


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
if s.manifest.target["kind"] == "opencl":
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


def time_export(export_dir: str, steps: int, warmup: int = 2, seed: int = 0) -> dict:
    """ms per training step and per inference pass of an export alone on this machine's device
    (:class:`~thomas_tune.benchmark.timing.ExportSide`: fresh random batches, each copied to
    the device before the step's clocks start; the step's dropout masks are drawn on the device
    inside it): medians of ``steps`` runs after ``warmup``, host clock (``train_ms``,
    ``infer_ms``) and OpenCL profiling events (``train_device_ms``, ``infer_device_ms``; None
    off OpenCL), with spreads; plus :func:`export_counters`. ``run_bench`` times several
    builds interleaved instead (:func:`~thomas_tune.benchmark.timing.time_interleaved`)."""
    from .timing import ExportSide, as_result, time_interleaved
    side = ExportSide(export_dir, seed)
    timed = time_interleaved({"export": side}, steps, warmup)["export"]
    return {**as_result(timed), **export_counters(side, export_dir, seed)}


def export_counters(side, export_dir: str, seed: int = 0, steps: int = 3) -> dict:
    """What an export's training step asks of an OpenCL device, counted by the sidecar over
    ``steps`` steps of ``side`` (an :class:`~thomas_tune.benchmark.timing.ExportSide` on
    ``export_dir``): ``launches_per_step`` (kernels enqueued), ``launch_arg_bytes_per_step``
    (bytes of the buffers given to them: an upper bound of the step's memory traffic), and
    ``device_peak_bytes`` (:func:`device_memory`, a fresh process); all None off OpenCL.
    ``batch`` and ``infer_batch`` are the export's."""
    out = {"batch": side.batch, "infer_batch": side.infer_batch, "launches_per_step": None,
           "launch_arg_bytes_per_step": None, "device_peak_bytes": None}
    if not side.opencl:
        return out
    from .. import opencl
    side.session.sync()
    before = opencl.stats()
    for _ in range(steps):
        side.train_once()
    after = opencl.stats()
    out["launches_per_step"] = (after["launches"] - before["launches"]) / steps
    out["launch_arg_bytes_per_step"] = (after["launch_arg_bytes"]
                                        - before["launch_arg_bytes"]) / steps
    out["device_peak_bytes"] = device_memory(export_dir, seed=seed)
    return out


_MEMORY_PROBE = """
import json, sys
import numpy as np
from thomas_tune import opencl
from thomas_tune.runtime import Session
s = Session(sys.argv[1], seed=int(sys.argv[2]))
s.one_function_step = sys.argv[4] == "1"
rng = np.random.default_rng(int(sys.argv[2]))
for _ in range(int(sys.argv[3])):
    x = rng.standard_normal(s.model.input_shape(s.batch)).astype("float32")
    s.train_step(x, rng.integers(0, s.model.num_classes, s.batch))
s.sync()
print(json.dumps(opencl.stats()))
"""


def device_memory(export_dir: str, steps: int = 3, seed: int = 0,
                  one_function: bool = True) -> int:
    """The most bytes allocated on the OpenCL device by a fresh process that opens a
    :class:`~thomas_tune.runtime.Session` on the export and runs ``steps`` training steps:
    the parameters, BatchNorm statistics and optimizer state, the step's buffers, and what
    the runtime's memory pools keep (counted by the sidecar, :func:`thomas_tune.opencl.stats`).
    A fresh process, because the runtime's pools outlive a session and serve the next one.
    ``one_function``: the steps as the export runs them (``train_step``); False: as two calls
    (:attr:`~thomas_tune.runtime.Session.one_function_step`).
    Raises RuntimeError when the probe fails (its last output line in the message)."""
    import json
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, export_dir, str(seed), str(steps),
                        str(int(one_function))],
                       capture_output=True, text=True)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"device memory of {export_dir}: the probe failed: {tail}")
    return int(json.loads(lines[-1])["device_peak_bytes"])


def _same_export(out_dir: str, want: dict) -> bool:
    from ..manifest import Manifest
    try:
        m = Manifest.read(out_dir)
    except ValueError:
        return False
    return all(getattr(m, k) == v for k, v in want.items())


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

    from ..compiler.export import export, log_hash
    from ..training_graph.graph import training_module
    from ..logs import TuningLog
    log = TuningLog(log_path) if log_path else None
    if log is not None and not log.exists():
        raise ValueError(f"tuning log {log_path!r} has no records")
    import tvm_ffi
    tg = training_module(model, batch, trainable, optimizer)
    # the graph the export was compiled from: an export of an older graph (other gradients,
    # other fusion) has other kernels, so it is compiled again
    graph_key = str(tvm_ffi.structural_hash(exported_training_module(tg)))
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
