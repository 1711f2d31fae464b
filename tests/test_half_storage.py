"""Half-precision storage (``--precision mixed16``, thomas_tune.half_storage), kernel by kernel,
on PoCL and llvm: a graph of two convolutions, a ReLU and a residual add whose layer outputs the
build stores as float16. Each stored tensor is returned, so what the device holds is read
back: each value must be float16, and exactly the float16 nearest to the float64 value of the
same layer computed from the build's own (stored) inputs, except where float32's arithmetic
error reaches a midpoint between two float16 neighbours (either neighbour is right there).
A build that does not round fails, and so does one whose kernels store rounding toward zero
(``vstore_half_rtz``: every other value one float16 step off); float32 kernels' OpenCL C is
what it was without the rewrite."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

N, C, H = 2, 8, 10


def _graph():
    """``f(x, w1, w2) -> (y, c, a)``: ``y = conv(x, w1)``, ``c = conv(relu(y), w2)``,
    ``a = y + c``."""
    from tvm import relax
    from tvm.relax.op import add, nn

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((N, C, H, H), "float32"))
    w1 = relax.Var("w1", relax.TensorType((C, C, 3, 3), "float32"))
    w2 = relax.Var("w2", relax.TensorType((C, C, 3, 3), "float32"))
    with bb.function("f", [x, w1, w2]):
        with bb.dataflow():
            y = bb.emit(nn.conv2d(x, w1, padding=1))
            r = bb.emit(nn.relu(y))
            c = bb.emit(nn.conv2d(r, w2, padding=1))
            a = bb.emit(add(y, c))
            out = bb.emit_output(relax.Tuple([y, c, a]))
        bb.emit_func_output(out)
    return bb.get()


def _run(tmp_path, target_name, rounded=True):
    """Build :func:`_graph` (layer outputs stored as float16 when ``rounded``) for
    ``target_name`` and run it on fresh inputs: (x, w1, w2, y, c, a) as float64."""
    import tvm
    from tvm.relax import VirtualMachine

    from thomas_tune import half_storage
    from thomas_tune.compiler.compile import compile_graph
    from thomas_tune.runtime import device_for
    from thomas_tune.target import export_shared, parse_target

    mod = _graph()
    if rounded:
        mod = half_storage.round_module(mod, {"f": N})
    target = parse_target(target_name)
    path = str(tmp_path / "f.so")
    export_shared(compile_graph(mod, target), path, target)
    dev = device_for(target.kind.name)
    vm = VirtualMachine(tvm.runtime.load_module(path), dev)
    rng = np.random.default_rng()
    x = rng.standard_normal((N, C, H, H)).astype("float32")
    w1, w2 = (rng.standard_normal((C, C, 3, 3)).astype("float32") / 8 for _ in range(2))
    out = vm["f"](*(tvm.runtime.tensor(v, dev) for v in (x, w1, w2)))
    return [np.asarray(v, "float64") for v in (x, w1, w2, *(t.numpy() for t in out))]


def _conv(x, w):
    return torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(w), padding=1).numpy()


def _nearest_half_wrong(got: np.ndarray, exact: np.ndarray, err: np.ndarray) -> np.ndarray:
    """Elements of ``got`` (values read back) that are not the float16 nearest to ``exact``
    (float64), where no float16 midpoint lies within ``err`` (float32 arithmetic's error
    bound, per element) of it; where one does, either neighbour is right."""
    # rounding to nearest is monotone: the float16 of any value in the window lies between
    # those of its ends
    lo, hi = ((exact - err).astype("float16").astype("float64"),
              (exact + err).astype("float16").astype("float64"))
    ok = (got >= lo) & (got <= hi) & (got == got.astype("float16").astype("float64"))
    return ~ok


def _conv_error(x, w):
    """A bound of float32's error in each output of ``conv(x, w)``: n u sum |x| |w| with n
    the terms of a sum and u = 2^-24 (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., eq. 3.5), doubled."""
    n = w.shape[1] * w.shape[2] * w.shape[3]
    return 2 * n * 2.0 ** -24 * _conv(np.abs(x), np.abs(w))


def _wrong(x, w1, w2, y, c, a) -> tuple[int, int, int]:
    """Elements of the stored ``y``, ``c`` and ``a`` that are not their layer's float16
    (module docstring), each computed in float64 from the build's own stored inputs."""
    r = np.maximum(y, 0)
    return tuple(int(_nearest_half_wrong(got, exact, err).sum()) for got, exact, err in (
        (y, _conv(x, w1), _conv_error(x, w1)), (c, _conv(r, w2), _conv_error(r, w2)),
        (a, y + c, 2.0 ** -23 * np.abs(y + c))))


@pytest.mark.parametrize("target_name", ["opencl", "llvm"])
def test_stored_layer_outputs_are_the_nearest_float16(tmp_path, target_name):
    x, w1, w2, *stored = _run(tmp_path, target_name)
    for v in stored:  # float16 values, read back
        assert np.all(v == v.astype("float16").astype("float64"))
    assert _wrong(x, w1, w2, *stored) == (0, 0, 0)
    y = stored[0]
    assert np.abs(y).max() > 1.0 and np.count_nonzero(y) > 0.9 * y.size  # not a trivial pass


def test_a_build_that_does_not_round_fails(tmp_path):
    x, w1, w2, *stored = _run(tmp_path, "opencl", rounded=False)
    assert all(n > 0.9 * v.size for n, v in zip(_wrong(x, w1, w2, *stored), stored))


def test_kernels_storing_toward_zero_fail(tmp_path, monkeypatch):
    """The rewrite's stores with ``vstore_half_rtz`` (round toward zero): the values are
    float16, but about half of them one step off."""
    from thomas_tune import half_source
    plain = half_source.rewrite_half_access
    monkeypatch.setattr(half_source, "rewrite_half_access",
                        lambda src: plain(src).replace("vstore_half(", "vstore_half_rtz("))
    x, w1, w2, *stored = _run(tmp_path, "opencl")
    y = stored[0]
    assert np.all(y == y.astype("float16").astype("float64"))
    assert _wrong(x, w1, w2, *stored)[0] > 0.3 * y.size


def test_float32_source_is_left_as_it_is():
    """A float32 graph's OpenCL C passes the rewrite unchanged (the same object), so float32
    builds and their tuning logs' kernels are what they were."""
    import tvm

    from thomas_tune.compiler.compile import compile_graph
    from thomas_tune.half_source import rewrite_half_access
    from thomas_tune.target import parse_target

    exe = compile_graph(_graph(), parse_target("opencl"))
    lib = exe.mod if hasattr(exe, "mod") else exe

    def opencl(m):
        if m.kind == "opencl":
            return m
        return next((o for o in map(opencl, m.imports) if o is not None), None)

    src = opencl(lib).inspect_source()
    assert "float" in src and "half" not in src
    assert rewrite_half_access(src) is src
    assert tvm is not None


def test_work_group_tiles_private_values_and_lone_roundings_are_rewritten():
    """A convolution's ``__local half`` tile of its float16 input becomes ``__local ushort``
    of the same size, read and written through ``vload_half`` / ``vstore_half`` on a
    ``__local half*``; its private ``half`` values floats (a literal rounded to float16); a
    kernel that rounds with ``convert_half`` but has no float16 buffer gets the rounding helper;
    vector loads and stores of float16 memory go through ``vload_halfN`` / ``vstore_halfN``, and
    a gathered ``halfN`` literal becomes a ``floatN`` one. (The PoCL builds above compile and
    check such kernels' values.)"""
    from thomas_tune.half_source import ROUND_HALF, rewrite_half_access
    tile = ("__kernel void k(__global float* restrict o, __global half* restrict x) {\n"
            "  __local half t[64];\n  half v;\n  v = (half)0.000000e+00f;\n"
            "  if (1) { v = x[get_local_id(0)]; }\n  t[get_local_id(0)] = v;\n"
            "  o[0] = ((float)t[3]);\n}\n")
    out = rewrite_half_access(tile)
    assert "__local ushort t_bits[64];" in out and "__local half* t = (__local half*)t_bits;" in out
    assert "vstore_half(v, get_local_id(0), t)" in out and "vload_half(3, t)" in out
    assert "vload_half(get_local_id(0), x)" in out and "float v;" in out
    assert f"v = {ROUND_HALF}(0.000000e+00f);" in out
    lone = ("__kernel void r(__global float* restrict o, __global float* restrict x) {\n"
            "  o[0] = ((float)convert_half(x[0]));\n}\n")
    out = rewrite_half_access(tile + lone)  # one source, as TVM writes a module's kernels
    assert f"{ROUND_HALF}(x[0])" in out and "convert_half" not in out
    # alone, with the extension block TVM writes before it (a kernel that rounds a float32
    # value to float16 and back holds no half word: tune's rounding kernels at mixed16)
    block = ("#ifdef cl_khr_fp16\n#pragma OPENCL EXTENSION cl_khr_fp16 : enable\n"
             "#elif defined(cl_amd_fp16)\n#pragma OPENCL EXTENSION cl_amd_fp16 : enable\n"
             "#else\n#error \"Half precision floating point not supported\"\n#endif\n")
    out = rewrite_half_access(block + lone)
    assert f"{ROUND_HALF}(x[0])" in out and "convert_half" not in out and "#error" not in out
    # a vectorized copy of float16 data into a tile (a float32 schedule's cooperative fetch
    # carried to the half-storage twin): halfN loads and stores through floatN, exact for
    # float16 data; a float32 vector load beside it is left as it is
    vec = ("__kernel void c(__global float* restrict o, __global half* restrict x) {\n"
           "  __local half t[8];\n  vstore2(vload2(0, x + (get_local_id(0) * 2)), 0, t + "
           "(get_local_id(0) * 2));\n  vstore2(vload2(0, o + 2), 0, o);\n"
           "  o[0] = ((float)t[1]);\n}\n")
    out = rewrite_half_access(vec)
    assert ("vstore_half2(vload_half2(0, x + (get_local_id(0) * 2)), 0, t + (get_local_id(0) "
            "* 2))") in out
    assert "vstore2(vload2(0, o + 2), 0, o)" in out and "vload_half(1, t)" in out
    # a gathered copy: a halfN literal of float16 loads, held as floatN rounded to float16
    gather = ("__kernel void g(__global float* restrict o, __global half* restrict x) {\n"
              "  __local half t[8];\n  int2 i = (int2)(3, 5);\n"
              "  half2 v = (half2)(x[i.s0],x[i.s1]);\n  vstore2(v, 0, t + 2);\n"
              "  o[0] = ((float)t[3]);\n}\n")
    out = rewrite_half_access(gather)
    assert (f"float2 v = {ROUND_HALF}2((float2)(vload_half(i.s0, x),vload_half(i.s1, x)));"
            in out), out
    assert "vstore_half2(v, 0, t + 2)" in out and f"inline float2 {ROUND_HALF}2(" in out


def test_private_float16_tiles_and_vector_roundings_compile_and_round_on_the_device(rng):
    """Two forms the H100's mixed16 tuning met (docs/journal/memory.md): a private ``half``
    array (a work-item's tile of a stored input) becomes a ``float`` array holding float16
    values, and a kernel whose only float16 is a vectorized rounding (``convert_half4`` of a
    float32 epilogue read back as float32, no ``half`` word) gets the vector helper. Both
    rewritten sources compile on this machine's device (no ``cl_khr_fp16``) and give numpy's
    float16 values of fresh inputs."""
    cl = pytest.importorskip("pyopencl")
    from thomas_tune.half_source import ROUND_HALF, rewrite_half_access
    devs = [d for p in cl.get_platforms() for d in p.get_devices()]
    if not devs:
        pytest.skip("no OpenCL device")
    tile = ("__kernel void p(__global float* restrict o, __global half* restrict x) {\n"
            "  half t[4];\n"
            "  for (int i = 0; i < 4; ++i) { t[i] = x[(get_global_id(0) * 4) + i]; }\n"
            "  for (int i = 0; i < 4; ++i) { o[(get_global_id(0) * 4) + i] = "
            "(((float)t[3 - i]) * 2.000000e+00f); }\n}\n")
    out = rewrite_half_access(tile)
    assert "float t[4];" in out and "t[i] = vload_half(" in out and ", x); }" in out
    vround = ("__kernel void v(__global float* restrict o, __global float* restrict x) {\n"
              "  float4 a = convert_float4((convert_half4(max(vload4(0, x + (get_global_id(0) "
              "* 4)), ((float4)(0.000000e+00f, 0.000000e+00f, 0.000000e+00f, "
              "0.000000e+00f))))));\n  vstore4(a, 0, o + (get_global_id(0) * 4));\n}\n")
    out2 = rewrite_half_access(vround)
    assert "convert_half" not in out2 and f"inline float4 {ROUND_HALF}4(" in out2
    ctx = cl.Context([devs[0]])
    queue = cl.CommandQueue(ctx)
    n = 64
    x16 = (rng.standard_normal(4 * n) * 100).astype("float16")
    x32 = (rng.standard_normal(4 * n) * 100).astype("float32")
    mf = cl.mem_flags
    got = {}
    for name, src, host in (("p", out, x16), ("v", out2, x32)):
        prog = cl.Program(ctx, src).build()
        xb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=host)
        ob = cl.Buffer(ctx, mf.WRITE_ONLY, 4 * 4 * n)
        getattr(prog, name)(queue, (n,), None, ob, xb)
        got[name] = np.empty(4 * n, "float32")
        cl.enqueue_copy(queue, got[name], ob)
    want_p = x16.astype("float64").reshape(n, 4)[:, ::-1].reshape(-1) * 2
    np.testing.assert_array_equal(got["p"], want_p)
    want_v = np.maximum(x32, 0).astype("float16").astype("float64")
    np.testing.assert_array_equal(got["v"], want_v)


def _step_graph():
    """``g(x, w1, w2) -> (loss, y, c, a)`` with :func:`_graph`'s layers and ``loss = sum(a
    * a)``, and its adjoint ``g_adjoint`` (gradients of ``w1`` and ``w2``) built by Relax,
    then its layer outputs stored as float16 (as an export builds a step: gradient first)."""
    from tvm import relax
    from tvm.relax.op import add, multiply, nn
    from tvm.relax.op import sum as rsum

    from thomas_tune import half_storage

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((N, C, H, H), "float32"))
    w1 = relax.Var("w1", relax.TensorType((C, C, 3, 3), "float32"))
    w2 = relax.Var("w2", relax.TensorType((C, C, 3, 3), "float32"))
    with bb.function("g", [x, w1, w2]):
        with bb.dataflow():
            y = bb.emit_output(nn.conv2d(x, w1, padding=1))
            c = bb.emit_output(nn.conv2d(bb.emit(nn.relu(y)), w2, padding=1))
            a = bb.emit_output(add(y, c))
            loss = bb.emit_output(rsum(bb.emit(multiply(a, a))))
        bb.emit_func_output(relax.Tuple([loss, y, c, a]))
    mod = bb.get()
    mod = relax.transform.Gradient("g", [mod["g"].params[1], mod["g"].params[2]])(mod)
    return half_storage.round_module(mod, {"g_adjoint": N})


def _step_run(tmp_path, target_name):
    """Run :func:`_step_graph`'s adjoint on fresh inputs: (x, w1, w2, loss, y, c, a, gw1, gw2)
    as float64."""
    import tvm
    from tvm.relax import VirtualMachine

    from thomas_tune.compiler.compile import compile_graph
    from thomas_tune.runtime import device_for
    from thomas_tune.target import export_shared, parse_target

    target = parse_target(target_name)
    path = str(tmp_path / "g.so")
    export_shared(compile_graph(_step_graph(), target), path, target)
    dev = device_for(target.kind.name)
    vm = VirtualMachine(tvm.runtime.load_module(path), dev)
    rng = np.random.default_rng()
    ins = [rng.standard_normal((N, C, H, H)).astype("float32"),
           *(rng.standard_normal((C, C, 3, 3)).astype("float32") / 8 for _ in range(2))]
    (outs, grads) = vm["g_adjoint"](*(tvm.runtime.tensor(v, dev) for v in ins))
    return [np.asarray(v, "float64") for v in ins] + [
        np.asarray(v.numpy(), "float64") for v in (*outs, *grads)]


def _step_reference(x, w1, w2, y, c, a):
    """Loss and gradients of ``w1``, ``w2`` in PyTorch float64 with each layer output taking
    the build's stored value (``y``, ``c``, ``a``) and passing gradients through unchanged
    (the build's rounding, whose gradient is the identity)."""
    T = torch.tensor

    def stored(v, value):  # the value read back, the gradient of v
        return v + (T(value) - v).detach()

    W1, W2 = T(w1, requires_grad=True), T(w2, requires_grad=True)
    F = torch.nn.functional
    Y = stored(F.conv2d(T(x), W1, padding=1), y)
    Cc = stored(F.conv2d(F.relu(Y), W2, padding=1), c)
    A = stored(Y + Cc, a)
    loss = (A * A).sum()
    g1, g2 = torch.autograd.grad(loss, [W1, W2])
    return float(loss.detach()), g1.numpy(), g2.numpy()


def _step_errors(run) -> list[float]:
    """Relative errors of the build's loss and two gradients (max |difference| / max |ref|)
    against :func:`_step_reference`."""
    x, w1, w2, loss, y, c, a, gw1, gw2 = run
    ref = _step_reference(x, w1, w2, y, c, a)
    return [abs(float(loss) - ref[0]) / abs(ref[0])] + [
        float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip((gw1, gw2), ref[1:])]


#: float32's error in a sum of n terms is at most n u sum |terms| (u = 2^-24, Higham eq. 3.5);
#: a weight's gradient here sums N*H*H = 200 products, the loss 1,600 squares (no
#: cancellation): 200 u = 1.2e-5 and 1,600 u = 1e-4 of the sums of magnitudes. Measured:
#: 1e-7 to 1e-6. 1e-4 is above both and a hundredth of a 1% error
STEP_BOUND = 1e-4


@pytest.mark.parametrize("target_name", ["opencl", "llvm"])
def test_a_step_reads_its_stored_halves_and_keeps_gradients_in_float32(tmp_path, target_name):
    """The backward reads the stored float16 tensors (and only they): gradients within float32
    rounding of float64's on the build's own stored values; the forward's layer outputs are
    float16, the nearest ones; a gradient 1% off fails."""
    run = _step_run(tmp_path, target_name)
    x, w1, w2, loss, y, c, a, gw1, gw2 = run
    assert _wrong(x, w1, w2, y, c, a) == (0, 0, 0)
    errs = _step_errors(run)
    print(target_name, errs)
    assert max(errs) < STEP_BOUND
    for i in (7, 8):  # each gradient 1% off
        mutant = list(run)
        mutant[i] = mutant[i] * 1.01
        assert _step_errors(mutant)[i - 6] > 50 * STEP_BOUND


def test_half_storage_kernels_are_workloads_of_their_own():
    """The tasks of the mixed16 graph: the kernels that store or read float16 are workloads
    no float32 task has (their buffers' dtypes differ), so a tuning log keeps them apart; each
    convolution kernel of the mixed16 graph is one of them."""
    from thomas_tune import half_storage
    from thomas_tune.target import parse_target
    from thomas_tune.tasks import extract, key

    target = parse_target("opencl")
    f32 = extract({"g": _graph()}, target)
    f16 = extract({"g": half_storage.round_module(_graph(), {"f": N})}, target)
    keys32 = {key(t) for t in f32}
    half = [t for t in f16 if "float16" in t.mod.script()]
    assert {t.name for t in half} and not {key(t) for t in half} & keys32
    assert all("float16" in t.mod.script() for t in f16 if "conv2d" in t.name)


def test_a_float16_kernel_is_checked_within_float16_steps():
    """The kernel check of a workload that rounds to float16 on the way (tune at mixed16):
    its comparison kernel computes in float32 (float16 holds no NOT_FINITE), and its tolerance
    is four float16 steps of the largest value, so two schedules of one kernel whose float32
    sums round either side of a float16 midpoint agree, and a kernel 1% off still fails."""
    from tvm import te

    from thomas_tune import kernel_check as kc
    from thomas_tune.target import parse_target

    x = te.placeholder((4, 64), "float32", "x")
    k = te.reduce_axis((0, 64), "k")
    s = te.compute((4,), lambda i: te.sum(x[i, k], axis=k), name="s")
    h = te.compute((4,), lambda i: s[i].astype("float16"), name="h")
    func = te.create_prim_func([x, h])
    spec = kc.check_spec(func)
    assert spec.half and spec.tol == kc.HALF_TOLERANCE > kc.tolerance(spec.terms)
    cmp = kc.compare_kernel(func, spec, parse_target("opencl"))
    assert [dt for _, dt in kc.arg_shapes(cmp)] == ["float16", "float16", "float32", "float32"]
    ref = np.float16(np.random.default_rng().uniform(1.0, 2.0, 4))
    step = np.float16(np.nextafter(ref, np.float16(np.inf)))  # one float16 step up
    assert kc.compare({1: step}, {1: ref}, spec.tol) is None
    assert kc.compare({1: np.float16(ref * 1.01)}, {1: ref}, spec.tol) is not None
    # one that only reads float16 (a backward convolution of a stored activation) computes
    # in float32, and is checked as float32 kernels are
    xh = te.placeholder((4, 64), "float16", "xh")
    k2 = te.reduce_axis((0, 64), "k2")
    s32 = te.compute((4,), lambda i: te.sum(xh[i, k2].astype("float32"), axis=k2), name="s32")
    reads = kc.check_spec(te.create_prim_func([xh, s32]))
    assert not reads.half and reads.tol == kc.tolerance(reads.terms) < kc.HALF_TOLERANCE


def test_tune_at_mixed16_measures_and_the_export_applies_its_records(tmp_path):
    """``tune --precision mixed16`` on PoCL over a loopback tracker (AlexNet 0.1@67, its two
    costliest tasks, 8 trials): every trial is built and measured, none wrong, and the mixed16
    export applies the records, each checked on the device. Before the rewrite took kernels
    that round without a float16 buffer and the check compared float16 outputs in float32 and
    within float16 steps, every trial of such a task failed (a build error, or a float16
    constant of 1e30) or was called wrong."""
    import json
    import os

    from thomas_tune import rpc
    from thomas_tune.cli import main
    from thomas_tune.compiler.export import export
    from thomas_tune.logs import TuningLog
    from thomas_tune.models import build, init_params
    from thomas_tune.target import parse_target
    from thomas_tune.tuning.defaults import DEFAULT_LATENCY
    log = tmp_path / "log"
    small = ["--model", "alexnet", "--width", "0.1", "--resolution", "67", "--classes", "5",
             "--batch", "8", "--target", "opencl", "--precision", "mixed16"]
    with rpc.loopback(key="pocl-mixed16", servers=1, lifetime=600) as addr:
        assert main(["tune", *small, "--tracker", f"{addr[0]}:{addr[1]}", "--key",
                     "pocl-mixed16", "--top", "2", "--trials", "8", "--trials-per-iter", "4",
                     "--population", "8", "--genetic-iters", "1", "--build-workers", "1",
                     # a bound no kernel of this size nears, so that a run slowed by a
                     # loaded machine is not cut (20 s by default: seen cut beside other tests)
                     "--trial-timeout", "120", "--log", str(log)]) == 0
    errors = log / "trial_errors.jsonl"
    assert not errors.exists() or not errors.read_text().strip(), errors.read_text()
    records = TuningLog(str(log)).database().get_all_tuning_records()
    assert records and all(r.run_secs for r in records)
    assert all("float16" in r.workload.mod.script() for r in records)
    if os.path.exists(log / DEFAULT_LATENCY):  # every record applied, faster or not
        os.remove(log / DEFAULT_LATENCY)
    model = build("alexnet", num_classes=5, resolution=67, width=0.1)
    out = str(tmp_path / "tuned")
    m = export(out, model, init_params(model, seed=11), parse_target("opencl"), batch=8,
               trainable="all", precision="mixed16", log=TuningLog(str(log)),
               progress=lambda *_: None)
    assert m.record_check["checked"] >= 1 and not m.record_check["wrong"], json.dumps(
        m.record_check)

