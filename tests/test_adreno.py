"""The phone's target executed: the training and inference builds of MobileNetV2 and AlexNet
compiled for TVM's ``qcom/adreno-opencl`` tag and for the Adreno 540 limits of
``targets/adreno540_opencl.json`` (docs/android.md), with default schedules, run on PoCL and
checked against PyTorch in float64: the training step's loss and every gradient
(:mod:`thomas_tune.step_check`), and the inference logits.

Small sizes here (the 224-px builds run on the GPU machine: docs/android.md). MobileNetV2 runs
with the shipped weights pretrained on digits 0-4 (the demo's, of the same width, resolution and
classes), not freshly initialised ones: at batch 4 with BatchNorms over 16 values, a randomly
initialised MobileNetV2 amplifies float32 rounding so much that PyTorch's own float32 step is
1e-4 from float64 at the last ReLU6 (3e-6 with the pretrained weights), while pre-activations
lie within 2e-5 of the kink on every batch: any float32 build then takes the other side of a
kink on some batches, PyTorch's included, and the check fails on about one draw in twenty
(docs/journal/precision.md). The check batches are drawn fresh on every run. An Adreno or
Android OpenCL target makes dlight's rules switch to their Adreno configurations; the default
schedules keep dlight's generic ones (:func:`thomas_tune.schedules.dlight_target`), and the
last test shows why on the kernels that the Adreno configuration gets wrong.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tvm

from thomas_tune.compiler.export import export
from thomas_tune.models import build
from thomas_tune.runtime import Session
from thomas_tune.export_check import check_export
from thomas_tune.target import parse_target

from build_cache import export as shared_export  # the session's build of these inputs
from conftest import SMALL, random_tensors
from opencl_kernels import NEEDS_OPENCL

pytestmark = NEEDS_OPENCL
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A540 = os.path.join(ROOT, "targets", "adreno540_opencl.json")
TARGETS = {"qcom/adreno-opencl": "qcom/adreno-opencl", "adreno540": A540}
BATCH = 4


#: MobileNetV2 for the product's target (the Adreno 540's limits), AlexNet for both: the two
#: targets differ only in shared memory per block (32 KB and TVM's tag's 16 KB)
CASES = [("adreno540", "mobilenet_v2"), ("adreno540", "alexnet"),
         ("qcom/adreno-opencl", "alexnet")]


@pytest.mark.parametrize("which,name", CASES)
def test_adreno_builds_compute_the_float64_step_on_pocl(name, which, tmp_path, rng):
    torch = pytest.importorskip("torch")
    from thomas_tune.reference import torch_module
    target = parse_target(TARGETS[which])
    assert target.kind.name == "opencl" and target.attrs["device"] == "adreno"
    if which == "adreno540":
        assert int(target.attrs["max_shared_memory_per_block"]) == 32768
    model = build(name, **SMALL[name])
    tensors = random_tensors(model, rng)
    if name == "mobilenet_v2":  # module docstring: why pretrained weights
        from thomas_tune.demo import pretrained_path
        from thomas_tune.models import load_checkpoint
        pretrained, tensors, _ = load_checkpoint(pretrained_path())
        assert pretrained.num_classes == model.num_classes
    out = str(tmp_path / "export")
    shared_export(out, model, tensors, target, batch=BATCH, infer_batch=2, trainable="all",
                  progress=lambda *_: None)

    # the training step: loss and every gradient against float64
    checked = check_export(out, seed=int(rng.integers(1 << 30)))
    print(f"{name} {which}: {checked.line()}")
    assert checked.ok, checked.line()

    # the inference build: logits against float64
    x = rng.standard_normal(model.input_shape(2)).astype("float32")
    got = Session(out).predict(x)
    net = torch_module(model, tensors, dtype="float64")
    with torch.no_grad():
        ref = net(torch.tensor(x, dtype=torch.float64)).numpy()
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    print(f"{name} {which}: inference max rel err {err:.1e}")
    assert err < 1e-4, err


def test_dlight_adreno_configuration_is_kept_out_of_default_schedules(rng):
    """The kernels of MobileNetV2's step that dlight's Adreno ``Matmul`` configuration got
    wrong (the data gradient of a 1x1 convolution fused with the ReLU6 mask: it vectorizes the
    mask, which TVM's OpenCL compared as -1 with 0), scheduled by dlight directly for the
    Adreno tag and for a generic OpenCL target with the same limits, run on PoCL: both compute
    right through the build's vector-cast rewrite (``schedules/bool_casts.py``); the default
    schedules of the Adreno tag are the generic ones, and right."""
    import tvm_ffi
    from tvm.s_tir import dlight as dl

    from thomas_tune.training_graph import graph as G
    from thomas_tune import kernel_check as kc
    from thomas_tune import kernel_reference as kr
    from thomas_tune.measure.builder import build_candidate
    from thomas_tune.schedules import dlight_target
    from thomas_tune.tasks import fuse
    model = build("mobilenet_v2", **SMALL["mobilenet_v2"])
    # BatchNorm in inference form, so that ReLU6's gradient is a mask the 1x1 data gradient
    # fuses (in training form it is inside BatchNorm's own backward kernel)
    mod = fuse(G.training_module(model, BATCH, "all,frozen-bn", None).mod)
    adreno = parse_target("qcom/adreno-opencl")
    generic = dlight_target(adreno)
    assert generic.attrs["device"] == "generic" and "adreno" not in generic.keys
    assert int(generic.attrs["max_shared_memory_per_block"]) == 16384
    assert dlight_target(parse_target("opencl")).export() == parse_target("opencl").export()
    android = parse_target("opencl", "android-aarch64")  # dlight reads the host too
    assert "android" not in str(dlight_target(android).host)
    masked = [(gv.name_hint, f) for gv, f in mod.functions.items()
              if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint.startswith(
                  "fused_conv2d_transpose") and gv.name_hint.endswith("_where1")]
    assert masked, "no 1x1 data gradient fused with the ReLU6 mask in the step"
    name, func = masked[0]
    one = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    dev = tvm.opencl(0)

    def scheduled(target):
        with target:
            return dl.gpu.Matmul().apply(one["main"], target, False).mod

    spec = kc.check_spec(one["main"])
    ref = build_candidate(scheduled(generic), generic)
    args, expected = kr.reference_outputs(ref["main"], dev, one["main"],
                                          int(rng.integers(1 << 30)), spec)
    adreno_lib = build_candidate(scheduled(adreno), adreno)
    assert "select(" in adreno_lib.imports[0].inspect_source()  # the vectorized mask
    assert kc.compare(kr.run_checked(adreno_lib["main"], dev, args), expected, spec.tol) is None
    default = kc.default_kernel(one, adreno)
    assert tvm_ffi.structural_equal(default["main"], kc.default_kernel(one, generic)["main"])
    assert kc.compare(kr.run_checked(build_candidate(default, adreno)["main"], dev, args),
                      expected, spec.tol) is None


def test_tuned_records_for_the_adreno_target_compute_the_float64_step(tmp_path, rng):
    """AlexNet tuned for ``qcom/adreno-opencl`` on PoCL (a few trials over a loopback
    tracker), exported with its tuning log: the applied records are checked, and the step's
    loss and gradients stay within the untuned build's error of float64."""
    pytest.importorskip("torch")
    from thomas_tune import rpc
    from thomas_tune.cli import main
    from thomas_tune.logs import TuningLog
    from thomas_tune.tuning.defaults import DEFAULT_LATENCY
    model = build("alexnet", **SMALL["alexnet"])
    tensors = random_tensors(model, rng)
    log = tmp_path / "log"
    small = ["--model", "alexnet", "--width", "0.1", "--resolution", "67", "--classes", "5",
             "--batch", str(BATCH), "--target", "qcom/adreno-opencl"]
    with rpc.loopback(key="pocl-adreno", servers=1, lifetime=600) as addr:
        assert main(["tune", *small, "--tracker", f"{addr[0]}:{addr[1]}", "--key",
                     "pocl-adreno", "--top", "2", "--trials", "8", "--trials-per-iter", "4",
                     "--population", "8", "--genetic-iters", "1", "--build-workers", "1",
                     "--log", str(log)]) == 0
    # the build applies a record only where it beats the default schedule's time in the log;
    # without those times every record is applied (compile.tuned_build), so that the records
    # of 8 trials, faster or not, reach the build and its check whatever the search found
    os.remove(log / DEFAULT_LATENCY)
    target = parse_target("qcom/adreno-opencl")
    quiet = dict(batch=BATCH, trainable="all", progress=lambda *_: None)
    untuned, tuned = str(tmp_path / "untuned"), str(tmp_path / "tuned")
    # the untuned build is the one the test above checks (infer_batch does not change the step)
    shared_export(untuned, model, tensors, target, infer_batch=2, **quiet)
    manifest = export(tuned, model, tensors, target, log=TuningLog(str(log)), **quiet)
    assert manifest.record_check["checked"] >= 1 and not manifest.record_check["wrong"]
    seed = int(rng.integers(1 << 30))
    base = check_export(untuned, seed=seed)
    checked = check_export(tuned, seed=seed)
    print(f"tuned for qcom/adreno-opencl: {checked.line()} (untuned: {base.line()})")
    assert base.ok and checked.ok, checked.line()
