"""The code a measuring lane's worker process runs: one RPC session to a device server, kept.

A lane of :class:`thomas_tune.measure.runner.FarmRunner` is a worker process
(``tvm.support.popen_pool.PopenWorker``) that the lane calls with these functions: open the
session (:func:`lane_open`), upload and load a candidate and have the server compile its OpenCL
programs (:func:`lane_prepare`), take the device lock (:func:`lane_lock`), check the candidate
against its task's reference and time it (:func:`lane_time`). What they keep between calls (the
session, the loaded references and their checked inputs, the random arguments per shape) lives
in this module's ``_LANE``, one per worker process.
"""

from __future__ import annotations

import collections
import gc
import math
import time

MAX_TRIAL_DEVICE_S = 0.5  # timed device seconds per trial, beyond the warm-up run


#: tasks whose checked inputs and reference outputs a lane keeps on its device at once
REFERENCES_PER_SESSION = 4


_LANE: dict = {}


def lane_open(tracker_host: str, tracker_port: int, key: str, session_timeout_s: float,
               priority: int) -> str:
    """(worker) Ask the tracker for a server of ``key``; keep the session. Returns its name."""
    from tvm import rpc
    lane_close()
    client = rpc.connect_tracker(tracker_host, tracker_port)
    from ..rpc import whole_seconds  # tvm_rpc and TVM's Java server parse whole seconds only
    sess = client.request(key, priority=priority, session_timeout=whole_seconds(session_timeout_s),
                          max_retry=1)
    _LANE.update(session=sess, args={}, locked=None, n=0)
    try:
        _LANE["lock"] = sess.get_function("thomas_tune.device_lock")
    except Exception:  # a server without thomas_tune (e.g. TVM's Android app)
        _LANE["lock"] = None
    _LANE["build"] = None
    # compiles a candidate's OpenCL kernels before the device lock is taken; at low priority
    # where the server offers it (servers of thomas_tune), so timed runs keep the CPU
    for name in ("thomas_tune.opencl.build_programs_low_priority",
                 "thomas_tune.opencl.build_programs"):
        try:
            _LANE["build"] = sess.get_function(name)
            break
        except Exception:  # a server without it (an older one, or without the OpenCL runtime)
            continue
    return str(getattr(sess, "_tbl_index", ""))


def lane_close() -> None:
    """(worker) Drop the session, if any (the server's session process then ends): what
    refers to it (its modules, functions and arrays) goes with it, cycles included."""
    _LANE.clear()
    gc.collect()


def lane_ping() -> bool:
    """(worker) True when the lane's session still answers."""
    sess = _LANE.get("session")
    if sess is None:
        return False
    # a round trip to the server: on a session whose server process died, device queries
    # such as ``sess.cpu(0).exist`` still answer True, a remote call raises
    sess.get_function("tvm.rpc.server.workpath")("ping")
    return True


def _alloc(sess, dev, args_info):
    """(worker) The arguments of a candidate on the device: floats filled at random by the
    server; integer tensors (labels, gather indices) with random 0s and 1s, in range for every
    gather of the graphs (a random fill over the whole int64 range makes a loss kernel read out
    of bounds: on the H100 that failed every nll_loss trial with CL error -36, and the session
    had to be opened again)."""
    import numpy as np
    from tvm.s_tir.meta_schedule.runner.utils import alloc_argument_common
    fill = sess.get_function("tvm.contrib.random.random_fill_for_measure")
    args = alloc_argument_common(fill, dev, args_info, 1)[0]
    rng = np.random.default_rng()
    for arr in args:
        dtype = str(arr.dtype)
        if dtype.startswith(("int", "uint")) or dtype == "bool":
            arr.copyfrom(rng.integers(0, 2, tuple(int(n) for n in arr.shape)).astype(dtype))
    return args


def lane_load(artifact: str, name: str, dev):
    """(worker) Upload ``artifact`` as ``name`` to the lane's session, load it and have the
    driver compile its OpenCL programs (where the server offers it). Returns the module."""
    sess = _LANE["session"]
    sess.upload(artifact, name)
    mod = sess.load_module(name)
    build = _LANE.get("build")
    if build is not None:
        build(mod, dev.index)
    return mod


def lane_prepare(artifact: str, device_type: str, args_info, ref: tuple | None = None) -> dict:
    """(worker) Upload and load one candidate on the lane's session and have the driver
    compile its OpenCL programs (outside the device lock; no device work); likewise the
    reference kernel of ``ref`` (:meth:`thomas_tune.kernel_reference.Reference.wire`) the first
    time the session sees its task.

    Returns ``{name: s}`` of the phases; raises on any failure. The candidate waits in the
    worker for :func:`lane_time`."""
    sess = _LANE["session"]
    t = {}
    if ref is not None and ref[1] is not None and ref[0] not in _LANE.setdefault("ref_libs", {}):
        t0 = time.perf_counter()
        dev = sess.device(device_type, 0)
        _LANE["ref_libs"][ref[0]] = lane_load(ref[1], f"ref-{ref[0]}.so", dev)
        t["run.reference_load"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    name = f"c{_LANE['n']}.so"
    _LANE["n"] += 1
    sess.upload(artifact, name)
    t1 = time.perf_counter()
    t["run.upload"] = t1 - t0
    mod = sess.load_module(name)
    dev = sess.device(device_type, 0)
    t2 = time.perf_counter()
    t["run.load"] = t2 - t1
    _LANE["candidate"] = (name, mod, dev, args_info)
    build = _LANE.get("build")
    if build is not None:
        build(mod, dev.index)
        t["run.compile"] = time.perf_counter() - t2
    return t


def lane_lock() -> float:
    """(worker) Take the device lock that servers of one device share (if the server has it).
    Returns the seconds waited."""
    t0 = time.perf_counter()
    lock = _LANE.get("lock")
    if lock is not None and not _LANE.get("locked"):
        lock(1)
        _LANE["locked"] = True
    return time.perf_counter() - t0


def lane_reference(ref: tuple, dev) -> dict:
    """(worker) The checked inputs and reference outputs of task ``ref`` (a
    :meth:`thomas_tune.kernel_reference.Reference.wire` tuple) on the lane's session, made once
    per session (the :data:`REFERENCES_PER_SESSION` most recent tasks are kept on the device):
    the reference library loaded, the inputs drawn and the reference kernel (the task's default
    schedule) run on them there (:func:`thomas_tune.kernel_reference.device_reference`); only
    the seed goes to the device and, for float outputs, the outputs stay there. A reference
    without a built default schedule is computed on this host with the llvm build of the
    workload, and its inputs uploaded."""
    import tvm

    from .. import kernel_reference as kr
    key, artifact, workload_json, spec, seed = ref
    refs = _LANE.setdefault("refs", collections.OrderedDict())
    if key in refs:
        refs.move_to_end(key)
        return refs[key]
    func = tvm.ir.load_json(workload_json)
    if artifact is not None:
        libs = _LANE.setdefault("ref_libs", {})
        if key not in libs:
            libs[key] = lane_load(artifact, f"ref-{key}.so", dev)
        args, compare, expected = kr.device_reference(libs[key], dev, func, seed, spec)
    else:
        host = tvm.cpu(0)
        lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
        local, expected = kr.reference_outputs(lib["main"], host, func, seed, spec)
        inputs = [a.numpy() for a in local.args]
        args = kr.DeviceArgs(inputs, spec, dev)
        compare = None
    entry = {"args": args, "expected": expected, "tol": spec.tol, "compare": compare}
    refs[key] = entry
    while len(refs) > REFERENCES_PER_SESSION:
        refs.popitem(last=False)
    return refs[key]


def lane_time(repeat: int, min_repeat_ms: float, max_number: int,
              ref: tuple | None = None) -> dict:
    """(worker) Check and time the candidate of :func:`lane_prepare`, under the device lock of
    :func:`lane_lock` (released here), then remove its file from the server.

    With ``ref`` (:meth:`thomas_tune.kernel_reference.Reference.wire`), the candidate first
    runs once on the task's checked inputs (:func:`lane_reference`) with its outputs poisoned,
    and its outputs are compared with the reference's
    (:func:`thomas_tune.kernel_check.compare`); a wrong result is returned as ``{"wrong":
    reason}`` and not timed (the session's references are dropped: an out-of-range write may
    have changed them). Without ``ref`` the arguments are random (cached per argument shapes
    for the session) and nothing is checked.

    Returns ``{"costs": [s, ...], "number": runs per repeat, "phases": {name: s}}``, or
    ``{"wrong": reason, "phases": ...}``; raises on any other failure."""
    from .. import kernel_check as kc
    from .. import kernel_reference as kr
    name, mod, dev, args_info = _LANE.pop("candidate")
    sess = _LANE["session"]
    t = {}
    try:
        # The arguments are made here, under the lock: filling them runs kernels and copies
        # on the device, which must not overlap another server's timed run. (What made small
        # kernels' times noisy on the H100 was CPU contention, not this: see COMPILE_NICE.)
        t2 = time.perf_counter()
        out = {"phases": t}
        if ref is not None:
            entry = lane_reference(ref, dev)
            t3 = time.perf_counter()
            t["run.reference"] = t3 - t2
            if entry["compare"] is None:
                got = kr.run_checked(mod[mod.entry_name], dev, entry["args"])
                out["wrong"] = kc.compare(got, entry["expected"], entry["tol"])
            else:  # compared on the device: two numbers per output come back
                out["wrong"] = kc.verdict(entry["compare"].run(mod[mod.entry_name], dev),
                                          entry["tol"])
            t["run.check"] = time.perf_counter() - t3
            args = entry["args"].args
        else:
            key = repr(args_info)
            args = _LANE["args"].get(key)
            if args is None:
                args = _LANE["args"][key] = _alloc(sess, dev, args_info)
            t["run.alloc"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        if out.get("wrong") is None:
            out.update(_timed(mod, dev, args, repeat, min_repeat_ms, max_number))
        else:
            _LANE.pop("refs", None)
        t["run.time"] = time.perf_counter() - t3
    finally:
        if _LANE.pop("locked", False):
            _LANE["lock"](0)
    t4 = time.perf_counter()
    try:
        sess.get_function("tvm.rpc.server.remove")(name)
    except Exception:  # leftovers are removed with the session's folder anyway
        pass
    t["run.remove"] = time.perf_counter() - t4
    return out


def _timed(mod, dev, args, repeat: int, min_repeat_ms: float, max_number: int) -> dict:
    """(worker) Time ``mod``'s entry function on ``args``: one warm-up run sizes the runs per
    repeat to about ``min_repeat_ms``. Returns ``{"costs": [s per run, one per repeat],
    "number": runs per repeat}``."""
    warm = mod.time_evaluator(mod.entry_name, dev, number=1, repeat=1)(*args).mean
    number = max(1, min(max_number, math.ceil(min_repeat_ms * 1e-3 / max(warm, 1e-9))))
    # A slow candidate (often 100x the best) is timed less: its device time per trial
    # stays near MAX_TRIAL_DEVICE_S, so servers sharing the device lock never wait long.
    reps = max(1, min(repeat, int(MAX_TRIAL_DEVICE_S / max(warm * number, 1e-9))))
    if warm >= MAX_TRIAL_DEVICE_S:
        return {"costs": [warm], "number": 1}
    res = mod.time_evaluator(mod.entry_name, dev, number=number, repeat=reps)(*args)
    return {"costs": [float(c) for c in res.results], "number": number}
