"""``rpc probe`` through thomas_tune's own device server and through TVM's ``tvm_rpc`` (PoCL),
and an export checked against a device profile before its first step.

The probed figures are checked for plausibility against this machine, not against fixed
numbers: the properties equal what the OpenCL driver says here (pyopencl, TVM's device
attributes); bandwidth lies within a factor of 10 of numpy's copy rate on this machine;
throughput is positive and below the cores' float32 peak (16 lanes x 2 FMA units x 2 FLOPs per
cycle, AVX-512); launch and compile times are positive and bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import time

import numpy as np
import pytest

from thomas_tune import rpc
from thomas_tune.cli import main
from thomas_tune.manifest import Manifest
from thomas_tune.limits import (COMPILE_FLOOR_S, DeviceLimitError, check_export,
                                library_kernels, local_bytes, runner_bounds)
from thomas_tune.rpc.probe import PROFILE_FILE, SPEC_ALLOC_SOURCE, read_profile

from opencl_kernels import NEEDS_OPENCL

pytestmark = NEEDS_OPENCL
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20


def _host_copy_gb_s(nbytes: int = 64 * MIB) -> float:
    """numpy's copy rate on this machine (GB/s, bytes read plus written), best of 5."""
    a = np.random.default_rng().random(nbytes // 8)
    b = np.empty_like(a)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best / 1e9


def _plausible(profile: dict) -> None:
    """The measured figures of ``profile`` are those a real run on this machine can give."""
    import pyopencl as cl
    m, p = profile["measured"], profile["properties"]
    for name in ("launch_us", "copy_gb_s", "fma_gflop_s", "compile_s", "compile_s_max"):
        assert math.isfinite(m[name]) and m[name] > 0, (name, m[name])
    assert m["compile_s"] <= m["compile_s_max"] < 120, m
    assert len(m["compile_s_each"]) == m["programs"] == 3
    assert m["launch_us"] < 1e5, m  # an empty kernel in under 0.1 s
    host = _host_copy_gb_s()
    assert host / 10 < m["copy_gb_s"] < host * 10, (m["copy_gb_s"], host)
    dev = [d for pl in cl.get_platforms() for d in pl.get_devices()
           if d.name == p["device_name"]][0]
    peak = dev.max_compute_units * dev.max_clock_frequency * 1e-3 * 64  # GFLOP/s
    assert 0.01 < m["fma_gflop_s"] < peak, (m["fma_gflop_s"], peak)
    assert p["max_work_group_size"] == dev.max_work_group_size
    assert p["local_memory_bytes"] == dev.local_mem_size
    # PoCL reports a share of the memory free at the time: within a factor 2 of this one
    assert 0.5 < p["global_memory_bytes"] / dev.global_mem_size < 2


@pytest.fixture(scope="module", autouse=True)
def optimised_pocl():
    """PoCL's own optimisations on, in this module's processes and the servers it starts: a
    probe measures the device as users' builds compile for it (tests/conftest.py turns them
    off for the rest of the suite; unoptimised, PoCL's copy kernel ran at a tenth of numpy's copy
    rate and failed the plausibility bound)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("POCL_EXTRA_BUILD_FLAGS", raising=False)
        yield


@pytest.fixture(scope="module")
def tracker():
    t = rpc.start_tracker("127.0.0.1", 9540, 9550)
    yield ("127.0.0.1", t.port)
    t.terminate()


@pytest.fixture(scope="module")
def profile_path(tracker, tmp_path_factory):
    """A profile probed through thomas_tune's own server on this machine's PoCL, beside the
    Adreno target's values."""
    key = "probe-tt"
    server = rpc.start_server(tracker, key, port=9550, port_end=9560)
    try:
        rpc.wait_for_key(tracker, key, timeout=60)
        path = tmp_path_factory.mktemp("probe") / PROFILE_FILE
        args = ["rpc", "probe", "--tracker", f"{tracker[0]}:{tracker[1]}", "--key", key,
                "--out", str(path), "--target", os.path.join(ROOT, "targets",
                                                             "adreno540_opencl.json")]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(args) == 0
        (path.parent / "printed.txt").write_text(printed.getvalue())
        return path
    finally:
        server.terminate()


def test_probe_through_thomas_tune_server(profile_path):
    import pyopencl as cl
    profile = read_profile(str(profile_path))
    p, src = profile["properties"], profile["sources"]
    assert profile["server"] == "thomas_tune"
    _plausible(profile)
    dev = [d for pl in cl.get_platforms() for d in pl.get_devices()
           if d.name == p["device_name"]][0]
    # the sidecar's server answers what TVM's device API cannot: the driver's own values
    assert p["max_alloc_bytes"] == dev.max_mem_alloc_size
    assert "device_info" in src["max_alloc_bytes"]
    assert p["fp16"] == ("cl_khr_fp16" in dev.extensions.split())
    out = (profile_path.parent / "printed.txt").read_text()
    # printed beside the target file's values (the Adreno 540's 256 work-items, 32 KiB)
    assert f"max_work_group_size    {dev.max_work_group_size}   target: 256" in out
    assert "target: 32768" in out and "GFLOP/s" in out and "GB/s" in out


@pytest.mark.tvm_rpc
def test_probe_through_tvm_rpc(tracker, tmp_path):
    import tvm

    from test_tvm_rpc import Server, _build
    build_dir = _build("THOMAS_TUNE_TVM_RPC")
    key = "probe-tvm-rpc"
    server = Server(build_dir, tracker, key, 9560, tmp_path, lifetime=600)
    try:
        rpc.wait_for_key(tracker, key, timeout=60)
        path = tmp_path / "profile.json"
        assert main(["rpc", "probe", "--tracker", f"{tracker[0]}:{tracker[1]}", "--key", key,
                     "--out", str(path)]) == 0
        profile = read_profile(str(path))
    finally:
        server.stop()
    p, src = profile["properties"], profile["sources"]
    assert profile["server"] == "tvm" and "extensions" not in p
    _plausible(profile)
    here = tvm.opencl(0)
    assert p["device_name"] == here.device_name
    # not readable through TVM's runtime: the spec's minimum, said so
    assert src["max_alloc_bytes"] == SPEC_ALLOC_SOURCE
    assert p["max_alloc_bytes"] == max(p["global_memory_bytes"] // 4, 128 * MIB)
    # PoCL on this machine has no cl_khr_fp16: TVM's half kernel does not build there
    assert p["fp16"] is False and "did not build" in src["fp16"]
    assert "Load module" in server.text()  # the kernels ran in tvm_rpc's own runtime


@pytest.fixture(scope="module")
def big_batch_export(tmp_path_factory):
    """A small AlexNet exported with batch 32: its input batch (1.7 MiB) is its largest
    tensor, above its largest weight (1.4 MiB)."""
    from thomas_tune.compiler.export import export
    from thomas_tune.models import build, init_params
    from thomas_tune.target import parse_target
    model = build("alexnet", num_classes=5, resolution=67, width=0.1)
    out = str(tmp_path_factory.mktemp("export") / "alexnet")
    export(out, model, init_params(model, seed=3), parse_target("opencl"), batch=32,
           progress=lambda *_: None)
    return out


def _variant(profile_path, tmp_path, **props) -> str:
    profile = json.loads(profile_path.read_text())
    profile["properties"].update(props)
    path = tmp_path / ("-".join(f"{k}{v}" for k, v in props.items()) + ".json")
    path.write_text(json.dumps(profile))
    return str(path)


def test_export_over_the_largest_allocation_refused_before_the_first_step(
        big_batch_export, profile_path, tmp_path, capsys):
    out = big_batch_export
    # within the probed device's limits: no error
    assert isinstance(check_export(out, read_profile(str(profile_path)), "export"), list)
    manifest = Manifest.read(out)
    assert manifest.buffers["peak_bytes"] > 0 and manifest.buffers["tensors"]
    batch_bytes = 4 * 32 * 3 * 67 * 67
    with np.load(os.path.join(out, "params.npz")) as z:
        largest_weight = max(z[n].nbytes for n in z.files if not n.startswith("__"))
    assert batch_bytes > largest_weight
    small = _variant(profile_path, tmp_path, max_alloc_bytes=batch_bytes - 1)
    # no server of this key: a run that got past the check would wait for one and time out
    args = ["--export", out, "--tracker", "127.0.0.1:9549", "--key", "probe-nobody",
            "--wait", "1", "--device-profile", small]
    assert main(["train", *args, "--data", str(tmp_path), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "the input batch (train) [32, 3, 67, 67]" in err, err
    assert "--batch 31 or less" in err and "probe-nobody" not in err, err
    # inference's batch of 1 is within it: the weights are checked, and pass
    assert isinstance(check_export(out, read_profile(small), "infer"), list)
    # a limit below the largest weight names that weight in inference too
    tiny = _variant(profile_path, tmp_path, max_alloc_bytes=largest_weight - 1)
    assert main(["infer", *args[:-1], tiny, "nothing.png"]) == 2
    assert "classifier.1.weight [409, 900]" in capsys.readouterr().err


def test_kernel_over_local_memory_and_export_keeps_the_profile(big_batch_export, profile_path,
                                                              tmp_path):
    from thomas_tune.cli.export import _check_against_profile
    out = big_batch_export
    kernels = library_kernels(os.path.join(out, "train.so"))
    assert len(kernels) > 10 and all("__kernel void" in s for s in kernels.values())
    name, need = max(((n, local_bytes(s)) for n, s in kernels.items()), key=lambda x: x[1])
    assert need > 0 and "__local" in kernels[name]
    low = _variant(profile_path, tmp_path, local_memory_bytes=need - 4)
    with pytest.raises(DeviceLimitError, match=f"kernel {name} of train.so declares {need} "):
        check_export(out, read_profile(low), "train")
    narrow = _variant(profile_path, tmp_path, max_work_group_size=64)
    with pytest.raises(DeviceLimitError, match="max_threads_per_block"):
        check_export(out, read_profile(narrow), "infer")
    # export with a profile: checked, and kept in the export for train and infer to find
    ns = argparse.Namespace(device_profile=str(profile_path), log=None, out=out)
    _check_against_profile(ns)
    assert json.loads(open(os.path.join(out, PROFILE_FILE)).read())["key"] == "probe-tt"
    ns.device_profile = low
    with pytest.raises(DeviceLimitError, match=name):
        _check_against_profile(ns)


def test_runner_bounds_follow_the_probed_compile_time(profile_path, tmp_path):
    profile = read_profile(str(profile_path))
    compile_s, trial_s, how = runner_bounds(None)
    assert (compile_s, trial_s) == (30.0, 20.0) and "no device profile" in how
    profile["measured"]["compile_s_max"] = 6.5  # a phone's compiler (issue 65)
    compile_s, _, how = runner_bounds(profile)
    assert compile_s == 130.0 and "6.5 s" in how
    profile["measured"]["compile_s_max"] = 0.2
    assert runner_bounds(profile)[0] == COMPILE_FLOOR_S
    assert runner_bounds(profile, compile_timeout_s=7.0, trial_timeout_s=3.0)[:2] == (7.0, 3.0)
    profile["measured"]["launch_us"] = 5000.0  # 3 x 1000 launches of 5 ms: 15 s, x4
    assert runner_bounds(profile)[1] == 60.0
    # tune finds the profile beside its tuning log
    from thomas_tune.cli.tune import _bounds
    profile["measured"]["compile_s_max"] = 2.5
    (tmp_path / PROFILE_FILE).write_text(json.dumps(profile))
    ns = argparse.Namespace(device_profile=None, compile_timeout=None, trial_timeout=None,
                            repeat=3)
    assert _bounds(ns, str(tmp_path)) == {"compile_timeout_s": 50.0, "trial_timeout_s": 60.0}
    ns.compile_timeout = 12.0
    assert _bounds(ns, str(tmp_path))["compile_timeout_s"] == 12.0
    assert _bounds(ns, str(tmp_path / "elsewhere"))["trial_timeout_s"] == 20.0


def test_session_timeout_zero_is_refused(big_batch_export, capsys):
    from thomas_tune.remote import RemoteDevice
    with pytest.raises(ValueError, match="session timeout 0"):
        RemoteDevice(("127.0.0.1", 9549), "k", 0)
    assert RemoteDevice(("127.0.0.1", 9549), "k").session_timeout_s == 900
    assert main(["infer", "--export", big_batch_export, "--tracker", "127.0.0.1:9549",
                 "--key", "probe-nobody", "--session-timeout", "0", "x.png"]) == 2
    assert "--session-timeout 0" in capsys.readouterr().err
