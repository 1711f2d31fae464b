"""The bench verb's pieces and the OpenCL program-binary cache, on PoCL and llvm.

Cache: a second process loading the same OpenCL module creates its program from the cached
binary and compiles no OpenCL C; a damaged cache file, or one the driver refuses, falls back to
a source build and is rewritten. Each load runs in a fresh process (as a second start does).
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import te

from thomas_tune import opencl

from opencl_kernels import NEEDS_OPENCL as needs_opencl  # the one OpenCL guard

CHILD = r"""
import json, sys
import numpy as np, tvm
from thomas_tune import compiler_available, opencl
n, seed = int(sys.argv[2]), int(sys.argv[3])
x = np.random.default_rng(seed).standard_normal(n).astype("float32")
dev = tvm.opencl(0)
lib = tvm.runtime.load_module(sys.argv[1])
a = tvm.runtime.tensor(x, dev)
c = tvm.runtime.tensor(np.empty(n, "float32"), dev)
lib["main"](a, c)
err = float(np.max(np.abs(c.numpy() - (x * 3.0 + np.exp(x * 0.25)))))
print(json.dumps({"err": err, "relax": "tvm.relax" in sys.modules,
                  "compiler": compiler_available(), **opencl.stats()}))
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


def _start(library, cache, rng, **extra_env):
    env = dict(os.environ, THOMAS_TUNE_OPENCL_CACHE=str(cache), **extra_env)
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


@needs_opencl
def test_opencl_sidecar_runs_under_runtime_only_tvm(kernel_library, tmp_path, rng):
    """The sidecar (linked against libtvm_runtime alone) loads and runs an exported OpenCL
    kernel in a process whose TVM has no compiler, and uses the binary cache there too."""
    cache = tmp_path / "cache"
    first, _ = _start(kernel_library, cache, rng, TVM_USE_RUNTIME_LIB="1")
    assert not first["compiler"] and not first["relax"]
    assert (first["source_builds"], first["binary_writes"]) == (1, 1)
    second, _ = _start(kernel_library, cache, rng, TVM_USE_RUNTIME_LIB="1")
    assert (second["source_builds"], second["binary_loads"]) == (0, 1)


# ---- bench pieces (llvm: this machine's CPU) ----------------------------------------------------
@pytest.fixture(scope="module")
def small_export(tmp_path_factory):
    """A small AlexNet (width 0.1, 67x67, 5 classes, batch 2) exported with default schedules."""
    from thomas_tune.compiler.export import export
    from thomas_tune.models import build, init_params
    from thomas_tune.target import parse_target
    model = build("alexnet", num_classes=5, resolution=67, width=0.1)
    out = str(tmp_path_factory.mktemp("bench") / "export")
    export(out, model, init_params(model, seed=3), parse_target("llvm"), batch=2,
           trainable="all", progress=lambda m: None)
    return out


def test_kernels_of_the_step_are_those_of_the_export(small_export):
    """Every kernel the bench derives from the graph is in the exported library, runs on random
    inputs, and the kernels' time per step is of the order of the measured step."""
    import tvm
    from thomas_tune.benchmark import exported_training_module, step_kernels, time_export, \
        time_kernels
    from thomas_tune.training_graph.graph import training_module
    from thomas_tune.models import load_checkpoint
    model, _, _ = load_checkpoint(small_export + "/params.npz")
    tg = training_module(model, 2, "all")
    kernels = step_kernels(exported_training_module(tg))
    assert kernels and all(k.calls >= 1 and k.args for k in kernels)
    assert sum(k.flops * k.calls for k in kernels) > 0
    time_kernels(small_export + "/train.so", kernels, tvm.cpu(), "default", min_ms=1,
                 progress=False)
    ms = [k.ms["default"] for k in kernels]
    assert all(np.isfinite(m) and m > 0 for m in ms), [k.name for k in kernels
                                                        if not np.isfinite(k.ms["default"])]
    kernel_ms = sum(k.ms["default"] * k.calls for k in kernels)
    step = time_export(small_export, steps=5)
    # the step runs these kernels once each per call, plus the VM's host work: the kernels
    # timed alone sum to a little less than the step (0.75-0.92 of it over 20 runs on 2 loaded
    # cores); a kernel list that misses half the step, or counts calls twice, is outside
    assert 0.4 < kernel_ms / step["train_ms"] < 1.25, (kernel_ms, step)


LOCAL_LOG = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tuning_logs", "local-cpu",
                         "mobilenet_v2-w0.35-r64-c10-b8")


def test_tuning_curve_replays_the_log():
    """The curve starts at the default-schedule estimate, never rises, counts the step's records
    and ends at min(default, best record) per workload (best records read through
    MetaSchedule's database, not the curve's own parser)."""
    from thomas_tune.benchmark import exported_training_module, mark_tuned, step_kernels, \
        tuning_curve
    from thomas_tune.training_graph.graph import training_module
    from thomas_tune.models import build
    from thomas_tune.logs import TuningLog
    model = build("mobilenet_v2", num_classes=10, resolution=64, width=0.35)
    kernels = step_kernels(exported_training_module(training_module(model, 8, "all")))
    rng = np.random.default_rng()
    for k in kernels:  # default-schedule times: random, some slower than any record
        k.ms["default"] = float(rng.choice([1e-4, 10.0]))
    assert mark_tuned(kernels, LOCAL_LOG) > 0
    curve = tuning_curve(LOCAL_LOG, kernels)
    ms = np.array(curve["ms"])
    assert curve["trials"] == list(range(len(ms)))
    assert np.all(np.diff(ms) <= 1e-9)
    assert ms[0] == pytest.approx(sum(k.ms["default"] * k.calls for k in kernels))
    db = TuningLog(LOCAL_LOG).database()
    want = 0.0
    for k in kernels:
        best = k.ms["default"]
        if k.tuned:
            recs = db.get_top_k(db.commit_workload(k.mod), 1)
            best = min(best, 1e3 * float(np.mean([float(s) for s in recs[0].run_secs])))
        want += best * k.calls
    assert ms[-1] == pytest.approx(want, rel=1e-6)
    assert curve["trials_to_95pct"] is None or 0 < curve["trials_to_95pct"] <= curve["trials"][-1]


def test_bench_times_no_build_with_a_wrong_gradient(small_export, tmp_path, monkeypatch,
                                                   capsys):
    """The export's first convolution's bias gradient 1% off as the bench reads it (what a
    reduction kernel writing it wrong returns): the bench's check fails it by name and it is
    not timed."""
    import mutants as M

    from thomas_tune import export_check
    from thomas_tune.cli import main
    real = export_check.export_step

    def wrong(*args, **kwargs):
        loss, grads = real(*args, **kwargs)
        return loss, M.param_mutant(grads, "features.0.bias", 1.01)

    monkeypatch.setattr(export_check, "export_step", wrong)
    out = tmp_path / "bench.json"
    main(["bench", "--export", small_export, "--steps", "2", "--kernels", "2", "--no-torch",
          "--no-startup", "--quiet", "--json", str(out)])
    text = capsys.readouterr().out
    assert "default: not timed, its numbers are wrong" in text, text
    res = json.loads(out.read_text()) if out.exists() else {"checks": {}}
    if res["checks"]:
        assert res["checks"]["default"]["failing"] == ["features.0.bias"], res["checks"]


def test_bench_verb_on_an_export(small_export, tmp_path, capsys):
    from thomas_tune.cli import main
    out = tmp_path / "bench.json"
    assert main(["bench", "--export", small_export, "--steps", "3", "--kernels", "4",
                 "--no-torch", "--no-startup", "--quiet", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    v = res["variants"]["default"]
    assert v["train_ms"] > 0 and v["infer_ms"] > 0 and v["kernels_failed"] == 0
    # timed only after its loss and every gradient were checked against PyTorch float64
    check = res["checks"]["default"]
    assert check["ok"] and len(check["errors"]) == 16, check
    assert all(check["errors"][n] <= check["bounds"][n] <= 1e-2 for n in check["errors"]), check
    # the small AlexNet's step reached 2.0-2.6% of the measured FMA peak over 20 runs on 2
    # loaded cores: a FLOP count or a peak off by 4x either way is outside
    assert 0.005 < v["share_of_peak_flops"] < 0.1 and res["peaks"]["gflops"] > 0, v
    assert len(res["kernels"]) == res["step"]["kernels"]
    text = capsys.readouterr().out
    assert "slowest kernels of the default training step" in text
    assert res["kernels"][0]["name"] in text


@pytest.fixture(scope="module")
def frozen_features_export(tmp_path_factory):
    """The small AlexNet of :func:`small_export` exported with its classifier alone trainable
    (last:3; the features frozen). torch.compile 2.13's inductor computes zero gradients for
    this AlexNet's convolutions on the CPU when they train (its max-pool backward is scheduled
    after the kernel that reads its result, where the adaptive average pool widens 2x2 to 6x6):
    the bench's check rejects that side, rightly, so the test that times it trains the
    classifier."""
    from thomas_tune.compiler.export import export
    from thomas_tune.models import build, init_params
    from thomas_tune.target import parse_target
    model = build("alexnet", num_classes=5, resolution=67, width=0.1)
    out = str(tmp_path_factory.mktemp("bench") / "export-last3")
    export(out, model, init_params(model, seed=3), parse_target("llvm"), batch=2,
           trainable="last:3", progress=lambda m: None)
    return out


def test_bench_times_torch_compile_after_checking_it(frozen_features_export, tmp_path, capsys):
    """--torch-compile adds PyTorch under torch.compile: compiled before the timed rounds (its
    compile time apart, nothing compiled inside them), its loss and every trainable gradient
    checked against PyTorch float64 as an export's are and against PyTorch eager float32 on
    the same batches, then timed with the others, with the eager side's fields, its row and
    the build's speed-up over it."""
    pytest.importorskip("torch")
    from thomas_tune.cli import main
    out = tmp_path / "bench.json"
    assert main(["bench", "--export", frozen_features_export, "--steps", "3", "--warmup", "1",
                 "--kernels", "0", "--no-startup", "--torch-compile", "--quiet",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["skipped"] == {}, res["skipped"]
    check = res["checks"]["torch.compile"]
    assert check["ok"], check["line"]
    trainable = {f"classifier.{i}.{k}" for i in (1, 4, 6) for k in ("weight", "bias")}
    assert set(check["errors"]) == set(res["checks"]["default"]["errors"]) == trainable
    # the export's check draws dropout masks, the PyTorch side runs with dropout off: each has
    # its own float64 loss on the same batches, both finite
    assert math.isfinite(check["loss_ref"]) and math.isfinite(
        res["checks"]["default"]["loss_ref"]), (check, res["checks"]["default"])
    # the same step as PyTorch eager float32 to float32 rounding: a gradient of a kernel
    # fused wrongly is off by 1e-2..1
    eager = check["against_eager"]
    assert set(eager["errors"]) == trainable and max(eager["errors"].values()) < 1e-4, eager
    assert eager["loss_err"] < 1e-6, eager
    v = res["variants"]["torch.compile"]
    assert v["checked"] and "torch.compile" in v["device"], v
    assert set(res["variants"]["torch"]) <= set(v)
    for key in ("train_ms", "infer_ms", "compile_s", "train_images_per_s",
                "infer_images_per_s", "share_of_peak_flops"):
        assert np.isfinite(v[key]) and v[key] > 0, (key, v[key])
    assert v["train_ms_spread"]["n"] == v["infer_ms_spread"]["n"] == 3
    assert v["graphs"] >= 2 and v["recompiled_while_timed"] == 0, v
    text = capsys.readouterr().out
    assert "\ntorch.compile " in text and "default vs torch.compile: " in text, text


NO_CXX_CHILD = r"""
import sys
import torch._inductor.config as inductor_config
inductor_config.cpp.cxx = (None, sys.argv[1])  # the one C++ compiler inductor may use: none
from thomas_tune.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_bench_names_why_torch_compile_cannot_run(small_export, tmp_path):
    """Where torch.compile cannot compile (here inductor finds no C++ compiler for the CPU),
    bench names the cause and the fix, times the other sides and reports no compiled side:
    no eager step stands in for it."""
    pytest.importorskip("torch")
    out = tmp_path / "bench.json"
    missing = str(tmp_path / "no-such-c++")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # nothing cached
    proc = subprocess.run([sys.executable, "-c", NO_CXX_CHILD, missing, "bench", "--export",
                           small_export, "--steps", "2", "--warmup", "1", "--kernels", "0",
                           "--no-startup", "--no-torch", "--torch-compile", "--quiet",
                           "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert "torch.compile" not in res["variants"] and res["variants"]["default"]["train_ms"] > 0
    why = res["skipped"]["torch.compile"]
    assert "InvalidCxxCompiler" in why and missing in why and "install a C++ compiler" in why, why
    assert f"torch.compile not timed: {why}" in proc.stdout, proc.stdout
    assert "vs torch.compile" not in proc.stdout


@needs_opencl
def test_device_timer_spans_the_recorded_kernels(kernel_library, rng):
    """record_start/record_stop time exactly the kernels launched between them, by the
    device's profiling events: n launches give n kernels, their busy time lies within their
    span, and the span within the host's clock around them (it cannot include work before
    the first launch or after the last); a second recording starts empty."""
    import time
    dev = tvm.opencl(0)
    lib = tvm.runtime.load_module(kernel_library)
    x = rng.standard_normal(4099).astype("float32")
    a, c = tvm.runtime.tensor(x, dev), tvm.runtime.tensor(np.empty(4099, "float32"), dev)
    lib["main"](a, c)
    dev.sync()
    n = int(rng.integers(3, 9))
    opencl.record_start()
    t0 = time.perf_counter()
    for _ in range(n):
        lib["main"](a, c)
    dev.sync()
    wall_ms = (time.perf_counter() - t0) * 1e3
    r = opencl.record_stop()
    assert r["kernels"] == n, r
    assert 0 < r["busy_ms"] <= r["span_ms"] * (1 + 1e-6) + 1e-6, r
    assert r["span_ms"] <= wall_ms, (r, wall_ms)
    opencl.record_start()
    assert opencl.record_stop() == {"kernels": 0, "busy_ms": 0.0, "span_ms": 0.0}
    np.testing.assert_allclose(c.numpy(), x * 3.0 + np.exp(x * 0.25), rtol=1e-5, atol=1e-5)


@needs_opencl
def test_opencl_peaks_cached_per_device(tmp_path, monkeypatch):
    import tvm
    from thomas_tune.benchmark import measure_peaks
    monkeypatch.setenv("THOMAS_TUNE_CACHE", str(tmp_path))
    target = opencl.target_for(0)
    first = measure_peaks(target, tvm.opencl(0), min_ms=2)
    assert not first["cached"] and first["gflops"] > 0.1 and first["gbytes_per_s"] > 0.1
    again = measure_peaks(target, tvm.opencl(0))
    assert again["cached"] and again["gflops"] == first["gflops"]
    assert (tmp_path / "peaks.json").exists()


def test_runtime_import_leaves_torch_out():
    """A second start's time is mostly imports: loading and running an export must not import
    PyTorch (tvm_ffi and tvm.relax would, when it is installed), and torch still works after."""
    pytest.importorskip("torch")
    code = ("import sys, thomas_tune.runtime; assert 'torch' not in sys.modules, 'torch imported'; "
            "import torch; print(torch.ones(2).sum().item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0"


RUNTIME_ONLY_CHILD = r"""
import json, sys
import numpy as np
from thomas_tune import compiler_available
from thomas_tune.models import build, spec
from thomas_tune.runtime import Session
data = np.load(sys.argv[2])
s = Session(sys.argv[1])
loss = s.train_step(data["x"], data["y"])
np.save(sys.argv[3], s.predict(data["x"][:1]))
s.save(sys.argv[4])
specs = {}
for arch, config in json.loads(sys.argv[5]).items():
    for mode in ("train", "infer"):
        m = spec(build(arch, **config), 3, mode)
        specs[f"{arch}/{mode}"] = [[[p.name, list(p.shape), p.block, p.init] for p in m.params],
                                   [[p.name, list(p.shape), p.block, p.init] for p in m.states],
                                   m.blocks, {k: [list(v[0]), v[1]] for k, v in m.masks.items()}]
print(json.dumps({"loss": loss, "compiler": compiler_available(),
                  "relax": sorted(k for k in sys.modules if k.startswith("tvm.relax")),
                  "torch": "torch" in sys.modules, "specs": specs}))
"""


def test_export_runs_in_a_runtime_only_process(small_export, tmp_path, rng):
    """A process started with TVM_USE_RUNTIME_LIB=1 (TVM's runtime library alone, as a deployed
    second start) imports no tvm.relax, yet loads the export, runs a training step with the
    loss, updated weights and checkpoint of a normal process, and traces the models' specs
    (shapes only there) as Relax does."""
    from conftest import SMALL
    from thomas_tune.models import build, load_checkpoint, spec
    from thomas_tune.runtime import Session
    s = Session(small_export)
    x = rng.standard_normal(s.model.input_shape(s.batch)).astype("float32")
    y = rng.integers(0, s.model.num_classes, s.batch)
    np.savez(tmp_path / "batch.npz", x=x, y=y)
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    proc = subprocess.run([sys.executable, "-c", RUNTIME_ONLY_CHILD, small_export,
                           str(tmp_path / "batch.npz"), str(tmp_path / "logits.npy"),
                           str(tmp_path / "after.npz"), json.dumps(SMALL)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not out["compiler"] and out["relax"] == [] and not out["torch"]
    loss = s.train_step(x, y)  # this process: TVM with its compiler, tvm.relax imported
    assert np.isfinite(loss) and abs(out["loss"] - loss) <= 1e-5, (out["loss"], loss)
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), s.predict(x[:1]),
                               rtol=1e-5, atol=1e-5)
    model, tensors, _ = load_checkpoint(str(tmp_path / "after.npz"))
    assert (model.arch, model.config()) == (s.model.arch, s.model.config())
    mine = s.tensors()
    assert tensors.keys() == mine.keys()
    for k in mine:
        np.testing.assert_allclose(tensors[k], mine[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for arch, config in SMALL.items():
        for mode in ("train", "infer"):
            m = spec(build(arch, **config), 3, mode)
            assert out["specs"][f"{arch}/{mode}"] == [
                [[p.name, list(p.shape), p.block, p.init] for p in m.params],
                [[p.name, list(p.shape), p.block, p.init] for p in m.states],
                m.blocks, {k: [list(v[0]), v[1]] for k, v in m.masks.items()}]


def test_compiling_verbs_refuse_a_runtime_only_process(tmp_path):
    """Under TVM_USE_RUNTIME_LIB=1 a verb that compiles exits with status 2 and says why."""
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    proc = subprocess.run([sys.executable, "-m", "thomas_tune.cli", "export", "--model",
                           "alexnet", "--out", str(tmp_path / "x")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "TVM_USE_RUNTIME_LIB" in proc.stderr, proc.stderr
    assert not (tmp_path / "x").exists()


def test_an_unchecked_time_is_marked_and_enters_no_ratio():
    """A build whose numbers were not checked (no PyTorch, or the check off) is printed marked
    unchecked and is in no speed-up; with both builds checked the ratio is printed."""
    from thomas_tune.benchmark.report import format_report

    def variant(ms, checked):
        return {"train_ms": ms, "train_images_per_s": 8e3 / ms, "infer_ms": ms / 3,
                "infer_images_per_s": 3e3 / ms, "share_of_peak_flops": 0.1,
                "share_of_peak_bandwidth": 0.2, "checked": checked}

    res = {"model": {"arch": "alexnet", "width": 0.1, "resolution": 67, "num_classes": 5},
           "batch": 8, "infer_batch": 1, "trainable": "all", "trainable_params": 16,
           "optimizer": "momentum_sgd", "device": "cpu",
           "peaks": {"gflops": 100.0, "gbytes_per_s": 10.0, "method": "fma loop"},
           "step": {"calls": 40, "gflop": 0.1, "argument_gbytes": 0.01}, "checks": {},
           "variants": {"default": variant(10.0, False), "tuned": variant(5.0, False)}}
    text = format_report(res)
    assert text.count("(unchecked: its numbers were not compared)") == 2, text
    assert "speed-up" not in text and "2.00x" not in text, text
    res["variants"] = {"default": variant(10.0, True), "tuned": variant(5.0, True)}
    text = format_report(res)
    assert "unchecked" not in text, text
    assert "tuned vs default: 2.00x (training, host clock)" in text, text


def test_the_table_prints_megabytes_per_step_beside_the_peak():
    """A variant's bytes per step (the sidecar's launch_arg_bytes over the steps) are printed in
    MB (10^6 bytes) in their own column beside the device peak; a variant without the counters
    (off OpenCL) prints a dash there."""
    from thomas_tune.benchmark.report import format_report
    row = {"train_ms": 10.0, "train_images_per_s": 800.0, "infer_ms": 3.0,
           "infer_images_per_s": 333.0, "share_of_peak_flops": 0.1,
           "share_of_peak_bandwidth": 0.2, "launches_per_step": 120,
           "device_peak_bytes": 21_500_000, "launch_arg_bytes_per_step": 123_456_789}
    res = {"model": {"arch": "alexnet", "width": 0.1, "resolution": 67, "num_classes": 5},
           "batch": 8, "infer_batch": 1, "trainable": "all", "trainable_params": 16,
           "optimizer": "momentum_sgd", "device": "cpu",
           "peaks": {"gflops": 100.0, "gbytes_per_s": 10.0, "method": "fma loop"},
           "step": {"calls": 40, "gflop": 0.1, "argument_gbytes": 0.01}, "checks": {},
           "variants": {"default": row,
                        "tuned": dict(row, launch_arg_bytes_per_step=None)}}
    lines = format_report(res).splitlines()
    header = next(ln for ln in lines if ln.startswith("variant"))
    col = header.index("MB/step")
    default = next(ln for ln in lines if ln.startswith("default "))
    tuned = next(ln for ln in lines if ln.startswith("tuned "))
    assert default[col - 1:col + 7].strip() == "123.5", (header, default)
    assert tuned[col - 1:col + 7].strip() == "-", (header, tuned)
    assert "21.5" in default
