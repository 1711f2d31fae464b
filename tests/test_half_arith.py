"""Native half arithmetic (``--precision autocast16``, thomas_tune.half_arith).

No device here runs it: PoCL reports no ``cl_khr_fp16``. What is checked instead:

* the choice: the precision is accepted only where the device reports ``cl_khr_fp16`` (a
  device profile, a server's extension list, the target's device family), refused otherwise
  with the extension and ``--precision mixed16`` named, both ways;
* the build: an Adreno export at autocast16 keeps half arithmetic and the ``cl_khr_fp16``
  pragma in its OpenCL C (the native form), the same target at mixed16 gets the
  ``vload_half`` / ``vstore_half`` form, and a target without the extension is refused before
  anything compiles;
* the source: every kernel of the native form compiles with clang (OpenCL C 2.0 for SPIR,
  ``cl_khr_fp16`` defined), into LLVM IR with float16 additions, and fails with the extension
  undefined; PoCL's compiler refuses it;
* the numbers, on llvm (the CPU computes float16 arithmetic as LLVM's ``half``, each
  operation rounded): a graph of two convolutions, a bias, a ReLU and a residual add, each
  result against a float64 PyTorch reference computed from the build's own inputs, rounded to
  float16 where autocast rounds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A540 = os.path.join(ROOT, "targets", "adreno540_opencl.json")
N, C, H = 2, 8, 10


def _profile(extensions: str | None = None, fp16: bool | None = None) -> dict:
    props = {"device_name": "a device"}
    if extensions is not None:
        props["extensions"] = extensions
    if fp16 is not None:
        props["fp16"] = fp16
    return {"key": "k", "properties": props, "sources": {"fp16": "a kernel with half "
                                                                  "arithmetic built"}}


def test_the_precision_is_taken_only_where_the_device_reports_cl_khr_fp16():
    from thomas_tune.half_arith import fp16_evidence, require_fp16
    from thomas_tune.target import parse_target

    adreno, generic = parse_target(A540), parse_target('{"kind": "opencl"}')
    assert fp16_evidence(adreno)[0] and fp16_evidence(parse_target("qcom/adreno-opencl"))[0]
    assert not fp16_evidence(generic)[0]
    # a profile decides, either way
    assert not fp16_evidence(adreno, profile=_profile("cl_khr_icd cl_khr_fp64"))[0]
    assert fp16_evidence(generic, profile=_profile("cl_khr_icd cl_khr_fp16"))[0]
    assert not fp16_evidence(adreno, profile=_profile(fp16=False))[0]
    assert fp16_evidence(generic, profile=_profile(fp16=True))[0]
    # so does a server's extension list (opencl:remote from thomas_tune's server)
    assert fp16_evidence(generic, limits={"opencl": {"extensions": "cl_khr_fp16"}})[0]
    assert not fp16_evidence(adreno, limits={"opencl": {"extensions": "cl_khr_fp64"}})[0]
    assert not fp16_evidence(parse_target('{"kind": "cuda"}'))[0]
    assert require_fp16("autocast16", adreno) is not None
    assert require_fp16("mixed16", generic) is None
    for target, kw in ((generic, {}), (adreno, {"profile": _profile("cl_khr_icd")})):
        with pytest.raises(ValueError, match="cl_khr_fp16.*--precision mixed16"):
            require_fp16("autocast16", target, **kw)


def test_export_refuses_autocast16_for_a_device_without_the_extension(tmp_path, target):
    """PoCL's target (``opencl:0``, device family generic): refused before anything is
    compiled, naming the extension and the fix; the same with PoCL's own profile."""
    from thomas_tune.compiler.export import export
    from thomas_tune.models import build, init_params
    from conftest import SMALL

    model = build("alexnet", **SMALL["alexnet"])
    out = tmp_path / "export"
    with pytest.raises(ValueError, match="cl_khr_fp16.*use --precision mixed16"):
        export(str(out), model, init_params(model), target, batch=4, precision="autocast16",
               progress=lambda *_: None)
    assert not out.exists() or not os.listdir(out)
    # an Adreno target with a profile of a device without the extension: refused too
    from thomas_tune.target import parse_target
    with pytest.raises(ValueError, match="lacks cl_khr_fp16"):
        export(str(out), model, init_params(model), parse_target(A540), batch=4,
               precision="autocast16", device_profile=_profile("cl_khr_icd"),
               progress=lambda *_: None)


@pytest.fixture(scope="module")
def adreno_exports(tmp_path_factory):
    """Small AlexNet exported for the Adreno 540 target (this machine's host, no tuning log)
    at autocast16 and at mixed16: {precision: (folder, manifest, kernels by library)}."""
    from thomas_tune.compiler.export import export
    from thomas_tune.limits import library_kernels
    from thomas_tune.models import build, init_params
    from thomas_tune.target import parse_target
    from conftest import SMALL

    model = build("alexnet", **SMALL["alexnet"])
    said: list[str] = []
    out = {}
    for precision in ("autocast16", "mixed16"):
        folder = str(tmp_path_factory.mktemp(precision))
        manifest = export(folder, model, init_params(model), parse_target(A540), batch=4,
                          infer_batch=2, precision=precision, progress=said.append)
        kernels = {lib: library_kernels(os.path.join(folder, lib))
                   for lib in ("train.so", "inference.so")}
        out[precision] = (folder, manifest, kernels)
    assert any("reports cl_khr_fp16" in line and "'adreno'" in line for line in said), said
    return out


_HALF_ARITH = re.compile(r"\(half\)\(|max\(\(half\)|\bhalf \w+ = ")


def test_the_adreno_build_takes_the_native_form_only_at_autocast16(adreno_exports):
    _, manifest, kernels = adreno_exports["autocast16"]
    assert manifest.precision == "autocast16"
    for lib, found in kernels.items():
        source = "".join(found.values())
        assert "vload_half" not in source and "vstore_half" not in source, lib
        assert "__global half* restrict" in source and _HALF_ARITH.search(source), lib
        # the code generator's pragma block, with its #error for a device without it
        assert "#error \"Half precision floating point not supported" in source, lib
    _, manifest, kernels = adreno_exports["mixed16"]
    assert manifest.precision == "mixed16"
    source = "".join(kernels["train.so"].values())
    assert "vload_half" in source and "vstore_half" in source
    # float16 pointers declared, never loaded from or stored to, and no half arithmetic
    assert "#error" not in source and not _HALF_ARITH.search(source)


def _clang() -> str | None:
    """clang, or the newest versioned clang-N on PATH."""
    if shutil.which("clang"):
        return shutil.which("clang")
    found = sorted((int(m.group(1)), p) for d in os.environ.get("PATH", "").split(os.pathsep)
                   if os.path.isdir(d) for p in os.listdir(d)
                   if (m := re.fullmatch(r"clang-(\d+)", p)))
    return shutil.which(found[-1][1]) if found else None


def _clang_cl(source: str, tmp_path, fp16: bool) -> subprocess.CompletedProcess:
    """``source`` compiled by clang as OpenCL C 2.0 for SPIR (LLVM IR out, printed), with
    ``cl_khr_fp16`` defined or undefined."""
    path = tmp_path / "kernels.cl"
    path.write_text(source)
    ext = "+cl_khr_fp16" if fp16 else "-cl_khr_fp16"
    return subprocess.run([_clang(), "-x", "cl", "-cl-std=CL2.0", "-Xclang", f"-cl-ext={ext}",
                           "-target", "spir64", "-S", "-emit-llvm", "-o", "-", str(path)],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def mobilenet_native(tmp_path_factory):
    """Small MobileNetV2 (training BatchNorms, depthwise convolutions, residual adds) exported
    at autocast16 for the Adreno 540 target: its kernels by library."""
    from thomas_tune.compiler.export import export
    from thomas_tune.limits import library_kernels
    from thomas_tune.models import build, init_params
    from thomas_tune.target import parse_target
    from conftest import SMALL

    model = build("mobilenet_v2", **SMALL["mobilenet_v2"])
    folder = str(tmp_path_factory.mktemp("mobilenet_v2"))
    manifest = export(folder, model, init_params(model), parse_target(A540), batch=4,
                      infer_batch=2, precision="autocast16", progress=lambda *_: None)
    assert manifest.precision == "autocast16"
    return {lib: library_kernels(os.path.join(folder, lib)) for lib in ("train.so",
                                                                       "inference.so")}


@pytest.mark.skipif(_clang() is None, reason="no clang on PATH (apt-get install clang)")
@pytest.mark.parametrize("name", ["alexnet", "mobilenet_v2"])
def test_native_source_compiles_with_cl_khr_fp16_in_clang(name, request, tmp_path):
    """Every kernel of both libraries, as one OpenCL C file: with ``cl_khr_fp16`` clang
    compiles it, its LLVM IR adding float16 values; without, it refuses it."""
    if name == "alexnet":
        kernels = request.getfixturevalue("adreno_exports")["autocast16"][2]
    else:
        kernels = request.getfixturevalue("mobilenet_native")
    for lib, found in kernels.items():
        source = "\n".join(found.values())
        done = _clang_cl(source, tmp_path, fp16=True)
        assert done.returncode == 0, (lib, done.stderr[-2000:])
        assert re.search(r"= fadd (?:fast )?half ", done.stdout), lib
        refused = _clang_cl(source, tmp_path, fp16=False)
        assert refused.returncode != 0 and "Half precision floating point not supported" in \
            refused.stderr, lib
    version = subprocess.run([_clang(), "--version"], capture_output=True, text=True)
    print(f"{_clang()}: {version.stdout.splitlines()[0]}")


def test_pocl_refuses_half_arithmetic(adreno_exports):
    """This machine's OpenCL device (PoCL) has no ``cl_khr_fp16``: its compiler refuses a
    kernel of the native form (and builds the same kernel's mixed16 form)."""
    cl = pytest.importorskip("pyopencl")
    devs = [d for p in cl.get_platforms() for d in p.get_devices()]
    if not devs:
        pytest.skip("no OpenCL device")
    dev = devs[0]
    assert "cl_khr_fp16" not in dev.extensions.split()
    ctx = cl.Context([dev])
    _, _, native = adreno_exports["autocast16"]
    name, source = next((n, s) for n, s in native["inference.so"].items()
                        if n.startswith("fused_conv2d"))
    with pytest.raises(cl.RuntimeError) as err:
        cl.Program(ctx, source).build()
    line = next((x for x in str(err.value).splitlines() if "error:" in x), "")
    print(f"{dev.platform.version} {dev.name}, {name}: {line}")
    # the build log: the code generator's #error of the pragma block (no cl_khr_fp16 defined)
    assert "Half precision floating point not supported" in line, str(err.value)[-2000:]
    _, _, mixed = adreno_exports["mixed16"]
    name, source = next((n, s) for n, s in mixed["train.so"].items() if "vload_half" in s)
    cl.Program(ctx, source).build()


# ---- the numbers on llvm ---------------------------------------------------------------------

def _graph():
    """``f(x, w1, b1, w2) -> (z, r, c, a)``: ``z = conv(x, w1) + b1``, ``r = relu(z)``,
    ``c = conv(r, w2)``, ``a = c + r``."""
    from tvm import relax
    from tvm.relax.op import add, nn

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((N, C, H, H), "float32"))
    w1 = relax.Var("w1", relax.TensorType((C, C, 3, 3), "float32"))
    b1 = relax.Var("b1", relax.TensorType((1, C, 1, 1), "float32"))
    w2 = relax.Var("w2", relax.TensorType((C, C, 3, 3), "float32"))
    with bb.function("f", [x, w1, b1, w2]):
        with bb.dataflow():
            z = bb.emit(add(nn.conv2d(x, w1, padding=1), b1))
            r = bb.emit(nn.relu(z))
            c = bb.emit(nn.conv2d(r, w2, padding=1))
            a = bb.emit(add(c, r))
            out = bb.emit_output(relax.Tuple([z, r, c, a]))
        bb.emit_func_output(out)
    return bb.get()


def _run_llvm(tmp_path):
    """:func:`_graph` with autocast16's arithmetic built for llvm, run on fresh inputs:
    (x, w1, b1, w2, z, r, c, a) as float64."""
    import tvm
    from tvm.relax import VirtualMachine

    from thomas_tune.compiler.compile import compile_graph
    from thomas_tune.half_arith import autocast_module
    from thomas_tune.target import export_shared, parse_target

    mod = autocast_module(_graph(), {"f": N})
    target = parse_target("llvm")
    path = str(tmp_path / "f.so")
    export_shared(compile_graph(mod, target), path, target)
    vm = VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
    rng = np.random.default_rng()
    ins = [rng.standard_normal((N, C, H, H)), 0.3 * rng.standard_normal((C, C, 3, 3)),
           rng.standard_normal((1, C, 1, 1)), 0.3 * rng.standard_normal((C, C, 3, 3))]
    ins = [a.astype("float32") for a in ins]
    outs = vm["f"](*[tvm.runtime.tensor(a) for a in ins])
    return [a.astype("float64") for a in ins] + [o.numpy().astype("float64") for o in outs]


def _half(a):
    return a.astype(np.float16).astype(np.float64)


def _conv64(x, w):
    import torch
    return torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), padding=1).numpy()


def _ulp16(a):
    """The spacing of float16 at ``a`` (its subnormal spacing near 0)."""
    return np.maximum(np.spacing(np.abs(a).astype(np.float16)).astype(np.float64), 2.0 ** -24)


#: each convolution result may be one float16 step from the float64 one rounded: the build
#: sums in float32 (72 products here), whose error can carry a value over a midpoint between
#: two float16 neighbours; on at most this share of the values
MIDPOINT_SHARE = 0.02

#: the products of float16 operands are exact in float32 (11 + 11 significant bits), so the
#: only float32 error of a convolution is its sum's: at most gamma_n * sum |x_i w_i| for n
#: terms (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5, with
#: u = 2^-24). Near zero that can exceed a float16 step (2^-24 among subnormals)
SUM_TERMS = C * 9
GAMMA32 = SUM_TERMS * 2.0 ** -24 / (1 - SUM_TERMS * 2.0 ** -24)


def _sum_error(x, w):
    """The bound on a float32 convolution's summation error, per output (float64)."""
    return GAMMA32 * _conv64(np.abs(x), np.abs(w))


def _errors(x, w1, b1, w2, z, r, c, a) -> dict:
    """Per result, the largest distance from the reference in steps (a float16 step at the
    reference, plus the float32 sum's error bound for a convolution), and the share of values
    not equal to it; each reference is the float64 operation on the build's own inputs (the
    previous results), its operands and result rounded to float16 as autocast rounds them."""
    conv1 = _half(_conv64(_half(x), _half(w1)))
    e1, e2 = _sum_error(_half(x), _half(w1)), _sum_error(r, _half(w2))
    c_ref = _half(_conv64(r, _half(w2)))
    # z: the convolution's one step, carried through the bias's addition, and that rounding
    refs = {"z": (z, _half(conv1 + _half(b1)), _ulp16(conv1) + _ulp16(conv1 + b1) + e1),
            "r": (r, np.maximum(z, 0), None), "c": (c, c_ref, _ulp16(c_ref) + e2),
            "a": (a, _half(c + r), None)}
    return {k: (float(np.max(np.abs(got - ref) / (_ulp16(ref) if step is None else step))),
                float(np.mean(got != ref)))
            for k, (got, ref, step) in refs.items()}


def _check(errors: dict) -> None:
    assert errors["r"] == (0.0, 0.0) and errors["a"] == (0.0, 0.0), errors
    for k in ("z", "c"):  # one rounding of the convolution, then (z) the bias added in half
        assert errors[k][0] <= 1.0 and errors[k][1] <= MIDPOINT_SHARE, (k, errors)


def test_half_arithmetic_on_llvm_rounds_where_autocast_does(tmp_path):
    run = _run_llvm(tmp_path)
    errors = _errors(*run)
    print(f"autocast16 on llvm, (largest error in float16 steps, share off): {errors}")
    _check(errors)
    x, w1, b1, w2, z, r, c, a = run
    # the results are float16 values, and the convolution's operands were rounded: the same
    # convolution of the float32 operands is farther than its one rounding
    assert all(np.array_equal(v, _half(v)) for v in (z, r, c, a))


def test_a_build_without_half_arithmetic_fails(tmp_path, monkeypatch):
    """With no product computed in float16 (so nothing is), the results are float32's: the
    exact checks of the element-wise results fail."""
    from thomas_tune import half_arith
    monkeypatch.setattr(half_arith, "PRODUCTS", frozenset())
    errors = _errors(*_run_llvm(tmp_path))
    with pytest.raises(AssertionError):
        _check(errors)


def test_autocast16_kernels_are_workloads_of_their_own():
    """The autocast16 graph's convolution kernels (float16 operands) are workloads neither
    the float32 nor the mixed16 graph has: a tuning log keeps them apart."""
    from thomas_tune import half_storage
    from thomas_tune.half_arith import autocast_module
    from thomas_tune.target import parse_target
    from thomas_tune.tasks import extract, key

    target = parse_target(A540)
    others = {key(t) for mod in (_graph(), half_storage.round_module(_graph(), {"f": N}))
              for t in extract({"g": mod}, target)}
    tasks = extract({"g": autocast_module(_graph(), {"f": N})}, target)
    convs = [t for t in tasks if "conv2d" in t.name]
    assert convs and all("float16" in t.mod.script() for t in convs)
    assert not {key(t) for t in convs} & others


def test_tune_refuses_autocast16_for_a_device_without_the_extension(capsys):
    """``tune --precision autocast16`` for a generic OpenCL target: refused before any
    server is asked (the tracker's port has none), naming the extension and the fix."""
    from thomas_tune.cli import main
    assert main(["tune", "--model", "alexnet", "--width", "0.1", "--resolution", "67",
                 "--classes", "5", "--batch", "4", "--target", '{"kind": "opencl"}',
                 "--tracker", "127.0.0.1:19251", "--key", "none", "--wait", "1",
                 "--precision", "autocast16"]) != 0
    err = capsys.readouterr().err
    assert "cl_khr_fp16" in err and "--precision mixed16" in err, err


# ---- whole networks on llvm, against PyTorch's own autocast float16 -------------------------

#: a network's logits at autocast16 are as far from float64 as PyTorch's autocast float16 on
#: the CPU is, within this factor either way (largest error over the batches, relative to the
#: largest logit). Both round every layer's output to float16; they differ in where: PyTorch
#: rounds the weights and computes an inference BatchNorm in float32 after the convolution,
#: the build folds the BatchNorm into the weights and bias first and rounds those (figures:
#: docs/journal/precision.md)
AUTOCAST_FACTOR = 4.0


def _logits_errors(name: str, rng, batches: int = 3) -> tuple[float, float]:
    """(the build's error, PyTorch autocast float16's error): the largest over ``batches``
    batches of 4 of max|logits - float64's| / max|float64's|, for the SMALL network ``name``
    (MobileNetV2 with the demo's pretrained weights, as in tests/test_adreno.py) built at
    autocast16 for llvm."""
    import torch
    import tvm
    from tvm.relax import VirtualMachine

    from thomas_tune.training_graph import graph as G
    from thomas_tune.compiler.compile import compile_graph
    from thomas_tune.half_arith import autocast_module
    from thomas_tune.manifest import PREDICT
    from thomas_tune.models import build, spec
    from thomas_tune.reference import torch_module
    from conftest import REFERENCE, SMALL, random_tensors

    model = build(name, **SMALL[name])
    tensors = random_tensors(model, rng)
    if name == "mobilenet_v2":
        from thomas_tune.demo import pretrained_path
        from thomas_tune.models import load_checkpoint
        model, tensors, _ = load_checkpoint(pretrained_path())
    b = 4
    mod = autocast_module(G.inference_module(model, b), {PREDICT: b})
    # LLVM's optimisation off (``compile.reference_target``): the same logits, bit for bit
    vm = VirtualMachine(compile_graph(mod, REFERENCE), tvm.cpu())
    s = spec(model)
    args = [tvm.runtime.tensor(np.asarray(tensors[p.name], "float32"))
            for p in (*s.params, *s.states)]
    net64 = torch_module(model, tensors, "float64").eval()
    net32 = torch_module(model, tensors, "float32").eval()
    ours = theirs = 0.0
    for _ in range(batches):
        x = rng.standard_normal(model.input_shape(b)).astype("float32")
        with torch.no_grad():
            ref = net64(torch.tensor(x, dtype=torch.float64)).numpy()
            with torch.autocast("cpu", dtype=torch.float16):
                t16 = net32(torch.tensor(x)).float().numpy()
        got = vm["predict"](tvm.runtime.tensor(x), *args).numpy()
        scale = np.abs(ref).max()
        ours = max(ours, float(np.abs(got - ref).max() / scale))
        theirs = max(theirs, float(np.abs(t16 - ref).max() / scale))
    return ours, theirs


@pytest.mark.parametrize("name", ["alexnet", "mobilenet_v2"])
def test_networks_at_autocast16_are_as_far_from_float64_as_pytorch_autocast(name, rng):
    ours, theirs = _logits_errors(name, rng)
    print(f"{name} logits vs float64: autocast16 on llvm {ours:.2e}, PyTorch autocast "
          f"float16 {theirs:.2e} ({ours / theirs:.2f}x)")
    assert theirs / AUTOCAST_FACTOR <= ours <= AUTOCAST_FACTOR * theirs


def test_a_network_without_half_arithmetic_is_not_autocast(rng, monkeypatch):
    """AlexNet built with the precision left unapplied (float32's logits, 1e-7 from float64)
    is far closer to float64 than autocast: the check's lower side fails it."""
    from thomas_tune import half_arith
    monkeypatch.setattr(half_arith, "autocast_function", lambda func, batch: func)
    ours, theirs = _logits_errors("alexnet", rng, batches=1)
    assert not theirs / AUTOCAST_FACTOR <= ours, (ours, theirs)


def test_an_autocast16_export_is_refused_by_a_profile_without_the_extension(adreno_exports):
    """``train`` / ``infer`` check an export against the device profile before the first
    step: an autocast16 export and a device without ``cl_khr_fp16`` fail there, naming the
    extension and the fix, instead of at the first program build; with the extension, or a
    mixed16 export, the check passes."""
    from thomas_tune.limits import DeviceLimitError, check_export
    big = {"max_alloc_bytes": 1 << 34, "global_memory_bytes": 1 << 36,
           "max_work_group_size": 1024, "local_memory_bytes": 1 << 16}

    def profile(extensions):
        return {"key": "k", "properties": {"device_name": "d", "extensions": extensions, **big}}
    native, mixed = adreno_exports["autocast16"][0], adreno_exports["mixed16"][0]
    with pytest.raises(DeviceLimitError, match="cl_khr_fp16.*--precision mixed16"):
        check_export(native, profile("cl_khr_icd cl_khr_fp64"), "train")
    check_export(native, profile("cl_khr_icd cl_khr_fp16"), "export")
    check_export(mixed, profile("cl_khr_icd cl_khr_fp64"), "export")


def _step_errors(name: str, tmp_path, seeds=(0, 1, 2)) -> tuple[list, list, list]:
    """Per check batch (``step_check.batch`` of each seed, batch 8, dropout off) of the SMALL
    network ``name`` exported for llvm at autocast16: (the loss's error against PyTorch
    float64, the median over the parameters of the gradient errors against float64
    (``step_check.gradient_errors``), the same median for PyTorch's autocast float16 step on
    the CPU)."""
    import torch

    from thomas_tune.compiler.export import export
    from thomas_tune.kink_step import torch_forward
    from thomas_tune.models import build
    from thomas_tune.step_check import batch, export_step, gradient_errors
    from conftest import REFERENCE, SMALL, random_tensors

    model = build(name, **SMALL[name])
    tensors = random_tensors(model, np.random.default_rng(0))
    out = str(tmp_path / "export")
    # LLVM's optimisation off (``compile.reference_target``): the same losses and gradients
    # to the last digit printed, in less build time
    manifest = export(out, model, tensors, REFERENCE, batch=8, precision="autocast16",
                      progress=lambda *_: None)
    assert manifest.precision == "autocast16"

    def torch_grads(dtype):
        loss, _, params, names = torch_forward(model, tensors, manifest.trainable, x, y,
                                               dtype=dtype)
        grads = torch.autograd.grad(loss, params)
        return float(loss.detach()), {n: g.detach().double().numpy()
                                      for n, g in zip(names, grads)}

    loss_err, ours, theirs = [], [], []
    for seed in seeds:
        x, y = batch(model, 8, seed)
        loss64, g64 = torch_grads("float64")
        with torch.autocast("cpu", dtype=torch.float16):
            _, g16 = torch_grads("float32")
        loss, g = export_step(out, x, y)
        loss_err.append(abs(loss - loss64) / abs(loss64))
        ours.append(float(np.median(list(gradient_errors(g, g64).values()))))
        theirs.append(float(np.median(list(gradient_errors(g16, g64).values()))))
    return loss_err, ours, theirs


def test_alexnets_step_at_autocast16_is_as_far_from_float64_as_pytorch_autocast(tmp_path):
    """AlexNet's training step (float32 gradients of the rounded forward) on llvm: its
    gradients as far from float64 as PyTorch's autocast float16 step's are (whose backward is
    float16): per batch the median over the parameters of the gradient errors, whose middle
    over three batches is within :data:`AUTOCAST_FACTOR` either way of PyTorch's; the loss
    within float16's rounding of its logits (relative 1e-3). Rounding moves an untrained
    network's gradients by tens of percent (docs/journal/precision.md), so the bound is
    relative to autocast's own; a build with the precision left unapplied (float32's 1e-6)
    fails its lower side."""
    loss_err, ours, theirs = _step_errors("alexnet", tmp_path)
    print(f"alexnet step at autocast16 on llvm: loss errors {loss_err}; median gradient "
          f"errors {['%.2e' % e for e in ours]}, PyTorch autocast float16 "
          f"{['%.2e' % e for e in theirs]}")
    assert max(loss_err) < 1e-3
    assert sorted(ours)[1] <= AUTOCAST_FACTOR * sorted(theirs)[1]
    assert sorted(ours)[1] >= sorted(theirs)[1] / AUTOCAST_FACTOR


def test_a_step_without_half_arithmetic_is_not_autocast(tmp_path, monkeypatch):
    from thomas_tune import half_arith
    monkeypatch.setattr(half_arith, "autocast_function", lambda func, batch: func)
    _, ours, theirs = _step_errors("alexnet", tmp_path, seeds=(0,))
    assert ours[0] < theirs[0] / AUTOCAST_FACTOR, (ours, theirs)


def test_export_verb_reads_the_extension_from_the_device_profile(tmp_path, capsys):
    """``thomas-tune export --precision autocast16`` for the Adreno target with
    ``--device-profile`` of a device whose extension list lacks ``cl_khr_fp16``: refused
    before anything is compiled (the profile wins over the target's device family)."""
    import json

    from thomas_tune.cli import main
    from thomas_tune.rpc.probe import PROFILE_FORMAT
    profile = {"format": PROFILE_FORMAT, "key": "no-fp16",
               "properties": {"device_name": "d", "extensions": "cl_khr_icd cl_khr_fp64",
                              "max_work_group_size": 256, "local_memory_bytes": 32768,
                              "global_memory_bytes": 1 << 32, "max_alloc_bytes": 1 << 30},
               "measured": {"launch_us": 10.0, "copy_gb_s": 10.0, "fma_gflop_s": 100.0,
                            "compile_s": 0.1}}
    path = tmp_path / "device_profile.json"
    path.write_text(json.dumps(profile))
    out = tmp_path / "export"
    assert main(["export", "--model", "alexnet", "--width", "0.1", "--resolution", "67",
                 "--classes", "5", "--batch", "4", "--target", A540, "--out", str(out),
                 "--precision", "autocast16", "--device-profile", str(path)]) == 2
    err = capsys.readouterr().err
    assert "no-fp16" in err and "lacks cl_khr_fp16" in err and "--precision mixed16" in err, err
    assert not (out / "train.so").exists()
