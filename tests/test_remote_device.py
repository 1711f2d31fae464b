"""A device server reached the way a phone is: the device's limits read over RPC, sessions
asked for in whole seconds, and a remote training run that outlives its session's bound.

One tracker and one device server on 127.0.0.1 (TVM's Python server with thomas_tune's
runtime: PoCL through the OpenCL sidecar). The server parses ``-timeout=`` as TVM's C++
server ``tvm_rpc`` does (digits only, ``apps/cpp_rpc/rpc_server.cc``; any other value ends the
whole server process, as the exception thrown there ends ``tvm_rpc``) and writes down every
option it is sent; its PoCL device is limited to a work-group size drawn at random
(``POCL_MAX_WORK_GROUP_SIZE`` in the server's environment only), so a limit this process
could read for itself would not match. Where it still differs from ``tvm_rpc``: at the bound
it sends the client an ``RPCSessionTimeoutError`` before it ends the session's process (the
client of ``tvm_rpc`` sees the connection end), and each session has its own folder, removed
at the bound too. ``tests/test_tvm_rpc.py`` runs ``tvm_rpc`` itself where it is built; not
covered here or there: the Android NDK build, ``adb`` and the phone's OpenCL drivers
(docs/android.md).
"""

from __future__ import annotations

import json
import os
import sys

import cloudpickle
import numpy as np
import pytest
import tvm

from thomas_tune import rpc
from thomas_tune.compiler.export import export
from thomas_tune.models import build, init_params
from thomas_tune.measure.lane import lane_close, lane_open
from thomas_tune.measure.runner import FarmRunner
from thomas_tune.remote import RemoteDevice, connect
from thomas_tune.runtime import Session
from thomas_tune.target import (DEVICE_FILE, parse_target, read_device_limits, resolve_target,
                                target_from_limits, write_device_file)
from thomas_tune.training_graph.optimizers import OptimizerConfig

from opencl_kernels import NEEDS_OPENCL

pytestmark = NEEDS_OPENCL
KEY = "remote-pocl"
OPTIONS_LOG = "THOMAS_TUNE_TEST_OPTIONS_LOG"
MODEL = dict(num_classes=5, resolution=67, width=0.1)  # the small AlexNet of test_aarch64
BATCH = 4


def _strict_server_init():
    """(server process) thomas_tune's device-server set-up, then TVM's option parser replaced
    by one that accepts ``-timeout=`` as tvm_rpc does (``IsNumber``: digits only; anything else
    ends the server process, as it ends tvm_rpc) and appends every client's options to the
    file named by ``OPTIONS_LOG``."""
    from tvm.rpc import server as tvm_server

    from thomas_tune import rpc as tt_rpc
    tt_rpc._init_device_server()
    path = os.environ[OPTIONS_LOG]

    def parse(opts):
        with open(path, "a") as f:
            f.write(json.dumps(list(opts)) + "\n")
        out = {}
        for kv in opts:
            if kv.startswith("-timeout="):
                if not kv[9:].isdigit():  # tvm_rpc's ICHECK, outside its try: it exits
                    print(f"Timeout is not valid: {kv!r}", file=sys.stderr, flush=True)
                    os._exit(1)
                out["timeout"] = int(kv[9:])
        return out

    tvm_server._parse_server_opt = parse


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    """(tracker address, the server's work-group limit, options log path); the tracker and
    server stop after the module (and by themselves after 10 minutes)."""
    folder = tmp_path_factory.mktemp("farm")
    options_log = str(folder / "options.jsonl")
    group = int(np.random.default_rng().choice([64, 128, 256, 512]))
    tracker = rpc.start_tracker("127.0.0.1", 9400, 9600)
    addr = ("127.0.0.1", tracker.port)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    saved = {k: os.environ.get(k) for k in ("POCL_MAX_WORK_GROUP_SIZE", OPTIONS_LOG)}
    os.environ.update({"POCL_MAX_WORK_GROUP_SIZE": str(group), OPTIONS_LOG: options_log})
    try:  # the server's process takes this environment; this one gets its own back
        server = tvm.rpc.Server("127.0.0.1", port=9600, port_end=9800, tracker_addr=addr,
                                key=KEY, silent=True, server_init_callback=_strict_server_init)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    timer = __import__("threading").Timer(600, lambda: (server.terminate(),
                                                        tracker.terminate()))
    timer.daemon = True
    timer.start()
    try:
        rpc.wait_for_key(addr, KEY, timeout=60)
        yield addr, group, options_log
    finally:
        timer.cancel()
        server.terminate()
        tracker.terminate()


def _requested_timeouts(options_log: str) -> list[str]:
    """The ``-timeout=`` values of every session the server was asked for, in order."""
    with open(options_log) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [next((kv[9:] for kv in opts if kv.startswith("-timeout=")), "")
            for opts in lines]


def _local_pocl_device():
    import pyopencl as cl
    name = tvm.opencl(0).device_name
    return next(d for p in cl.get_platforms() for d in p.get_devices() if d.name == name)


def test_limits_are_read_from_the_device_server(farm, tmp_path):
    addr, group, _ = farm
    local = _local_pocl_device()
    assert local.max_work_group_size != group  # this process's PoCL is not limited
    limits = read_device_limits(addr, KEY)
    assert limits["max_threads_per_block"] == group
    assert limits["max_shared_memory_per_block"] == local.local_mem_size
    assert limits["warp_size"] == 1  # the sidecar's (and TVM's OpenCL runtime's) convention
    assert limits["device_name"] == local.name
    info = limits["opencl"]  # the driver's own answers, from the server's process
    assert info["max_work_group_size"] == group and info["local_mem_size"] == local.local_mem_size
    assert info["preferred_work_group_size_multiple"] >= 1

    target, device = resolve_target("opencl:remote", "native", addr, KEY)
    assert device["max_threads_per_block"] == group
    assert int(target.attrs["max_threads_per_block"]) == group
    assert int(target.attrs["max_num_threads"]) == group
    assert int(target.attrs["max_shared_memory_per_block"]) == local.local_mem_size
    assert int(target.attrs["thread_warp_size"]) == 1
    assert target.host is not None and target.kind.name == "opencl"

    # recorded in a tuning log's folder, read back with no server (export --log)
    write_device_file(str(tmp_path), limits)
    again, recorded = resolve_target("opencl:remote", None, log_dir=str(tmp_path))
    assert recorded == limits and str(again) == str(target_from_limits(limits))
    with open(tmp_path / DEVICE_FILE) as f:
        assert json.load(f)["max_threads_per_block"] == group


def test_remote_target_errors(tmp_path):
    with pytest.raises(ValueError, match="--tracker HOST:PORT --key KEY"):
        parse_target("opencl:remote")
    with pytest.raises(ValueError, match="device.json"):
        resolve_target("opencl:remote", log_dir=str(tmp_path))
    with pytest.raises(ValueError, match="only opencl:remote"):
        resolve_target("cuda:remote")
    with pytest.raises(ValueError, match="warp_size"):
        target_from_limits({"kind": "opencl", "max_threads_per_block": 256,
                            "max_shared_memory_per_block": 32768, "warp_size": 0})


def test_sessions_are_asked_for_in_whole_seconds(farm, rng):
    addr, _, options_log = farm
    before = len(_requested_timeouts(options_log))
    runtime_s = float(rng.uniform(30, 60))
    session = connect(addr, KEY, session_timeout_s=runtime_s)
    del session
    remote = RemoteDevice(addr, KEY, runtime_s + 0.25)
    session = remote.open()
    del session
    lane_s = float(rng.uniform(600, 700))
    runner = FarmRunner(addr, KEY, lanes=1, session_timeout_s=lane_s, log=None)
    lane_open(addr[0], addr[1], KEY, runner.session_timeout_s, 1)  # a tuning lane's request
    lane_close()
    read_device_limits(addr, KEY)
    asked = _requested_timeouts(options_log)[before:]
    want = [int(np.ceil(runtime_s)), int(np.ceil(runtime_s + 0.25)), int(np.ceil(lane_s)), 120]
    assert asked == [str(w) for w in want]
    for bad in (0, -3, float("nan"), "soon"):
        with pytest.raises(ValueError, match="session timeout"):
            rpc.whole_seconds(bad)


@pytest.fixture(scope="module")
def small_export(tmp_path_factory):
    """A small AlexNet exported for this machine's CPU (llvm): quick to compile; its training
    state lives in the device server's session process all the same. The learning rate is
    one that trains a repeated batch without diverging over the hundreds of steps a fast
    machine fits in the renewals test (at 0.01 three seeds of four reached 1e26 or NaN
    within 600 steps)."""
    out = str(tmp_path_factory.mktemp("export"))
    model = build("alexnet", **MODEL)
    export(out, model, init_params(model, seed=11), parse_target("llvm"), batch=BATCH,
           trainable="all", optimizer=OptimizerConfig(name="momentum_sgd", lr=0.001),
           progress=lambda *_: None)
    return out


def test_training_outlives_its_session_bound_and_keeps_its_state(farm, small_export, rng):
    addr, _, options_log = farm
    x = rng.standard_normal((BATCH, 3, 67, 67)).astype("float32")
    y = rng.integers(0, MODEL["num_classes"], BATCH)
    seed = int(rng.integers(1 << 30))

    # the server ends each session at 4 s: the run goes on only through renewals
    with Session(small_export, remote=RemoteDevice(addr, KEY, 4), seed=seed) as short:
        losses, extra = [], 10
        while len(short.renewals) < 2 or extra > 0:
            losses.append(short.train_step(x, y))
            extra -= len(short.renewals) >= 2
        print(f"{len(losses)} steps, renewals: {short.renewals}")
        assert all(r["step"] > 0 for r in short.renewals)
        tensors, logits = short.tensors(), short.predict(x[:1])

    # the same steps in one session give the same numbers: the state came through every
    # renewal, and the export's parameters were not uploaded again
    with Session(small_export, remote=RemoteDevice(addr, KEY, 600), seed=seed) as one:
        losses_one = [one.train_step(x, y) for _ in losses]
        assert not one.renewals
        np.testing.assert_allclose(losses, losses_one, rtol=1e-5, atol=1e-6)
        assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
        for name, value in one.tensors().items():
            np.testing.assert_allclose(tensors[name], value, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(logits, one.predict(x[:1]), rtol=1e-4, atol=1e-5)
    assert set(_requested_timeouts(options_log)) >= {"4", "600"}


def test_cached_features_train_on_the_device_server_as_here(farm, tmp_path, rng):
    # the features come back to this side and each step sends its batch's features; the
    # head's step returns its tuples on the device, as the full step's
    addr, _, _ = farm
    out = str(tmp_path / "cached")
    model = build("alexnet", **MODEL)
    export(out, model, init_params(model, seed=12), parse_target("llvm"), batch=BATCH,
           trainable="last:3", progress=lambda *_: None, cache_features=True)
    x = rng.standard_normal((BATCH + 1, 3, 67, 67)).astype("float32")
    y = rng.integers(0, MODEL["num_classes"], BATCH)
    seed = int(rng.integers(1 << 30))
    runs = []
    for remote in (RemoteDevice(addr, KEY, 600), None):
        with Session(out, remote=remote, seed=seed) as s:
            f = s.features(x)
            runs.append((f, [s.train_step_features(f[:BATCH], y) for _ in range(3)],
                         s.tensors()))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(runs[0][1], runs[1][1], rtol=1e-5)
    for name, value in runs[1][2].items():
        np.testing.assert_allclose(runs[0][2][name], value, rtol=1e-4, atol=1e-6)


def test_a_bound_too_short_for_the_export_is_a_clear_error(farm, small_export):
    addr, _, _ = farm
    with pytest.raises(ValueError, match="give --session-timeout"):
        Session(small_export, remote=RemoteDevice(addr, KEY, 1))


def test_every_session_was_asked_for_in_whole_seconds(farm):
    _, _, options_log = farm
    asked = _requested_timeouts(options_log)
    assert asked and all(t.isdigit() and int(t) > 0 for t in asked), asked


def test_gpu_host_code_is_generated_unoptimised():
    """A GPU target's host code is generated at LLVM opt-level 0 unless its host names a level;
    the device part of the target, and an llvm target, are unchanged."""
    from thomas_tune.target import GPU_HOST_OPT_LEVEL, codegen_target, parse_target
    gpu = parse_target("opencl", host="linux-aarch64")
    built = codegen_target(gpu)
    assert int(built.host.attrs["opt-level"]) == GPU_HOST_OPT_LEVEL == 0
    assert built.host.attrs["mtriple"] == "aarch64-linux-gnu"
    device = {k: v for k, v in gpu.export().items() if k != "host"}
    assert {k: v for k, v in built.export().items() if k != "host"} == device
    assert "opt-level" not in gpu.host.export()  # the given target is left as it was
    own = parse_target('{"kind": "opencl", "host": {"kind": "llvm", "opt-level": 2}}')
    assert int(codegen_target(own).host.attrs["opt-level"]) == 2
    cpu = parse_target("llvm")
    assert codegen_target(cpu).export() == cpu.export()


def test_remote_steps_are_the_local_ones_either_way(farm, small_export, rng):
    # train_step over RPC runs the export's one-function step, its parameters updated in place
    # in the tuple the device's VM owns; the two-call step
    # (Session.one_function_step off) and a local session give the same numbers from the same
    # seed
    addr, _, _ = farm
    x = rng.standard_normal((BATCH, 3, 67, 67)).astype("float32")
    y = rng.integers(0, MODEL["num_classes"], BATCH)
    seed = int(rng.integers(1 << 30))
    runs = []
    for remote, one_function in ((True, True), (True, False), (False, True)):
        with Session(small_export, seed=seed,
                     remote=RemoteDevice(addr, KEY, 600) if remote else None) as s:
            s.one_function_step = one_function
            before = s.tensors()
            runs.append(([s.train_step(x, y) for _ in range(3)], s.tensors()))
            # the steps updated the parameters where the session keeps them
            moved = [n for n, v in runs[-1][1].items() if not np.array_equal(v, before[n])]
            assert moved, "no parameter changed in three training steps"
    (losses, tensors), *others = runs
    assert all(np.isfinite(losses)), losses
    for other_losses, other_tensors in others:
        np.testing.assert_allclose(other_losses, losses, rtol=1e-5, atol=1e-6)
        for name, value in tensors.items():
            np.testing.assert_allclose(other_tensors[name], value, rtol=1e-4, atol=1e-6,
                                       err_msg=name)
